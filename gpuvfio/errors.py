"""Typed errors. The CLI edge (and the Ansible modules) turn each into one line and an exit status.

Exit status 2 is bad input: the user can fix the invocation, the spec or the root.
Exit status 1 is a refusal (the request is well formed, but the host's state forbids it:
a group that is not viable, a GPU in use, too few hugepages) or a failed step or check.
"""


class GpuvfioError(Exception):
    """Base of every error gpuvfio raises on purpose; exit status 1. ``report``: what was done
    or planned (a restore's results, a bind plan), for --json and Ansible."""

    exit_code = 1

    def __init__(self, message: str = "", report: dict | None = None) -> None:
        super().__init__(message)
        self.report = report


class Refused(GpuvfioError):
    """A well-formed request the host's state does not allow; nothing was changed. ``report``
    carries the plan or checks behind the refusal."""


class InputError(GpuvfioError):
    """The request itself is malformed: a bad address, size, name or option."""

    exit_code = 2


class HostReadError(GpuvfioError):
    """The host tree cannot be read: missing root, missing /sys subtree, unreadable file."""

    exit_code = 2


class UnsafePathError(HostReadError):
    """A path or symlink would lead outside <root>/sys (or the allowed subtree)."""
