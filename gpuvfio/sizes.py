"""Memory sizes as admins write them: 64G, 64GiB, 65536M, 64g, 1T, 512MiB, 1048576K.

Binary units throughout (libvirt counts KiB); a bare number is MiB, as virt-install's
--memory takes it. Decimal GB/MB are accepted as the same binary units: nobody sizes
a guest in 10^9 bytes on purpose.
"""

from __future__ import annotations

import re

from gpuvfio.errors import InputError
from gpuvfio.numbers import shown, uint

_SIZE = re.compile(r"^\s*([0-9]+)(?:\.([0-9]+))?\s*([kmgt]?)(?:i?b)?\s*$", re.I | re.ASCII)
_FACTOR = {"": 1024, "k": 1, "m": 1024, "g": 1024**2, "t": 1024**3}
# 52 bits of physical address (x86-64 with 5-level paging, AArch64 with LPA) is 4 PiB: no
# machine has more memory to give, so no size gpuvfio takes is larger.
MAX_KIB = 1 << 42


def parse_size_kib(text: str) -> int:
    """KiB in ``text``, exactly (no float rounding); InputError unless it is a whole number of
    KiB from 1 KiB to MAX_KIB, written in ASCII digits."""
    match = _SIZE.match(text or "")
    if not match:
        raise InputError(f"not a size: {shown(text)} (examples: 64G, 64GiB, 65536M)")
    whole, fraction = uint(match.group(1)), match.group(2) or ""
    scale = 10 ** len(fraction)
    if whole is None or (fraction and uint(fraction) is None):
        raise InputError(f"size {shown(text)} has too many digits (at most 20 on each side of the point)")
    numerator = (whole * scale + (uint(fraction) if fraction else 0)) * _FACTOR[match.group(3).lower()]
    if numerator < scale or numerator % scale:
        raise InputError(f"size {shown(text)} is not a whole number of KiB")
    if numerator // scale > MAX_KIB:
        raise InputError(f"size {shown(text)} is larger than {format_kib(MAX_KIB)}")
    return numerator // scale


def format_kib(kib: int) -> str:
    for unit, factor in (("TiB", 1024**3), ("GiB", 1024**2), ("MiB", 1024)):
        if kib >= factor and kib % factor == 0:
            return f"{kib // factor} {unit}"
    return f"{kib} KiB"


def page_label(kib: int) -> str:
    """A page size as --hugepages and the kernel's hugepagesz= write it: 1G, 2M, 4K."""
    for unit, factor in (("G", 1024**2), ("M", 1024)):
        if kib >= factor and kib % factor == 0:
            return f"{kib // factor}{unit}"
    return f"{kib}K"


def pages_text(kib: int | None) -> str:
    """A guest's backing pages: "1G hugepages", "2M hugepages", or "4K pages" (none asked for)."""
    return f"{page_label(kib)} hugepages" if kib else "4K pages"
