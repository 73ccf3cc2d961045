"""Inventory services: the list and doctor reports, recording a host as a fixture, and the host's
identity that testbed results are read against."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from enum import Enum

from gpuvfio.address import PciAddress
from gpuvfio.bind.journal import journal_check
from gpuvfio.domain.versions import version_text
from gpuvfio.files import check_output_path, write_output
from gpuvfio.errors import InputError
from gpuvfio.host.doctor import FAIL, WARN, Check, run_doctor
from gpuvfio.host.fixture import dump_host as record
from gpuvfio.host.fixture import host_from_record, open_host
from gpuvfio.host.inventory import FunctionIndex, Inventory, read_inventory, read_selected
from gpuvfio.host.kernel import KernelInfo, read_kernel
from gpuvfio.host.model import NVIDIA_VENDOR, IommuGroup, NumaNode, PciFunction
from gpuvfio.host.numa import read_numa
from gpuvfio.host.pciids import PciIds
from gpuvfio.host.root import HostRoot
from gpuvfio.virt.connection import connection_versions

__all__ = ["ListReport", "DoctorReport", "HostIdentity", "Accelerator", "IommuMode", "FunctionIndex", "list_report",
           "inventory_report", "doctor_report", "dump_host", "host_identity", "open_host", "host_from_record"]


@dataclass
class ListReport:
    """gpuvfio list: the functions chosen and the IOMMU groups that hold them (None: the host has
    no IOMMU groups, the IOMMU is off)."""

    devices: list[PciFunction]
    groups: list[IommuGroup] | None

    def to_json(self) -> dict:
        return {"devices": [f.to_json() for f in self.devices],
                "groups": None if self.groups is None else [g.to_json() for g in self.groups]}


@dataclass
class DoctorReport:
    """gpuvfio doctor: every readiness check (in the order they run), with the kernel and NUMA
    facts they were judged on."""

    checks: list[Check]
    kernel: KernelInfo
    numa_nodes: list[NumaNode]

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def warned(self) -> list[Check]:
        return [c for c in self.checks if c.status == WARN]

    def to_json(self) -> dict:
        return {"checks": [c.to_json() for c in self.checks],
                "kernel": self.kernel.to_json(),
                "numa_nodes": [n.to_json() for n in self.numa_nodes]}


def list_report(host: HostRoot, *, show_all: bool, only: list[PciAddress] = (),
                index: FunctionIndex | None = None) -> ListReport:
    """What ``gpuvfio list`` shows: devices and the groups that hold them. Only what is shown is
    read whole: every function for ``--all``; else the ids and groups of all (``index``, shared
    with the selection that made ``only``), then the chosen functions and their groups."""
    names = PciIds.load(host)
    if show_all and not only:
        return inventory_report(read_inventory(host, names=names), show_all=True)
    index = index or FunctionIndex(host)
    if only:
        unknown = [str(a) for a in only if a not in index.present]
        if unknown:
            raise InputError(f"no such PCI function on this host: {', '.join(unknown)}")
        chosen = sorted(set(only))
    else:
        with host.sys_dirs() as dirs:
            chosen = [a for a in index.addresses if index.vendor(a, dirs) == NVIDIA_VENDOR]
    return inventory_report(read_selected(host, chosen, index, names=names), show_all=show_all, only=only)


def inventory_report(inventory: Inventory, *, show_all: bool, only: list[PciAddress] = ()) -> ListReport:
    functions = list(inventory.functions.values())
    if only:
        unknown = [str(a) for a in only if a not in inventory.functions]
        if unknown:
            raise InputError(f"no such PCI function on this host: {', '.join(unknown)}")
        chosen = [inventory.functions[a] for a in sorted(set(only))]
    else:
        chosen = functions if show_all else [f for f in functions if f.is_nvidia]
    if inventory.groups is None:
        groups = None
    elif show_all and not only:
        groups = list(inventory.groups.values())
    else:
        wanted = {f.iommu_group for f in chosen if f.iommu_group is not None}
        groups = [g for gid, g in inventory.groups.items() if gid in wanted]
    return ListReport(chosen, groups)


def doctor_report(host: HostRoot) -> DoctorReport:
    inventory = read_inventory(host, names=PciIds.load(host))
    kernel = read_kernel(host)
    nodes = read_numa(host)
    return DoctorReport(run_doctor(host, inventory, kernel, nodes) + [journal_check(host)], kernel, nodes)


def dump_host(host: HostRoot, out: str) -> str:
    """Record the host as a fixture; write it atomically to ``out`` unless ``out`` is '-'.

    ``out`` is a new name in an existing directory, or a regular file (replaced): never a
    device, a directory or a link (gpuvfio runs as root; a rename over /dev/null is a mistake)."""
    if out != "-":
        check_output_path(out)
    text = record(host)
    if out != "-":
        write_output(out, text)
    return text


class IommuMode(str, Enum):
    """How the host's own devices use the IOMMU: identity-mapped (``iommu=pt``) or translated
    (the kernel's default DMA API translation; Documentation/admin-guide/kernel-parameters.txt)."""

    PASSTHROUGH = "pt"
    TRANSLATED = "translated"


@dataclass(frozen=True)
class Accelerator:
    """A GPU a testbed run measures, as its results name it."""

    function: PciFunction

    @property
    def model(self) -> str:
        fn = self.function
        # pci.ids may not know the GPU (Debian 12's has no H200): its IDs then.
        return fn.device_name or f"{fn.vendor_id}:{fn.device_id}"

    @property
    def link_max(self) -> str | None:
        link = self.function.link
        return f"Gen{link.max_gen} x{link.max_width}" if link and link.max_gen else None

    def to_json(self) -> dict:
        return {"address": str(self.function.address), "model": self.model,
                "numa_node": self.function.numa_node, "link_max": self.link_max}


@dataclass(frozen=True)
class HostIdentity:
    """The system description every testbed result is read against (MLPerf's system-description
    fields where they apply to a hypervisor, plus the IOMMU and hugepage facts)."""

    cpu_model: str | None
    sockets: int | None
    os_name: str | None  # os-release PRETTY_NAME
    nvidia_driver: str | None  # /sys/module/nvidia/version
    kernel: KernelInfo
    nodes: list[NumaNode]
    accelerators: list[Accelerator]
    python: str
    qemu_version: str | None = None  # None: no libvirt connection asked
    libvirt_version: str | None = None

    @property
    def cpus(self) -> int | None:
        return sum(len(n.cpus) for n in self.nodes) or None

    @property
    def memory_kb(self) -> int | None:
        return sum(n.mem_total_kb or 0 for n in self.nodes) or None

    @property
    def iommu_mode(self) -> IommuMode:
        return IommuMode.PASSTHROUGH if self.kernel.param("iommu") == "pt" else IommuMode.TRANSLATED

    @property
    def hugepage_sizes_kb(self) -> list[int]:
        return sorted({size for n in self.nodes for size in n.hugepages})

    def to_json(self) -> dict:
        return {"host_cpu": self.cpu_model, "host_sockets": self.sockets, "host_cpus": self.cpus,
                "host_memory_kb": self.memory_kb, "host_os": self.os_name, "host_kernel": self.kernel.release,
                "host_nvidia_driver": self.nvidia_driver, "accelerators": [a.to_json() for a in self.accelerators],
                "accelerator_count": len(self.accelerators), "iommu": self.kernel.iommu_vendor,
                "iommu_mode": self.iommu_mode.value, "numa_nodes": len(self.nodes),
                "hugepage_sizes_kb": self.hugepage_sizes_kb, "python": self.python,
                "qemu_version": self.qemu_version, "libvirt_version": self.libvirt_version}


def host_identity(host: HostRoot, gpus: list[PciAddress], conn=None) -> HostIdentity:
    """This host as testbed results describe it; ``conn`` (a libvirt connection) adds the QEMU
    and libvirt versions."""
    cpuinfo = host.read(host.path("proc", "cpuinfo")) or ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 None)
    sockets = {line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("physical id")}
    kernel = read_kernel(host)
    nodes = read_numa(host)
    os_release = host.read(host.config_path("etc", "os-release")) or ""
    pretty = next((line.split("=", 1)[1].strip().strip('"') for line in os_release.splitlines()
                   if line.startswith("PRETTY_NAME=")), None)
    driver = (host.read(host.sys_path("module", "nvidia", "version")) or "").strip() or None
    accelerators = []
    if gpus:
        inventory = read_inventory(host, names=PciIds.load(host))
        for gpu in gpus:
            fn = inventory.functions.get(gpu)
            if fn is not None and fn.is_gpu:  # a slot's audio function is selected, not an accelerator
                accelerators.append(Accelerator(fn))
    qemu = lib = None
    if conn is not None:
        qemu, lib = connection_versions(conn)
    return HostIdentity(model, len(sockets) or None, pretty, driver, kernel, nodes, accelerators,
                        platform.python_version(), version_text(qemu) if qemu else None,
                        version_text(lib) if lib else None)
