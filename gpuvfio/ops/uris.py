"""libvirt URIs as every interface takes them: one policy (gpuvfio.virt.uri.check_uri, which
open_connection applies again), libvirt's default URI, and ``none``, which asks no libvirt. The
interfaces check a URI where it comes in through here, without reaching past the services."""

from __future__ import annotations

from gpuvfio.errors import InputError
from gpuvfio.virt.connection import default_uri
from gpuvfio.virt.uri import check_uri

__all__ = ["NO_LIBVIRT", "check_uri", "default_uri", "libvirt_uri"]

NO_LIBVIRT = "none"  # --connect none (connect in Ansible and specs): ask no libvirt


def libvirt_uri(value: str | None, *, needed_for: str | None = None, source: str = "--connect") -> str | None:
    """``value`` as a command that may do without libvirt takes it: ``none`` asks no libvirt (None
    back), and one that needs libvirt for ``needed_for`` says so in one line; any other URI is
    checked by the one policy (check_uri)."""
    if value == NO_LIBVIRT:
        if needed_for is not None:
            raise InputError(f"{needed_for} needs libvirt; {source} none asks none")
        return None
    return check_uri(value, source=source)
