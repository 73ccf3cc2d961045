"""Guest lifecycle through libvirt-python, with libvirt's own messages in typed errors.

define (idempotent, via gpuvfio.define), start, hot-attach/detach of a hostdev (live and
config), shutdown with a timeout then destroy, undefine; and where to reach the guest:
a forwarded port in the domain's own QEMU arguments (user networking), the DHCP leases
of its libvirt network, the QEMU guest agent, or the ARP table.
"""

from __future__ import annotations

import re
import time
import xml.etree.ElementTree as ET

from gpuvfio.define import LibvirtError, default_uri
from gpuvfio.errors import InputError

QEMU_NS = "{http://libvirt.org/schemas/domain/qemu/1.0}"
METADATA_NS = "https://gpuvfio.invalid/xmlns/domain/1"
_HOSTFWD = re.compile(r"hostfwd=tcp:(?P<host>[0-9.]*):(?P<port>\d+)-[0-9.]*:22\b")


def _libvirt():
    import libvirt

    libvirt.registerErrorHandler(lambda *args: None, None)
    return libvirt


def connect(uri: str | None = None):
    libvirt = _libvirt()
    uri = uri or default_uri()
    try:
        return libvirt.open(uri)
    except libvirt.libvirtError as exc:
        raise LibvirtError(f"cannot connect to libvirt at {uri}: {exc.get_error_message()}") from None


def lookup(conn, name: str):
    libvirt = _libvirt()
    try:
        return conn.lookupByName(name)
    except libvirt.libvirtError as exc:
        if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
            return None
        raise LibvirtError(f"looking up {name}: {exc.get_error_message()}") from None


def made_by_gpuvfio(dom) -> bool:
    """Domains gpuvfio defines carry its metadata element; others are not ours to remove."""
    libvirt = _libvirt()
    try:
        dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, METADATA_NS, libvirt.VIR_DOMAIN_AFFECT_CONFIG)
        return True
    except libvirt.libvirtError:
        return False


def _call(what: str, func, *args):
    libvirt = _libvirt()
    try:
        return func(*args)
    except libvirt.libvirtError as exc:
        raise LibvirtError(f"{what}: {exc.get_error_message()}") from None


def start(dom) -> None:
    if not dom.isActive():
        _call(f"starting {dom.name()}", dom.create)


def stop(dom, timeout: float = 60.0) -> str:
    """ACPI shutdown, wait up to ``timeout``, then destroy. Returns how it ended."""
    libvirt = _libvirt()
    if not dom.isActive():
        return "not running"
    try:
        dom.shutdown()
    except libvirt.libvirtError:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not dom.isActive():
            return "shut down"
        time.sleep(0.25)
    if dom.isActive():
        _call(f"destroying {dom.name()}", dom.destroy)
    return "destroyed"


def undefine(dom) -> None:
    libvirt = _libvirt()
    flags = libvirt.VIR_DOMAIN_UNDEFINE_NVRAM | libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
    try:
        dom.undefineFlags(flags)
    except libvirt.libvirtError:
        _call(f"undefining {dom.name()}", dom.undefine)


def hostdev_xml(address) -> str:
    return (f"<hostdev mode='subsystem' type='pci' managed='no'><source><address domain='0x{address.domain:04x}' "
            f"bus='0x{address.bus:02x}' slot='0x{address.slot:02x}' function='0x{address.function:x}'/>"
            "</source></hostdev>")


def attach_hostdev(dom, address) -> None:
    libvirt = _libvirt()
    flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG | (libvirt.VIR_DOMAIN_AFFECT_LIVE if dom.isActive() else 0)
    _call(f"attaching {address} to {dom.name()}", dom.attachDeviceFlags, hostdev_xml(address), flags)


def detach_hostdev(dom, address) -> None:
    libvirt = _libvirt()
    flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG | (libvirt.VIR_DOMAIN_AFFECT_LIVE if dom.isActive() else 0)
    _call(f"detaching {address} from {dom.name()}", dom.detachDeviceFlags, hostdev_xml(address), flags)


def ssh_address(conn, dom) -> tuple[str, int]:
    """Where the guest's SSH answers, from the sources libvirt knows, in that order."""
    libvirt = _libvirt()
    root = ET.fromstring(dom.XMLDesc(0))
    for arg in root.iter(f"{QEMU_NS}arg"):
        match = _HOSTFWD.search(arg.get("value", ""))
        if match:
            return match.group("host") or "127.0.0.1", int(match.group("port"))
    macs = {m.get("address") for m in root.iter("mac")}
    for iface in root.iter("interface"):
        source = iface.find("source")
        if iface.get("type") == "network" and source is not None:
            try:
                leases = conn.networkLookupByName(source.get("network")).DHCPLeases()
            except libvirt.libvirtError:
                leases = []
            for lease in leases:
                if lease.get("mac") in macs and lease.get("type") == libvirt.VIR_IP_ADDR_TYPE_IPV4:
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
    raise InputError(f"cannot find an address for {dom.name()} (no forwarded port, DHCP lease, guest agent "
                     "or ARP entry); give --ssh-host/--ssh-port")
