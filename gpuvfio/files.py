"""Writing files so that a crash leaves the old content or the new, never half of either."""

from __future__ import annotations

import os
import stat

from gpuvfio.errors import GpuvfioError, InputError


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


def check_output_path(out: str) -> None:
    """``out`` is a new name in an existing directory or a regular file (replaced): never a
    device, a directory or a link (gpuvfio runs as root; a rename over /dev/null is a mistake)."""
    if not out or "\0" in out:
        raise InputError("the output path is empty")
    path = os.path.abspath(out)
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise InputError(f"cannot write {out}: {directory} is not a directory")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        kind = "a link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise InputError(f"cannot write {out}: it is {kind} (give a new name, a regular file, or - for stdout)")


def write_output(out: str, text: str) -> None:
    """Write a file the user named (checked as above), atomically; errors in one line."""
    check_output_path(out)
    try:
        atomic_write(os.path.abspath(out), text)
    except OSError as exc:
        raise GpuvfioError(f"cannot write {out}: {exc.strerror or exc}") from None


def read_regular(path: str, limit: int = 1 << 20) -> bytes | None:
    """The bytes of a regular file (a run's identity and results, a ROM image), or None when
    there is none; never read through a link, never opened when it is a FIFO or a device (an
    open can block or act), never more than ``limit`` bytes. InputError, one line, otherwise."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}") from None
    if stat.S_ISLNK(mode):
        raise InputError(f"cannot read {path}: it is a link")
    if not stat.S_ISREG(mode):
        raise InputError(f"{path} is not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:  # replaced by a link since (ELOOP), or unreadable
        raise InputError(f"cannot read {path}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError(f"{path} is not a regular file")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise InputError(f"{path} is larger than {limit} bytes")
        return b"".join(chunks)
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
