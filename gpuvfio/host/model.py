"""The host model: plain values read from sysfs/procfs, no I/O here."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.errors import HostReadError
from gpuvfio.host.health import Health
from gpuvfio.numbers import uint

NVIDIA_VENDOR = "10de"
NVSWITCH_CLASS = "0680"  # "Bridge: other" endpoints on NVIDIA HGX baseboards (include/linux/pci_ids.h)
DISPLAY_CLASS = "03"  # base class 03: VGA, XGA, 3D controllers (include/linux/pci_ids.h PCI_BASE_CLASS_DISPLAY)
PCI_BRIDGE_CLASS = "0604"  # PCI-to-PCI bridge (root ports, switch ports), include/linux/pci_ids.h

# include/linux/ioport.h
IORESOURCE_IO = 0x00000100
IORESOURCE_MEM = 0x00000200
IORESOURCE_PREFETCH = 0x00002000
IORESOURCE_MEM_64 = 0x00100000

# drivers/pci/pci.h: PCIE_SPEED2STR / pcie_link_speed; generation by GT/s.
_GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


def generation(speed_gts: float | None) -> int | None:
    return _GEN_BY_GTS.get(speed_gts) if speed_gts is not None else None


@dataclass(slots=True)
class Bar:
    index: int  # 0-5 BARs, 6 expansion ROM, 7-12 SR-IOV VF BARs (all VFs together)
    start: int
    size: int
    flags: int

    @property
    def kind(self) -> str:
        if self.index == 6:
            return "rom"
        if 7 <= self.index <= 12:
            return "vf"
        return "io" if self.flags & IORESOURCE_IO else "mem"

    @property
    def is_64bit(self) -> bool:
        return bool(self.flags & IORESOURCE_MEM_64)

    @property
    def prefetchable(self) -> bool:
        return bool(self.flags & IORESOURCE_PREFETCH)

    def to_json(self) -> dict:
        return {"index": self.index, "kind": self.kind, "size": self.size,
                "is_64bit": self.is_64bit, "prefetchable": self.prefetchable}


# What max_link_width says when a function's Link Capabilities read 0 (no link it can train:
# QEMU's virtio functions, a device whose config reads fail): PCIE_LNK_WIDTH_UNKNOWN,
# drivers/pci/pci.c pcie_get_width_cap (Linux 6.1). No maximum, not a width of 255.
WIDTH_UNKNOWN = 0xFF


@dataclass(slots=True)
class Link:
    current_speed_gts: float | None
    current_width: int | None
    max_speed_gts: float | None
    max_width: int | None

    def __post_init__(self) -> None:
        if self.max_width == WIDTH_UNKNOWN:
            self.max_width = None

    @property
    def current_gen(self) -> int | None:
        return generation(self.current_speed_gts)

    @property
    def max_gen(self) -> int | None:
        return generation(self.max_speed_gts)

    def describe(self) -> str:
        def one(gen, width, speed):
            if speed is None and width is None:
                return "?"
            return f"Gen{gen or '?'} x{width if width is not None else '?'}"
        cur = one(self.current_gen, self.current_width, self.current_speed_gts)
        top = one(self.max_gen, self.max_width, self.max_speed_gts)
        return cur if cur == top else f"{cur} (max {top})"

    def to_json(self) -> dict:
        return {"current_speed_gts": self.current_speed_gts, "current_width": self.current_width,
                "current_gen": self.current_gen, "max_speed_gts": self.max_speed_gts,
                "max_width": self.max_width, "max_gen": self.max_gen}


@dataclass(slots=True)
class MdevType:
    type_id: str
    name: str | None
    available_instances: int | None
    device_api: str | None
    description: str | None

    def to_json(self) -> dict:
        return {"id": self.type_id, "name": self.name, "available_instances": self.available_instances,
                "device_api": self.device_api, "description": self.description}


@dataclass(slots=True)
class VgpuType:
    type_id: int
    name: str

    def to_json(self) -> dict:
        return {"id": self.type_id, "name": self.name}


@dataclass(slots=True)
class PciFunction:
    address: PciAddress
    vendor_id: str
    device_id: str
    class_id: str
    subsystem_vendor_id: str | None = None
    subsystem_device_id: str | None = None
    revision: str | None = None
    driver: str | None = None
    driver_override: str | None = None
    iommu_group: int | None = None
    numa_node: int | None = None
    local_cpulist: str | None = None
    parents: list[PciAddress] = field(default_factory=list)
    link: Link | None = None
    bars: list[Bar] = field(default_factory=list)
    sriov_total_vfs: int | None = None
    sriov_num_vfs: int | None = None
    vfs: list[PciAddress] = field(default_factory=list)
    physfn: PciAddress | None = None
    mdev_types: list[MdevType] = field(default_factory=list)
    vgpu_creatable: list[VgpuType] | None = None
    vgpu_current: int | None = None
    boot_vga: bool | None = None
    reset_method: list[str] | None = None
    health: Health | None = None  # endpoints only: config space, reset, power
    switch_links: list[PciAddress] = field(default_factory=list)  # Broadcom virtual switch links
    vendor_name: str | None = None
    device_name: str | None = None
    class_name: str | None = None

    @property
    def is_bridge(self) -> bool:
        return self.class_id.startswith(PCI_BRIDGE_CLASS)

    @property
    def is_nvidia(self) -> bool:
        return self.vendor_id == NVIDIA_VENDOR

    @property
    def is_gpu(self) -> bool:
        return self.class_id.startswith(DISPLAY_CLASS)

    @property
    def is_nvswitch(self) -> bool:
        """An NVSwitch of an HGX baseboard: an NVIDIA "Bridge: other" (0x0680) endpoint, no
        PCI-to-PCI bridge (pci.ids calls it a bridge; it bridges NVLinks, not PCI buses)."""
        return self.is_nvidia and self.class_id.startswith(NVSWITCH_CLASS)

    @property
    def kind(self) -> str:
        """What gpuvfio shows it as: gpu, nvswitch, bridge (PCI-to-PCI), or device."""
        if self.is_nvidia_gpu:
            return "gpu"
        if self.is_nvswitch:
            return "nvswitch"
        return "bridge" if self.is_bridge else "device"

    @property
    def is_nvidia_gpu(self) -> bool:
        """An NVIDIA function of the display class (VGA 0x0300 or 3D 0x0302): gpuvfio's one
        meaning of "an NVIDIA GPU", and what QEMU gives the P2P clique capability to
        (hw/vfio/pci-quirks.c vfio_add_nv_gpudirect_cap checks vendor and class only)."""
        return self.is_nvidia and self.is_gpu

    @property
    def largest_bar(self) -> int:
        return max((b.size for b in self.bars if b.index <= 5), default=0)

    @property
    def display_name(self) -> str:
        """What a listing calls it: pci.ids' device name, else its class's name ("3D controller"),
        else "device". pci.ids calls an NVSwitch (class 0x0680) a bridge: it bridges NVLinks, not
        PCI buses, so it is an NVSwitch here."""
        return self.device_name or ("NVSwitch" if self.is_nvswitch else self.class_name) or "device"

    def label(self) -> str:
        """``0000:03:00.0 [8086:15f3] Ethernet controller (igc)``: how problems name a function."""
        kind = self.class_name or f"class {self.class_id}"
        return f"{self.address} [{self.vendor_id}:{self.device_id}] {kind} ({self.driver or 'no driver'})"

    def to_json(self) -> dict:
        sriov = None
        if self.sriov_total_vfs is not None:
            sriov = {"total_vfs": self.sriov_total_vfs, "num_vfs": self.sriov_num_vfs,
                     "vfs": [str(v) for v in self.vfs]}
        vgpu = None
        if self.vgpu_creatable is not None or self.vgpu_current is not None:
            vgpu = {"creatable_types": [t.to_json() for t in self.vgpu_creatable or []],
                    "current_type": self.vgpu_current}
        return {
            "address": str(self.address),
            "vendor_id": self.vendor_id,
            "device_id": self.device_id,
            "class_id": self.class_id,
            "subsystem_vendor_id": self.subsystem_vendor_id,
            "subsystem_device_id": self.subsystem_device_id,
            "revision": self.revision,
            "vendor_name": self.vendor_name,
            "device_name": self.device_name,
            "class_name": self.class_name,
            "driver": self.driver,
            "driver_override": self.driver_override,
            "iommu_group": self.iommu_group,
            "numa_node": self.numa_node,
            "local_cpulist": self.local_cpulist,
            "parents": [str(p) for p in self.parents],
            "is_bridge": self.is_bridge,
            "kind": self.kind,
            "link": self.link.to_json() if self.link else None,
            "bars": [b.to_json() for b in self.bars],
            "largest_bar": self.largest_bar,
            "sriov": sriov,
            "physfn": str(self.physfn) if self.physfn else None,
            "mdev_types": [m.to_json() for m in self.mdev_types],
            "vgpu": vgpu,
            "boot_vga": self.boot_vga,
            "reset_method": self.reset_method,
            "health": self.health.to_json() if self.health else None,
            "switch_links": [str(a) for a in self.switch_links],
        }


@dataclass(slots=True)
class IommuGroup:
    group_id: int
    devices: list[PciAddress]
    viable: bool
    problems: list[str]

    def to_json(self) -> dict:
        return {"id": self.group_id, "devices": [str(d) for d in self.devices],
                "viable": self.viable, "problems": list(self.problems)}


@dataclass(slots=True)
class NumaNode:
    node_id: int
    cpulist: str
    cpus: list[int]
    mem_total_kb: int | None
    mem_free_kb: int | None
    hugepages: dict[int, tuple[int, int]]  # page size kB -> (total, free)
    distances: dict[int, int] = field(default_factory=dict)  # node -> ACPI SLIT distance (10 = local)

    def to_json(self) -> dict:
        return {"id": self.node_id, "cpulist": self.cpulist, "cpus": len(self.cpus),
                "distances": {str(k): v for k, v in sorted(self.distances.items())},
                "mem_total_kb": self.mem_total_kb, "mem_free_kb": self.mem_free_kb,
                "hugepages": {f"{size}kB": {"total": t, "free": f}
                              for size, (t, f) in sorted(self.hugepages.items())}}


_CPULIST_LIMIT = 1 << 16  # CPU numbers: the kernel's NR_CPUS tops out at 8192; more is a broken file


def parse_cpulist(text: str | None) -> list[int]:
    """``0-3,8,10-11`` -> [0,1,2,3,8,10,11] (lib/bitmap.c bitmap_parselist format), each CPU once
    and in order. Anything else is a damaged host file: one line, not a traceback. The ranges
    are merged before they are expanded, so a list that repeats ``0-8191`` thousands of times
    (a hostile recording) costs its length, not its length times 8192."""
    if not text:
        return []
    ranges: list[tuple[int, int]] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        if dash and ":" in hi:  # "0-15:2/4" group syntax is rare in sysfs output; take the range
            hi = hi.split(":")[0]
        first = uint(lo, _CPULIST_LIMIT - 1)
        last = uint(hi, _CPULIST_LIMIT - 1) if dash else first
        if first is None or last is None or last < first:
            raise HostReadError(f"malformed CPU list {text.strip()[:60]!r}")
        ranges.append((first, last))
    cpus: list[int] = []
    end = -1  # the last CPU taken so far
    for first, last in sorted(ranges):
        if last > end:
            cpus.extend(range(max(first, end + 1), last + 1))
            end = last
    return cpus


def format_cpulist(values) -> str:
    """[0,1,2,5] -> '0-2,5': the kernel's cpulist format, which libvirt's cpuset also reads."""
    parts, start, prev = [], None, None
    for value in sorted(set(values)):
        if start is None:
            start = prev = value
        elif value == prev + 1:
            prev = value
        else:
            parts.append(f"{start}-{prev}" if start != prev else str(start))
            start = prev = value
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(parts)
