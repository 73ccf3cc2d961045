"""The one way gpuvfio talks to libvirt: opening a connection, and libvirt's errors as typed
gpuvfio errors carrying libvirt's own message.

libvirt-python is imported on first use (it loads libvirt.so: ~30 ms that commands which never
talk to libvirt, such as list and doctor, need not pay). ``registerErrorHandler`` stops
libvirt-python from printing each error itself; gpuvfio reports it once, at its edge.
"""

from __future__ import annotations


from gpuvfio.domain.versions import parse_version
from gpuvfio.errors import GpuvfioError
from gpuvfio.settings import LIBVIRT_URI_ENV, Settings
from gpuvfio.virt.uri import check_uri, names_a_test_file

URI_ENV = LIBVIRT_URI_ENV
SYSTEM_URI = "qemu:///system"


class LibvirtError(GpuvfioError):
    """A libvirt call failed; carries libvirt's own message."""


def default_uri(settings: Settings | None = None) -> str:
    """libvirt's own default: $LIBVIRT_DEFAULT_URI (by gpuvfio's URI policy), else the system
    QEMU driver. ``settings``: the run's (default: read now)."""
    settings = settings if settings is not None else Settings.from_environment()
    return check_uri(settings.libvirt_uri, source=URI_ENV, settings=settings) or SYSTEM_URI


def libvirt_module():
    """libvirt-python, with its error printing turned off."""
    try:
        import libvirt
    except ImportError:
        raise LibvirtError("libvirt-python is not installed (pip install libvirt-python)") from None
    libvirt.registerErrorHandler(lambda *args: None, None)
    return libvirt


def open_connection(uri: str, *, read_only: bool = False):
    # The last guard: whatever edge the URI came through, libvirt acts on some of its parts
    # (programs to run) as it opens it, so it is checked here too (gpuvfio.virt.uri).
    check_uri(uri)
    libvirt = libvirt_module()
    try:
        return libvirt.openReadOnly(uri) if read_only else libvirt.open(uri)
    except libvirt.libvirtError as exc:
        if names_a_test_file(uri):  # its parse errors quote the file: say which file, not what is in it
            raise LibvirtError(f"libvirt's test driver could not load {uri}: not a configuration it takes") from None
        raise LibvirtError(f"cannot connect to libvirt at {uri}: {exc.get_error_message()}") from None


def call(what: str, func, *args):
    """``func(*args)`` with a libvirt failure turned into LibvirtError("what: libvirt's message")."""
    libvirt = libvirt_module()
    try:
        return func(*args)
    except libvirt.libvirtError as exc:
        raise LibvirtError(f"{what}: {exc.get_error_message()}") from None


def connection_versions(conn) -> tuple[tuple[int, int, int] | None, tuple[int, int, int] | None]:
    """(QEMU, libvirt) behind ``conn``. virConnectGetLibVersion is the daemon's libvirt, whatever
    the driver; virConnectGetVersion is the hypervisor's (major * 1000000 + minor * 1000 + micro)
    and means QEMU only on a QEMU connection (the test driver reports a number of its own)."""
    qemu = None
    if call("asking libvirt for its driver", conn.getType).upper() == "QEMU":
        qemu = parse_version(call("asking libvirt for the QEMU version", conn.getVersion))
    return qemu, parse_version(call("asking libvirt for its version", conn.getLibVersion))
