"""A defined domain, read once: what gpuvfio (and libvirt) put in its XML.

One reader of a domain's definition (virDomainGetXMLDesc) serves every question asked of it:
which host PCI functions and mdevs it assigns (who uses a device), what gpuvfio recorded in
its metadata (detach, verify), the P2P clique of each GPU (QEMU's x-nv-gpudirect-clique in
``<qemu:override>``), where its SSH answers (gpuvfio's record or a user-networking forward),
its firmware and machine, and its placement (vCPUs, memory, hugepages, NUMA, pins) as the
testbed records it. One parser (the standard library's ElementTree) and one walk per read.
CPU pins for the other domains' placement keep their own reader (gpuvfio.virt.pins), whose
cpuset rules are libvirt's cputune semantics, not a list of facts.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.domain.render import METADATA_NS
from gpuvfio.errors import GpuvfioError
from gpuvfio.numbers import uint

__all__ = ["DefinedDomain", "read_defined", "hostdev_address", "QEMU_NS"]

QEMU_NS = "{http://libvirt.org/schemas/domain/qemu/1.0}"
_HOSTFWD = re.compile(r"hostfwd=tcp:(?P<host>[0-9.]*):(?P<port>\d+)-[0-9.]*:22\b")
_PIN_LIMIT = 1 << 16  # a cpuset bound: libvirt's own is far lower; a hostile XML must not make us count forever


class UnreadableDomain(GpuvfioError):
    """libvirt handed back a definition that is not XML."""


def hostdev_address(hostdev: ET.Element) -> PciAddress | None:
    """The source address of a ``<hostdev type='pci'>`` element, or None."""
    addr = hostdev.find("./source/address") if hostdev.get("type") == "pci" else None
    if addr is None:
        return None
    try:
        return PciAddress(int(addr.get("domain", "0"), 16), int(addr.get("bus"), 16), int(addr.get("slot"), 16),
                          int(addr.get("function"), 16))
    except (TypeError, ValueError, GpuvfioError):  # not hex, or out of range
        return None


@dataclass(frozen=True)
class DefinedDomain:
    name: str
    by_gpuvfio: bool  # carries gpuvfio's metadata element
    recorded: tuple[PciAddress, ...] = ()  # the host devices gpuvfio recorded when it defined it
    hostdevs: frozenset[PciAddress] = frozenset()  # <hostdev type='pci'> sources
    mdevs: frozenset[str] = frozenset()  # <hostdev type='mdev'> UUIDs
    cliques: dict[PciAddress, int] = field(default_factory=dict)  # host GPU -> its P2P clique
    ssh: tuple[str, int] | None = None  # gpuvfio's record of the SSH forward, else a hostfwd to :22
    firmware: str | None = None  # efi | bios | None (libvirt's default)
    machine: str | None = None
    vcpus: int = 0
    memory_kib: int = 0
    hugepage_kib: int | None = None
    numa_nodeset: str | None = None  # <numatune><memory nodeset>
    memnodes: tuple[int, ...] = ()  # <numatune><memnode nodeset>, one per guest cell
    vcpu_pins: str | None = None  # the host CPUs of every <vcpupin>, in order, comma-separated
    macs: frozenset[str] = frozenset()
    networks: tuple[str, ...] = ()  # the libvirt networks its interfaces are on

    def placement_json(self) -> dict:
        """Where it sits, as the testbed records it with each result."""
        return {"vcpus": self.vcpus, "memory_kib": self.memory_kib, "hugepage_kib": self.hugepage_kib,
                "numa_nodeset": self.numa_nodeset, "vcpu_pins": self.vcpu_pins, "machine": self.machine}


def read_defined(xml: str) -> DefinedDomain:
    """Everything gpuvfio asks of a domain's definition, from one parse of it."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as exc:
        raise UnreadableDomain(f"libvirt's definition is not XML ({exc})") from None
    metadata = root.find(f"metadata/{{{METADATA_NS}}}domain")
    recorded = tuple(a for a in (PciAddress.try_parse(e.get("address", ""))
                                 for e in root.iter(f"{{{METADATA_NS}}}device")) if a)
    by_alias = {device.get("alias"): int(prop.get("value"))
                for device in root.iter(f"{QEMU_NS}device") for prop in device.iter(f"{QEMU_NS}property")
                if prop.get("name") == "x-nv-gpudirect-clique" and prop.get("value", "").isdigit()}
    hostdevs, mdevs, cliques = set(), set(), {}
    for hostdev in root.iter("hostdev"):
        address = hostdev_address(hostdev)
        if address is not None:
            hostdevs.add(address)
            alias = hostdev.find("alias")
            if alias is not None and alias.get("name") in by_alias:
                cliques[address] = by_alias[alias.get("name")]
        if hostdev.get("type") == "mdev":
            mdevs |= {a.get("uuid") for a in hostdev.iterfind("source/address") if a.get("uuid")}
    page = root.find("memoryBacking/hugepages/page")
    memory = root.find("numatune/memory")
    os_type = root.find("os/type")
    pins = [cpu for pin in root.iterfind("cputune/vcpupin") for cpu in (pin.get("cpuset") or "").split(",") if cpu]
    return DefinedDomain(
        name=root.findtext("name") or "", by_gpuvfio=metadata is not None, recorded=recorded,
        hostdevs=frozenset(hostdevs), mdevs=frozenset(mdevs), cliques=cliques, ssh=_ssh(root),
        firmware=_firmware(root), machine=os_type.get("machine") if os_type is not None else None,
        vcpus=uint(root.findtext("vcpu"), _PIN_LIMIT) or 0, memory_kib=uint(root.findtext("memory")) or 0,
        hugepage_kib=uint(page.get("size")) if page is not None else None,
        numa_nodeset=memory.get("nodeset") if memory is not None else None,
        memnodes=tuple(n for n in (uint(m.get("nodeset"), _PIN_LIMIT) for m in root.iterfind("numatune/memnode"))
                       if n is not None),
        vcpu_pins=",".join(sorted(dict.fromkeys(pins), key=lambda c: uint(c.split("-")[0], _PIN_LIMIT) or 0))
        or None,
        macs=frozenset(m.get("address") for m in root.iter("mac") if m.get("address")),
        networks=tuple(s.get("network") for i in root.iter("interface") if i.get("type") == "network"
                       for s in i.iterfind("source") if s.get("network")))


def _ssh(root: ET.Element) -> tuple[str, int] | None:
    for element in root.iter(f"{{{METADATA_NS}}}ssh"):
        port = uint(element.get("port", ""), 65535)
        if port:
            return element.get("host") or "127.0.0.1", port
    for arg in root.iter(f"{QEMU_NS}arg"):
        match = _HOSTFWD.search(arg.get("value", ""))
        if match and 0 < int(match.group("port")) < 65536:
            return match.group("host") or "127.0.0.1", int(match.group("port"))
    return None


def _firmware(root: ET.Element) -> str | None:
    os_element = root.find("os")
    if os_element is None:
        return None
    if os_element.get("firmware"):
        return os_element.get("firmware")
    loader = os_element.find("loader")
    if loader is not None and loader.get("type") == "pflash":
        return "efi"
    return "bios" if loader is None else None
