"""A defined domain, read once: what gpuvfio (and libvirt) put in its XML.

One reader of a domain's definition (virDomainGetXMLDesc) serves every question asked of it:
which host PCI functions and mdevs it assigns (who uses a device), what gpuvfio recorded in
its metadata (detach, verify), the P2P clique of each GPU (QEMU's x-nv-gpudirect-clique in
``<qemu:override>``), where its SSH answers (gpuvfio's record or a user-networking forward),
its firmware and machine, its placement (vCPUs, memory, hugepages, NUMA, pins) as the testbed
records it, and the model itself for the CPU pins (gpuvfio.virt.pins). The definition is
parsed into gpuvfio.domain.model, the same classes gpuvfio writes its own documents with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.domain import model
from gpuvfio.domain.device_elements import Hostdev
from gpuvfio.domain.elements import UnreadableXml
from gpuvfio.errors import GpuvfioError
from gpuvfio.numbers import uint
from gpuvfio.virt.connection import LibvirtError, call, libvirt_module

__all__ = ["DefinedDomain", "read_defined", "hostdev_address", "HostDomain", "read_all", "listed"]

_HOSTFWD = re.compile(r"hostfwd=tcp:(?P<host>[0-9.]*):(?P<port>[0-9]{1,5})-[0-9.]*:22\b", re.ASCII)
_PIN_LIMIT = 1 << 16  # a cpuset bound: libvirt's own is far lower; a hostile XML must not make us count forever


class UnreadableDomain(GpuvfioError):
    """libvirt handed back a definition that is not XML."""


def hostdev_address(hostdev: Hostdev) -> PciAddress | None:
    """The source address of a ``<hostdev type='pci'>`` element, or None."""
    source = hostdev.source.address if hostdev.type == "pci" and hostdev.source else None
    if source is None or None in (source.bus, source.slot, source.function):
        return None
    return PciAddress(source.domain or 0, source.bus, source.slot, source.function)


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
    # The whole definition, for what is asked by rule rather than as a fact (gpuvfio.virt.pins).
    model: model.Domain | None = field(default=None, compare=False, repr=False)

    def placement_json(self) -> dict:
        """Where it sits, as the testbed records it with each result."""
        return {"vcpus": self.vcpus, "memory_kib": self.memory_kib, "hugepage_kib": self.hugepage_kib,
                "numa_nodeset": self.numa_nodeset, "vcpu_pins": self.vcpu_pins, "machine": self.machine}


def read_defined(xml: str) -> DefinedDomain:
    """Everything gpuvfio asks of a domain's definition, from one parse of it."""
    try:
        domain = model.read_domain(xml)
    except UnreadableXml as exc:
        raise UnreadableDomain(f"libvirt's {exc}") from None
    record = domain.record
    hostdevs, mdevs, cliques = set(), set(), {}
    by_alias = _cliques(domain)
    for hostdev in domain.hostdevs:
        address = hostdev_address(hostdev)
        if address is not None:
            hostdevs.add(address)
            if hostdev.alias is not None and hostdev.alias.name in by_alias:
                cliques[address] = by_alias[hostdev.alias.name]
        elif hostdev.type == "mdev" and hostdev.source and hostdev.source.address and hostdev.source.address.uuid:
            mdevs.add(hostdev.source.address.uuid)
    interfaces = domain.devices.interfaces if domain.devices else ()
    return DefinedDomain(
        name=domain.name or "", by_gpuvfio=record is not None,
        recorded=tuple(a for a in (PciAddress.try_parse(d.address or "") for d in record.devices) if a)
        if record else (),
        hostdevs=frozenset(hostdevs), mdevs=frozenset(mdevs), cliques=cliques, ssh=_ssh(domain),
        firmware=_firmware(domain.os), machine=domain.os.type.machine if domain.os and domain.os.type else None,
        **_placement(domain),
        macs=frozenset(i.mac.address for i in interfaces if i.mac and i.mac.address),
        networks=tuple(i.source.network for i in interfaces if i.type == "network" and i.source and i.source.network),
        model=domain)


def _cliques(domain: model.Domain) -> dict[str, int]:
    """Hostdev alias -> the P2P clique QEMU's override gives it."""
    devices = domain.qemu_override.devices if domain.qemu_override else ()
    return {device.alias: int(prop.value) for device in devices if device.frontend
            for prop in device.frontend.properties
            if prop.name == "x-nv-gpudirect-clique" and uint(prop.value or "") is not None}


def _placement(domain: model.Domain) -> dict:
    backing = domain.memory_backing
    pages = backing.hugepages.pages if backing and backing.hugepages else ()
    numatune, cputune = domain.numatune, domain.cputune
    pins = [cpu for pin in (cputune.vcpupins if cputune else ()) for cpu in (pin.cpuset or "").split(",") if cpu]
    vcpus = domain.vcpu.count if domain.vcpu else None
    return {
        "vcpus": vcpus if vcpus is not None and vcpus <= _PIN_LIMIT else 0,
        "memory_kib": (domain.memory.kib if domain.memory else None) or 0,
        "hugepage_kib": pages[0].size if pages else None,
        "numa_nodeset": numatune.memory.nodeset if numatune and numatune.memory else None,
        "memnodes": tuple(n for n in (uint(m.nodeset or "", _PIN_LIMIT) for m in (numatune.memnodes if numatune else ()))
                          if n is not None),
        "vcpu_pins": ",".join(sorted(dict.fromkeys(pins), key=lambda c: uint(c.split("-")[0], _PIN_LIMIT) or 0))
        or None}


def _ssh(domain: model.Domain) -> tuple[str, int] | None:
    record = domain.record
    if record is not None and record.ssh is not None and record.ssh.port and record.ssh.port <= 65535:
        return record.ssh.host or "127.0.0.1", record.ssh.port
    for arg in domain.qemu_commandline.args if domain.qemu_commandline else ():
        match = _HOSTFWD.search(arg.value or "")
        if match and 0 < int(match.group("port")) < 65536:
            return match.group("host") or "127.0.0.1", int(match.group("port"))
    return None


def _firmware(os_element: model.Os | None) -> str | None:
    if os_element is None:
        return None
    if os_element.firmware:
        return os_element.firmware
    loader = os_element.loader
    if loader is not None and loader.type == "pflash":
        return "efi"
    return "bios" if loader is None else None


@dataclass(frozen=True)
class HostDomain:
    """A domain on a connection: its live definition and, when it runs and persists, the one it
    takes on its next start (what it holds now and what it will hold)."""

    name: str
    definitions: tuple[DefinedDomain, ...]


def read_all(conn, *, exclude: str | None = None) -> tuple[HostDomain, ...]:
    """Every domain on ``conn`` but ``exclude``, each definition read once. A transient domain
    that ended since the listing holds nothing and is left out."""
    libvirt = libvirt_module()
    found = []
    for dom in call("listing libvirt's domains", conn.listAllDomains, 0):
        try:
            name = dom.name()
            if name == exclude:
                continue
            xmls = [dom.XMLDesc(0)]
            if dom.isActive() and dom.isPersistent():
                xmls.append(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                continue
            raise LibvirtError(f"reading a domain's definition: {exc.get_error_message()}") from None
        found.append(HostDomain(name, tuple(read_defined(x) for x in xmls)))
    return tuple(found)


def listed(conn, memo: dict | None, *, exclude: str | None = None) -> tuple[HostDomain, ...]:
    """``read_all``, once per connection while ``memo`` (a Context's listing scope) lasts: the
    questions one plan asks (which domains use the devices, whose vCPUs are pinned where) see
    one listing. ``memo`` None: listed afresh."""
    if memo is None:
        return read_all(conn, exclude=exclude)
    # By connection and the domain left out: the one left out is not read at all, as read_all
    # leaves it (an unreadable definition of the domain being replaced stops nothing).
    key = (id(conn), exclude)
    if key not in memo:
        memo[key] = (conn, read_all(conn, exclude=exclude))  # the connection kept: its id not reused
    return memo[key][1]
