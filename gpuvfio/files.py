"""The one file layer: every read and write of a host tree, the state directory, persist files,
recordings, specs, results and reports goes through here (a structure test forbids raw opens
elsewhere in the package).

gpuvfio runs as root on trees it is given, so a path is never trusted for what it names:
* A :class:`Tree` is a top directory (the caller's choice: ``--root``, the state directory,
  ``OUT``) and everything beneath it is reached by walking directory fds, each component opened
  with O_NOFOLLOW: a link on the way is refused. Links are followed only where a caller means
  to, outside this layer's walk: sysfs's own links by ``HostRoot.resolve_in_sys`` (inside
  ``<root>/sys`` only), a host's /etc links by ``HostRoot.config_path`` (inside the root only).
* A file is looked at (fstatat, no follow; or the type its directory's listing gave) before it
  is opened and must be a regular file (sysfs attributes and procfs files are regular files
  too); it is opened O_NONBLOCK|O_NOCTTY and checked again by fstat, so a FIFO never blocks us
  and a device is never opened (opening /dev/watchdog arms it).
* Every read has a bound that fits what it reads; more is an error, not a truncation.
* A write goes to a new temp file beside its target (O_EXCL|O_NOFOLLOW), is fsynced and renamed
  over the target in the same directory fd; directories are made one component at a time.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import sys

from gpuvfio import kmsg
from gpuvfio.errors import GpuvfioError, HostReadError, InputError, UnsafePathError
from gpuvfio.settings import Settings

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# The layer's open flags, one set for every opener (tree_filler included): a link is never
# followed, a FIFO never waited on, a terminal never made ours, no fd leaks into a child.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | _CLOEXEC
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NOCTTY | _CLOEXEC  # a new regular file
ATTRIBUTE_LIMIT = 64 << 10  # a sysfs attribute is at most a page; a recorded one is small too
TEXT_LIMIT = 1 << 20
HOST_TEXT_LIMIT = 16 << 20  # /proc/cpuinfo of a 512-thread host, pci.ids (1.4 MB in 2024)


class NotRegular(UnsafePathError):
    """A FIFO, a device, a socket or a directory where a regular file was expected."""


def split(rel: str) -> list[str]:
    """The components of a relative path; absolute paths, '..' and NUL are refused."""
    if not isinstance(rel, str) or "\0" in rel or rel.startswith("/"):
        raise UnsafePathError(f"refusing path {rel!r}")
    parts = [part for part in rel.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise UnsafePathError(f"refusing path {rel!r}")
    return parts


_KINDS = {stat.S_IFLNK: "a link", stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a device",
          stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket"}


def kind_name(mode: int) -> str:
    """'a link', 'a FIFO', ...: what a non-regular file is, for a message."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _walk_error(exc: OSError, where: str):
    if exc.errno in (errno.ELOOP, errno.EMLINK):
        raise UnsafePathError(f"{where} is a link (not followed)") from None
    if exc.errno == errno.ENOTDIR:
        raise UnsafePathError(f"{where} is not a directory") from None
    if exc.errno in (errno.EACCES, errno.EPERM):
        raise HostReadError(f"cannot open {where}: permission denied (run as root?)") from None
    if exc.errno == errno.ENAMETOOLONG:
        raise UnsafePathError(f"{where[:120]}...: name too long") from None
    raise HostReadError(f"cannot open {where}: {exc.strerror or exc}") from None


def _component_error(exc: OSError, dir_fd: int, part: str, where: str):
    """Why a directory component could not be opened: O_DIRECTORY|O_NOFOLLOW answers ENOTDIR for
    a link too, so look (without following) to say which."""
    if exc.errno in (errno.ENOTDIR, errno.ELOOP):
        try:
            mode = os.stat(part, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            mode = 0
        if stat.S_ISLNK(mode):
            raise UnsafePathError(f"{where} is a link (not followed)") from None
        raise UnsafePathError(f"{where} is not a directory") from None
    _walk_error(exc, where)


def read_at(dir_fd: int, name: str, limit: int, where: str, *, head: bool = False,
            listed: os.DirEntry | None = None) -> bytes | None:
    """The bytes of the regular file ``name`` in an open directory, at most ``limit`` of them
    (more is UnsafePathError; with ``head``, the first ``limit`` bytes are the answer: a binary
    attribute read in part); None when there is none. A link, FIFO, device or directory there is
    UnsafePathError. ``listed``: its entry in a listing of the directory (scan_fd) that the caller
    holds; the type the listing gives (getdents' d_type) is the look before the open then."""
    if listed is not None and listed.is_file(follow_symlinks=False):
        before = None
    else:
        try:
            before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            _walk_error(exc, where)
        if not stat.S_ISREG(before.st_mode):
            raise NotRegular(f"{where} is {kind_name(before.st_mode)}, not a regular file")
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        _walk_error(exc, where)
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (
                before is not None and (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino)):
            raise NotRegular(f"{where} changed while it was opened")
        # A file that says its size (a regular file, a sysfs attribute: a page, or a binary
        # attribute's size) is read in one read(2) of that size + 1; procfs says 0: read to EOF.
        # Reaching the size it gave is the end: nothing that size or less reads on (fs/kernfs).
        known = now.st_size
        chunks, size = [], 0
        while size <= limit:
            want = limit + 1 - size
            try:
                chunk = os.read(fd, min(want, known + 1) if known else min(want, 1 << 20))
            except OSError as exc:
                # sysfs answers EIO/EINVAL/ENODEV/ENXIO for attributes a device does not implement
                # (link speed without a PCIe capability): no value, not an error.
                if exc.errno in (errno.EIO, errno.EINVAL, errno.ENODEV, errno.ENXIO, errno.EAGAIN,
                                 errno.EOPNOTSUPP, errno.ENOTSUP):
                    return None
                raise HostReadError(f"cannot read {where}: {exc.strerror or exc}") from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size == known:
                break
        if size > limit:
            if head:
                return b"".join(chunks)[:limit]
            raise UnsafePathError(f"{where} is larger than {limit} bytes")
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


def scan_fd(dir_fd: int, where: str) -> dict[str, os.DirEntry]:
    """The entries of an open directory by name, with the types its listing gives (read_at's
    ``listed``): one getdents pass instead of a stat per name."""
    try:
        with os.scandir(dir_fd) as entries:
            return {entry.name: entry for entry in entries}
    except OSError as exc:
        raise HostReadError(f"cannot list {where}: {exc.strerror or exc}") from None


def open_dir_at(dir_fd: int, name: str, where: str) -> int | None:
    """The fd of directory ``name`` in an open directory (O_NOFOLLOW: a link there is refused);
    None when it is missing. The caller closes it."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        _component_error(exc, dir_fd, name, where)


def open_dir_step(dir_fd: int, name: str, where: str) -> int | bool | None:
    """The fd of directory ``name`` in an open directory (the caller closes it); None when nothing
    is there, False when it is no directory: O_NOFOLLOW|O_DIRECTORY opens no link and no FIFO
    (ENOTDIR or ELOOP, openat(2)), and a walk that follows links itself reads the link there."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            _walk_error(exc, where)
        return False


class Tree:
    """A top directory (followed: the caller chose it) and paths beneath it (never followed).

    ``Tree(top, "var/lib/gpuvfio")`` is the part beneath ``top`` walked link-free on every use."""

    def __init__(self, top: str, base: str = "") -> None:
        if not top or "\0" in top:
            raise InputError("a directory path is empty")
        self.top = os.path.abspath(top)
        self.base = split(base)

    def __repr__(self) -> str:
        return f"Tree({self.path()!r})"

    def path(self, rel: str = "") -> str:
        """The path a message names (never opened by this name)."""
        return os.path.join(self.top, *self.base, *split(rel))

    def sub(self, rel: str) -> "Tree":
        return Tree(self.top, "/".join(self.base + split(rel)))

    # -- directories ---------------------------------------------------------------------
    def _open_top(self, *, create: bool) -> int | None:
        try:
            return os.open(self.top, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        except FileNotFoundError:
            if not create:
                return None
        except OSError as exc:
            if exc.errno == errno.ENOTDIR:
                raise UnsafePathError(f"{self.top} is not a directory") from None
            _walk_error(exc, self.top)
        try:  # the top is the caller's own path (an admin's GPUVFIO_STATE_DIR): made as mkdir -p would
            os.makedirs(self.top, 0o755, exist_ok=True)
            return os.open(self.top, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.EEXIST):
                raise UnsafePathError(f"{self.top} is not a directory") from None
            raise GpuvfioError(f"cannot make {self.top}: {exc.strerror or exc}") from None

    def open_dir(self, parts: list[str], *, create: bool = False, mode: int = 0o755) -> int | None:
        """An fd of the directory ``base + parts`` (made, one component at a time, with
        ``create``); None when it is missing and not made. The caller closes it."""
        fd = self._open_top(create=create)
        if fd is None:
            return None
        where = self.top
        try:
            for part in self.base + parts:
                where = os.path.join(where, part)
                next_fd = open_dir_at(fd, part, where)
                if next_fd is None and create:
                    try:
                        os.mkdir(part, mode, dir_fd=fd)
                    except FileExistsError:
                        pass  # made meanwhile (or a link planted): the open below decides
                    except OSError as exc:
                        _walk_error(exc, where)
                    next_fd = open_dir_at(fd, part, where)
                    if next_fd is None:
                        raise HostReadError(f"cannot open {where}: removed while it was made")
                if next_fd is None:
                    return None
                os.close(fd)
                fd = next_fd
            result, fd = fd, -1
            return result
        finally:
            if fd >= 0:
                os.close(fd)

    def _parent(self, rel: str, *, create: bool = False, mode: int = 0o755) -> tuple[int | None, str]:
        parts = split(rel)
        if not parts:
            raise UnsafePathError(f"refusing empty file name under {self.path()}")
        return self.open_dir(parts[:-1], create=create, mode=mode), parts[-1]

    def is_dir(self, rel: str = "") -> bool:
        try:
            fd = self.open_dir(split(rel))
        except UnsafePathError:
            return False
        if fd is not None:
            os.close(fd)
        return fd is not None

    def listdir(self, rel: str = "") -> list[str]:
        """Names in a directory beneath the top, sorted; empty when it does not exist."""
        fd = self.open_dir(split(rel))
        if fd is None:
            return []
        try:
            return sorted(os.listdir(fd))
        except OSError as exc:
            raise HostReadError(f"cannot list {self.path(rel)}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)

    def make_dir(self, rel: str = "", mode: int = 0o755) -> None:
        fd = self.open_dir(split(rel), create=True, mode=mode)
        os.close(fd)

    # -- files ---------------------------------------------------------------------------
    def lstat(self, rel: str) -> os.stat_result | None:
        dir_fd, name = self._parent(rel)
        if dir_fd is None:
            return None
        try:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            _walk_error(exc, self.path(rel))
        finally:
            os.close(dir_fd)

    def exists(self, rel: str) -> bool:
        """Is there anything (a link included) at ``rel``? A link on the way is no."""
        try:
            return self.lstat(rel) is not None
        except UnsafePathError:
            return False

    def read(self, rel: str, limit: int = TEXT_LIMIT, *, head: bool = False) -> bytes | None:
        dir_fd, name = self._parent(rel)
        if dir_fd is None:
            return None
        try:
            return read_at(dir_fd, name, limit, self.path(rel), head=head)
        finally:
            os.close(dir_fd)

    def read_kernel_log(self, rel: str, limit: int = kmsg.LOG_LIMIT) -> bytes | None:
        """The kernel log at ``rel`` in /dev/kmsg's form: the live root's device (gpuvfio.kmsg, the
        newest records within ``limit``) or a recording (a regular file of such records); None
        when there is none. Any other device, a link or a FIFO there is refused, never opened."""
        dir_fd, name = self._parent(rel)
        if dir_fd is None:
            return None
        try:
            try:
                found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return None
            except OSError as exc:
                _walk_error(exc, self.path(rel))
            if not stat.S_ISCHR(found.st_mode):
                return read_at(dir_fd, name, limit, self.path(rel))
            if (os.major(found.st_rdev), os.minor(found.st_rdev)) != kmsg.DEVICE or self.path() != "/":
                raise NotRegular(f"{self.path(rel)} is the character device {os.major(found.st_rdev)}:"
                                 f"{os.minor(found.st_rdev)}: only the live root's /dev/kmsg (1:11) is read")
            try:
                fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                _walk_error(exc, self.path(rel))
            return kmsg.read_open(fd, found, limit, self.path(rel))  # which closes it
        finally:
            os.close(dir_fd)

    def text(self, rel: str, limit: int = TEXT_LIMIT) -> str | None:
        """A UTF-8 text file; other bytes are bad input (a host's or a user's file)."""
        data = self.read(rel, limit)
        if data is None:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{self.path(rel)} is not UTF-8 text") from None

    def readlink(self, rel: str) -> str | None:
        """A link's target (never followed); None when there is nothing there or not a link."""
        dir_fd, name = self._parent(rel)
        if dir_fd is None:
            return None
        try:
            return os.readlink(name, dir_fd=dir_fd)
        except OSError:
            return None
        finally:
            os.close(dir_fd)

    def write(self, rel: str, data: str | bytes, mode: int = 0o644, *, dir_mode: int = 0o755,
              durable: bool = True) -> None:
        """Replace ``rel`` with ``data`` atomically: a new temp file beside it, fsync, rename in
        the same directory fd, fsync the directory. Missing parents are made link-free.
        ``durable`` False skips the fsyncs (a scratch copy that dies with the process)."""
        payload = data.encode("utf-8") if isinstance(data, str) else data
        dir_fd, name = self._parent(rel, create=True, mode=dir_mode)
        try:
            tmp = self._temp_name(dir_fd, name)
            try:
                _write_new(dir_fd, tmp, payload, mode, durable)
                self._check_replaceable(dir_fd, name, rel)
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                _unlink_quietly(dir_fd, tmp)
                raise
            if durable:
                os.fsync(dir_fd)
        except OSError as exc:
            raise GpuvfioError(f"cannot write {self.path(rel)}: {exc.strerror or exc}") from None
        finally:
            os.close(dir_fd)

    def symlink(self, rel: str, target: str, *, dir_mode: int = 0o755) -> None:
        """Make ``rel`` a link to ``target`` (systemd's enablement links), atomically."""
        dir_fd, name = self._parent(rel, create=True, mode=dir_mode)
        try:
            tmp = self._temp_name(dir_fd, name)
            os.symlink(target, tmp, dir_fd=dir_fd)
            try:
                self._check_replaceable(dir_fd, name, rel)
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                _unlink_quietly(dir_fd, tmp)
                raise
        except OSError as exc:
            raise GpuvfioError(f"cannot write {self.path(rel)}: {exc.strerror or exc}") from None
        finally:
            os.close(dir_fd)

    def stage(self, rel: str, data: str | bytes | None = None, *, link: str | None = None, mode: int = 0o644,
              dir_mode: int = 0o755) -> str:
        """The first half of a transaction over several files: new content (``data``, or a link to
        ``link``) in a temp file beside ``rel``, fsynced; ``replace_with`` renames it into place.
        Returns the temp's relative path."""
        dir_fd, name = self._parent(rel, create=True, mode=dir_mode)
        parent = "/".join(split(rel)[:-1])
        try:
            tmp = self._temp_name(dir_fd, name)
            if link is not None:
                os.symlink(link, tmp, dir_fd=dir_fd)
            else:
                _write_new(dir_fd, tmp, data.encode("utf-8") if isinstance(data, str) else (data or b""), mode, True)
        except OSError as exc:
            raise GpuvfioError(f"cannot write {self.path(rel)}: {exc.strerror or exc}") from None
        finally:
            os.close(dir_fd)
        return f"{parent}/{tmp}" if parent else tmp

    def replace_with(self, tmp_rel: str, rel: str) -> None:
        """Rename a staged temp over ``rel`` (same directory; a directory there is refused).
        OSError passes through: the transaction's caller puts back what it renamed."""
        dir_fd, name = self._parent(rel)
        if dir_fd is None:
            raise GpuvfioError(f"cannot write {self.path(rel)}: its directory is gone")
        try:
            tmp_parts = split(tmp_rel)
            if tmp_parts[:-1] != split(rel)[:-1]:
                raise UnsafePathError(f"refusing a rename across directories: {tmp_rel} -> {rel}")
            self._check_replaceable(dir_fd, name, rel)
            os.replace(tmp_parts[-1], name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def remove(self, rel: str) -> bool:
        """Remove a file or link (never a directory); False when there was nothing."""
        dir_fd, name = self._parent(rel)
        if dir_fd is None:
            return False
        try:
            os.unlink(name, dir_fd=dir_fd)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            # Linux's unlink(2) answers EISDIR for a directory; its EPERM (POSIX's answer for a
            # directory) means a sticky directory or an immutable file, which the reason says.
            if exc.errno == errno.EISDIR:
                raise UnsafePathError(f"{self.path(rel)} is a directory (not removed)") from None
            raise GpuvfioError(f"cannot remove {self.path(rel)}: {exc.strerror or exc}") from None
        finally:
            os.close(dir_fd)

    def open_attribute(self, rel: str) -> int:
        """A write-only fd of the attribute ``rel`` (a sysfs file: never made, never truncated),
        reached through directory fds held from the top, each component O_NOFOLLOW: a link on
        the way, swapped in since the path was planned, is refused, never written through. Only
        a regular file with one link (every sysfs attribute has one; a hard link planted in a
        tree would write into another file). FileNotFoundError: it is not there (the device is
        gone); the caller closes the fd."""
        dir_fd, name = self._parent(rel)
        if dir_fd is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), self.path(rel))
        try:
            # Looked at before it is opened: a device is never opened (opening /dev/watchdog arms
            # it), a directory, FIFO or socket never met as an errno; then checked again by fstat.
            before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
            if not stat.S_ISREG(before):
                kind = kind_name(before)
                if stat.S_ISLNK(before):
                    raise UnsafePathError(f"refusing to write {self.path(rel)}: it is a link")
                raise NotRegular(f"refusing to write {self.path(rel)}: it is {kind}")
            try:
                fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | _CLOEXEC,
                             dir_fd=dir_fd)
            except FileNotFoundError:
                raise
            except OSError as exc:  # replaced since it was looked at: refused, whatever it is now
                raise NotRegular(f"refusing to write {self.path(rel)}: it changed while it was opened "
                                 f"({exc.strerror or exc})") from None
            found = os.fstat(fd)
            problem = (f"it is {kind_name(found.st_mode)}" if not stat.S_ISREG(found.st_mode) else
                       f"it has {found.st_nlink} links (a sysfs attribute has one)" if found.st_nlink != 1 else None)
            if problem:
                os.close(fd)
                raise NotRegular(f"refusing to write {self.path(rel)}: {problem}")
            return fd
        finally:
            os.close(dir_fd)

    def open_lock(self, rel: str, mode: int = 0o600, *, dir_mode: int = 0o700) -> int:
        """A read-write fd of a regular lock file (made when missing), for flock."""
        dir_fd, name = self._parent(rel, create=True, mode=dir_mode)
        try:
            try:
                current = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                current = None
            if current is not None and not stat.S_ISREG(current.st_mode):
                raise NotRegular(f"{self.path(rel)} is {kind_name(current.st_mode)}, not a regular file")
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | _CLOEXEC,
                         mode, dir_fd=dir_fd)
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
                # The lock is written (the holder's line): a hard link to another file would be
                # emptied. Only a file gpuvfio made (one link) is a lock.
                os.close(fd)
                raise NotRegular(f"{self.path(rel)} is not a lock gpuvfio made ("
                                 + ("not a regular file" if not stat.S_ISREG(found.st_mode)
                                    else f"it has {found.st_nlink} links") + "): move it away")
            return fd
        except OSError as exc:
            _walk_error(exc, self.path(rel))
        finally:
            os.close(dir_fd)

    # -- helpers -------------------------------------------------------------------------
    @staticmethod
    def _temp_name(dir_fd: int, name: str) -> str:
        # A name may be 255 bytes (NAME_MAX), so one over 200 bytes is cut, by bytes (200 characters
        # can be 800), and a digest of the whole name ends the cut, or two files of one
        # transaction whose names share their first 200 bytes would share a temp.
        raw = os.fsencode(name)
        if len(raw) > 200:
            raw = raw[:183] + b"-" + hashlib.sha256(raw).hexdigest()[:16].encode()
        tmp = os.fsdecode(b"." + raw + f".tmp-{os.getpid()}".encode())
        _unlink_quietly(dir_fd, tmp)  # a stale temp of an earlier run with this pid, or anything planted
        return tmp

    def _check_replaceable(self, dir_fd: int, name: str, rel: str) -> None:
        """A rename replaces a file or a link (the link itself, never what it points to); a
        directory, FIFO or device planted there is refused."""
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise NotRegular(f"cannot write {self.path(rel)}: it is {kind_name(mode)}")


class ReadOnly(GpuvfioError):
    """A write through a Tree that only reads (a dry run's state dir): a bug, never a change."""


def create_at(dir_fd: int, name: str, mode: int = 0o644) -> int:
    """The write fd of a new regular file ``name`` in an open directory (O_EXCL: never an
    existing file, nor through a link; FileExistsError when anything is there). The caller
    writes and closes it."""
    return os.open(name, NEW_FILE_FLAGS, mode, dir_fd=dir_fd)


def _write_new(dir_fd: int, name: str, payload: bytes, mode: int, durable: bool) -> None:
    """A new file ``name`` (O_EXCL: never an existing one, nor through a link) with ``payload``."""
    fd = create_at(dir_fd, name, mode)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(dir_fd: int, name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


def silence_stdout() -> None:
    """Point stdout's descriptor at /dev/null: its reader is gone (a closed pipe), and what is
    still buffered must not raise BrokenPipeError again when the interpreter flushes at exit
    (Python's documented way: docs.python.org/3/library/signal.html, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a real descriptor (captured by a test): nothing to silence


@contextlib.contextmanager
def scratch_dir(prefix: str):
    """A private temporary directory (0700), removed with everything in it afterwards (rmtree
    does not follow links). Memory-backed /dev/shm when it is there and TMPDIR is not set: a
    recorded host is thousands of small files."""
    import tempfile  # here, where it is used: the root command and a live host's reads need none

    scratch = "/dev/shm" if os.access("/dev/shm", os.W_OK) and not Settings.from_environment().tmpdir_set else None
    with tempfile.TemporaryDirectory(prefix=prefix, dir=scratch) as directory:
        yield directory
