"""Every host path comes from here: one injected root (``--root`` / ``GPUVFIO_ROOT``).

Like mdevctl's ``Environment::root()``, the root is a directory that looks like ``/``:
the live host (``/``), a recorded fixture loaded into a temporary directory, or a
simulated host in a test. Nothing else in gpuvfio names ``/sys`` or ``/proc``.

Safety: gpuvfio runs as root, so a crafted tree (or a hostile device name) must not
make it read or write outside ``<root>/sys``. Device directories are reached through
``sys/bus/pci/devices/*`` symlinks; we resolve those ourselves (one walk on held directory
fds, gpuvfio.host.walk), refuse any symlink on the way that leads outside ``<root>/sys``,
and open attribute files with O_NOFOLLOW.
Links we only *name* (``driver``, ``iommu_group``) are checked lexically and never
followed.
"""

from __future__ import annotations

import copy
import errno
import os
import stat

from gpuvfio import files
from gpuvfio.errors import HostReadError, InputError, UnsafePathError
from gpuvfio.host.walk import HeldDirs
from gpuvfio.read_only_tree import ReadOnlyTree
from gpuvfio.settings import ROOT_ENV, Settings


class HostRoot:
    """A host as seen through one root directory."""

    def __init__(self, root: str | os.PathLike[str] | None = None, *, settings: Settings | None = None) -> None:
        # The run's settings, read from the environment once, here (gpuvfio.settings): the state
        # dir, a pci.ids file, templates and schemas, the test hook -- what this host's run uses.
        self.settings = settings if settings is not None else Settings.from_environment()
        if root is None:
            root = self.settings.root
            if root is not None and not root.strip():
                raise InputError(f"{ROOT_ENV} is empty (give a directory, or unset it for /)")
            root = root or "/"
        root = os.fspath(root)
        if not root or not root.strip() or "\0" in root:
            raise InputError("the host root is empty (give a directory, or leave --root out for /)")
        if not os.path.isdir(root):
            raise HostReadError(f"host root is not a directory: {root}")
        self.root = os.path.realpath(root)
        self.tree = files.Tree(self.root)
        # realpath of <root>/sys must stay inside the root: a fixture whose sys is a
        # symlink to the live /sys would silently inspect (and later change) this host.
        # Nor the root itself (sys -> .): sysfs's links would then reach the whole root (its
        # /etc), and a write meant for an attribute would land there.
        sys_dir = os.path.realpath(os.path.join(self.root, "sys"))
        if not self._inside(sys_dir, self.root):
            raise UnsafePathError(f"{os.path.join(self.root, 'sys')} leads outside the root {self.root}")
        if sys_dir == self.root:
            raise UnsafePathError(f"{os.path.join(self.root, 'sys')} is the root {self.root} itself, not its sysfs")
        self.sys = sys_dir
        # Complete answers of earlier walks, by the path asked (HeldDirs.walk): of sysfs's links
        # inside sys, and of the host's own links inside the root.
        self._resolved: dict[str, str] = {self.sys: self.sys}
        self._host_resolved: dict[str, str] = {}
        # A recording (a fixture file loaded into a temp dir) holds sysfs, proc and some of /etc,
        # not the host's files at large, nor gpuvfio's state there.
        self.recorded = False
        # Set for the plan of a remote testbed run (made here from the hypervisor's recording):
        # the files a domain names (ROM images, UEFI code) are checked by the run there.
        self.files_checked_by_run = False

    # -- paths -------------------------------------------------------------------------
    @staticmethod
    def _inside(path: str, top: str) -> bool:
        return path == top or path.startswith(top.rstrip("/") + "/")

    def read_only(self) -> "HostRoot":
        """This host with its files reached through a Tree that refuses every write (the host of
        a Context that only reads: a persist or an mdevctl file is refused, as the state dir is)."""
        view = copy.copy(self)
        view.tree = ReadOnlyTree(self.root)
        return view

    def path(self, *parts: str) -> str:
        """A path under the root (``proc/cmdline``, ``var/lib/gpuvfio``); parts are relative."""
        for part in parts:
            if part.startswith("/") or ".." in part.split("/"):
                raise UnsafePathError(f"refusing path component {part!r}")
        return os.path.join(self.root, *parts)

    def sys_path(self, *parts: str) -> str:
        """A path under ``<root>/sys`` built from trusted, relative parts."""
        for part in parts:
            if part.startswith("/") or ".." in part.split("/"):
                raise UnsafePathError(f"refusing sysfs path component {part!r}")
        return os.path.join(self.sys, *parts)

    def require_dir(self, *parts: str) -> str:
        """A sysfs directory that must exist (a missing subtree is bad input: exit 2)."""
        path = self.sys_path(*parts)
        if not self.is_dir(path):
            raise HostReadError(f"missing {path} (is {self.root} a host root with /sys?)")
        return path

    def _resolve(self, path: str, top: str, *, host_links: bool, memo: dict[str, str] | None) -> str:
        """``path`` with every link in it resolved (HeldDirs.walk), never leaving ``top``; a complete
        answer is taken from ``memo`` and kept there (None: resolved afresh, nothing kept)."""
        path = os.path.normpath(path)
        known = memo.get(path) if memo is not None else None
        if known is not None:
            return known
        with HeldDirs(self.tree) as held:
            return held.walk(path, top, host_links=host_links, memo=memo)[0]

    def resolve_in_sys(self, path: str) -> str:
        """Resolve symlinks in ``path`` component by component, refusing any escape from sys.

        Answers are kept: an inventory of 600 functions shares a handful of bridge directories,
        and a device's real directory is asked again for each of its attributes."""
        return self._resolve(path, self.sys, host_links=False, memo=self._resolved)

    def open_sys_attribute(self, path: str) -> int:
        """A write-only fd of the sysfs attribute ``path``: its directory resolved afresh (sysfs's
        own links followed inside ``<root>/sys``, nothing taken from an earlier walk's answers),
        then opened through held directory fds from the root, every component O_NOFOLLOW, the
        attribute a regular file with one link (gpuvfio.files.Tree.open_attribute). Whatever
        was swapped in since the plan resolved the path is refused, never written through.
        FileNotFoundError when the attribute or a directory on its way is not there (the device
        or driver is gone: the kernel's own answer)."""
        path = os.path.normpath(path)
        try:
            directory = self._resolve(os.path.dirname(path), self.sys, host_links=False, memo=None)
        except HostReadError as exc:
            if str(exc).startswith("missing "):
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from None
            raise
        return self.tree.open_attribute(os.path.relpath(os.path.join(directory, os.path.basename(path)), self.root))

    def config_path(self, *parts: str) -> str:
        """A configuration file of the host (``etc/os-release``), its symlinks followed the way
        the host would follow them: absolute targets are taken under the root, and the result
        must stay inside the root (/etc/os-release -> ../usr/lib/os-release on systemd hosts)."""
        return self._resolve(self.path(*parts), self.root, host_links=True, memo=self._host_resolved)

    def _beneath(self, path: str) -> str:
        """``path`` relative to the root, with the links in its directories resolved: sysfs's own
        inside ``<root>/sys`` only, the host's elsewhere inside the root; the last component is
        never followed (a link there is refused by the file layer)."""
        path = os.path.normpath(path)
        if self._inside(path, self.sys) and path != self.sys:
            path = os.path.join(self.resolve_in_sys(os.path.dirname(path)), os.path.basename(path))
        elif path != self.root and self._inside(path, self.root):
            # The host's own directory links (merged /usr: /lib -> usr/lib), followed as the host
            # follows them and never out of the root; the file itself is not followed.
            path = os.path.join(self._resolve(os.path.dirname(path), self.root, host_links=True,
                                              memo=self._host_resolved),
                                os.path.basename(path))
        if not self._inside(path, self.root):
            raise UnsafePathError(f"{path} is outside the root {self.root}")
        return os.path.relpath(path, self.root) if path != self.root else ""

    # -- reading (all of it through gpuvfio.files) -------------------------------------------
    def read(self, path: str, limit: int | None = None) -> str | None:
        """Text of one attribute or host file, stripped; None when absent or the kernel has no
        value. A link in its place, a FIFO, a device, a directory, a file over ``limit`` bytes or
        a permission error is an error: the tree is not what it claims to be, or we are not root.
        The bound by default: a sysfs attribute is at most a page (ATTRIBUTE_LIMIT); the host's
        other files (modules.dep, /proc/interrupts of a many-CPU host) HOST_TEXT_LIMIT."""
        try:
            rel = self._beneath(path)
        except HostReadError as exc:
            if str(exc).startswith("missing "):
                return None
            raise
        if limit is None:
            limit = files.ATTRIBUTE_LIMIT if self._inside(os.path.join(self.root, rel), self.sys) \
                else files.HOST_TEXT_LIMIT
        data = self.tree.read(rel, limit)
        return None if data is None else data.decode("utf-8", "replace").strip()

    def read_head(self, path: str, limit: int = 4096, *, head: bool = True) -> bytes | None:
        """At most ``limit`` bytes of a regular file (a binary attribute such as ``config`` is
        read in part: its size is the device's config space, not ours to refuse); with ``head``
        False, a larger file is an error."""
        try:
            rel = self._beneath(path)
        except HostReadError as exc:
            if str(exc).startswith("missing "):
                return None
            raise
        return self.tree.read(rel, limit, head=head)

    def is_dir(self, path: str) -> bool:
        try:
            return self.tree.is_dir(self._beneath(path))
        except HostReadError:
            return False

    def sys_dirs(self) -> "SysDirs":
        """Directories under ``<root>/sys`` opened for one pass over them (an inventory); close it
        (or use ``with``) at the end of the pass."""
        return SysDirs(self)

    def link_name_at(self, dir_fd: int, name: str, where: str) -> str | None:
        """``link_name`` for a link in an open directory ``where``."""
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise UnsafePathError(f"{where}/{name} is not a symlink") from None
            raise HostReadError(f"cannot read link {where}/{name}: {exc.strerror}") from None
        return self._checked_link(f"{where}/{name}", where, target)

    def _checked_link(self, path: str, where: str, target: str) -> str:
        if os.path.isabs(target):
            raise UnsafePathError(f"{path} links to absolute path {target}")
        resolved = os.path.normpath(os.path.join(where, target))
        if not self._inside(resolved, self.sys):
            raise UnsafePathError(f"{path} links outside {self.sys} (to {target})")
        return os.path.basename(resolved)

    def raw_link(self, path: str) -> str | None:
        """A link's target as written (never followed; None when there is no link there): for
        recording links as data (sysfs's, /proc/PID/fd's)."""
        try:
            rel = self._beneath(path)
        except HostReadError:
            return None
        return self.tree.readlink(rel)

    def exists(self, path: str) -> bool:
        """Is there anything at ``path`` (a link included), reached without following links
        other than sysfs's own?"""
        try:
            return self.tree.exists(self._beneath(path))
        except HostReadError:
            return False

    def is_file(self, path: str) -> bool:
        """Is ``path`` a regular file, reached as ``exists`` reaches it (a final link is no)?"""
        return self._kind_is(path, stat.S_ISREG)

    def installed(self, path: str) -> bool:
        """Is there a regular file at ``path`` as the host itself opens it: its links followed as
        the host follows them (absolute targets taken under the root, never out of it)? A
        dangling link is no."""
        try:
            real = self._resolve(path, self.root, host_links=True, memo=self._host_resolved)
        except (HostReadError, UnsafePathError):
            return False
        return self.is_file(real)

    def is_link(self, path: str) -> bool:
        """Is ``path`` itself a symlink (never followed), reached as ``exists`` reaches it?"""
        return self._kind_is(path, stat.S_ISLNK)

    def _kind_is(self, path: str, test) -> bool:
        try:
            found = self.tree.lstat(self._beneath(path))
        except (HostReadError, UnsafePathError):
            return False
        return found is not None and test(found.st_mode)

    def link_name(self, path: str) -> str | None:
        """The last component of a symlink's target, without following it.

        Used for ``driver`` and ``iommu_group`` links. The target is checked lexically:
        a link that would lead outside ``<root>/sys`` is refused."""
        try:
            rel = self._beneath(path)
        except HostReadError as exc:
            if str(exc).startswith("missing "):
                return None
            raise
        parts = files.split(rel)
        if not parts:
            raise UnsafePathError(f"{path} is not a symlink")
        dir_fd = self.tree.open_dir(parts[:-1])
        if dir_fd is None:
            return None
        try:
            return self.link_name_at(dir_fd, parts[-1], os.path.join(self.root, *parts[:-1]))
        finally:
            os.close(dir_fd)

    def listdir(self, path: str) -> list[str]:
        """Names in a directory, sorted; empty when the directory does not exist."""
        try:
            rel = os.path.join(self._beneath(path))
            if self._inside(os.path.normpath(path), self.sys):
                rel = os.path.relpath(self.resolve_in_sys(path), self.root)
        except HostReadError as exc:
            if str(exc).startswith("missing "):
                return []
            raise
        try:
            return self.tree.listdir(rel)
        except UnsafePathError as exc:
            if "is not a directory" in str(exc):
                return []
            raise


class SysDir:
    """One open directory under ``<root>/sys`` (a PCI function's) and, once asked for, its listing:
    each attribute is one openat under the fd, the listing's type of it the look before the open
    (files.read_at). Values are read as ``HostRoot.read`` reads them: stripped text, None when
    absent; a link, FIFO or device in an attribute's place is an error."""

    __slots__ = ("host", "fd", "path", "_entries")

    def __init__(self, host: HostRoot, fd: int, path: str) -> None:
        self.host, self.fd, self.path = host, fd, path
        self._entries: dict[str, os.DirEntry] | None = None

    def __enter__(self) -> "SysDir":
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    @property
    def entries(self) -> dict[str, os.DirEntry]:
        if self._entries is None:
            self._entries = files.scan_fd(self.fd, self.path)
        return self._entries

    def _listed(self, name: str) -> os.DirEntry | None | bool:
        """The entry of ``name`` when the directory was listed (False: listed and not there)."""
        if self._entries is None:
            return None
        return self._entries.get(name, False)

    def data(self, name: str, limit: int = files.ATTRIBUTE_LIMIT, *, head: bool = False) -> bytes | None:
        listed = self._listed(name)
        if listed is False:
            return None
        return files.read_at(self.fd, name, limit, f"{self.path}/{name}", head=head, listed=listed)

    def text(self, name: str) -> str | None:
        data = self.data(name)
        return None if data is None else data.decode("utf-8", "replace").strip()

    def link(self, name: str) -> str | None:
        """The last component of the link ``name``'s target (``driver``, ``iommu_group``), checked
        as ``HostRoot.link_name`` checks it and never followed."""
        if self._listed(name) is False:
            return None
        return self.host.link_name_at(self.fd, name, self.path)

    def text_in(self, sub: str, name: str) -> str | None:
        """An attribute in a subdirectory (``power/control``): read under this fd when the listing
        has a directory there; a link there (followed by sysfs's rules) or anything else is read
        by its path through ``HostRoot.read``."""
        entry = self.entries.get(sub)
        if entry is None:
            return None
        if not entry.is_dir(follow_symlinks=False):
            return self.host.read(os.path.join(self.path, sub, name))
        fd = files.open_dir_at(self.fd, sub, f"{self.path}/{sub}")
        if fd is None:
            return None
        try:
            data = files.read_at(fd, name, files.ATTRIBUTE_LIMIT, f"{self.path}/{sub}/{name}")
        finally:
            os.close(fd)
        return None if data is None else data.decode("utf-8", "replace").strip()


class SysDirs:
    """Directories under ``<root>/sys`` opened for one pass: the directories above them (a few
    dozen bridges above a few thousand functions) are opened once by the walk (HeldDirs), one
    component at a time without following a link, and held until ``close``; a function's own
    directory is then its link read and one openat under its bridge's held fd."""

    def __init__(self, host: HostRoot) -> None:
        self.host = host
        self._held = HeldDirs(host.tree)

    def __enter__(self) -> "SysDirs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._held.close()

    def open(self, path: str) -> SysDir:
        """The directory ``path`` names, its sysfs links resolved inside sys as resolve_in_sys
        resolves them (the same walk, on this pass's held fds), opened afresh for the caller. A
        kept answer is walked in its place: a real path, which a walk answers with itself."""
        path = os.path.normpath(path)
        known = self.host._resolved.get(path)
        real, fd = self._held.walk(known or path, self.host.sys, host_links=False,
                                   memo=None if known else self.host._resolved, open_last=True,
                                   link_first=known is None)
        return SysDir(self.host, fd, real)
