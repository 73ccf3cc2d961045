"""JSON from sources gpuvfio does not trust (a guest's verifier, the Fabric Manager's fmpm, an
NVLink recording), read one way: UTF-8 only, no NaN or Infinity (Python's json takes them,
RFC 8259 does not; nor 1e999, which Python reads as inf), no lone surrogate escape such as
"\\ud800" (valid JSON text, but no Unicode string: printing it raises UnicodeEncodeError), no
key twice in an object (Python keeps the last silently), no integer of more than 20 digits (no
counter a guest or tool reports has more; Python reads 400 digits as an int no float holds, and
past 4300 digits its int() refuses), and nesting too deep for Python's parser is a rejection,
not a RecursionError. Each caller turns
JsonRejected into its own typed error, naming the source.
"""

from __future__ import annotations

import json
import math

from gpuvfio.numbers import DIGITS, uint


class JsonRejected(ValueError):
    """Not JSON as strict_loads takes it; the message says why, in one short line."""


def _no_constant(name: str):
    raise JsonRejected(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonRejected(f"{text[:20]} is not a finite number")
    return value


def _bounded_int(text: str) -> int:
    negative = text.startswith("-")
    digits = text[1:] if negative else text
    value = uint(digits, 10 ** DIGITS - 1)
    if value is None:
        raise JsonRejected(f"an integer of {len(digits)} digits (at most {DIGITS})")
    return -value if negative else value


def _check_text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise JsonRejected("a string holds a lone surrogate (not Unicode text)") from None
    return value


def _unique_keys(pairs):
    seen = {}
    for key, value in pairs:
        _check_text(key)
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, list):
            _check_list(value)
        if key in seen:
            raise JsonRejected(f"key {key[:40]!r} appears twice in an object")
        seen[key] = value
    return seen


def _check_list(items: list) -> None:
    for item in items:
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, list):
            _check_list(item)


def strict_loads(data: bytes | str):
    """The JSON value in ``data``; JsonRejected when it is not strict JSON."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise JsonRejected("not UTF-8") from None
    try:
        value = json.loads(data, parse_constant=_no_constant, parse_float=_finite,
                           parse_int=_bounded_int, object_pairs_hook=_unique_keys)
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, list):  # strings in a top-level list (objects check their own)
            _check_list(value)
        return value
    except JsonRejected:
        raise
    except RecursionError:
        raise JsonRejected("nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError
        raise JsonRejected(f"not JSON ({(str(exc).splitlines() or [''])[0][:80]})") from None
