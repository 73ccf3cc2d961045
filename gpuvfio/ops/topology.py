"""The topology service: the host's GPU/NIC matrix as ``nvidia-smi topo -m`` prints it (X, PIX,
PXB, PHB, NODE, SYS from the sysfs tree, NV# from NVLink), each device's CPU and NUMA affinity,
the NUMA distances (ACPI SLIT) and where each device hangs in the PCIe tree.

Rows and columns are NVIDIA GPUs (class 03xx) then NICs (class 02xx), each in address order
(GPU0.., NIC0..), as nvidia-smi numbers them; SR-IOV VFs only when named. A GPU pair whose
NVLink was not read keeps its PCIe word and ``nvlink`` null: unknown, never "none".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass, field
from enum import Enum

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError
from gpuvfio.host.fabric import Fabric, read_fabric
from gpuvfio.host.inventory import Inventory, read_inventory
from gpuvfio.host.model import NumaNode, PciFunction
from gpuvfio.host.numa import read_numa
from gpuvfio.host.nvlink import RECORD_PATH, NvLink, NvLinkReading, read_nvlink
from gpuvfio.host.pciids import PciIds
from gpuvfio.host.topology import LEGEND, NODE, PHB, PIX, PXB, SAME, SYS, Position, position, relation

if TYPE_CHECKING:  # the annotation only: a Context is passed in, never made here
    from gpuvfio.ops.context import Context

__all__ = ["TopologyReport", "TopoDevice", "DeviceKind", "SwitchPort", "GpuLinks", "NvLinkSummary",
           "topology_report", "LEGEND_ORDER", "FULL_LEGEND"]

NV = "NV#"
LEGEND_ORDER = (SAME, SYS, NODE, PHB, PXB, PIX, NV)  # nvidia-smi's order
FULL_LEGEND = {SAME: "self", **LEGEND, NV: "a bonded set of # NVLinks (NVML)"}


def is_nic(fn: PciFunction) -> bool:
    return fn.class_id.startswith("02")


class DeviceKind(str, Enum):
    GPU = "gpu"
    NIC = "nic"


@dataclass(frozen=True)
class SwitchPort:
    """A PCIe switch's upstream port on a device's path, named by pci.ids when it knows it."""

    address: PciAddress
    name: str | None

    def to_json(self) -> dict:
        return {"address": str(self.address), "name": self.name}


@dataclass(frozen=True)
class GpuLinks:
    """A GPU's NVLinks as read (``links``), or why they were not (``links`` None, ``why``)."""

    links: tuple[NvLink, ...] | None
    why: str | None = None

    @property
    def read(self) -> bool:
        return self.links is not None

    def count(self, kind: str) -> int:
        return sum(1 for link in self.links or () if link.kind == kind)

    @property
    def to_switch(self) -> int:
        return self.count("switch")

    @property
    def to_gpu(self) -> int:
        return self.count("gpu")

    @property
    def other(self) -> int:
        return len(self.links or ()) - self.to_switch - self.to_gpu

    def to_json(self) -> dict:
        if self.links is None:
            return {"read": False, "why": self.why}
        return {"read": True, "links": len(self.links), "to_switch": self.to_switch, "to_gpu": self.to_gpu,
                "other": self.other, "detail": [link.to_json() for link in self.links]}


@dataclass(frozen=True)
class TopoDevice:
    """A row (and column) of the matrix: a GPU or a NIC, its place in the PCIe tree and, for a
    GPU, its NVLinks."""

    name: str  # GPU0.., NIC0.., as nvidia-smi numbers them
    function: PciFunction
    position: Position
    switches: list[SwitchPort]  # upstream ports, nearest the root first
    nvlink: GpuLinks | None  # None: a NIC

    @property
    def kind(self) -> DeviceKind:
        return DeviceKind.GPU if self.function.is_nvidia_gpu else DeviceKind.NIC

    def to_json(self) -> dict:
        fn, pos = self.function, self.position
        return {
            "name": self.name, "kind": self.kind.value, "address": str(fn.address),
            "vendor_id": fn.vendor_id, "device_id": fn.device_id, "device_name": fn.device_name,
            "driver": fn.driver, "numa_node": fn.numa_node, "local_cpulist": fn.local_cpulist,
            "root_complex": str(pos.root_complex),
            "root_port": str(pos.root_port) if pos.root_port else None,
            "switches": [s.to_json() for s in self.switches],
            "bridges": [str(b) for b in pos.path],
            "nvlink": self.nvlink.to_json() if self.nvlink is not None else None,
        }


@dataclass(frozen=True)
class NvLinkSummary:
    """Where the NVLink facts came from, in one line (``summary``), and the GPUs left unread."""

    reading: NvLinkReading
    summary: str
    unread: dict[PciAddress, str]  # GPU -> why its links were not read

    def to_json(self) -> dict:
        reading = self.reading
        return {"read": reading.read, "source": reading.source, "driver": reading.driver, "record": RECORD_PATH,
                "reason": reading.reason, "summary": self.summary,
                "unread": {str(a): why for a, why in self.unread.items()}}


@dataclass
class TopologyReport:
    """``gpuvfio topo``: the matrix by device name (``matrix`` with NV# where NVLink joins two GPUs,
    ``pcie`` the PCIe word alone, ``nvlink_links`` the link count of each GPU pair: None when
    not read), the devices, the NUMA nodes, the NVSwitch fabric and notes."""

    devices: list[TopoDevice]
    matrix: dict[str, dict[str, str]]
    pcie: dict[str, dict[str, str]]
    nvlink_links: dict[str, dict[str, int | None]]
    nvlink: NvLinkSummary
    nodes: list[NumaNode]
    fabric: Fabric
    notes: list[str] = field(default_factory=list)

    @property
    def single_node(self) -> bool:
        return len(self.nodes) <= 1

    def to_json(self) -> dict:
        return {
            "devices": [d.to_json() for d in self.devices],
            "matrix": self.matrix,
            "pcie": self.pcie,
            "nvlink_links": self.nvlink_links,
            "nvlink": self.nvlink.to_json(),
            "numa": {"nodes": [{"id": n.node_id, "cpulist": n.cpulist,
                                "distances": {str(k): v for k, v in sorted(n.distances.items())}}
                               for n in self.nodes],
                     "single_node": self.single_node},
            "legend": {word: FULL_LEGEND[word] for word in LEGEND_ORDER},
            "fabric": self.fabric.to_json(),
            "notes": list(self.notes),
        }


def topology_report(ctx: Context, *, only: list[PciAddress] = ()) -> TopologyReport:
    """What ``gpuvfio topo`` shows. ``only``: these functions (each a GPU or a NIC)."""
    host = ctx.host
    inventory = read_inventory(host, names=PciIds.load(host))
    devices, left_out = _chosen(inventory, only)
    nodes = read_numa(host)
    single_node = len(nodes) <= 1
    reading = read_nvlink(host)
    names = _names(devices)
    positions = {fn.address: position(fn) for fn in devices}
    matrix: dict[str, dict[str, str]] = {}
    pcie: dict[str, dict[str, str]] = {}
    nvlink: dict[str, dict[str, int | None]] = {}
    for a in devices:
        row, prow = matrix.setdefault(names[a.address], {}), pcie.setdefault(names[a.address], {})
        for b in devices:
            word = relation(positions[a.address], positions[b.address], single_node=single_node)
            prow[names[b.address]] = row[names[b.address]] = word
            if a.is_nvidia_gpu and b.is_nvidia_gpu and a.address != b.address:
                count = reading.links_between(a.address, b.address)
                nvlink.setdefault(names[a.address], {})[names[b.address]] = count
                if count:
                    row[names[b.address]] = f"NV{count}"
    notes = []
    if left_out:
        notes.append(f"{left_out} SR-IOV VF(s) left out (name them to see them)")
    return TopologyReport(
        devices=[_device(fn, names[fn.address], positions[fn.address], inventory, reading) for fn in devices],
        matrix=matrix, pcie=pcie, nvlink_links=nvlink,
        nvlink=_nvlink_summary(reading, [fn for fn in devices if fn.is_nvidia_gpu]),
        nodes=nodes, fabric=read_fabric(host, inventory), notes=notes)


def _chosen(inventory: Inventory, only: list[PciAddress]) -> tuple[list[PciFunction], int]:
    functions = inventory.functions
    if only:
        inventory.require(*only)
        other = [functions[a].label() for a in only if not (functions[a].is_nvidia_gpu or is_nic(functions[a]))]
        if other:
            raise InputError(f"not an NVIDIA GPU (class 03xx) or a NIC (class 02xx): {'; '.join(other)}")
        chosen = [functions[a] for a in sorted(set(only))]
        left_out = 0
    else:
        every = [f for f in functions.values() if f.is_nvidia_gpu or is_nic(f)]
        chosen = [f for f in every if f.physfn is None]
        left_out = len(every) - len(chosen)
    gpus = [f for f in chosen if f.is_nvidia_gpu]
    return gpus + [f for f in chosen if not f.is_nvidia_gpu], left_out


def _names(devices: list[PciFunction]) -> dict[PciAddress, str]:
    names, counts = {}, {"GPU": 0, "NIC": 0}
    for fn in devices:
        kind = "GPU" if fn.is_nvidia_gpu else "NIC"
        names[fn.address] = f"{kind}{counts[kind]}"
        counts[kind] += 1
    return names


def _device(fn: PciFunction, name: str, pos: Position, inventory: Inventory, reading: NvLinkReading) -> TopoDevice:
    def bridge(address: PciAddress) -> SwitchPort:
        upstream = inventory.functions.get(address)
        return SwitchPort(address, upstream.device_name if upstream else None)

    links = _gpu_links(fn, reading) if fn.is_nvidia_gpu else None
    return TopoDevice(name, fn, pos, [bridge(s) for s in pos.switches], links)


def _gpu_links(fn: PciFunction, reading: NvLinkReading) -> GpuLinks:
    links = reading.gpus.get(fn.address)
    if links is None:
        return GpuLinks(None, _unread_reason(fn, reading))
    return GpuLinks(tuple(links))


def _unread_reason(fn: PciFunction, reading: NvLinkReading) -> str:
    if reading.source is None:
        return reading.reason or "not read"
    if reading.reason is not None:
        return f"not read on the recorded host: {reading.reason}"
    if reading.source == "nvml":
        return (f"NVML does not list it (it is on {fn.driver or 'no driver'}; NVML sees only GPUs on the "
                "nvidia driver)")
    return "the recording has no entry for it (not on the nvidia driver when it was recorded?)"


def _nvlink_summary(reading: NvLinkReading, gpus: list[PciFunction]) -> NvLinkSummary:
    unread = {fn.address: _unread_reason(fn, reading) for fn in gpus if fn.address not in reading.gpus}
    if reading.source == "nvml":
        said = "read from NVML" + (f" (driver {reading.driver})" if reading.driver else "")
    elif reading.source == "recording" and reading.reason is None:
        said = f"from the recording {RECORD_PATH}" + (f" (driver {reading.driver})" if reading.driver else "")
    elif reading.source == "recording":
        said = f"not read: the recording says its host was not read ({reading.reason})"
    else:
        said = f"not read: {reading.reason}"
    return NvLinkSummary(reading, said, unread)
