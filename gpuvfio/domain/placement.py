"""Placement policy: which host CPUs the vCPUs pin to, which node backs memory, how big
the guest's 64-bit MMIO window must be. Pure functions of the host model.

CPU choice follows Nova's hardware.py idea of keeping a guest thread's siblings
together: a guest core is a whole host core (all SMT siblings), so the topology the
guest sees matches what it runs on. The core holding CPU 0 is left to the host when
the node has enough others (IRQs and housekeeping land there).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuvfio.errors import Refused
from gpuvfio.host.model import PciFunction
from gpuvfio.host.numa import Cpu

GiB_KIB = 1024 * 1024
OVMF_DEFAULT_MMIO64_MB = 32 * 1024  # OVMF's default 64-bit PCI MMIO aperture (OvmfPkg PlatformPei)


@dataclass(slots=True)
class CellPlacement:
    node: int
    vcpus: list[int]  # guest vCPU numbers
    host_cpus: list[int]  # host CPU for each guest vCPU, same order
    emulator_cpus: list[int]
    memory_kib: int
    threads: int  # SMT threads per guest core


def host_cores(cpus: dict[int, Cpu], node_cpus: list[int]) -> list[tuple[int, ...]]:
    """The node's physical cores, each as its sibling CPUs (on this node), lowest CPU first."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in node_cpus:
        info = cpus[cpu]
        cores.setdefault((info.package, info.core), []).append(cpu)
    return sorted((tuple(sorted(c)) for c in cores.values()), key=lambda c: c[0])


def place_cell(node: int, node_cpus: list[int], cpus: dict[int, Cpu], vcpus: list[int], memory_kib: int,
               *, force: bool = False) -> CellPlacement:
    """Pin ``vcpus`` to whole host cores of ``node``: the widest SMT width that divides the vCPU
    count and has enough cores (hybrid CPUs: the P-cores with their siblings first)."""
    cores = host_cores(cpus, node_cpus)
    wanted = len(vcpus)
    for threads in range(max((len(c) for c in cores), default=1), 0, -1):
        usable = [c for c in cores if len(c) >= threads]
        if wanted % threads == 0 and len(usable) >= wanted // threads:
            break
    else:
        # No SMT width fits: distinct CPUs, whole cores first, one guest thread per CPU.
        spare = len(node_cpus) > wanted
        ordered = [c for c in cores if not (spare and 0 in c)] + [c for c in cores if spare and 0 in c]
        flat = [(cpu,) for core in ordered for cpu in core]
        threads, usable = 1, flat
    needed = wanted // threads
    if 0 in node_cpus and len(usable) > needed:
        usable = [c for c in usable if 0 not in c] + [c for c in usable if 0 in c]
    if needed > len(usable):
        if not force:
            raise Refused(f"NUMA node {node} has {len(node_cpus)} CPUs ({len(cores)} cores); "
                          f"{wanted} vCPUs do not fit "
                          "(lower --vcpus, use --numa none, or --force to share cores)")
        flat = [cpu for core in cores for cpu in core]
        host = [flat[i % len(flat)] for i in range(wanted)]
        return CellPlacement(node, vcpus, host, sorted(node_cpus), memory_kib, 1)
    host = [cpu for core in usable[:needed] for cpu in core[:threads]]
    used = set(host)
    emulator = sorted(c for c in node_cpus if c not in used) or sorted(used)
    return CellPlacement(node, vcpus, host, emulator, memory_kib, threads)


def hugepage_choice(requested: str, demand: list[tuple[int | None, int]], free: dict[int, dict[int, int]],
                    *, force: bool = False) -> tuple[int | None, str | None]:
    """(page size in KiB or None, warning) for ``demand``: (node, KiB) per guest cell; node None
    means memory from any node (no guest NUMA pinning: the kernel's default policy takes pages
    from the local node and falls back to the others). ``free``: node -> page KiB -> free pages."""
    def available(node: int | None, size: int) -> int:
        if node is None:
            return sum(sizes.get(size, 0) for sizes in free.values())
        return free.get(node, {}).get(size, 0)

    def fits(size: int) -> bool:
        return all(kib % size == 0 and available(node, size) * size >= kib for node, kib in demand)

    def where(node: int | None) -> str:
        return "all nodes" if node is None else f"node {node}"

    if requested == "none":
        return None, None
    if requested in ("1G", "2M"):
        size = GiB_KIB if requested == "1G" else 2048
        if not fits(size) and not force:
            short = ", ".join(f"{where(node)}: {available(node, size)} free x {requested}, "
                              f"{-(-kib // size)} needed" for node, kib in demand)
            raise Refused(f"not enough free {requested} hugepages ({short}); reserve more, pick another "
                          "size, or --force")
        return size, None
    for size in (GiB_KIB, 2048):  # auto: the largest size that fits
        if fits(size):
            return size, None
    return None, ("no hugepage size has enough free pages on " + ", ".join(where(n) for n, _k in demand)
                  + "; guest memory uses 4K pages (slower DMA mapping)")


def _pow2(value: int) -> int:
    return 1 << (value - 1).bit_length() if value > 1 else 1


def mmio64_window_mb(devices_per_port: list[list[PciFunction]]) -> int | None:
    """64-bit MMIO window for the guest: each root port's 64-bit prefetchable BARs summed and
    rounded up to a power of two (bridge windows are naturally aligned), all ports summed,
    plus half again as headroom, rounded up; never below OVMF's 32 GiB default."""
    total = 0
    for functions in devices_per_port:
        port = sum(b.size for f in functions for b in f.bars if b.index <= 5 and b.is_64bit and b.prefetchable)
        if port:
            total += _pow2(port)
    if not total:
        return None
    window = _pow2(total + total // 2) // (1024 * 1024)
    return max(window, OVMF_DEFAULT_MMIO64_MB)


def guest_phys_bits_needed(memory_kib: int, mmio64_mb: int | None) -> int:
    """Address bits for RAM above 4 GiB plus the MMIO window on top (QEMU places the 64-bit
    hole above RAM, aligned to its size)."""
    top = 4 * GiB_KIB * 1024 + memory_kib * 1024
    if mmio64_mb:
        size = mmio64_mb * 1024 * 1024
        top = -(-top // size) * size + size
    return (top - 1).bit_length()
