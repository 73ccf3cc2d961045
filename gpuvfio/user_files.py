"""Files and directories a user names on the command line or in a spec (an output file, a ROM
image, a spec, results, OUT): the directory is followed (the user's choice), the file itself is
reached through the one file layer (gpuvfio.files) -- never through a final link, never a FIFO
or a device, bounded; errors are one line of bad input."""

from __future__ import annotations

import os
import stat

from gpuvfio.errors import HostReadError, InputError, UnsafePathError
from gpuvfio.files import TEXT_LIMIT, NotRegular, Tree, kind_name

__all__ = ["user_file", "check_output_path", "write_output", "read_regular", "user_dir", "for_another_program"]


def user_file(path: str) -> tuple[Tree, str]:
    """The directory a user named (followed: their choice) and the file's name in it."""
    if not path or "\0" in path:
        raise InputError("the path is empty")
    full = os.path.abspath(path)
    directory, name = os.path.split(full)
    if not name:
        raise InputError(f"{path} names a directory, not a file")
    return Tree(directory), name


def check_output_path(out: str) -> None:
    """``out`` is a new name in an existing directory or a regular file (replaced): never a
    device, a directory or a link (gpuvfio runs as root; a rename over /dev/null is a mistake)."""
    if not out or "\0" in out:
        raise InputError("the output path is empty")
    tree, name = user_file(out)
    if not os.path.isdir(tree.top):
        raise InputError(f"cannot write {out}: {tree.top} is not a directory")
    current = tree.lstat(name)
    if current is not None and not stat.S_ISREG(current.st_mode):
        raise InputError(f"cannot write {out}: it is {kind_name(current.st_mode)} (give a new name, a regular file, "
                         "or - for stdout)")


def write_output(out: str, text: str) -> None:
    """Write a file the user named (checked as above), atomically; errors in one line."""
    check_output_path(out)
    tree, name = user_file(out)
    tree.write(name, text)


def read_regular(path: str, limit: int = TEXT_LIMIT, *, head: bool = False) -> bytes | None:
    """The bytes of a regular file a user named (a spec, a ROM image, results), or None when
    there is none; never read through a final link, never opened when it is a FIFO or a device,
    never more than ``limit`` bytes. InputError, one line, otherwise."""
    tree, name = user_file(path)
    try:
        return tree.read(name, limit, head=head)
    except NotRegular as exc:
        raise InputError(str(exc)) from None
    except UnsafePathError as exc:
        message = str(exc)
        raise InputError(f"cannot read {path}: it is a link" if "is a link" in message else message) from None
    except HostReadError as exc:
        raise InputError(str(exc)) from None


def user_dir(path: str, *, create: bool = False) -> Tree:
    """A directory a user named (``OUT``; followed: their choice), made when ``create`` and
    missing (its parent must exist; the new directory is made without following a link)."""
    if not path or not path.strip() or "\0" in path:
        raise InputError("the directory path is empty")
    full = os.path.abspath(path)
    if create and not os.path.isdir(full):
        parent, name = os.path.split(full)
        if not os.path.isdir(parent):
            raise InputError(f"cannot make {path}: {parent} is not a directory")
        try:
            Tree(parent).make_dir(name)
        except UnsafePathError as exc:
            raise InputError(f"cannot make {path}: {exc}") from None
    return Tree(full)


def for_another_program(path: str, *, directory: bool = False) -> bool:
    """Is there a regular file (a directory with ``directory``) at a path a user named for another
    program to read (an SSH key, known_hosts or config for ssh and paramiko, templates for jinja2,
    a schema for libxml2), reached as that program reaches it, links followed? What gpuvfio reads
    itself goes through read_regular instead; this is the one place such a path is looked at."""
    return os.path.isdir(path) if directory else os.path.isfile(path)
