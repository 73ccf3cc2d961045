"""How the host's PCIe devices reach each other: root complexes, switches, and the path words
``nvidia-smi topo -m`` prints (PIX, PXB, PHB, NODE, SYS), read from the sysfs tree alone.

A device's sysfs path names the bridges above it (``pci0000:15/0000:15:01.0/0000:16:00.0/...``):
the first is the root port on the root complex's bus, and below it a PCIe switch shows as an
upstream port followed by one of its downstream ports (PCIe base spec 1.3.3: a switch is a
set of virtual PCI-to-PCI bridges). A PCIe-to-PCI bridge (a BMC's AST1150) is a bridge with
no bridge below it, so it is not taken for a switch.

Which GPUs may share a P2P clique (QEMU's ``x-nv-gpudirect-clique``) follows from this and the
IOMMU groups: a guest's peer addresses are IOVAs, so peer traffic must go up to the IOMMU to be
translated. The kernel puts two functions in separate groups only when ACS on the path between
them forces exactly that (drivers/pci/pci.c pci_acs_path_enabled, drivers/iommu/iommu.c
pci_device_group), so separate groups are the proof -- unless pcie_acs_override has made the
groups lie. Peers must also sit under one switch or one root complex: P2P between root
complexes and across sockets is not routed reliably (NVIDIA's GPUDirect notes; QEMU's
docs/igd-assign and vfio-pci notes on the clique).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuvfio.address import PciAddress
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
P2P_ROUTABLE = (PIX, PXB, PHB)  # under one switch or one root complex
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
        under_one_switch = (ancestor in a.switches and len(a.path) - common <= 1 and len(b.path) - common <= 1)
        return PIX if under_one_switch else PXB
    if a.root_complex == b.root_complex:
        return PHB
    if a.numa_node is not None and a.numa_node == b.numa_node:
        return NODE
    if a.numa_node is None and b.numa_node is None and single_node:
        return NODE
    return SYS


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
    notes: list[str]  # why a GPU or a pair got no clique

    def clique_of(self, address: PciAddress) -> int | None:
        for clique in self.cliques:
            if address in clique.members:
                return clique.clique_id
        return None

    def to_json(self) -> dict:
        return {"cliques": [c.to_json() for c in self.cliques], "notes": list(self.notes)}


def p2p_cliques(functions: list[PciFunction], *, acs_override: bool, single_node: bool = False) -> CliquePlan:
    """Group the NVIDIA display functions among ``functions`` (one guest's devices, host order)
    into the sets whose peer traffic the host can route through its IOMMU. A set of one is no
    clique. The reasons for leaving GPUs out are returned, for the plan to print."""
    gpus = [f for f in functions if f.is_nvidia_gpu]
    notes: list[str] = []
    if len(gpus) < 2:
        return CliquePlan([], notes)
    if acs_override:
        notes.append("pcie_acs_override is on the kernel command line: IOMMU groups do not prove that peer "
                      "traffic reaches the IOMMU, so no GPU gets a P2P clique")
        return CliquePlan([], notes)
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
    positions = {fn.address: position(fn) for fn in usable}
    parent = {a: a for a in positions}

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    addresses = list(positions)
    for i, a in enumerate(addresses):
        for b in addresses[i + 1:]:
            word = relation(positions[a], positions[b], single_node=single_node)
            if word in P2P_ROUTABLE:
                parent[find(b)] = find(a)
    sets: dict[PciAddress, list[PciAddress]] = {}
    for a in addresses:
        sets.setdefault(find(a), []).append(a)
    cliques: list[Clique] = []
    for members in sets.values():
        if len(members) < 2:
            continue
        if len(cliques) == MAX_CLIQUES:
            notes.append(f"{', '.join(map(str, members))}: more than {MAX_CLIQUES} cliques; left out")
            continue
        worst = max((relation(positions[a], positions[b], single_node=single_node)
                     for i, a in enumerate(members) for b in members[i + 1:]), key=DISTANCE.__getitem__)
        cliques.append(Clique(len(cliques), members, worst))
    lonely: dict[str, list[PciAddress]] = {}
    for a in addresses:
        if len(sets[find(a)]) == 1 and len(addresses) > 1:
            nearest = min((relation(positions[a], positions[b], single_node=single_node)
                           for b in addresses if b != a), key=DISTANCE.__getitem__)
            lonely.setdefault(nearest, []).append(a)
    for nearest, members in lonely.items():
        notes.append(f"{', '.join(map(str, members))}: the nearest other GPU is {nearest} ({LEGEND[nearest]}), "
                     "where PCIe P2P is not routed: no clique (NVLink P2P, where the GPUs have it, needs none)")
    return CliquePlan(cliques, notes)
