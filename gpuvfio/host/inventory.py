"""Read PCI functions and IOMMU groups of a host through its root.

Sources (Documentation/ABI/testing/sysfs-bus-pci, sysfs-kernel-iommu_groups):
``sys/bus/pci/devices/<addr>`` links to the device directory under ``sys/devices``;
attributes are one value per file; ``driver`` and ``iommu_group`` are symlinks;
``resource`` has one ``start end flags`` line per resource (drivers/pci/pci-sysfs.c,
resource_show).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpuvfio.address import PciAddress
from gpuvfio.errors import HostReadError
from gpuvfio.host.groups import build_groups
from gpuvfio.host.health import read_health
from gpuvfio.host.model import Bar, IommuGroup, Link, MdevType, PciFunction, VgpuType
from gpuvfio.host.numa import MAX_NODE
from gpuvfio.host.root import HostRoot
from gpuvfio.numbers import U64_MAX, decimal, hex_uint, uint

PCI_DEVICES = ("bus", "pci", "devices")


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


_ADDRESS_CACHE: dict[str, PciAddress | None] = {}


def _address(name: str) -> PciAddress | None:
    addr = _ADDRESS_CACHE.get(name, False)
    if addr is False:
        addr = _ADDRESS_CACHE[name] = PciAddress.try_parse(name)
    return addr


def read_function(host: HostRoot, address: PciAddress, *, names=None) -> PciFunction:
    real_dir = host.resolve_in_sys(host.sys_path(*PCI_DEVICES, str(address)))
    dir_fd = host.open_dir(real_dir)
    try:
        return _read_function(host, address, real_dir, dir_fd, names)
    finally:
        os.close(dir_fd)


def read_ids(host: HostRoot, address: PciAddress) -> tuple[str, str, str]:
    """(vendor, device, class) of one function, as read_function reads them, and nothing else:
    what a device selector matches (three small reads instead of a function's dozen)."""
    real_dir = host.resolve_in_sys(host.sys_path(*PCI_DEVICES, str(address)))
    dir_fd = host.open_dir(real_dir)
    try:
        ids = tuple(_hex_id(host.read_at(dir_fd, name, real_dir), width)
                    for name, width in (("vendor", 4), ("device", 4), ("class", 6)))
    finally:
        os.close(dir_fd)
    if None in ids:
        raise HostReadError(f"{real_dir}: missing or malformed vendor/device/class")
    return ids


def _read_function(host: HostRoot, address: PciAddress, real_dir: str, dir_fd: int, names) -> PciFunction:
    entries = set(host.list_fd(dir_fd, real_dir))
    read_at, link_at = host.read_at, host.link_name_at

    def attr(name: str) -> str | None:
        return read_at(dir_fd, name, real_dir) if name in entries else None

    def link(name: str) -> str | None:
        return link_at(dir_fd, name, real_dir) if name in entries else None

    vendor = _hex_id(attr("vendor"), 4)
    device = _hex_id(attr("device"), 4)
    klass = _hex_id(attr("class"), 6)
    if vendor is None or device is None or klass is None:
        raise HostReadError(f"{real_dir}: missing or malformed vendor/device/class")
    fn = PciFunction(address=address, vendor_id=vendor, device_id=device, class_id=klass)
    fn.subsystem_vendor_id = _hex_id(attr("subsystem_vendor"), 4)
    fn.subsystem_device_id = _hex_id(attr("subsystem_device"), 4)
    fn.revision = _hex_id(attr("revision"), 2)
    fn.driver = link("driver")
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
        fn.health = read_health(host, real_dir, fn.reset_method)
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


def read_functions(host: HostRoot, *, names=None) -> dict[PciAddress, PciFunction]:
    return {a: read_function(host, a, names=names) for a in list_addresses(host)}


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


def iommu_groups_present(host: HostRoot) -> bool:
    return bool(host.listdir(host.sys_path("kernel", "iommu_groups")))


def read_inventory(host: HostRoot, *, names=None) -> Inventory:
    functions = read_functions(host, names=names)
    groups = build_groups(functions) if iommu_groups_present(host) else None
    return Inventory(functions, groups)
