"""JSON from sources gpuvfio does not trust (a guest's verifier, the Fabric Manager's fmpm, an
NVLink recording), read one way: UTF-8 only, no NaN or Infinity (Python's json takes them,
RFC 8259 does not), no key twice in an object (Python keeps the last silently), and nesting
too deep for Python's parser is a rejection, not a RecursionError. Each caller turns
JsonRejected into its own typed error, naming the source.
"""

from __future__ import annotations

import json


class JsonRejected(ValueError):
    """Not JSON as strict_loads takes it; the message says why, in one short line."""


def _no_constant(name: str):
    raise JsonRejected(f"{name} is not a JSON number")


def _unique_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise JsonRejected(f"key {key[:40]!r} appears twice in an object")
        seen[key] = value
    return seen


def strict_loads(data: bytes | str):
    """The JSON value in ``data``; JsonRejected when it is not strict JSON."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise JsonRejected("not UTF-8") from None
    try:
        return json.loads(data, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except JsonRejected:
        raise
    except RecursionError:
        raise JsonRejected("nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and int() past its digit limit
        raise JsonRejected(f"not JSON ({(str(exc).splitlines() or [''])[0][:80]})") from None
