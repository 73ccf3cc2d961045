"""Every host path comes from here: one injected root (``--root`` / ``GPUVFIO_ROOT``).

Like mdevctl's ``Environment::root()``, the root is a directory that looks like ``/``:
the live host (``/``), a recorded fixture loaded into a temporary directory, or a
simulated host in a test. Nothing else in gpuvfio names ``/sys`` or ``/proc``.

Safety: gpuvfio runs as root, so a crafted tree (or a hostile device name) must not
make it read or write outside ``<root>/sys``. Device directories are reached through
``sys/bus/pci/devices/*`` symlinks; we resolve those ourselves, refuse any symlink on
the way that leads outside ``<root>/sys``, and open attribute files with O_NOFOLLOW.
Links we only *name* (``driver``, ``iommu_group``) are checked lexically and never
followed.
"""

from __future__ import annotations

import errno
import os
import stat

from gpuvfio.errors import HostReadError, InputError, UnsafePathError

ROOT_ENV = "GPUVFIO_ROOT"
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)



class HostRoot:
    """A host as seen through one root directory."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        if root is None:
            root = os.environ.get(ROOT_ENV) or "/"
        root = os.fspath(root)
        if not root:
            raise InputError("the host root is empty (give a directory, or leave --root out for /)")
        if not os.path.isdir(root):
            raise HostReadError(f"host root is not a directory: {root}")
        self.root = os.path.realpath(root)
        # realpath of <root>/sys must stay inside the root: a fixture whose sys is a
        # symlink to the live /sys would silently inspect (and later change) this host.
        sys_dir = os.path.realpath(os.path.join(self.root, "sys"))
        if not self._inside(sys_dir, self.root):
            raise UnsafePathError(f"{os.path.join(self.root, 'sys')} leads outside the root {self.root}")
        self.sys = sys_dir
        self._resolved: dict[str, str] = {self.sys: self.sys}
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
        if not os.path.isdir(path):
            raise HostReadError(f"missing {path} (is {self.root} a host root with /sys?)")
        return path

    def resolve_in_sys(self, path: str) -> str:
        """Resolve symlinks in ``path`` component by component, refusing any escape from sys.

        Resolved directory prefixes are cached: an inventory of 600 functions shares
        a handful of bridge directories, so most devices cost one lstat.
        """
        path = os.path.normpath(path)
        if not self._inside(path, self.sys):
            raise UnsafePathError(f"{path} is outside {self.sys}")
        cached = self._resolved.get(path)
        if cached is not None:
            return cached
        parent, name = os.path.split(path)
        base = self.resolve_in_sys(parent)
        candidate = os.path.join(base, name)
        hops = 0
        while True:
            try:
                st = os.lstat(candidate)
            except FileNotFoundError:
                raise HostReadError(f"missing {candidate}") from None
            except OSError as exc:
                raise HostReadError(f"cannot read {candidate}: {exc.strerror}") from None
            if not stat.S_ISLNK(st.st_mode):
                break
            hops += 1
            if hops > 16:
                raise UnsafePathError(f"too many symlinks at {path}")
            target = os.readlink(candidate)
            if os.path.isabs(target):
                # Real sysfs links are relative; an absolute one in a root would point
                # at the live host (or anywhere): refuse it.
                raise UnsafePathError(f"{candidate} links to absolute path {target}")
            target_path = os.path.normpath(os.path.join(os.path.dirname(candidate), target))
            if not self._inside(target_path, self.sys):
                raise UnsafePathError(f"{candidate} links outside {self.sys} (to {target})")
            candidate = self.resolve_in_sys(target_path) if target_path != path else target_path
        self._resolved[path] = candidate
        return candidate

    def config_path(self, *parts: str) -> str:
        """A configuration file of the host (``etc/os-release``), its symlinks followed the way
        the host would follow them: absolute targets are taken under the root, and the result
        must stay inside the root (/etc/os-release -> ../usr/lib/os-release on systemd hosts)."""
        candidate = self.path(*parts)
        for _hop in range(16):
            try:
                target = os.readlink(candidate)
            except OSError:  # not a symlink (EINVAL), missing, or unreadable: read() reports it
                break
            if os.path.isabs(target):
                candidate = os.path.join(self.root, target.lstrip("/"))
            else:
                candidate = os.path.join(os.path.dirname(candidate), target)
            candidate = os.path.normpath(candidate)
        else:
            raise UnsafePathError(f"too many symlinks at {self.path(*parts)}")
        real = os.path.realpath(candidate)
        if not self._inside(real, self.root):
            raise UnsafePathError(f"{self.path(*parts)} leads outside the root {self.root}")
        return candidate

    # -- reading -----------------------------------------------------------------------
    def read(self, path: str) -> str | None:
        """Text of one attribute file, stripped; None when absent or the kernel has no value.

        A symlink in place of the file, a directory, or a permission error is an error:
        those mean the tree is not what it claims to be, or we are not root.
        """
        try:
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return self._open_error(exc, path)
        try:
            chunks = []
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError as exc:
            if exc.errno == errno.EISDIR:
                raise HostReadError(f"cannot read {path}: is a directory") from None
            # sysfs answers EIO/EINVAL/ENODEV/ENXIO for attributes a device does not
            # implement (e.g. link speed on a device without a PCIe capability).
            return None
        finally:
            os.close(fd)
        return b"".join(chunks).decode("utf-8", "replace").strip()

    def open_dir(self, path: str) -> int:
        """A directory fd for ``read_at``; ``path`` must already be resolved (resolve_in_sys)."""
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise HostReadError(f"cannot open {path}: {exc.strerror}") from None

    def read_at(self, dir_fd: int, name: str, where: str) -> str | None:
        """``read`` for a file in an open directory: one open and one read per attribute.

        sysfs returns a whole attribute (at most a page) in one read(), and the regular
        files of a recorded tree are small, so a single 64 KiB read is the whole file.
        This is the inventory's hot path (hundreds of functions, a dozen files each).
        """
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return self._open_error(exc, f"{where}/{name}")
        try:
            data = os.read(fd, 65536)
        except OSError as exc:
            if exc.errno == errno.EISDIR:
                raise HostReadError(f"cannot read {where}/{name}: is a directory") from None
            return None
        finally:
            os.close(fd)
        return data.decode("utf-8", "replace").strip()

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

    @staticmethod
    def _open_error(exc: OSError, path: str):
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"refusing to follow symlink {path}") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise HostReadError(f"cannot read {path}: permission denied (run as root?)") from None
        if exc.errno == errno.ENOTDIR:
            return None
        raise HostReadError(f"cannot read {path}: {exc.strerror}") from None

    def read_bytes(self, path: str, limit: int = 4096) -> bytes | None:
        try:
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(f"refusing to follow symlink {path}") from None
            raise HostReadError(f"cannot read {path}: {exc.strerror}") from None
        try:
            return os.read(fd, limit)
        except OSError:
            return None
        finally:
            os.close(fd)

    def link_name(self, path: str) -> str | None:
        """The last component of a symlink's target, without following it.

        Used for ``driver`` and ``iommu_group`` links. The target is checked lexically:
        a link that would lead outside ``<root>/sys`` is refused.
        """
        try:
            target = os.readlink(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # not a symlink
                raise UnsafePathError(f"{path} is not a symlink") from None
            raise HostReadError(f"cannot read link {path}: {exc.strerror}") from None
        return self._checked_link(path, os.path.dirname(path), target)

    def listdir(self, path: str) -> list[str]:
        """Names in a directory, sorted; empty when the directory does not exist."""
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []
        except OSError as exc:
            raise HostReadError(f"cannot list {path}: {exc.strerror}") from None
