"""Inventory services: the list and doctor reports, recording a host as a fixture, and the host's
identity that testbed results are read against."""

from __future__ import annotations

import platform

from gpuvfio.address import PciAddress
from gpuvfio.bind.journal import journal_check
from gpuvfio.domain.versions import version_text
from gpuvfio.files import check_output_path, write_output
from gpuvfio.errors import InputError
from gpuvfio.host.doctor import run_doctor
from gpuvfio.host.fixture import dump_host as record
from gpuvfio.host.fixture import host_from_record, open_host
from gpuvfio.host.inventory import Inventory, read_inventory
from gpuvfio.host.kernel import read_kernel
from gpuvfio.host.numa import read_numa
from gpuvfio.host.pciids import PciIds
from gpuvfio.host.root import HostRoot
from gpuvfio.virt.connection import connection_versions

__all__ = ["list_report", "inventory_report", "doctor_report", "dump_host", "host_identity", "open_host", "host_from_record"]


def list_report(host: HostRoot, *, show_all: bool, only: list[PciAddress] = ()) -> dict:
    """The ``gpuvfio list --json`` object: devices and the groups that hold them."""
    inventory = read_inventory(host, names=PciIds.load(host))
    return inventory_report(inventory, show_all=show_all, only=only)


def inventory_report(inventory: Inventory, *, show_all: bool, only: list[PciAddress] = ()) -> dict:
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
        groups = [g.to_json() for g in inventory.groups.values()]
    else:
        wanted = {f.iommu_group for f in chosen if f.iommu_group is not None}
        groups = [g.to_json() for gid, g in inventory.groups.items() if gid in wanted]
    return {"devices": [f.to_json() for f in chosen], "groups": groups}


def doctor_report(host: HostRoot) -> dict:
    inventory = read_inventory(host, names=PciIds.load(host))
    kernel = read_kernel(host)
    nodes = read_numa(host)
    checks = run_doctor(host, inventory, kernel, nodes) + [journal_check(host)]
    return {"checks": [c.to_json() for c in checks],
            "kernel": kernel.to_json(),
            "numa_nodes": [n.to_json() for n in nodes]}


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


def host_identity(host: HostRoot, gpus: list[PciAddress], conn=None) -> dict:
    """The system description every testbed result is read against (MLPerf's system-description
    fields where they apply to a hypervisor, plus the IOMMU and hugepage facts)."""
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
                # pci.ids may not know the GPU (Debian 12's has no H200): its IDs then.
                accelerators.append({"address": str(gpu), "model": fn.device_name or f"{fn.vendor_id}:{fn.device_id}",
                                     "numa_node": fn.numa_node,
                                     "link_max": f"Gen{fn.link.max_gen} x{fn.link.max_width}"
                                     if fn.link and fn.link.max_gen else None})
    ident = {"host_cpu": model, "host_sockets": len(sockets) or None,
             "host_cpus": sum(len(n.cpus) for n in nodes) or None,
             "host_memory_kb": sum(n.mem_total_kb or 0 for n in nodes) or None, "host_os": pretty,
             "host_kernel": kernel.release, "host_nvidia_driver": driver, "accelerators": accelerators,
             "accelerator_count": len(accelerators), "iommu": kernel.iommu_vendor,
             "iommu_mode": "pt" if kernel.param("iommu") == "pt" else "translated", "numa_nodes": len(nodes),
             "hugepage_sizes_kb": sorted({size for n in nodes for size in n.hugepages}),
             "python": platform.python_version(), "qemu_version": None, "libvirt_version": None}
    if conn is not None:
        qemu, lib = connection_versions(conn)
        ident["qemu_version"] = version_text(qemu) if qemu else None
        ident["libvirt_version"] = version_text(lib) if lib else None
    return ident
