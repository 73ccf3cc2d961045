"""Memory sizes as admins write them: 64G, 64GiB, 65536M, 64g, 1T, 512MiB, 1048576K.

Binary units throughout (libvirt counts KiB); a bare number is MiB, as virt-install's
--memory takes it. Decimal GB/MB are accepted as the same binary units: nobody sizes
a guest in 10^9 bytes on purpose.
"""

from __future__ import annotations

import re

from gpuvfio.errors import InputError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.I)
_FACTOR = {"": 1024, "k": 1, "m": 1024, "g": 1024**2, "t": 1024**3}


def parse_size_kib(text: str) -> int:
    match = _SIZE.match(text or "")
    if not match:
        raise InputError(f"not a size: {text!r} (examples: 64G, 64GiB, 65536M)")
    value = float(match.group(1)) * _FACTOR[match.group(2).lower()]
    if value < 1 or value != int(value):
        raise InputError(f"size {text!r} is not a whole number of KiB")
    return int(value)


def format_kib(kib: int) -> str:
    for unit, factor in (("TiB", 1024**3), ("GiB", 1024**2), ("MiB", 1024)):
        if kib >= factor and kib % factor == 0:
            return f"{kib // factor} {unit}"
    return f"{kib} KiB"
