"""The host's identity that testbed results are read against (MLPerf's system-description fields
where they apply to a hypervisor, the IOMMU and hugepage facts, the QEMU and libvirt versions)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import platform
from dataclasses import dataclass
from enum import Enum

from gpuvfio.address import PciAddress
from gpuvfio.domain.versions import version_text
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.kernel import KernelInfo, read_kernel
from gpuvfio.host.model import NumaNode, PciFunction
from gpuvfio.host.numa import read_numa
from gpuvfio.host.pciids import PciIds
from gpuvfio.virt.connection import connection_versions

if TYPE_CHECKING:  # the annotation only: a Context is passed in, never made here
    from gpuvfio.ops.context import Context

__all__ = ["IommuMode", "Accelerator", "HostIdentity", "host_identity"]


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


def host_identity(ctx: Context, gpus: list[PciAddress], conn=None) -> HostIdentity:
    """This host as testbed results describe it; ``conn`` (a libvirt connection) adds the QEMU
    and libvirt versions."""
    host = ctx.host
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
