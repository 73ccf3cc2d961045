"""Which libvirt domains (running or only defined) use given PCI functions.

Read-only connection; stdlib XML parsing (lxml is not needed to read hostdev
addresses). When no daemon answers, the caller skips its check with a note: binding
must work on hosts without libvirt, as driverctl does.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from gpuvfio.address import PciAddress


def hostdev_addresses(domain_xml: str) -> set[PciAddress]:
    """Source addresses of ``<hostdev mode='subsystem' type='pci'>`` in a domain's XML."""
    found = set()
    root = ET.fromstring(domain_xml)
    for hostdev in root.iter("hostdev"):
        if hostdev.get("type") != "pci":
            continue
        addr = hostdev.find("./source/address")
        if addr is None:
            continue
        try:
            found.add(PciAddress(int(addr.get("domain", "0"), 16), int(addr.get("bus"), 16),
                                 int(addr.get("slot"), 16), int(addr.get("function"), 16)))
        except (TypeError, ValueError):
            continue
    return found


def domain_lookup(uri: str):
    """A ``domains_using(addresses)`` function for plan_bind, bound to one libvirt URI."""

    def domains_using(addresses: list[PciAddress]) -> dict[PciAddress, list[str]] | None:
        try:
            import libvirt
        except ImportError:
            return None
        libvirt.registerErrorHandler(lambda *args: None, None)
        try:
            conn = libvirt.openReadOnly(uri)
        except libvirt.libvirtError:
            return None
        try:
            used: dict[PciAddress, list[str]] = {a: [] for a in addresses}
            for dom in conn.listAllDomains(0):
                xmls = [dom.XMLDesc(0)]
                if dom.isActive() and dom.isPersistent():
                    xmls.append(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
                addrs = set().union(*(hostdev_addresses(x) for x in xmls))
                for address in addresses:
                    if address in addrs:
                        used[address].append(dom.name())
            return used
        finally:
            conn.close()

    return domains_using
