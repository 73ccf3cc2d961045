"""Placement policy: which host CPUs the vCPUs pin to, which node backs memory (the 64-bit
MMIO window is address_space.py's). Pure functions of the host model.

CPU choice follows Nova's hardware.py idea of keeping a guest thread's siblings
together: a guest core is a whole host core (all SMT siblings), so the topology the
guest sees matches what it runs on. The core holding CPU 0 is left to the host when
the node has enough others (IRQs and housekeeping land there), and cores other domains on
the connection pin are left to them (gpuvfio.virt.pins finds those).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpuvfio.errors import Refused
from gpuvfio.host.model import format_cpulist
from gpuvfio.host.numa import Cpu

GiB_KIB = 1024 * 1024


@dataclass(slots=True)
class CellPlacement:
    node: int
    vcpus: list[int]  # guest vCPU numbers
    host_cpus: list[int]  # host CPU for each guest vCPU, same order
    emulator_cpus: list[int]
    memory_kib: int
    threads: int  # SMT threads per guest core
    avoided: list[int] = field(default_factory=list)  # node CPUs it stayed off: whole cores other domains pin
    notes: list[str] = field(default_factory=list)  # for the plan: what it stayed off, and whose
    warnings: list[str] = field(default_factory=list)  # --force made it share other domains' cores


def host_cores(cpus: dict[int, Cpu], node_cpus: list[int]) -> list[tuple[int, ...]]:
    """The node's physical cores, each as its sibling CPUs (on this node), lowest CPU first."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in node_cpus:
        info = cpus[cpu]
        cores.setdefault((info.package, info.core), []).append(cpu)
    return sorted((tuple(sorted(c)) for c in cores.values()), key=lambda c: c[0])


def place_cell(node: int, node_cpus: list[int], cpus: dict[int, Cpu], vcpus: list[int], memory_kib: int,
               *, force: bool = False, avoid: frozenset[int] = frozenset(),
               pinned_by: Mapping[int, Sequence[str]] | None = None) -> CellPlacement:
    """Pin ``vcpus`` to whole host cores of ``node``: the widest SMT width that divides the vCPU
    count and has enough cores (hybrid CPUs: the P-cores with their siblings first).

    ``avoid``: host CPUs other domains pin (gpuvfio.virt.pins.pinned_elsewhere); a core holding
    one is left to them, for vCPUs and emulator threads, when the node's other cores are enough.
    When they are not: Refused, or with ``force`` the vCPUs share those cores (free cores first)
    and the placement carries a warning. ``pinned_by``: host CPU -> the domains pinning it, to
    name them in notes and refusals."""
    cores = host_cores(cpus, node_cpus)
    avoid = frozenset(avoid)
    taken = [c for c in cores if not avoid.isdisjoint(c)]
    if not taken:
        placed = _pin(node, node_cpus, cores, vcpus, memory_kib)
        if placed is None:
            if not force:
                raise Refused(f"NUMA node {node} has {len(node_cpus)} CPUs ({len(cores)} cores); "
                              f"{len(vcpus)} vCPUs do not fit "
                              "(lower --vcpus, use --numa none, or --force to share cores)")
            placed = _overcommit(node, node_cpus, cores, vcpus, memory_kib)
        return placed
    free = [c for c in cores if avoid.isdisjoint(c)]
    free_cpus = sorted(cpu for core in free for cpu in core)
    avoided = sorted(cpu for core in taken for cpu in core)
    owners = _owners(sorted(avoid.intersection(node_cpus)), pinned_by)
    siblings = ", and those cores' sibling threads" if len(avoided) > len(avoid.intersection(node_cpus)) else ""
    placed = _pin(node, free_cpus, free, vcpus, memory_kib)  # None when no core is free
    if placed is not None:
        placed.avoided = avoided
        placed.notes.append(f"node {node}: vCPUs and emulator threads stayed off CPUs {format_cpulist(avoided)} "
                            f"(pinned by {owners}{siblings})")
        return placed
    if not force:
        raise Refused(f"NUMA node {node} has {len(node_cpus)} CPUs ({len(cores)} cores): {len(free_cpus)} free, "
                      f"{len(avoided)} on cores other domains pin ({owners}); {len(vcpus)} vCPUs do not fit in "
                      "the free ones (lower --vcpus, re-pin or remove those domains, use --numa none, or --force "
                      "to share their cores)")
    # Forced: every free core first (CPU 0's too: another guest's busy vCPU is worse company than
    # the host's housekeeping), then the cores other domains pin.
    ordered = [c for c in free if 0 not in c] + [c for c in free if 0 in c] + taken
    placed = _share(node, node_cpus, cpus, ordered, vcpus, memory_kib)
    own = set(placed.host_cpus)
    placed.emulator_cpus = sorted(set(free_cpus) - own) or sorted(own)
    placed.avoided = [c for c in avoided if c not in own]
    shared = sorted(own.intersection(avoided))
    placed.warnings.append(f"node {node}: {len(vcpus)} vCPUs do not fit in the {len(free_cpus)} CPUs other domains "
                           f"leave free; they share CPUs {format_cpulist(shared)} with {owners} (--force)")
    return placed


def _pin(node: int, node_cpus: list[int], cores: list[tuple[int, ...]], vcpus: list[int],
         memory_kib: int) -> CellPlacement | None:
    """``vcpus`` on distinct CPUs of ``cores`` (in that order of preference), whole cores where
    the SMT width allows; the emulator on the rest of ``node_cpus``. None when they do not fit."""
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
        return None
    host = [cpu for core in usable[:needed] for cpu in core[:threads]]
    used = set(host)
    emulator = sorted(c for c in node_cpus if c not in used) or sorted(used)
    return CellPlacement(node, vcpus, host, emulator, memory_kib, threads)


def _share(node: int, node_cpus: list[int], cpus: dict[int, Cpu], cores: list[tuple[int, ...]], vcpus: list[int],
           memory_kib: int) -> CellPlacement:
    """--force past other domains' pins: every CPU of ``cores`` in that order, whole cores, so the
    free ones are all used before a shared one; guest cores of the widest SMT width whose groups
    are host siblings, else one thread each. More vCPUs than CPUs: round-robin."""
    flat = [cpu for core in cores for cpu in core]
    wanted = len(vcpus)
    if wanted > len(flat):
        return _overcommit(node, node_cpus, cores, vcpus, memory_kib)
    host = flat[:wanted]
    threads = next(w for w in range(max(len(c) for c in cores), 0, -1)
                   if wanted % w == 0 and all(set(host[i:i + w]) <= set(cpus[host[i]].siblings)
                                              for i in range(0, wanted, w)))
    return CellPlacement(node, vcpus, host, [], memory_kib, threads)  # place_cell picks the emulator CPUs


def _overcommit(node: int, node_cpus: list[int], cores: list[tuple[int, ...]], vcpus: list[int],
                memory_kib: int) -> CellPlacement:
    """More vCPUs than CPUs (--force): round-robin over the cores' CPUs, in their order."""
    flat = [cpu for core in cores for cpu in core]
    host = [flat[i % len(flat)] for i in range(len(vcpus))]
    return CellPlacement(node, vcpus, host, sorted(node_cpus), memory_kib, 1)


def _owners(cpus: list[int], pinned_by: Mapping[int, Sequence[str]] | None) -> str:
    """'guest-a: 8-11, guest-b: 12-15' for the pinned ``cpus`` ('other domains: ...' unnamed)."""
    by_name: dict[str, list[int]] = {}
    for cpu in cpus:
        for name in (pinned_by or {}).get(cpu) or ["other domains"]:
            by_name.setdefault(name, []).append(cpu)
    return ", ".join(f"{name}: {format_cpulist(found)}" for name, found in sorted(by_name.items()))


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
            raise Refused(f"not enough free {requested} hugepages ({short}); "
                          + "".join(f"{hint}; " for hint in _page_hints(requested, size, demand, free, available))
                          + "reserve more, pick another size, or --force")
        return size, None
    for size in (GiB_KIB, 2048):  # auto: the largest size that fits
        if fits(size):
            return size, None
    return None, ("no hugepage size has enough free pages on " + ", ".join(where(n) for n, _k in demand)
                  + "; guest memory uses 4K pages (slower DMA mapping)")


def _page_hints(requested: str, size: int, demand: list[tuple[int | None, int]], free: dict[int, dict[int, int]],
                available) -> list[str]:
    """What to do about each cell short of ``size`` pages: how many more on which node, and where
    (mm/hugetlb.c's per-node nr_hugepages); and any node that has them, which the guest's memory
    is not bound to (its vCPUs and devices are elsewhere)."""
    hints = []
    bound = {node for node, _kib in demand if node is not None}
    for node, kib in demand:
        if kib % size:
            hints.append(f"{kib // 1024} MiB is not a whole number of {requested} pages")
            continue
        missing = kib // size - available(node, size)
        if node is not None and missing > 0:
            hints.append(f"node {node} needs {missing} more (reserve them in /sys/devices/system/node/node{node}/"
                         f"hugepages/hugepages-{size}kB/nr_hugepages)")
            others = [n for n in sorted(free) if n not in bound and free[n].get(size, 0) * size >= kib]
            if others:
                which = f"nodes {', '.join(map(str, others))} have" if len(others) > 1 else f"node {others[0]} has"
                hints.append(f"{which} enough, but the guest's memory is bound to node {node}, with its vCPUs "
                             "and devices")
    return hints
