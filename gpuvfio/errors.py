"""Typed errors. The CLI edge turns each into one line and an exit status.

Exit status 2 is bad input (the user can fix the invocation or the root);
exit status 1 is a refusal or a failed check on a valid request.
"""


class GpuvfioError(Exception):
    """Base of every error gpuvfio raises on purpose."""

    exit_code = 1


class InputError(GpuvfioError):
    """The request itself is malformed: a bad address, size, name or option."""

    exit_code = 2


class HostReadError(GpuvfioError):
    """The host tree cannot be read: missing root, missing /sys subtree, unreadable file."""

    exit_code = 2


class UnsafePathError(HostReadError):
    """A path or symlink would lead outside <root>/sys (or the allowed subtree)."""
