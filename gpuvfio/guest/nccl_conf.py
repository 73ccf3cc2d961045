"""NCCL_TOPO_FILE merged into a guest's /etc/nccl.conf, by the rules NCCL reads that file with.

NCCL reads /etc/nccl.conf at init in every process, so a line ``NCCL_TOPO_FILE=PATH`` there makes
every job in the guest load gpuvfio's topology file without an ``export``. The file is read by
NCCL's rules (src/misc/param.cc ``setEnvFile``, v2.30.7-1), ported in gpuvfio_ncclconf, which the
in-guest verifier reads the guest's files with too: records of at most 4095 bytes, ``#``
comments, the key before the first ``=``, no trimming, the first record of a key wins, and the
environment and ``$NCCL_CONF_FILE`` (or ``~/.nccl.conf``) win over /etc/nccl.conf.

So the merge appends a line when the file has no NCCL_TOPO_FILE NCCL would take, and leaves
every other byte of the admin's file as it was. An admin's own NCCL_TOPO_FILE is kept and said
(KEPT, ``previous``); only when asked (``replace``) does gpuvfio's line take the place of the
first record NCCL would take (its whole line).
Pure: the caller reads the file and writes the result (gpuvfio.ops.guests, over SSH).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from gpuvfio.guest.payload import gpuvfio_ncclconf as ncclconf

__all__ = ["CONF_FILE", "KEY", "ConfChange", "ConfMerge", "Record", "records", "value_of", "merge"]

CONF_FILE = ncclconf.ETC_FILE
KEY = "NCCL_TOPO_FILE"
FIELD_BYTES = ncclconf.FIELD_BYTES
COMMENT = b"# gpuvfio attach: the PCIe topology of this guest's GPUs as the host sees it (NCCL reads it at init)\n"


class ConfChange(str, Enum):
    """What the merge did to /etc/nccl.conf."""

    CREATED = "created"  # there was no file: it holds gpuvfio's line only
    ADDED = "added"  # the admin's file had no NCCL_TOPO_FILE: a line appended
    REPLACED = "replaced"  # asked to: the admin's NCCL_TOPO_FILE (``previous``) no longer applies
    KEPT = "kept"  # the admin's NCCL_TOPO_FILE (``previous``) is what NCCL reads: nothing written
    UNCHANGED = "unchanged"  # it already gives gpuvfio's path: nothing to write


@dataclass(frozen=True)
class Record:
    """One record as NCCL's reader sees it: where it starts in the file, its key and value
    (None for a comment or a record without ``=``)."""

    offset: int
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True)
class ConfMerge:
    """The file to write (``text``; the input itself when UNCHANGED), what changed, and the
    value NCCL took from the admin's file before (``previous``, as NCCL read it)."""

    text: bytes
    change: ConfChange
    previous: str | None = None

    @property
    def changed(self) -> bool:
        return self.change not in (ConfChange.UNCHANGED, ConfChange.KEPT)


def records(data: bytes) -> list[Record]:
    """The records of ``data`` in the order NCCL's ``setEnvFile`` reads them (gpuvfio_ncclconf,
    the reader the in-guest verifier uses too)."""
    return [Record(offset, key, value) for offset, key, value in ncclconf.records(data)]


def value_of(data: bytes, key: str = KEY) -> bytes | None:
    """The value NCCL takes for ``key`` from one file: its first record (setenv never overwrites)."""
    wanted = key.encode()
    return next((r.value for r in records(data) if r.key == wanted), None)


def _line_end(data: bytes, offset: int) -> int:
    """Where the content of the physical line at ``offset`` ends (before its ``\\r\\n`` or ``\\n``)."""
    end = data.find(b"\n", offset)
    end = len(data) if end < 0 else end
    return end - 1 if end > offset and data[end - 1:end] == b"\r" else end


def merge(existing: bytes | None, path: str, *, replace: bool = False) -> ConfMerge:
    """/etc/nccl.conf (``existing``; None: there is none) carrying ``NCCL_TOPO_FILE=path``, so
    that NCCL reads ``path`` and every other pair the admin set as before; where the admin's
    file already names another topology file, that one is kept unless ``replace``."""
    raw = path.encode()
    if not path.startswith("/") or any(c in raw for c in b"\n\r\0") or len(raw) > FIELD_BYTES:
        # NCCL would cut a longer value, and a newline would end the record early.
        raise ValueError(f"not a path NCCL can read from {CONF_FILE}: {path!r}")
    line = KEY.encode() + b"=" + raw
    if existing is None:
        return ConfMerge(COMMENT + line + b"\n", ConfChange.CREATED)
    first = next((r for r in records(existing) if r.key == KEY.encode()), None)
    if first is None:
        gap = b"\n" if existing and not existing.endswith(b"\n") else b""
        return ConfMerge(existing + gap + COMMENT + line + b"\n", ConfChange.ADDED)
    previous = first.value.decode("utf-8", "replace")
    if first.value == raw:
        return ConfMerge(existing, ConfChange.UNCHANGED)
    if not replace:
        return ConfMerge(existing, ConfChange.KEPT, previous)
    if first.offset == 0 or existing[first.offset - 1:first.offset] == b"\n":
        # The record starts a line: that line is replaced, its line ending kept.
        end = _line_end(existing, first.offset)
        return ConfMerge(existing[:first.offset] + line + existing[end:], ConfChange.REPLACED, previous)
    # The record is the tail of a line longer than NCCL's buffer: gpuvfio's line goes first, where
    # NCCL reads it before that tail (the admin's line stays as it is, and no longer applies).
    return ConfMerge(line + b"\n" + existing, ConfChange.REPLACED, previous)
