"""Read PCI functions and IOMMU groups of a host through its root.

Sources (Documentation/ABI/testing/sysfs-bus-pci, sysfs-kernel-iommu_groups):
``sys/bus/pci/devices/<addr>`` links to the device directory under ``sys/devices``;
attributes are one value per file; ``driver`` and ``iommu_group`` are symlinks;
``resource`` has one ``start end flags`` line per resource (drivers/pci/pci-sysfs.c,
resource_show). A function's ``uevent`` carries its ids and driver in one read (parse_uevent).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from gpuvfio.address import PciAddress
from gpuvfio.errors import HostReadError, InputError
from gpuvfio.host.groups import build_groups
from gpuvfio.host.health import read_health
from gpuvfio.host.model import Bar, IommuGroup, Link, MdevType, PciFunction, VgpuType
from gpuvfio.host.numa import MAX_NODE
from gpuvfio.host.root import HostRoot, SysDir, SysDirs
from gpuvfio.numbers import U64_MAX, decimal, hex_uint, uint

PCI_DEVICES = ("bus", "pci", "devices")


def device_path(host: HostRoot, address: PciAddress) -> str:
    """``<root>/sys/bus/pci/devices/<address>``, as ``HostRoot.sys_path`` builds it, without
    checking parts that cannot be unsafe (an address prints as DDDD:BB:SS.F): an inventory asks
    for it once or twice per function."""
    return f"{host.sys}/bus/pci/devices/{address}"


def _hex_id(text: str | None, width: int) -> str | None:
    if text is None:
        return None
    text = text.strip().lower()
    if text.startswith("0x"):
        text = text[2:]
    if hex_uint(text) is None:
        return None
    return text.rjust(width, "0")[-width:]


def _int(text: str | None, upper: int = U64_MAX) -> int | None:
    return uint(text, upper)


MAX_GTS = 1024.0  # PCIe 6.0 is 64 GT/s: a faster "speed" is not one


def _speed(text: str | None) -> float | None:
    # "16.0 GT/s PCIe" (5.x+), "16 GT/s" (older), "Unknown" / "Unknown speed"
    if not text:
        return None
    return decimal(text.split()[0], MAX_GTS)


def parse_resource(text: str | None) -> list[Bar]:
    bars: list[Bar] = []
    if not text:
        return bars
    for index, line in enumerate(text.splitlines()):
        if line.startswith("0x0000000000000000 0x0000000000000000"):
            continue  # unused resource: the common case, skip the parsing
        parts = line.split()
        if len(parts) != 3:
            continue
        start, end, flags = (hex_uint(p) for p in parts)
        if start is None or end is None or flags is None:
            continue
        if end == 0 or end < start:
            continue  # unused resource
        bars.append(Bar(index=index, start=start, size=end - start + 1, flags=flags))
    return bars


def parse_vgpu_types(text: str | None) -> list[VgpuType]:
    """``nvidia/creatable_vgpu_types`` (NVIDIA vGPU 17+ SR-IOV): a header, then ``ID : Name``."""
    types: list[VgpuType] = []
    for line in (text or "").splitlines():
        left, sep, right = line.partition(":")
        if not sep:
            continue
        type_id = uint(left.strip(), 0xFFFFFFFF)
        if type_id is not None:  # else the "ID : vGPU Name" header
            types.append(VgpuType(type_id, right.strip()))
    return types


def _parents(host: HostRoot, real_dir: str) -> list[PciAddress]:
    """PCI bridges between the root bus and the device: the PCI names in its sysfs path."""
    parts = real_dir[len(host.sys) + 1:].split("/")[:-1]
    return [a for a in (_address(p) for p in parts if p.count(":") >= 2) if a is not None]


# Broadcom's PEX switch driver (its pci_switch_link module, outside the kernel tree) lists the
# switches a Broadcom switch has a virtual P2P link to as the entries of
# /sys/kernel/pci_switch_link/virtual_switch_links/<bus id>/. NCCL reads them for each node of
# vendor 0x1000 it puts in its topology, keeping names of exactly 12 characters that are PCI
# devices, and joins the two switches by a LINK_LOC (src/os/linux.cc ncclOsGetBcmLinks,
# src/graph/xml.cc ncclTopoGetXmlFromSys, src/graph/topo.cc ncclTopoAddPciLinks, v2.30.7-1).
BROADCOM_VENDOR = "1000"
SWITCH_LINKS = ("kernel", "pci_switch_link", "virtual_switch_links")
MAX_SWITCH_LINKS = 256  # switches one fabric links; a longer listing is not believed past this


def switch_links(host: HostRoot, address: PciAddress) -> list[PciAddress]:
    """The PCI devices a Broadcom switch's virtual switch links reach, as NCCL keeps them."""
    names = host.listdir(host.sys_path(*SWITCH_LINKS, str(address)))
    peers = {peer for peer in (_address(name) for name in names if len(name) == 12) if peer not in (None, address)}
    return sorted(peers)[:MAX_SWITCH_LINKS]  # the bus ids NCCL would keep, then the bound: junk hides none


_ADDRESS_CACHE: dict[str, PciAddress | None] = {}


def _address(name: str) -> PciAddress | None:
    addr = _ADDRESS_CACHE.get(name, False)
    if addr is False:
        addr = _ADDRESS_CACHE[name] = PciAddress.try_parse(name)
    return addr


def read_function(host: HostRoot, address: PciAddress, *, names=None, dirs: SysDirs | None = None) -> PciFunction:
    """Every attribute gpuvfio shows of one function; ``dirs``: the pass's open directories."""
    if dirs is None:
        with host.sys_dirs() as own:
            return read_function(host, address, names=names, dirs=own)
    with dirs.open(device_path(host, address)) as directory:
        return _read_function(host, address, directory, names)


def _ids(directory: SysDir) -> tuple[str, str, str]:
    ids = (_hex_id(directory.text("vendor"), 4), _hex_id(directory.text("device"), 4),
           _hex_id(directory.text("class"), 6))
    if None in ids:
        raise HostReadError(f"{directory.path}: missing or malformed vendor/device/class")
    return ids


@dataclass(frozen=True, slots=True)
class KernelIds:
    """What a PCI function's ``uevent`` says of it: the ids the separate attributes show (the same
    ``struct pci_dev`` fields, after the quirks that rewrite them) and its driver's name."""

    vendor_id: str
    device_id: str
    class_id: str
    subsystem_vendor_id: str
    subsystem_device_id: str
    driver: str | None


# drivers/pci/pci-driver.c pci_uevent (the same lines since Linux 2.6): PCI_CLASS=%04X of the
# 24-bit class, PCI_ID=%04X:%04X, PCI_SUBSYS_ID=%04X:%04X, PCI_SLOT_NAME=pci_name(), MODALIAS;
# drivers/base/core.c dev_uevent adds DRIVER=<name> while a driver is bound (the name the
# ``driver`` link's target has: the driver's kobject is named after it).
_UEVENT_KEYS = frozenset(("PCI_CLASS", "PCI_ID", "PCI_SUBSYS_ID", "PCI_SLOT_NAME", "DRIVER"))


_ID_PAIR = re.compile(r"[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4}")
_CLASS = re.compile(r"[0-9A-Fa-f]{4,6}")


def _sysfs_name(name: str) -> bool:
    """Could ``name`` be a driver's directory under /sys/bus/pci/drivers (the name its ``driver``
    link gives)? Any kobject name: not empty, no "/", not "." or "..", at most NAME_MAX bytes. No
    narrower: drivers name themselves as they like ("i6300ESB timer", drivers/watchdog/i6300esb.c)."""
    return name not in ("", ".", "..") and "/" not in name and len(name.encode("utf-8", "surrogateescape")) <= 255


def parse_uevent(text: str | None, address: PciAddress) -> KernelIds | None:
    """The ids and driver ``text`` (a function's ``uevent``) gives for the function at
    ``address``; None when it is missing (a recording made before gpuvfio recorded it), names
    another function, or any of its fields is absent, repeated or malformed: the separate
    attributes are read then, as they always were."""
    fields: dict[str, str] = {}
    for line in (text or "").split("\n"):  # uevent_show ends each with "\n", nothing else
        key, equals, value = line.partition("=")
        if key in _UEVENT_KEYS:
            if not equals or key in fields:
                return None
            fields[key] = value
    ids, subsystem = fields.get("PCI_ID", ""), fields.get("PCI_SUBSYS_ID", "")
    klass, driver = fields.get("PCI_CLASS", ""), fields.get("DRIVER")
    if (_ID_PAIR.fullmatch(ids) is None or _ID_PAIR.fullmatch(subsystem) is None or _CLASS.fullmatch(klass) is None
            or fields.get("PCI_SLOT_NAME") != str(address) or (driver is not None and not _sysfs_name(driver))):
        return None
    ids, subsystem = ids.lower(), subsystem.lower()
    return KernelIds(ids[:4], ids[5:], klass.lower().rjust(6, "0"), subsystem[:4], subsystem[5:], driver)


def _kernel_ids(directory: SysDir, address: PciAddress) -> KernelIds:
    """A function's ids and driver: its ``uevent`` where that gives them (one read), else the
    five attributes and the ``driver`` link."""
    found = parse_uevent(directory.text("uevent"), address)
    if found is not None:
        return found
    vendor, device, klass = _ids(directory)
    return KernelIds(vendor, device, klass, _hex_id(directory.text("subsystem_vendor"), 4),
                     _hex_id(directory.text("subsystem_device"), 4), directory.link("driver"))


def read_ids(host: HostRoot, address: PciAddress, dirs: SysDirs | None = None) -> tuple[str, str, str]:
    """(vendor, device, class) of one function, as read_function reads them, and nothing else:
    what a device selector matches (one read where the ``uevent`` gives them)."""
    if dirs is None:
        with host.sys_dirs() as own:
            return read_ids(host, address, own)
    with dirs.open(device_path(host, address)) as directory:
        return _selector_ids(directory, address)


def read_ids_and_physfn(host: HostRoot, address: PciAddress, dirs: SysDirs) -> tuple[str, str, str, bool]:
    """read_ids's (vendor, device, class) and whether the function is an SR-IOV virtual function
    (it has a ``physfn`` link), from one open of its directory: what a device's Tab decides on."""
    with dirs.open(device_path(host, address)) as directory:
        return (*_selector_ids(directory, address), directory.link("physfn") is not None)


def _selector_ids(directory: SysDir, address: PciAddress) -> tuple[str, str, str]:
    found = parse_uevent(directory.text("uevent"), address)
    return _ids(directory) if found is None else (found.vendor_id, found.device_id, found.class_id)


@dataclass(frozen=True, slots=True)
class FunctionIds:
    """What a selector matches and an IOMMU group's viability looks at, read without the rest."""

    vendor_id: str
    device_id: str
    class_id: str
    iommu_group: int | None


def _read_function(host: HostRoot, address: PciAddress, directory: SysDir, names) -> PciFunction:
    real_dir = directory.path
    entries = directory.entries
    attr, link = directory.text, directory.link
    kernel = _kernel_ids(directory, address)
    vendor, device, klass = kernel.vendor_id, kernel.device_id, kernel.class_id
    fn = PciFunction(address=address, vendor_id=vendor, device_id=device, class_id=klass,
                     subsystem_vendor_id=kernel.subsystem_vendor_id,
                     subsystem_device_id=kernel.subsystem_device_id, driver=kernel.driver)
    fn.revision = _hex_id(attr("revision"), 2)
    override = attr("driver_override")
    fn.driver_override = None if override in (None, "(null)", "") else override
    fn.iommu_group = _int(link("iommu_group"))
    fn.numa_node = _int(attr("numa_node"), MAX_NODE)  # -1: none (no NUMA affinity), read as None
    fn.local_cpulist = attr("local_cpulist")
    fn.parents = _parents(host, real_dir)
    if "current_link_speed" in entries or "max_link_speed" in entries:
        link_info = Link(_speed(attr("current_link_speed")), _int(attr("current_link_width")),
                         _speed(attr("max_link_speed")), _int(attr("max_link_width")))
        if any(v is not None for v in (link_info.current_speed_gts, link_info.current_width,
                                       link_info.max_speed_gts, link_info.max_width)):
            fn.link = link_info
    fn.bars = parse_resource(attr("resource"))
    if "sriov_totalvfs" in entries:
        fn.sriov_total_vfs = _int(attr("sriov_totalvfs"))
        fn.sriov_num_vfs = _int(attr("sriov_numvfs"))
        vfs = (_address(link(name) or "") for name in entries if name.startswith("virtfn"))
        fn.vfs = sorted(v for v in vfs if v is not None)
    if "physfn" in entries:
        fn.physfn = _address(link("physfn") or "")
    if "mdev_supported_types" in entries:
        fn.mdev_types = _mdev_types(host, os.path.join(real_dir, "mdev_supported_types"))
    if "nvidia" in entries:
        nv_dir = os.path.join(real_dir, "nvidia")
        creatable = host.read(os.path.join(nv_dir, "creatable_vgpu_types"))
        current = host.read(os.path.join(nv_dir, "current_vgpu_type"))
        if creatable is not None or current is not None:
            fn.vgpu_creatable = parse_vgpu_types(creatable)
            fn.vgpu_current = _int(current)
    boot_vga = attr("boot_vga")
    fn.boot_vga = None if boot_vga is None else boot_vga == "1"
    reset = attr("reset_method")
    fn.reset_method = reset.split() if reset is not None else None
    if not fn.is_bridge:
        fn.health = read_health(directory, fn.reset_method)
    elif vendor == BROADCOM_VENDOR:
        fn.switch_links = switch_links(host, address)
    if names is not None:
        fn.vendor_name = names.vendor(vendor)
        fn.device_name = names.device(vendor, device)
        fn.class_name = names.class_name(klass)
    return fn


def _mdev_types(host: HostRoot, types_dir: str) -> list[MdevType]:
    result = []
    for type_id in host.listdir(types_dir):
        tdir = os.path.join(types_dir, type_id)
        result.append(MdevType(
            type_id=type_id,
            name=host.read(os.path.join(tdir, "name")),
            available_instances=_int(host.read(os.path.join(tdir, "available_instances"))),
            device_api=host.read(os.path.join(tdir, "device_api")),
            description=host.read(os.path.join(tdir, "description")),
        ))
    return result


def list_addresses(host: HostRoot) -> list[PciAddress]:
    devices_dir = host.require_dir(*PCI_DEVICES)
    addresses = [_address(name) for name in host.listdir(devices_dir)]
    return sorted(a for a in addresses if a is not None)


def read_functions(host: HostRoot, addresses: list[PciAddress] | None = None, *,
                   names=None) -> dict[PciAddress, PciFunction]:
    """The functions ``addresses`` (every one by default) read whole, in one pass."""
    with host.sys_dirs() as dirs:
        return {a: read_function(host, a, names=names, dirs=dirs)
                for a in (list_addresses(host) if addresses is None else addresses)}


@dataclass(slots=True)
class Inventory:
    functions: dict[PciAddress, PciFunction]
    groups: dict[int, IommuGroup] | None  # None: the host has no IOMMU groups at all

    def nvidia(self) -> list[PciFunction]:
        return [f for f in self.functions.values() if f.is_nvidia]

    def group_of(self, address: PciAddress) -> IommuGroup | None:
        fn = self.functions.get(address)
        if fn is None or fn.iommu_group is None or self.groups is None:
            return None
        return self.groups.get(fn.iommu_group)

    def require(self, *addresses: PciAddress) -> list[PciFunction]:
        """The functions at ``addresses``, in their order; bad input naming each one this host
        does not have."""
        require_present(self.functions, addresses)
        return [self.functions[address] for address in addresses]


def require_present(present, addresses) -> None:
    """Bad input naming each of ``addresses`` not in ``present`` (the host's functions, as any
    container of addresses): the one "no such PCI function" refusal."""
    missing = [str(address) for address in addresses if address not in present]
    if missing:
        raise InputError(f"no such PCI function on this host: {', '.join(missing)}")


def iommu_groups_present(host: HostRoot) -> bool:
    return bool(host.listdir(host.sys_path("kernel", "iommu_groups")))


def read_inventory(host: HostRoot, *, names=None) -> Inventory:
    functions = read_functions(host, names=names)
    groups = build_groups(functions) if iommu_groups_present(host) else None
    return Inventory(functions, groups)


class FunctionIndex:
    """The host's functions, and what a selection or a list of a few of them looks at, each read
    on first use and kept for one command: a function's vendor alone (most selections decide on
    it: ``-d 10de:`` and the default NVIDIA list), its ids and group, an IOMMU group's members
    (from the group's own directory, /sys/kernel/iommu_groups/N/devices: Documentation/ABI/
    testing/sysfs-kernel-iommu_groups). Reads go through the caller's pass (``dirs``)."""

    def __init__(self, host: HostRoot) -> None:
        self.host = host
        self._addresses: list[PciAddress] | None = None
        self._present: frozenset[PciAddress] = frozenset()
        self._vendors: dict[PciAddress, str] = {}
        self._ids: dict[PciAddress, FunctionIds] = {}

    def _scan(self) -> None:
        if self._addresses is None:
            self._addresses = list_addresses(self.host)
            self._present = frozenset(self._addresses)

    @property
    def addresses(self) -> list[PciAddress]:
        self._scan()
        return self._addresses

    @property
    def present(self) -> frozenset[PciAddress]:
        """The addresses, for membership tests."""
        self._scan()
        return self._present

    def vendor(self, address: PciAddress, dirs: SysDirs) -> str:
        if address in self._ids:
            return self._ids[address].vendor_id
        if address not in self._vendors:
            with dirs.open(device_path(self.host, address)) as directory:
                vendor = _hex_id(directory.text("vendor"), 4)
                if vendor is None:
                    raise HostReadError(f"{directory.path}: missing or malformed vendor")
            self._vendors[address] = vendor
        return self._vendors[address]

    def ids(self, address: PciAddress, dirs: SysDirs) -> FunctionIds:
        found = self._ids.get(address)
        if found is None:
            with dirs.open(device_path(self.host, address)) as directory:
                found = FunctionIds(*_selector_ids(directory, address), _int(directory.link("iommu_group")))
            self._ids[address] = found
        return found

    def group_members(self, group: int, dirs: SysDirs) -> list[PciAddress]:
        """The functions of IOMMU group ``group``: those its directory lists whose own
        ``iommu_group`` link names it too (build_groups groups by that link)."""
        listed = self.host.listdir(self.host.sys_path("kernel", "iommu_groups", str(group), "devices"))
        members = [a for a in map(_address, listed) if a is not None and a in self.present]
        return sorted(a for a in members if self.ids(a, dirs).iommu_group == group)


def read_selected(host: HostRoot, chosen: list[PciAddress], index: FunctionIndex, *, names=None) -> Inventory:
    """The functions ``chosen`` read whole, and the IOMMU groups that hold them: what a list of a
    few functions shows. A group is judged as build_groups judges it, on all its members (the
    group's directory, from the index); a member not chosen is read only for what viability
    looks at: ids, driver and class name."""
    with host.sys_dirs() as dirs:
        functions = {a: read_function(host, a, names=names, dirs=dirs) for a in chosen}
        if not iommu_groups_present(host):
            return Inventory(functions, None)
        members = dict(functions)
        for group in sorted({f.iommu_group for f in functions.values() if f.iommu_group is not None}):
            for address in index.group_members(group, dirs):
                if address not in members:
                    members[address] = _member(host, address, index.ids(address, dirs), dirs, names)
    return Inventory(functions, build_groups(members))


def _member(host: HostRoot, address: PciAddress, ids: FunctionIds, dirs: SysDirs, names) -> PciFunction:
    with dirs.open(device_path(host, address)) as directory:
        driver = directory.link("driver")
    fn = PciFunction(address=address, vendor_id=ids.vendor_id, device_id=ids.device_id, class_id=ids.class_id,
                     driver=driver, iommu_group=ids.iommu_group)
    if names is not None:
        fn.class_name = names.class_name(ids.class_id)
    return fn
