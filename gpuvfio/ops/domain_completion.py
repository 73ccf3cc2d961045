"""What a Tab offers for a libvirt domain's name (detach, verify): only from a libvirt reached
over a local socket, read-only, and only for as long as a person waits on a Tab
(COMPLETION_WAIT); a daemon that does not answer offers nothing. Apart from the devices'
completion (gpuvfio.ops.completion), so that the commands that take devices do not load libvirt's
connection helpers."""

from __future__ import annotations

import threading

from gpuvfio.errors import GpuvfioError
from gpuvfio.virt.connection import default_uri, libvirt_module

__all__ = ["domain_candidates", "COMPLETION_WAIT"]

COMPLETION_WAIT = 2.0  # seconds a Tab waits on libvirt


def _local(uri: str) -> bool:
    """A URI libvirt reaches over a local socket (or in this process: test:///): a Tab must not
    start ssh or wait on the network."""
    scheme, _, rest = uri.partition(":")
    if "+" in scheme and not scheme.endswith("+unix"):
        return False
    return not rest.startswith("//") or rest[2:3] in ("/", "")


def domain_candidates(uri: str | None, incomplete: str, *, wait: float = COMPLETION_WAIT) -> list[str]:
    """libvirt's domains that start with ``incomplete`` (read-only connection); nothing when
    libvirt is remote, not installed, refuses, or does not answer within ``wait`` seconds."""
    uri = uri or default_uri()
    if not _local(uri):
        return []
    found: list[str] = []

    def ask() -> None:
        try:
            libvirt = libvirt_module()
        except GpuvfioError:
            return
        try:
            conn = libvirt.openReadOnly(uri)
            try:
                found.extend(sorted(d.name() for d in conn.listAllDomains(0) if d.name().startswith(incomplete or "")))
            finally:
                conn.close()
        except libvirt.libvirtError:
            return

    # A daemon can accept and never answer: the question runs beside the Tab, which waits no
    # longer than a person does (a daemon thread: the process ends without it).
    asking = threading.Thread(target=ask, name="complete-domains", daemon=True)
    asking.start()
    asking.join(wait)
    return list(found) if not asking.is_alive() else []
