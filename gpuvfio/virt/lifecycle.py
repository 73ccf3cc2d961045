"""Guest lifecycle through libvirt-python, with libvirt's own messages in typed errors.

Look a domain up, tell whether gpuvfio defined it, start it, stop it (ACPI shutdown with a
timeout, then destroy), undefine it; read what gpuvfio recorded in its metadata (the host
devices it assigned); and find where the guest's SSH answers: the forward gpuvfio recorded,
a forwarded port in the domain's own QEMU arguments (user networking), the DHCP leases of its
libvirt network, the QEMU guest agent, or the ARP table.
"""

from __future__ import annotations

from gpuvfio.address import PciAddress
from gpuvfio.clock import SYSTEM_CLOCK, Clock
from gpuvfio.domain.render import METADATA_NS
from gpuvfio.errors import GpuvfioError
from gpuvfio.virt.connection import LibvirtError, call, libvirt_module
from gpuvfio.virt.defined import DefinedDomain, read_defined


class AddressUnknown(GpuvfioError):
    """libvirt knows no address for the guest (yet): no forward, lease, agent or ARP entry."""


def lookup(conn, name: str):
    """The domain called ``name``, or None."""
    libvirt = libvirt_module()
    try:
        return conn.lookupByName(name)
    except libvirt.libvirtError as exc:
        if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
            return None
        raise LibvirtError(f"looking up {name}: {exc.get_error_message()}") from None


def made_by_gpuvfio(dom) -> bool:
    """Domains gpuvfio defines carry its metadata element; others are not ours to change."""
    libvirt = libvirt_module()
    try:
        dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, METADATA_NS, libvirt.VIR_DOMAIN_AFFECT_CONFIG)
        return True
    except libvirt.libvirtError:
        return False


def is_active(dom) -> bool:
    return bool(call("asking libvirt whether the domain runs", dom.isActive))


def start(dom) -> None:
    if not is_active(dom):
        call(f"starting {dom.name()}", dom.create)


def stop(dom, timeout: float = 60.0, *, clock: Clock = SYSTEM_CLOCK) -> str:
    """ACPI shutdown, wait up to ``timeout`` on ``clock`` (the Context's), then destroy. Returns
    how it ended."""
    libvirt = libvirt_module()
    if not is_active(dom):
        return "not running"
    if timeout > 0:
        try:
            dom.shutdown()
        except libvirt.libvirtError:
            pass
        deadline = clock.monotonic() + timeout
        while clock.monotonic() < deadline:
            if not is_active(dom):
                return "shut down"
            clock.sleep(0.25)
    if is_active(dom):
        call(f"destroying {dom.name()}", dom.destroy)
    return "destroyed"


def undefine(dom) -> None:
    libvirt = libvirt_module()
    flags = libvirt.VIR_DOMAIN_UNDEFINE_NVRAM | libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
    try:
        dom.undefineFlags(flags)
    except libvirt.libvirtError:
        call(f"undefining {dom.name()}", dom.undefine)


def recorded_devices(dom) -> list[PciAddress]:
    """The host devices gpuvfio recorded in the domain's metadata when it defined it."""
    return recorded(dom)[0]


def recorded(dom) -> tuple[list[PciAddress], dict[PciAddress, int]]:
    """From one read of the definition (gpuvfio.virt.defined): the host devices gpuvfio recorded
    in its metadata, and the P2P clique it gave each GPU: what verify checks a running guest
    against, as attach does from its plan."""
    defined = defined_of(dom)
    return list(defined.recorded), dict(defined.cliques)


def defined_of(dom) -> DefinedDomain:
    """The domain's live definition, read once."""
    return read_defined(call("reading the domain's definition", dom.XMLDesc, 0))


def ssh_address(conn, dom) -> tuple[str, int]:
    """Where the guest's SSH answers, from the sources libvirt knows, in that order."""
    libvirt = libvirt_module()
    defined = defined_of(dom)
    if defined.ssh is not None:  # gpuvfio's record of the forward, else a user-networking hostfwd
        return defined.ssh
    for network in defined.networks:
        try:
            leases = conn.networkLookupByName(network).DHCPLeases()
        except libvirt.libvirtError:
            leases = []
        for lease in leases:
            if lease.get("mac") in defined.macs and lease.get("type") == libvirt.VIR_IP_ADDR_TYPE_IPV4:
                return lease["ipaddr"], 22
    for source in (libvirt.VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT, libvirt.VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_ARP):
        try:
            addresses = dom.interfaceAddresses(source)
        except libvirt.libvirtError:
            continue
        for name, iface in addresses.items():
            if name == "lo":
                continue
            for addr in iface.get("addrs") or []:
                if addr.get("type") == libvirt.VIR_IP_ADDR_TYPE_IPV4 and not addr["addr"].startswith("127."):
                    return addr["addr"], 22
    raise AddressUnknown(f"cannot find an address for {dom.name()} (no forwarded port, DHCP lease, guest agent "
                     "or ARP entry); give --ssh-host/--ssh-port")
