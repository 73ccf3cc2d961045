"""NUMA nodes: CPUs, memory and hugepages per node (Documentation/ABI/stable/sysfs-devices-node)."""

from __future__ import annotations

import os
import re

from gpuvfio.errors import HostReadError
from gpuvfio.host.root import HostRoot, SysDirs
from gpuvfio.host.model import NumaNode, parse_cpulist
from gpuvfio.numbers import uint

_MEMINFO = re.compile(r"Node [0-9]+ (MemTotal|MemFree):\s+([0-9]+) kB", re.ASCII)
_HP_DIR = re.compile(r"hugepages-([0-9]+)kB", re.ASCII)
_NODE_DIR = re.compile(r"node([0-9]+)", re.ASCII)
MAX_NODE = 1023  # CONFIG_NODES_SHIFT is at most 10 (x86-64): node numbers 0-1023


def _count(text: str | None) -> int:
    """A count or id from one sysfs file; 0 when it is missing or not a plain number."""
    return uint(text) or 0


def read_numa(host: HostRoot) -> list[NumaNode]:
    base = host.sys_path("devices", "system", "node")
    nodes = []
    for name in host.listdir(base):
        match = _NODE_DIR.fullmatch(name)
        node_id = uint(match.group(1), MAX_NODE) if match else None
        if node_id is None:
            continue
        ndir = os.path.join(base, name)
        cpulist = host.read(os.path.join(ndir, "cpulist")) or ""
        meminfo = {key: uint(value) for key, value in _MEMINFO.findall(host.read(os.path.join(ndir, "meminfo")) or "")}
        hugepages = {}
        for hp in host.listdir(os.path.join(ndir, "hugepages")):
            size = _HP_DIR.fullmatch(hp)
            size_kib = uint(size.group(1)) if size else None
            if size_kib:
                hdir = os.path.join(ndir, "hugepages", hp)
                hugepages[size_kib] = (_count(host.read(os.path.join(hdir, "nr_hugepages"))),
                                       _count(host.read(os.path.join(hdir, "free_hugepages"))))
        nodes.append(NumaNode(
            node_id=node_id, cpulist=cpulist, cpus=parse_cpulist(cpulist),
            mem_total_kb=meminfo.get("MemTotal"), mem_free_kb=meminfo.get("MemFree"),
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
    values = [uint(v, 255) for v in (text or "").split()]
    if len(values) != len(ids) or not all(v is not None and v >= 10 for v in values):
        return {}
    return dict(zip(ids, values))


class Cpu:
    __slots__ = ("cpu", "package", "core", "siblings")

    def __init__(self, cpu: int, package: int, core: int, siblings: tuple[int, ...]) -> None:
        self.cpu, self.package, self.core, self.siblings = cpu, package, core, siblings


def read_cpus(host: HostRoot, cpus: list[int]) -> dict[int, Cpu]:
    """Topology of ``cpus`` (sys/devices/system/cpu/cpuN/topology; ABI: sysfs-devices-system-cpu),
    in one pass: each CPU's topology directory opened once beneath the held ones above it, its
    three attributes read under that fd (a 224-CPU host: 224 opens, not 672 walks from the root)."""
    base = host.sys_path("devices", "system", "cpu")
    result = {}
    with host.sys_dirs() as dirs:
        for cpu in cpus:
            result[cpu] = _read_cpu(dirs, os.path.join(base, f"cpu{cpu}", "topology"), cpu)
    return result


def _read_cpu(dirs: SysDirs, topology: str, cpu: int) -> Cpu:
    try:
        directory = dirs.open(topology)
    except HostReadError as exc:
        if not str(exc).startswith("missing "):
            raise
        return Cpu(cpu, 0, 0, (cpu,))  # offline or not present: no topology, as a missing attribute
    with directory:
        package = _count(directory.text("physical_package_id"))
        core = _count(directory.text("core_id"))
        siblings = tuple(parse_cpulist(directory.text("thread_siblings_list") or str(cpu)))
    return Cpu(cpu, package, core, siblings or (cpu,))


def physical_address_bits(host: HostRoot) -> int | None:
    """The CPU's physical address width (``address sizes`` in /proc/cpuinfo)."""
    match = re.search(r"address sizes\s*:\s*([0-9]+) bits physical", host.read(host.path("proc", "cpuinfo")) or "",
                      re.ASCII)
    return uint(match.group(1), 64) if match else None


def cpu_vendor(host: HostRoot) -> str | None:
    """``GenuineIntel`` / ``AuthenticAMD`` (``vendor_id`` in /proc/cpuinfo)."""
    match = re.search(r"^vendor_id\s*:\s*(\S+)", host.read(host.path("proc", "cpuinfo")) or "", re.M)
    return match.group(1) if match else None
