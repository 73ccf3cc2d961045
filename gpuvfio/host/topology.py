"""How the host's PCIe devices reach each other: root complexes, switches, and the path words
``nvidia-smi topo -m`` prints (PIX, PXB, PHB, NODE, SYS), read from the sysfs tree alone.

A device's sysfs path names the bridges above it (``pci0000:15/0000:15:01.0/0000:16:00.0/...``):
the first is the root port on the root complex's bus, and below it a PCIe switch shows as an
upstream port followed by one of its downstream ports (PCIe base spec 1.3.3: a switch is a
set of virtual PCI-to-PCI bridges). A PCIe-to-PCI bridge (a BMC's AST1150) is a bridge with
no bridge below it, so it is not taken for a switch.

Which GPUs may share a P2P clique (QEMU's ``x-nv-gpudirect-clique``) follows from this, the
IOMMU groups, and the P2P level NCCL would use on this host. A guest's peer addresses are
IOVAs, so peer traffic must go up to the IOMMU to be translated. The kernel puts two functions
in separate groups only when ACS on the path between them forces exactly that
(drivers/pci/pci.c pci_acs_path_enabled, drivers/iommu/iommu.c pci_device_group), so separate
groups are the proof -- unless pcie_acs_override has made the groups lie. How far apart peers
may be is NCCL's default P2P level (``p2p_rule``); GeForce and TITAN cards get none at all, and
GPUs of different architectures never share one (by device id: gpuvfio.host.nvidia_ids).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.host import nvidia_ids
from gpuvfio.host.model import PciFunction

# nvidia-smi topo -m legend, nearest first (NV# is NVLink, read from NVML elsewhere).
SAME, PIX, PXB, PHB, NODE, SYS = "X", "PIX", "PXB", "PHB", "NODE", "SYS"
DISTANCE = {SAME: 0, PIX: 1, PXB: 2, PHB: 3, NODE: 4, SYS: 5}
LEGEND = {
    PIX: "at most one PCIe switch between them",
    PXB: "several PCIe bridges, not through the host bridge",
    PHB: "through the PCIe host bridge of one root complex",
    NODE: "between root complexes of one NUMA node",
    SYS: "across the interconnect between NUMA nodes (sockets)",
}
MAX_CLIQUES = 16  # x-nv-gpudirect-clique takes 0-15 (QEMU hw/vfio/pci-quirks.c)


@dataclass(frozen=True, slots=True)
class RootComplex:
    """A PCIe host bridge: the root bus a hierarchy hangs from (``pciDDDD:BB`` in sysfs)."""

    domain: int
    bus: int

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}"


@dataclass(frozen=True, slots=True)
class Position:
    """Where a function sits: its root complex, the bridges from the root port down, and the
    upstream ports of the switches on that path (nearest the root first)."""

    address: PciAddress
    root_complex: RootComplex
    path: tuple[PciAddress, ...]
    switches: tuple[PciAddress, ...]
    numa_node: int | None

    @property
    def switch(self) -> PciAddress | None:
        """The upstream port of the switch nearest the device (None: straight on a root port)."""
        return self.switches[-1] if self.switches else None

    @property
    def root_port(self) -> PciAddress | None:
        return self.path[0] if self.path else None


def position(fn: PciFunction) -> Position:
    path = tuple(fn.parents)
    top = path[0] if path else fn.address
    switches = []
    i = 1
    while i + 1 < len(path):  # upstream port, then one of its downstream ports
        switches.append(path[i])
        i += 2
    node = fn.numa_node if fn.numa_node is not None and fn.numa_node >= 0 else None
    return Position(fn.address, RootComplex(top.domain, top.bus), path, tuple(switches), node)


def relation(a: Position, b: Position, *, single_node: bool = False) -> str:
    """The nvidia-smi word for the path between two functions. ``single_node``: the host has at
    most one NUMA node, so functions without a node are on the same one."""
    if a.address.device == b.address.device:
        return SAME if a.address == b.address else PIX
    common = 0
    for x, y in zip(a.path, b.path):
        if x != y:
            break
        common += 1
    if common:
        ancestor = a.path[common - 1]
        # Either path may show the ancestor is a switch's upstream port: a function on the
        # switch's internal bus has no bridge below it in its own path, and the word is symmetric.
        is_switch = ancestor in a.switches or ancestor in b.switches
        under_one_switch = is_switch and len(a.path) - common <= 1 and len(b.path) - common <= 1
        return PIX if under_one_switch else PXB
    if a.root_complex == b.root_complex:
        return PHB
    if a.numa_node is not None and a.numa_node == b.numa_node:
        return NODE
    if a.numa_node is None and b.numa_node is None and single_node:
        return NODE
    return SYS


# -- P2P cliques ---------------------------------------------------------------------------------
AMD_VENDOR = "AuthenticAMD"  # the CPUID vendor string (/proc/cpuinfo vendor_id)

# NCCL's path type for each nvidia-smi word (src/include/graph.h and src/graph/paths.cc
# ncclTopoSetPaths at NCCL v2.30.7-1): NCCL makes one <cpu> of all root complexes of a NUMA node,
# so nvidia-smi's PHB and NODE are both its PATH_PHB.
NCCL_PATH = {PIX: "PATH_PIX", PXB: "PATH_PXB", PHB: "PATH_PHB", NODE: "PATH_PHB", SYS: "PATH_SYS"}
NCCL_RULE = "NCCL 2.23.4 to 2.30.7, src/graph/paths.cc ncclTopoCheckP2p"


@dataclass(frozen=True, slots=True)
class P2pRule:
    """How far apart two GPUs may sit and still share a clique: the farthest nvidia-smi word,
    and the rule that says so (for the plan)."""

    farthest: str  # PXB or SYS
    why: str

    def allows(self, word: str) -> bool:
        return DISTANCE[word] <= DISTANCE[self.farthest]


def p2p_rule(cpu_vendor: str | None, gpus: int) -> P2pRule:
    """NCCL's default P2P level for ``gpus`` GPUs on a host whose CPUID vendor is ``cpu_vendor``.

    NCCL 2.23.4 and later default to PATH_PXB ("don't use P2P across CPU Host Bridges and
    further apart") and to PATH_SYS only on x86 AMD CPUs with at most two GPUs (the 2.23.4
    release: "keep it enabled when we only have 2 GPUs"); 2.30.7 counts physical GPUs, the same
    thing here. A clique where NCCL would not use P2P on bare metal only tells the guest's
    driver that a path is good when NCCL's own authors found it is not. An unknown vendor (a
    recording without ``vendor_id``, or a CPU that has none: arm64) fails closed to PXB, which
    is also NCCL's level on arm64 and on every vendor but AMD."""
    if cpu_vendor == AMD_VENDOR and gpus <= 2:
        return P2pRule(SYS, f"NCCL's default P2P level on an x86 AMD CPU with at most two GPUs is PATH_SYS "
                            f"({NCCL_RULE}): a clique wherever the IOMMU groups allow")
    if cpu_vendor == AMD_VENDOR:
        where = f"on an x86 AMD CPU with {gpus} GPUs (PATH_SYS only for two at most)"
    elif cpu_vendor:
        where = f"on a {cpu_vendor} CPU"
    else:
        where = "where the CPU vendor is unknown (no vendor_id in /proc/cpuinfo; taken as not AMD)"
    return P2pRule(PXB, f"NCCL's default P2P level {where} is PATH_PXB ({NCCL_RULE}): cliques only under "
                        "PCIe switches (PIX, PXB), none through a host bridge (PHB, NODE, SYS)")


# GeForce and PCIe P2P: NVIDIA publishes no product table, and no driver document read for this
# says it. What NVIDIA has said in public is the NCCL maintainer's answers: "GeForce cards don't
# support GPU Direct P2P" (NVIDIA/nccl issue 1309, 2024-06-03) and "GeForce cards do not support
# P2P" (NVIDIA/nccl-tests issue 287, 2025-02-20, RTX 5090); the driver reports it through NVML
# (nvmlDeviceGetP2PStatus, ``nvidia-smi topo -p2p r``), and NCCL turns P2P off when NVML does not
# say OK (ncclTopoCheckP2p). TITAN cards are of the same consumer line. The driver offers peer
# access between GPUs of one architecture only (cuDeviceCanAccessPeer is 0 across them), so a
# clique never mixes architectures. What a card is comes from its device id in the table gpuvfio
# ships (gpuvfio.host.nvidia_ids), not from the host's pci.ids, which may be missing or old; a
# device the table does not know has nothing that says it has P2P. Community-patched open kernel
# modules enable P2P on some GeForce cards: ``--p2p force`` is for those (and for unknown ids).


def _p2p_models(usable: list[PciFunction], notes: list[str], forced: list[str], *,
                force: bool) -> list[PciFunction]:
    """The GPUs whose model may take part in PCIe P2P: not GeForce or TITAN cards, and only
    devices the id table knows by architecture; ``force`` keeps the others, said in ``forced``."""
    consumer, unknown = [], []
    for fn in usable:
        found = nvidia_ids.model(fn.device_id)
        if found is None or found.architecture is None:
            unknown.append(fn)
        elif found.consumer:
            consumer.append(fn)
    reasons = []
    if consumer:
        reasons.append((consumer, "GeForce and TITAN cards have no PCIe P2P in NVIDIA's driver (NVML reports it "
                                  "unsupported and NCCL then turns P2P off)"))
    if unknown:
        reasons.append((unknown, "a device id gpuvfio's NVIDIA id table does not know by architecture (pci.ids "
                                 f"{nvidia_ids.table()[0].get('pci.ids-version', 'unknown')}): nothing says it has "
                                 "PCIe P2P"))
    for members, why in reasons:
        names = ", ".join(f"{fn.address} ({_model_name(fn)})" for fn in members)
        if force:
            forced.append(f"--p2p force: {names}: {why}; cliques given anyway")
        else:
            notes.append(f"{names}: {why}; no clique")
    if force:
        return usable
    return [fn for fn in usable if fn not in consumer and fn not in unknown]


def _model_name(fn: PciFunction) -> str:
    found = nvidia_ids.model(fn.device_id)
    return fn.device_name or (found.name if found is not None else f"{fn.vendor_id}:{fn.device_id}")


def architecture(fn: PciFunction) -> str | None:
    """The GPU's architecture by the shipped id table (None: not known)."""
    found = nvidia_ids.model(fn.device_id)
    return found.architecture if found is not None else None


@dataclass(slots=True)
class Clique:
    clique_id: int
    members: list[PciAddress]
    relation: str  # the farthest path word between two members

    def to_json(self) -> dict:
        return {"id": self.clique_id, "members": [str(m) for m in self.members], "relation": self.relation,
                "why": f"{LEGEND[self.relation]}, each in its own IOMMU group (ACS sends peer traffic "
                       "through the IOMMU)"}


@dataclass(slots=True)
class CliquePlan:
    cliques: list[Clique]
    notes: list[str]  # why a GPU or a pair got no clique, and the rule followed
    rule: P2pRule | None = None
    forced: list[str] = field(default_factory=list)  # cliques only --p2p force gave: the plan warns

    def clique_of(self, address: PciAddress) -> int | None:
        for clique in self.cliques:
            if address in clique.members:
                return clique.clique_id
        return None

    def to_json(self) -> dict:
        return {"cliques": [c.to_json() for c in self.cliques], "notes": list(self.notes)}


def _isolated(gpus: list[PciFunction], notes: list[str]) -> list[PciFunction]:
    """The GPUs each in an IOMMU group of its own; a note for each of the others."""
    by_group: dict[int | None, list[PciFunction]] = {}
    for fn in gpus:
        by_group.setdefault(fn.iommu_group, []).append(fn)
    usable = []
    for fn in gpus:
        shared = [g for g in by_group[fn.iommu_group] if g is not fn]
        if fn.iommu_group is None:
            notes.append(f"{fn.address}: no IOMMU group, so nothing shows its peer traffic is translated; no clique")
        elif shared:
            notes.append(f"{fn.address}: shares IOMMU group {fn.iommu_group} with "
                         f"{', '.join(str(g.address) for g in shared)} (no ACS between them: peer writes to "
                         "guest addresses would bypass the IOMMU); no clique")
        else:
            usable.append(fn)
    return usable


def p2p_cliques(functions: list[PciFunction], *, acs_override: bool, single_node: bool = False,
                cpu_vendor: str | None = None, force: bool = False) -> CliquePlan:
    """Group the NVIDIA display functions among ``functions`` (one guest's devices, host order)
    into the sets whose peer traffic the host routes through its IOMMU and NCCL's default P2P
    level allows on this CPU (``p2p_rule``); GeForce and TITAN cards and ids the shipped table
    does not know get none, and architectures never mix. A set of one is no clique. ``force``
    lifts the NCCL level and the model rules (never the IOMMU's or the architectures'): what it
    alone gave is in ``forced``. The reasons for leaving GPUs out are returned, for the plan to print."""
    gpus = [f for f in functions if f.is_nvidia_gpu]
    notes: list[str] = []
    if len(gpus) < 2:
        return CliquePlan([], notes)
    if acs_override:
        notes.append("pcie_acs_override is on the kernel command line: IOMMU groups do not prove that peer "
                      "traffic reaches the IOMMU, so no GPU gets a P2P clique")
        return CliquePlan([], notes)
    rule = p2p_rule(cpu_vendor, len(gpus))
    usable = _isolated(gpus, notes)
    if len(usable) > 1:
        notes.append(f"P2P rule: {rule.why}")
    forced: list[str] = []
    usable = _p2p_models(usable, notes, forced, force=force)
    reach = P2pRule(SYS, "--p2p force") if force else rule
    positions = {fn.address: position(fn) for fn in usable}

    def word(a: PciAddress, b: PciAddress) -> str:
        return relation(positions[a], positions[b], single_node=single_node)

    addresses = list(positions)
    sets = [members for kind in _by_architecture(usable, notes).values()
            for members in _reachable_sets(kind, reach, word)]
    sets.sort(key=lambda members: members[0])
    cliques = _cliques(sets, rule, word, notes, forced)
    if force and not forced:
        notes.append("--p2p force: every clique is within NCCL's default level and every card's model has P2P; "
                     "force changed nothing")
    _lonely_notes(addresses, sets, rule, word, notes)
    return CliquePlan(cliques, notes, rule, forced)


def _by_architecture(usable: list[PciFunction], notes: list[str]) -> dict[str | None, list[PciAddress]]:
    """The GPUs' addresses by architecture (host order); a note where there are several, which
    never share a clique (NVIDIA's driver has no peer access across architectures)."""
    kinds: dict[str | None, list[PciAddress]] = {}
    for fn in usable:
        kinds.setdefault(architecture(fn), []).append(fn.address)
    if len(kinds) > 1:
        notes.append("GPUs of different architectures never share a P2P clique (NVIDIA's driver gives no peer "
                     "access across them): " + "; ".join(f"{kind or 'unknown'}: {', '.join(map(str, members))}"
                                                         for kind, members in kinds.items()))
    return kinds


def _reachable_sets(addresses: list[PciAddress], reach: P2pRule,
                    word: Callable[[PciAddress, PciAddress], str]) -> list[list[PciAddress]]:
    """The GPUs at ``addresses`` joined wherever ``reach`` allows the path word between two
    (``word``), and so on transitively: a GPU shares a set with every GPU it reaches through
    others. Each set is in host order, the sets in the order of their first members."""
    parent = {a: a for a in addresses}

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for i, a in enumerate(addresses):
        for b in addresses[i + 1:]:
            if reach.allows(word(a, b)):
                parent[find(b)] = find(a)
    sets: dict[PciAddress, list[PciAddress]] = {}
    for a in addresses:
        sets.setdefault(find(a), []).append(a)
    return list(sets.values())


def _cliques(sets: list[list[PciAddress]], rule: P2pRule, word: Callable[[PciAddress, PciAddress], str],
             notes: list[str], forced: list[str]) -> list[Clique]:
    """A clique for each set of two GPUs or more, up to MAX_CLIQUES (a note for each set left
    out), named by the farthest path between two of its members; one beyond NCCL's default
    level (``rule``) goes to ``forced``, as only --p2p force gave it."""
    cliques: list[Clique] = []
    for members in sets:
        if len(members) < 2:
            continue
        if len(cliques) == MAX_CLIQUES:
            notes.append(f"{', '.join(map(str, members))}: more than {MAX_CLIQUES} cliques; left out")
            continue
        worst = max((word(a, b) for i, a in enumerate(members) for b in members[i + 1:]), key=DISTANCE.__getitem__)
        cliques.append(Clique(len(cliques), members, worst))
        if not rule.allows(worst):
            forced.append(f"--p2p force: P2P clique {len(cliques) - 1} ({', '.join(map(str, members))}) spans "
                          f"{worst} ({NCCL_PATH[worst]}), beyond NCCL's default level {NCCL_PATH[rule.farthest]} "
                          "on this host")
    return cliques


def _lonely_notes(addresses: list[PciAddress], sets: list[list[PciAddress]], rule: P2pRule,
                  word: Callable[[PciAddress, PciAddress], str], notes: list[str]) -> None:
    """A note for the GPUs that reach no other, grouped by the path word to the nearest other
    GPU, which is beyond NCCL's default level (``rule``)."""
    alone = {members[0] for members in sets if len(members) == 1}
    lonely: dict[str, list[PciAddress]] = {}
    for a in addresses:
        if a in alone and len(addresses) > 1:
            nearest = min((word(a, b) for b in addresses if b != a), key=DISTANCE.__getitem__)
            lonely.setdefault(nearest, []).append(a)
    for nearest, members in lonely.items():
        notes.append(f"{', '.join(map(str, members))}: the nearest other GPU is {nearest} ({LEGEND[nearest]}), "
                     f"beyond NCCL's default P2P level here ({NCCL_PATH[rule.farthest]}): no clique (NVLink P2P, "
                     "where the GPUs have it, needs none)")
