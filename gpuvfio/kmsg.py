"""The kernel's log device, /dev/kmsg, read to its end once the file layer opened it
(gpuvfio.files.Tree.read_kernel_log: a character device with its numbers, reached through held
directory fds with no link followed, opened non-blocking): checked again by fstat, bounded.

Its records (Documentation/ABI/testing/dev-kmsg; kernel/printk/printk.c devkmsg_read) come one
per read(2), and a read smaller than a record loses it (EINVAL), so each asks for the most a
record holds; EPIPE says records were overwritten while read, and the next read goes on from the
oldest left; with O_NONBLOCK the end is EAGAIN.
"""

from __future__ import annotations

import collections
import errno
import os

from gpuvfio.errors import HostReadError, UnsafePathError

__all__ = ["DEVICE", "LOG_LIMIT", "read_open"]

DEVICE = (1, 11)  # drivers/char/mem.c devlist[11] "kmsg", MEM_MAJOR 1 (include/uapi/linux/major.h)
# A record as devkmsg_read formats it fits CONSOLE_EXT_LOG_MAX (8192, Linux 5.4-6.1; 6.6 caps it
# at PRINTK_MESSAGE_MAX, 2048); log_buf_len reaches 32 MiB on big hosts.
RECORD_MAX = 8192
LOG_LIMIT = 32 << 20
MAX_READS = 1 << 20  # a log written faster than it is read ends here rather than never


def read_open(fd: int, looked: os.stat_result, limit: int, where: str) -> bytes:
    """The records of the device open on ``fd`` (files.Tree.read_kernel_log opened it), which
    fstatat found to be ``looked`` before: the newest that fit in ``limit`` bytes. It closes ``fd``."""
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino, now.st_rdev) != (looked.st_dev, looked.st_ino, looked.st_rdev):
            raise UnsafePathError(f"{where} changed while it was opened")
        return _drain(fd, limit, where)
    finally:
        os.close(fd)


def _drain(fd: int, limit: int, where: str) -> bytes:
    records: collections.deque[bytes] = collections.deque()
    kept = 0
    for _ in range(MAX_READS):
        try:
            record = os.read(fd, RECORD_MAX)
        except BlockingIOError:
            break
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                continue
            raise HostReadError(f"cannot read {where}: {exc.strerror or exc}") from None
        if not record:
            break
        records.append(record)
        kept += len(record)
        while kept > limit:
            kept -= len(records.popleft())
    return b"".join(records)
