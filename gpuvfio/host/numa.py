"""NUMA nodes: CPUs, memory and hugepages per node (Documentation/ABI/stable/sysfs-devices-node)."""

from __future__ import annotations

import os
import re

from gpuvfio.host.root import HostRoot
from gpuvfio.host.model import NumaNode, parse_cpulist

_MEMINFO = re.compile(r"Node \d+ (MemTotal|MemFree):\s+(\d+) kB")
_HP_DIR = re.compile(r"hugepages-(\d+)kB")


def _int(text: str | None) -> int:
    try:
        return int(text) if text is not None else 0
    except ValueError:
        return 0


def read_numa(host: HostRoot) -> list[NumaNode]:
    base = host.sys_path("devices", "system", "node")
    nodes = []
    for name in host.listdir(base):
        match = re.fullmatch(r"node(\d+)", name)
        if not match:
            continue
        ndir = os.path.join(base, name)
        cpulist = host.read(os.path.join(ndir, "cpulist")) or ""
        meminfo = dict(_MEMINFO.findall(host.read(os.path.join(ndir, "meminfo")) or ""))
        hugepages = {}
        for hp in host.listdir(os.path.join(ndir, "hugepages")):
            size = _HP_DIR.fullmatch(hp)
            if size:
                hdir = os.path.join(ndir, "hugepages", hp)
                hugepages[int(size.group(1))] = (_int(host.read(os.path.join(hdir, "nr_hugepages"))),
                                                 _int(host.read(os.path.join(hdir, "free_hugepages"))))
        nodes.append(NumaNode(
            node_id=int(match.group(1)), cpulist=cpulist, cpus=parse_cpulist(cpulist),
            mem_total_kb=int(meminfo["MemTotal"]) if "MemTotal" in meminfo else None,
            mem_free_kb=int(meminfo["MemFree"]) if "MemFree" in meminfo else None,
            hugepages=hugepages,
        ))
    ids = sorted(n.node_id for n in nodes)
    for node in nodes:
        node.distances = _distances(host.read(os.path.join(base, f"node{node.node_id}", "distance")), ids)
    return sorted(nodes, key=lambda n: n.node_id)


def _distances(text: str | None, ids: list[int]) -> dict[int, int]:
    """node -> distance from ``nodeN/distance`` (the ACPI SLIT row, one value per online node in
    node order; Documentation/ABI/stable/sysfs-devices-node). A row that does not fit the nodes
    is left out: libvirt then uses its default distances, which is what an unreadable SLIT means."""
    values = (text or "").split()
    if len(values) != len(ids) or not all(v.isdigit() and 10 <= int(v) <= 255 for v in values):
        return {}
    return dict(zip(ids, (int(v) for v in values)))


class Cpu:
    __slots__ = ("cpu", "package", "core", "siblings")

    def __init__(self, cpu: int, package: int, core: int, siblings: tuple[int, ...]) -> None:
        self.cpu, self.package, self.core, self.siblings = cpu, package, core, siblings


def read_cpus(host: HostRoot, cpus: list[int]) -> dict[int, Cpu]:
    """Topology of ``cpus`` (sys/devices/system/cpu/cpuN/topology; ABI: sysfs-devices-system-cpu)."""
    base = host.sys_path("devices", "system", "cpu")
    result = {}
    for cpu in cpus:
        topo = os.path.join(base, f"cpu{cpu}", "topology")
        package = _int(host.read(os.path.join(topo, "physical_package_id")))
        core = _int(host.read(os.path.join(topo, "core_id")))
        siblings = tuple(parse_cpulist(host.read(os.path.join(topo, "thread_siblings_list")) or str(cpu)))
        result[cpu] = Cpu(cpu, package, core, siblings or (cpu,))
    return result


def physical_address_bits(host: HostRoot) -> int | None:
    """The CPU's physical address width (``address sizes`` in /proc/cpuinfo)."""
    match = re.search(r"address sizes\s*:\s*(\d+) bits physical", host.read(host.path("proc", "cpuinfo")) or "")
    return int(match.group(1)) if match else None


def cpu_vendor(host: HostRoot) -> str | None:
    """``GenuineIntel`` / ``AuthenticAMD`` (``vendor_id`` in /proc/cpuinfo)."""
    match = re.search(r"^vendor_id\s*:\s*(\S+)", host.read(host.path("proc", "cpuinfo")) or "", re.M)
    return match.group(1) if match else None
