"""Writing files so that a crash leaves the old content or the new, never half of either."""

from __future__ import annotations

import os


def atomic_write(path: str, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to a new temp file beside ``path`` (created afresh: never opened through
    something that was there), fsync it, rename it over ``path``, fsync the directory."""
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        os.unlink(tmp)  # a stale temp of an earlier run with this pid (or anything planted there)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
