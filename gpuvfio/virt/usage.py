"""Which libvirt domains (running or only defined) use given PCI functions.

Stdlib XML parsing (lxml is not needed to read hostdev addresses). The caller passes the
connection it has open; how that connection is chosen, and what happens when libvirt does
not answer, is one policy in gpuvfio.ops.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Callable

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError
from gpuvfio.virt.connection import LibvirtError, libvirt_module


def hostdev_address(hostdev: ET.Element) -> PciAddress | None:
    """The host function of one ``<hostdev mode='subsystem' type='pci'>`` element, or None."""
    addr = hostdev.find("./source/address") if hostdev.get("type") == "pci" else None
    if addr is None:
        return None
    try:
        return PciAddress(int(addr.get("domain", "0"), 16), int(addr.get("bus"), 16), int(addr.get("slot"), 16),
                          int(addr.get("function"), 16))
    except (TypeError, ValueError, GpuvfioError):  # not hex, or out of range
        return None


def hostdev_addresses(domain_xml: str) -> set[PciAddress]:
    """Source addresses of ``<hostdev mode='subsystem' type='pci'>`` in a domain's XML."""
    found = {hostdev_address(hostdev) for hostdev in ET.fromstring(domain_xml).iter("hostdev")}
    return found - {None}


def mdev_uuids(domain_xml: str) -> set[str]:
    """UUIDs of ``<hostdev mode='subsystem' type='mdev'>`` in a domain's XML."""
    root = ET.fromstring(domain_xml)
    return {a.get("uuid") for h in root.iter("hostdev") if h.get("type") == "mdev"
            for a in h.iterfind("source/address") if a.get("uuid")}


def assignments(conn, *, exclude: str | None = None) -> dict[str, list[str]]:
    """Which domains assign each PCI address (as text) and each mdev UUID, in their live or
    persistent definition; ``exclude``: a domain not to count."""
    libvirt = libvirt_module()
    found: dict[str, list[str]] = {}
    try:
        for dom in conn.listAllDomains(0):
            if dom.name() == exclude:
                continue
            xmls = [dom.XMLDesc(0)]
            if dom.isActive() and dom.isPersistent():
                xmls.append(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
            keys = {str(a) for x in xmls for a in hostdev_addresses(x)} | {u for x in xmls for u in mdev_uuids(x)}
            for key in keys:
                found.setdefault(key, []).append(dom.name())
    except libvirt.libvirtError as exc:
        raise LibvirtError(f"listing libvirt's domains: {exc.get_error_message()}") from None
    return found


def domains_using(conn, addresses: list[PciAddress], *, exclude: str | None = None,
                  mdev_parent: Callable[[str], PciAddress | None] = lambda uuid: None) -> dict[PciAddress, list[str]]:
    """Per address, the domains whose live or persistent definition assigns it, directly or as the
    parent of an mdev they use (``mdev_parent``: the GPU an mdev UUID lives on); ``exclude``: a
    domain not to count, the one an attach is about to replace."""
    used: dict[PciAddress, list[str]] = {a: [] for a in addresses}
    for key, names in assignments(conn, exclude=exclude).items():
        address = PciAddress.try_parse(key) or mdev_parent(key)
        if address in used:
            used[address] += [n for n in names if n not in used[address]]
    return used
