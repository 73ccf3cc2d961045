"""gpuvfio's state directory (the journal, the run lock, SSH host keys trusted on first use):
``GPUVFIO_STATE_DIR``, else ``<root>/var/lib/gpuvfio``. Where it is and how it is made, apart
from what is kept in it (gpuvfio.bind.journal), so a Context that only lists or plans knows its
state dir without loading the journal's code."""

from __future__ import annotations

import os

from gpuvfio.errors import InputError, UnsafePathError
from gpuvfio.files import Tree
from gpuvfio.host.root import HostRoot
from gpuvfio.settings import STATE_ENV

__all__ = ["KNOWN_HOSTS", "state_dir", "state_tree", "make_state_dir"]


def state_dir(host: HostRoot) -> Tree:
    """The state directory: beneath the host root, or the one GPUVFIO_STATE_DIR names (its last
    component is made by gpuvfio, never followed; the directories above it are the admin's)."""
    named = host.settings.state_dir  # GPUVFIO_STATE_DIR, read when the host was built
    if named is None:
        return Tree(host.root, "var/lib/gpuvfio")
    return state_tree(named)


def state_tree(directory: str | Tree) -> Tree:
    """A state directory given as a path: its parent is followed, the directory itself is not."""
    if isinstance(directory, Tree):
        return directory
    if not directory or "\0" in directory or not directory.strip():
        raise InputError(f"{STATE_ENV} is empty (give a directory, or leave it unset for <root>/var/lib/gpuvfio)")
    parent, name = os.path.split(os.path.abspath(directory))
    return Tree(parent, name)  # name is '' for '/', Tree's own default


KNOWN_HOSTS = "known_hosts"  # in the state dir: SSH host keys trusted on first use or pinned by a seed


def make_state_dir(directory: Tree) -> None:
    """The state directory, made private (0700) when gpuvfio makes it, link-free; a file or an
    unwritable place in its stead is one line, not a traceback."""
    try:
        directory.make_dir(mode=0o700)
    except UnsafePathError as exc:  # the file layer's other errors (EACCES, EROFS...) are one line already
        raise InputError(f"the state directory {directory.path()} cannot be used: {exc}") from None
