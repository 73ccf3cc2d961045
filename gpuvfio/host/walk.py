"""One walk of a path beneath a host's root (gpuvfio.host.root): sysfs's own links followed
inside ``<root>/sys``, a host's own links inside the root, one component at a time on held
directory fds, with limits counted on the path asked whatever was walked before.

Every answer about a path under ``<root>/sys`` (HostRoot.resolve_in_sys, SysDirs.open,
HostRoot.open_sys_attribute) comes from this walk; there is no other.
"""

from __future__ import annotations

import errno
import os

from gpuvfio import files
from gpuvfio.errors import HostReadError, UnsafePathError

MAX_COMPONENTS = 128  # deeper than any sysfs device path (a switch tree of 30 levels is ~100)
MAX_LINK_HOPS = 40  # the kernel's own limit on links in one lookup (MAXSYMLINKS, path_resolution(7))


class HeldDirs:
    """Directory fds held by their real paths (no link on their way), each opened under its
    parent's held fd with O_NOFOLLOW|O_DIRECTORY (openat(2)), and the walk that uses them: it
    passes a directory it holds without a system call, and no path string is resolved by the
    kernel, so nothing can be swapped in between a look and an open. Held for one walk, or for
    one pass (SysDirs).

    The walk (``walk``) resolves ``path`` beneath ``top`` (``<root>/sys``, or the root for the
    host's own links) one component at a time (no recursion: input drives the depth), following
    each link as the kernel's lookup would (path_resolution(7)) but never out of ``top``. sysfs's
    links are relative (Documentation/filesystems/sysfs.rst: a device's directory is linked from
    its bus and classes), so an absolute one in a root would name the live host and is refused; a
    host's /etc links (``host_links``) are followed as the host follows them, absolute targets
    taken under the root. A target is normalized (os.path.normpath) from the link's directory, a
    real one, so its leading '..' go up as the kernel's would; a '..' after a link inside the
    target is taken lexically (the kernel would follow the link first), which names another path
    inside ``top``, walked and checked as any. The path asked is taken as normalized too.

    Its limits are counted on the path asked and on every link's target, never on what an
    earlier walk found: at most MAX_LINK_HOPS links followed, at most MAX_COMPONENTS components
    on the way (the path's, then each target's and those still to walk after it). A held fd
    spares only looking up a directory whose real path it is (no link on its way), never a link
    or a count. ``memo`` keeps a walk's answer for the path asked, and each real path it met as
    its own answer (no link on its way, within MAX_COMPONENTS: what a fresh walk of it answers);
    an answer is a whole walk's, never a midpoint, so a path is accepted or refused alike by a
    fresh host and one that has walked before."""

    def __init__(self, tree: files.Tree) -> None:
        self.tree, self.root_path = tree, tree.top  # the host's root (a Tree of it)
        self.root = tree.top.rstrip("/")  # "" for "/": a child's path is always root + "/" + name
        self.fds: dict[str, int] = {}

    def __enter__(self) -> "HeldDirs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            os.close(fd)

    def get(self, path: str) -> int:
        """The held fd of the real directory ``path`` (the root or beneath it), opened with those
        above it when not held yet (a walk's top; the root itself is followed: the caller chose it).
        From the nearest held directory above, one component at a time: a root's sys may lie
        hundreds of directories deep, so no recursion."""
        fd = self.fds.get(path)
        if fd is not None:
            return fd
        below, where = [], path
        while where not in self.fds and where != self.root and where:
            below.append(where)
            where = where.rpartition("/")[0]
        if where not in self.fds:
            self.fds[where] = self.reopen(self.root)
        for step in reversed(below):
            parent, _, name = step.rpartition("/")
            fd = files.open_dir_at(self.fds[parent], name, step)
            if fd is None:
                raise HostReadError(f"missing {step}")
            self.fds[step] = fd
        return self.fds[path]

    def reopen(self, path: str) -> int:
        """A fresh fd of the real directory ``path``, for a caller to own and close."""
        if path == self.root:
            fd = self.tree.open_dir([])
        else:
            parent, _, name = path.rpartition("/")
            fd = files.open_dir_at(self.get(parent), name, path)
        if fd is None:
            raise HostReadError(f"missing {path or '/'}")
        return fd

    def walk(self, path: str, top: str, *, host_links: bool, memo: dict[str, str] | None,
             open_last: bool = False, link_first: bool = True) -> tuple[str, int | None]:
        """Where ``path`` (normalized) leads beneath ``top`` (the host's sys or root): a real path
        and, with ``open_last``, a fresh fd of that directory for the caller to close. A missing
        component is HostReadError "missing ..." in sys; for the host's links, the answer is the
        path as far as it is real, the rest as asked. ``memo`` keeps the answer.
        ``link_first``: the last component is likelier a link than not, so readlinkat(2) is tried
        before openat(2); either order gives the same answer."""
        top_path = top.rstrip("/")  # "" for "/", as the fds are named
        inside = top_path + "/"  # how a path beneath the top starts
        if "\0" in path:
            raise UnsafePathError(f"refusing path {path!r}")
        if not (path == top or path.startswith(inside)):
            raise UnsafePathError(f"{path} is outside {top}")
        # Each component below the top follows a "/" (a normalized path; "/" itself has none).
        if path.count("/", len(top_path)) - (path == "/") > MAX_COMPONENTS:
            raise UnsafePathError(f"{path[:120]}...: too many path components")
        fds, todo, entered = self.fds, [], []  # todo: the components still to walk, the next last
        real, hops, fd = self._toward(path, top, top_path, todo), 0, None
        while todo:
            name = todo.pop()
            key = real + "/" + name
            opened = open_last and not todo
            if not opened and key in fds:
                real = key
                continue
            parent = fds.get(real)
            if parent is None:  # the top, on the walk's first step
                parent = self.get(real)
            found = self._step(parent, name, key, todo, opened, link_first)
            if isinstance(found, str):
                hops, link_first = hops + 1, False  # a link's target is a directory in sysfs
                if hops > MAX_LINK_HOPS:
                    raise UnsafePathError(f"too many symlinks at {path}")
                target = self._target(path, top, inside, key, found, len(todo), host_links)
                real = self._toward(target, top, top_path, todo)
                continue
            if found is None:
                if not host_links:
                    raise HostReadError(f"missing {key}")
                return os.path.join(key, *todo[::-1]), None  # not kept: it is no answer yet
            if opened:
                fd = found  # the last: nothing follows it, the caller owns it
            elif found is not True:
                fds[key] = found
                entered.append(key)
            real = key
        if open_last and fd is None:  # the path ends at the top, or at a link to a directory walked
            fd = self.reopen(real)
        real = real or "/"
        if memo is not None:  # the answer, and each real path met as its own (see the class's words)
            memo[path] = real
            memo.setdefault(real, real)
            for where in entered:
                memo.setdefault(where, where)
        return real, fd

    def _toward(self, path: str, top: str, top_path: str, todo: list[str]) -> str:
        """Where a walk goes on to ``path`` (normalized, inside ``top``) before what is still to
        walk after it: the real directory it starts from, the rest pushed onto ``todo``. From
        ``path``'s directory when that is held (a real directory, no link on its way: walked one
        component at a time, it would only be looked up, nothing counted), else from the top."""
        if path == top:
            return top_path
        directory, _, name = path.rpartition("/")
        if directory in self.fds:
            todo.append(name)
            return directory
        rest = path[len(top_path):].lstrip("/")
        todo.extend(reversed(rest.split("/")))
        return top_path

    def _step(self, parent: int, name: str, key: str, todo: list[str], opened: bool,
              link_first: bool) -> int | str | bool | None:
        """The directory ``name`` (its path ``key``) in the directory ``parent`` opened: its fd; or
        the target of the link there; or None when nothing is there; True for the last component
        of a path resolved, not opened, when it is not a link (an attribute's path ends at a file).
        A directory on the way is opened first, a link read when the open says it is none."""
        open_first = bool(todo) or (opened and not link_first)
        if open_first:
            found = files.open_dir_step(parent, name, key)
            if found is not False:
                return found
        try:  # readlinkat(2): EINVAL when it is not a link
            return os.readlink(name, dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise HostReadError(f"cannot read {key}: {exc.strerror}") from None
        if not todo and not opened:
            return True
        if not open_first:
            found = files.open_dir_step(parent, name, key)
            if found is not False:
                return found
        if opened:
            raise UnsafePathError(f"{key} is not a directory")
        # On the way: what lstat(2) of the path beyond it would say.
        raise HostReadError(f"cannot read {key}/{todo[-1]}: {os.strerror(errno.ENOTDIR)}")

    def _target(self, path: str, top: str, inside: str, link: str, target: str, still: int,
                host_links: bool) -> str:
        """Where the link ``link`` (met walking ``path``, ``still`` components left after it)
        leads: a normalized path inside ``top``, or UnsafePathError."""
        if target.startswith("/"):  # os.path.isabs
            if not host_links:
                raise UnsafePathError(f"{link} links to absolute path {target}")
            target_path = os.path.normpath(os.path.join(self.root_path, target.lstrip("/")))
        else:
            target_path = os.path.normpath(link.rpartition("/")[0] + "/" + target)
        if not (target_path == top or target_path.startswith(inside)):
            if host_links:
                raise UnsafePathError(f"{path} leads outside the root {self.root_path} ({link} links to {target})")
            raise UnsafePathError(f"{link} links outside {top} (to {target})")
        if target_path.count("/", len(inside) - 1) - (target_path == "/") + still > MAX_COMPONENTS:
            raise UnsafePathError(f"{link}: too many path components")
        return target_path

