"""Numbers in text gpuvfio did not write (sysfs and /proc files, a guest's answers, libvirt's
XML, the command line, users' files), read one way: ASCII digits only, a bounded count of them,
an upper bound, no sign, space, underscore or prefix unless the reader says so.

Python's own readers are not for this. ``str.isdigit()`` is True for ``'²'``, which ``int()``
refuses (a ValueError where the caller expected none: a traceback); ``int()`` and ``float()``
take Arabic-Indic ``'١٢'``, ``' 12'``, ``'+12'`` and ``'1_2'`` as 12; an integer of more than
``sys.int_info.default_max_str_digits`` (4300) digits is a ValueError, and a 400-digit one is a
value no host or guest has (``float()`` of it overflows). So the readers here match
``[0-9]{1,N}`` (re.ASCII) and convert only what matched.
"""

from __future__ import annotations

import math
import re
import sys

from gpuvfio.errors import InputError

U64_MAX = (1 << 64) - 1
DIGITS = 20  # decimal digits of U64_MAX: no counter in a sysfs file or a guest's answer has more
HEX_DIGITS = 16  # hex digits of U64_MAX (resource lines, capability registers)

_DECIMAL = re.compile(r"[0-9]+", re.ASCII)
_HEX = re.compile(r"(?:0[xX])?([0-9a-fA-F]+)", re.ASCII)
_FIXED = re.compile(r"([0-9]+)(?:\.([0-9]+))?", re.ASCII)


def uint(text, upper: int = U64_MAX, *, digits: int = DIGITS) -> int | None:
    """The value of ``text``: 1 to ``digits`` ASCII decimal digits (nothing else: no sign,
    space, underscore), at most ``upper``; None otherwise (and for anything not a str)."""
    if not isinstance(text, str) or len(text) > digits or not _DECIMAL.fullmatch(text):
        return None
    value = int(text)
    return value if value <= upper else None


def hex_uint(text, upper: int = U64_MAX, *, digits: int = HEX_DIGITS) -> int | None:
    """The value of ``text`` in hex: an optional ``0x``, then 1 to ``digits`` ASCII hex digits,
    at most ``upper``; None otherwise. What sysfs prints with ``%#x``/``%x`` (vendor, class,
    resource lines, capability registers)."""
    match = _HEX.fullmatch(text) if isinstance(text, str) and len(text) <= digits + 2 else None
    if match is None or len(match.group(1)) > digits:
        return None
    value = int(match.group(1), 16)
    return value if value <= upper else None


def decimal(text, upper: float, *, digits: int = 6) -> float | None:
    """A fixed-point decimal (``16``, ``2.5``, ``16.0``): ASCII digits, at most ``digits`` on each
    side of the point, between 0 and ``upper``; None otherwise (no exponent, NaN or infinity)."""
    match = _FIXED.fullmatch(text) if isinstance(text, str) else None
    if match is None or len(match.group(1)) > digits or len(match.group(2) or "") > digits:
        return None
    value = float(text)
    return value if value <= upper else None


def parse_uint(text, what: str, upper: int = U64_MAX, *, lower: int = 0, digits: int = DIGITS,
               error: type[Exception] = InputError) -> int:
    """``uint`` for a value that must be there: ``error`` (InputError: exit status 2) in one
    line naming ``what`` when it is not a whole number from ``lower`` to ``upper``."""
    value = uint(text, upper, digits=digits)
    if value is None or value < lower:
        raise error(f"{what} must be a whole number from {lower} to {upper}, not {shown(text)}")
    return value


def finite(value) -> bool:
    """Is ``value`` a real number (int or float, not bool) that a float holds, NaN and infinity
    excluded? Unlike math.isfinite, an int past the float range is False, not an OverflowError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):
        return -sys.float_info.max <= value <= sys.float_info.max  # int/float comparison is exact
    return math.isfinite(value)


def shown(text, limit: int = 40) -> str:
    """``text`` for an error message: its repr, cut to ``limit`` characters (a 400-digit number
    stays one short line; an int too long for repr() is named, not shown)."""
    if isinstance(text, int) and not -10 ** DIGITS < text < 10 ** DIGITS:
        return f"an integer of more than {DIGITS} digits"
    text = repr(text)
    return text if len(text) <= limit else text[:limit - 5] + "...'"
