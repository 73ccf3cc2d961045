"""The file layer's bulk writer: many records written into one new tree in path order (a
recording loaded by ``gpuvfio.host.fixture``), under the rules of :mod:`gpuvfio.files`.

A walk from the top for every record (``Tree.write``: each component opened again, a temp file,
a rename) cost about 220 us a record, 0.7 s for the 3,208-record DGX sample that every
``--root X.host`` loads. Here the fds of the directories on the current path stay open (at most
its depth), so a record costs a few syscalls."""

from __future__ import annotations

import contextlib
import os
import stat

from gpuvfio.errors import GpuvfioError, HostReadError, UnsafePathError
from gpuvfio.files import NotRegular, Tree, create_at, kind_name, open_dir_at



class TreeFiller:
    """Many records written into one tree, in path order (a recording loaded): the fds of the
    directories on the current path stay open (at most its depth), so a record costs a few
    syscalls instead of a walk from the top. Tree's rules hold: every component is opened
    O_NOFOLLOW (a link on the way is refused), only regular files are written (a new one
    O_EXCL; one already there is looked at, never opened, and replaced by a new one renamed over
    it). Paths are lists of components. Scratch content: no fsync. A context manager."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self._parts: list[str] = []
        self._fds: list[int] = []

    def __enter__(self) -> "TreeFiller":
        self._fds = [self.tree.open_dir([], create=True)]
        return self

    def __exit__(self, *_exc) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds, self._parts = [], []

    def _where(self, parts: list[str]) -> str:
        return self.tree.path("/".join(parts))

    def _dir(self, parts: list[str]) -> int:
        held = self._parts
        keep, most = 0, min(len(parts), len(held))
        while keep < most and parts[keep] == held[keep]:
            keep += 1
        for fd in self._fds[keep + 1:]:
            os.close(fd)
        del self._fds[keep + 1:], held[keep:]
        for part in parts[keep:]:
            _check_component(part)
            fd = open_dir_at(self._fds[-1], part, self._where(held + [part]))  # a link there: refused
            self._fds.append(self._make(part) if fd is None else fd)
            held.append(part)
        return self._fds[-1]

    def _make(self, part: str) -> int:
        try:
            os.mkdir(part, 0o755, dir_fd=self._fds[-1])
        except FileExistsError:
            pass  # a link planted there meanwhile: the open below refuses it
        except OSError as exc:
            raise GpuvfioError(f"cannot make {self._where(self._parts + [part])}: {exc.strerror or exc}") from None
        # What is there now: a link planted meanwhile is refused, in words.
        fd = open_dir_at(self._fds[-1], part, self._where(self._parts + [part]))
        if fd is None:
            raise HostReadError(f"cannot open {self._where(self._parts + [part])}: removed while it was made")
        return fd

    def _parent(self, parts: list[str]) -> tuple[int, str]:
        if not parts:
            raise UnsafePathError(f"refusing empty file name under {self.tree.path()}")
        _check_component(parts[-1])
        return self._dir(parts[:-1]), parts[-1]

    def lstat(self, parts: list[str]) -> os.stat_result | None:
        dir_fd, name = self._parent(parts)
        try:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HostReadError(f"cannot look at {self._where(parts)}: {exc.strerror or exc}") from None

    def make_dir(self, parts: list[str]) -> None:
        self._dir(parts)

    def write(self, parts: list[str], data: bytes) -> None:
        """``parts`` holds ``data``: a new file, or a regular file there replaced (never a link,
        a directory, a FIFO or a device: NotRegular)."""
        dir_fd, name = self._parent(parts)
        try:  # O_EXCL: a new regular file, never anything that was there
            fd = create_at(dir_fd, name)
        except FileExistsError:
            self._replace(dir_fd, name, parts, data)
            return
        except OSError as exc:
            raise GpuvfioError(f"cannot write {self._where(parts)}: {exc.strerror or exc}") from None
        self._write_all(dir_fd, name, fd, data, parts)

    def _write_all(self, dir_fd: int, name: str, fd: int, data: bytes, parts: list[str]) -> None:
        """``data`` into ``name``, a file this filler just made (O_EXCL) and whose fd is closed
        here; ENOSPC and the like in one line, and the part-written file removed, so a load that
        failed leaves no file holding part of a record."""
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            raise GpuvfioError(f"cannot write {self._where(parts)}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)

    def _replace(self, dir_fd: int, name: str, parts: list[str], data: bytes) -> None:
        """A file there already (a record written twice): a regular file is replaced by a new one
        beside it, renamed over it (as Tree.write: never written through, a hard link included);
        anything else is refused, looked at without being opened."""
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError as exc:
            raise GpuvfioError(f"cannot write {self._where(parts)}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(mode):
            raise NotRegular(f"{self._where(parts)} is {kind_name(mode)} already")
        temp = f".{name[:200]}.tmp-{os.getpid()}"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=dir_fd)
            self._write_all(dir_fd, temp, create_at(dir_fd, temp), data, parts)
            os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            raise GpuvfioError(f"cannot write {self._where(parts)}: {exc.strerror or exc}") from None

    def symlink(self, parts: list[str], target: str) -> None:
        """``parts`` is a link to ``target`` (a file or link there is replaced; a directory is not)."""
        dir_fd, name = self._parent(parts)
        try:
            os.symlink(target, name, dir_fd=dir_fd)
            return
        except FileExistsError:
            pass
        except OSError as exc:
            raise GpuvfioError(f"cannot write {self._where(parts)}: {exc.strerror or exc}") from None
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError as exc:
            raise GpuvfioError(f"cannot write {self._where(parts)}: {exc.strerror or exc}") from None
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise NotRegular(f"{self._where(parts)} is {kind_name(mode)} already")
        try:
            os.unlink(name, dir_fd=dir_fd)
            os.symlink(target, name, dir_fd=dir_fd)
        except OSError as exc:
            raise GpuvfioError(f"cannot write {self._where(parts)}: {exc.strerror or exc}") from None


def _check_component(part: str) -> None:
    """One path component: never empty, '.', '..', nor holding '/' or NUL."""
    if not part or part in (".", "..") or "/" in part or "\0" in part:
        raise UnsafePathError(f"refusing path component {part!r}")
