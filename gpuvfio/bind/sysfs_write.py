"""Writes to sysfs with a timeout, in a child process.

A write to ``driver/unbind`` runs the driver's remove() in the writer's context; with
nvidia and a process still holding the GPU that can block in the kernel for ever (GPU
Operator vfio-manager runs unbind with a timeout for this reason). So every write
happens in a forked child; the parent waits at most ``timeout`` seconds for its
answer. A child stuck in the kernel cannot be killed (uninterruptible sleep); we
report it and leave it, and the caller marks the step *uncertain* in the journal so
that ``restore`` reconciles with what sysfs shows later.

The target is opened here, in the parent, just before the write: its directory resolved
afresh and opened through held directory fds beneath the root, every component O_NOFOLLOW, a
regular file with one link (HostRoot.open_sys_attribute). A path planned earlier is never
written by its string: a directory swapped for a link meanwhile is refused, not followed.

The kernel side is a ``backend``: ``backend(path, data, fd)`` performs one write on ``fd`` or
raises OSError. Production uses real ``write(2)``; the unit lane passes a simulated kernel
that applies Linux's semantics to a tree in tmp_path.
"""

from __future__ import annotations

import errno
import os
import select
import signal
from typing import Callable

from gpuvfio.clock import SYSTEM_CLOCK, Clock
from gpuvfio.errors import GpuvfioError
from gpuvfio.host.root import HostRoot
from gpuvfio.options import RUN

Backend = Callable[[str, bytes, int], None]
DEFAULT_TIMEOUT = RUN["write_timeout"].default  # --write-timeout's default (gpuvfio.options)


class SysfsWriteError(GpuvfioError):
    """The kernel refused a write: carries the path, the value and what the kernel said."""

    def __init__(self, path: str, value: str, err: int, message: str) -> None:
        self.path, self.value, self.errno = path, value, err
        super().__init__(f"writing {value!r} to {path} failed: {message}")


class SysfsWriteTimeout(GpuvfioError):
    """The write did not return in time; the kernel may still complete it."""

    def __init__(self, path: str, value: str, timeout: float, pid: int) -> None:
        self.path, self.value, self.pid = path, value, pid
        super().__init__(f"writing {value!r} to {path} did not return within {timeout:g}s "
                         f"(writer pid {pid} left behind; the kernel may still complete it)")


def kernel_write(path: str, data: bytes, fd: int) -> None:
    """One write(2) to a sysfs attribute opened by HostRoot.open_sys_attribute, as ``echo`` does it."""
    os.write(fd, data)


class SysfsWriter:
    def __init__(self, host: HostRoot, *, timeout: float = DEFAULT_TIMEOUT, backend: Backend = kernel_write,
                 clock: Clock = SYSTEM_CLOCK):
        self.host = host
        self.timeout = timeout
        self.backend = backend
        self.clock = clock  # the Context's: how long a stuck writer is given to be reaped

    def check(self, path: str) -> None:
        """Open ``path`` as write() will, and close it: a target the writer would refuse (a link
        on the way, a hard link, a FIFO) refuses the operation before its first write."""
        try:
            os.close(self.host.open_sys_attribute(os.path.normpath(path)))
        except FileNotFoundError:
            pass  # the write reports a missing attribute as the kernel's ENOENT, in its step

    def write(self, path: str, value: str) -> None:
        full = os.path.normpath(path)
        try:
            target = self.host.open_sys_attribute(full)
        except FileNotFoundError:  # the device (or driver) is gone: the kernel's own answer
            raise SysfsWriteError(full, value, errno.ENOENT, f"{os.strerror(errno.ENOENT)} (ENOENT)") from None
        try:
            self._write_in_child(full, value, target)
        finally:
            os.close(target)

    def _write_in_child(self, full: str, value: str, target: int) -> None:
        data = value.encode()
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: one write, report errno through the pipe, exit without cleanup
            code = 0
            message = b""
            try:
                os.close(read_fd)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                self.backend(full, data, target)
            except OSError as exc:
                code = exc.errno or errno.EIO
                message = (exc.strerror or str(exc)).encode()[:200]
            except BaseException as exc:  # noqa: BLE001 - report anything, never unwind the parent's stack
                code = errno.EIO
                message = repr(exc).encode()[:200]
            try:
                os.write(write_fd, f"{code}:".encode() + message)
            finally:
                os._exit(0)
        os.close(write_fd)
        try:
            ready, _, _ = select.select([read_fd], [], [], self.timeout)
            if not ready:
                self._abandon(pid)
                raise SysfsWriteTimeout(full, value, self.timeout, pid)
            answer = os.read(read_fd, 512).decode("utf-8", "replace")
        finally:
            os.close(read_fd)
        os.waitpid(pid, 0)
        code_text, _, message = answer.partition(":")
        code = int(code_text) if code_text.isdigit() else errno.EIO
        if code:
            raise SysfsWriteError(full, value, code, f"{message or os.strerror(code)} ({errno.errorcode.get(code, code)})")

    def _abandon(self, pid: int) -> None:
        """Try to end a stuck writer; a task in uninterruptible sleep ignores even SIGKILL."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = self.clock.monotonic() + 0.5
        while self.clock.monotonic() < deadline:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return
            self.clock.sleep(0.02)
