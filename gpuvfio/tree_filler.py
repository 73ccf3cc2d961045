"""The file layer's bulk writer: many records written into one new tree in path order (a
recording loaded by ``gpuvfio.host.fixture``), under the rules of :mod:`gpuvfio.files`.

A walk from the top for every record (``Tree.write``: each component opened again, a temp file,
a rename) cost about 220 us a record, 0.7 s for the 3,208-record DGX sample that every
``--root X.host`` loads. Here the fds of the directories on the current path stay open (at most
its depth), so a record costs a few syscalls."""

from __future__ import annotations

import errno
import os
import stat

from gpuvfio.errors import GpuvfioError, HostReadError, UnsafePathError
from gpuvfio.files import NotRegular, Tree, kind_name, open_dir_at, split

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class TreeFiller:
    """Many records written into one tree, in path order (a recording loaded): the fds of the
    directories on the current path stay open (at most its depth), so a record costs a few
    syscalls instead of a walk from the top. Tree's rules hold: every component is opened
    O_NOFOLLOW (a link on the way is refused), only regular files are written (O_NOFOLLOW,
    O_NONBLOCK, checked by fstat). Scratch content: no fsync. Use it as a context manager."""

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

    def _dir(self, parts: list[str]) -> int:
        keep = 0
        while keep < min(len(parts), len(self._parts)) and parts[keep] == self._parts[keep]:
            keep += 1
        for fd in self._fds[keep + 1:]:
            os.close(fd)
        del self._fds[keep + 1:], self._parts[keep:]
        for part in parts[keep:]:
            where = self.tree.path("/".join(self._parts + [part]))
            fd = open_dir_at(self._fds[-1], part, where)
            if fd is None:
                try:
                    os.mkdir(part, 0o755, dir_fd=self._fds[-1])
                except FileExistsError:
                    pass  # a link planted there meanwhile: the open below refuses it
                except OSError as exc:
                    raise GpuvfioError(f"cannot make {where}: {exc.strerror or exc}") from None
                fd = open_dir_at(self._fds[-1], part, where)
                if fd is None:
                    raise HostReadError(f"cannot open {where}: removed while it was made")
            self._fds.append(fd)
            self._parts.append(part)
        return self._fds[-1]

    def _parent(self, rel: str) -> tuple[int, str]:
        parts = split(rel)
        if not parts:
            raise UnsafePathError(f"refusing empty file name under {self.tree.path()}")
        return self._dir(parts[:-1]), parts[-1]

    def lstat(self, rel: str) -> os.stat_result | None:
        dir_fd, name = self._parent(rel)
        try:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HostReadError(f"cannot look at {self.tree.path(rel)}: {exc.strerror or exc}") from None

    def make_dir(self, rel: str) -> None:
        self._dir(split(rel))

    def write(self, rel: str, data: bytes) -> None:
        """``rel`` holds ``data``: a new file, or a regular file there rewritten (never a link,
        a directory or a FIFO: NotRegular)."""
        dir_fd, name = self._parent(rel)
        try:  # looked at before the open: a device planted there is never opened
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise NotRegular(f"{self.tree.path(rel)} is {kind_name(mode)} already")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | _CLOEXEC
        try:
            fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise NotRegular(f"{self.tree.path(rel)} changed while it was opened") from None
            raise GpuvfioError(f"cannot write {self.tree.path(rel)}: {exc.strerror or exc}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotRegular(f"{self.tree.path(rel)} is not a regular file")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def symlink(self, rel: str, target: str) -> None:
        """``rel`` is a link to ``target`` (a file or link there is replaced; a directory is not)."""
        dir_fd, name = self._parent(rel)
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise NotRegular(f"{self.tree.path(rel)} is {kind_name(mode)} already")
        try:
            if mode is not None:
                os.unlink(name, dir_fd=dir_fd)
            os.symlink(target, name, dir_fd=dir_fd)
        except OSError as exc:
            raise GpuvfioError(f"cannot write {self.tree.path(rel)}: {exc.strerror or exc}") from None

