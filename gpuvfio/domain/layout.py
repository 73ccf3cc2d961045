"""The guest's PCIe tree: where each passed-through device sits, and the controllers above it.

Two layouts:

* ``flat``: one pcie-root-port per device, on pcie-root, or with several guest NUMA cells on
  the pxb-pcie of the device's cell (what gpuvfio did before mirroring).
* ``mirror`` (default for two or more devices): the guest sees the host's shape. Devices below
  one host root port keep every PCIe switch between it and them: a guest root port, and for
  each host switch an emulated one (pcie-switch-upstream-port -> a pcie-switch-downstream-port
  for each of its ports the devices are below, libvirt formatdomain "PCI controllers"), level
  for level, so NCCL and the CUDA driver count the same switches between two GPUs as on the
  host (PIX under one switch, PXB across cascaded ones) and a GPU keeps its NIC beside it. A
  device alone below its root port gets a root port (every path from it goes through the host
  bridge either way); devices on different root ports stay apart. Devices from several host
  root complexes get one pxb-pcie each, bound to the guest NUMA cell of the host node
  (KubeVirt VEP 115 does the same); a hierarchy whose BARs reach 128 GiB gets a pxb of its
  own (KubeVirt VEP 199), so its bridge window does not share a bus range with others.
  Devices keep host order within each level.

Guest bus numbers are not the controller indexes: each pxb-pcie starts the bus range given by
its ``busNr``, and firmware numbers the buses below it (hw/pci-bridge/pci_expander_bridge.c);
busNr ranges must leave room for every bridge below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.domain.address_space import DEDICATED_BAR_BYTES, window_bars
from gpuvfio.errors import Refused
from gpuvfio.host.model import PciFunction
from gpuvfio.host.topology import Position, RootComplex, position

TOPOLOGIES = ("mirror", "flat")
PXB_FIRST_BUS = 0x80  # the first busNr tried; pcie-root's own buses stay below
PXB_LOWEST_BUS = 0x20
PXB_MIN_STRIDE = 0x10
PXB_WIDE_STRIDE = 0x20  # room to spare when few pxbs
SLOTS_PER_BUS = 32


@dataclass
class Controller:
    """A guest PCI controller (libvirt ``<controller type='pci'>``); ``index`` is the bus number
    libvirt gives the bus it provides."""

    index: int
    model: str  # pcie-expander-bus | pcie-root-port | pcie-switch-upstream-port | pcie-switch-downstream-port
    parent: int = 0  # the bus it plugs into (0 = pcie-root)
    slot: int | None = None  # its slot there; None: libvirt picks (pcie-root only)
    chassis: int | None = None  # root and downstream ports
    port: int | None = None
    bus_nr: int | None = None  # pcie-expander-bus
    cell: int | None = None  # pcie-expander-bus: guest NUMA cell
    purpose: str = ""  # what it mirrors, for the plan
    host: PciAddress | None = None  # the host bridge it stands for (a root port, switch port), if one

    @property
    def qemu_model(self) -> str:
        return {"pcie-expander-bus": "pxb-pcie", "pcie-root-port": "pcie-root-port",
                "pcie-switch-upstream-port": "x3130-upstream",
                "pcie-switch-downstream-port": "xio3130-downstream"}[self.model]


@dataclass
class GuestPort:
    """A physical device (all its functions) on the bus of controller ``index``, slot 0."""

    index: int
    functions: list[PciFunction]
    alias: str = ""  # user alias of function 0 (libvirt requires the ua- prefix)


@dataclass
class Layout:
    topology: str
    controllers: list[Controller] = field(default_factory=list)
    ports: list[GuestPort] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def expanders(self) -> list[Controller]:
        return [c for c in self.controllers if c.model == "pcie-expander-bus"]


def _bar_bytes(functions: list[PciFunction]) -> int:
    return sum(b.size for b in window_bars([b for f in functions for b in f.bars]))


class _Builder:
    def __init__(self) -> None:
        self.controllers: list[Controller] = []
        self.next_slot: dict[int, int] = {}
        self.chassis = 0

    def add(self, model: str, parent: int, purpose: str, **extra) -> Controller:
        slot = None
        if parent:  # on pcie-root libvirt hands out slots; elsewhere each needs its own
            slot = self.next_slot.get(parent, 0)
            if slot >= SLOTS_PER_BUS:
                # A PCIe bus has 32 device numbers; each port takes one (QEMU's pxb-pcie and
                # switch buses take no multifunction ports from gpuvfio).
                taken = self.controllers[parent - 1]
                raise Refused(f"more than {SLOTS_PER_BUS} ports on one guest bus (below {taken.model} "
                              f"{taken.index}, {taken.purpose}): a PCIe bus has {SLOTS_PER_BUS} device numbers; "
                              "pass fewer devices")
            self.next_slot[parent] = slot + 1
        if model in ("pcie-root-port", "pcie-switch-downstream-port"):
            self.chassis += 1
            extra.setdefault("chassis", self.chassis)
            extra.setdefault("port", 0x10 + self.chassis)
        controller = Controller(len(self.controllers) + 1, model, parent, slot, purpose=purpose, **extra)
        self.controllers.append(controller)
        return controller


def plan_layout(devices: list[list[PciFunction]], topology: str, cell_of_node: dict[int, int],
                guest_cells: bool) -> Layout:
    """The guest PCIe tree for ``devices`` (each the functions of one host slot)."""
    if topology not in TOPOLOGIES:
        raise ValueError(topology)
    if topology == "mirror" and len(devices) < 2:
        topology = "flat"  # one device has no neighbours to mirror
    builder = _Builder()
    layout = Layout(topology)
    if topology == "flat":
        _flat(builder, layout, devices, cell_of_node, guest_cells)
    else:
        _mirror(builder, layout, devices, cell_of_node, guest_cells)
    layout.controllers = builder.controllers
    _number_expanders(layout)
    return layout


def _flat(builder: _Builder, layout: Layout, devices, cell_of_node, guest_cells) -> None:
    expander_of_cell: dict[int, int] = {}
    if guest_cells:
        for cell in sorted(set(cell_of_node.values())):
            expander_of_cell[cell] = builder.add("pcie-expander-bus", 0, f"guest NUMA cell {cell}",
                                                 cell=cell).index
    for functions in devices:
        parent = 0
        if guest_cells:
            cell = cell_of_node.get(functions[0].numa_node, min(expander_of_cell))
            parent = expander_of_cell[cell]
        port = builder.add("pcie-root-port", parent, f"{functions[0].address}")
        layout.ports.append(GuestPort(port.index, functions))


def _mirror(builder: _Builder, layout: Layout, devices, cell_of_node, guest_cells) -> None:
    devices = sorted(devices, key=lambda fns: fns[0].address)
    where = {fns[0].address: position(fns[0]) for fns in devices}
    # Hierarchies: the devices below one host root port (every switch level between it and them
    # is mirrored), or a device alone on its root port or on the root bus.
    hierarchies: dict[tuple, list[list[PciFunction]]] = {}
    for functions in devices:
        pos = where[functions[0].address]
        key = (pos.root_complex, pos.root_port or functions[0].address)
        hierarchies.setdefault(key, []).append(functions)
    complexes: dict[RootComplex, list[list[list[PciFunction]]]] = {}
    for (complex_, _key), members in hierarchies.items():
        complexes.setdefault(complex_, []).append(members)
    own_bus = len(complexes) > 1 or guest_cells
    for complex_, groups in complexes.items():
        node = where[groups[0][0][0].address].numa_node
        cell = cell_of_node.get(node) if guest_cells else None
        if guest_cells and cell is None:
            cell = min(cell_of_node.values())
        for parent, hierarchy_list in _buses_of(builder, layout, complex_, groups, own_bus, cell):
            for group in hierarchy_list:
                _hierarchy(builder, layout, parent, group, where)


def _buses_of(builder: _Builder, layout: Layout, complex_: RootComplex, groups: list, own_bus: bool,
              cell: int | None) -> list[tuple[int, list]]:
    """The guest buses one host root complex's hierarchies go on: its pxb-pcie (or pcie-root),
    and a pxb of its own for each hierarchy whose BARs reach DEDICATED_BAR_BYTES."""
    big = [g for g in groups if _bar_bytes([f for fns in g for f in fns]) >= DEDICATED_BAR_BYTES]
    shared = [g for g in groups if g not in big]
    buses: list[tuple[int, list]] = []
    if shared:
        parent = 0
        if own_bus:
            parent = builder.add("pcie-expander-bus", 0, f"host root complex {complex_}", cell=cell).index
        buses.append((parent, shared))
    for group in big:
        size = _bar_bytes([f for fns in group for f in fns]) >> 30
        parent = builder.add("pcie-expander-bus", 0, f"host root complex {complex_}, {size} GiB of BARs "
                             "(a pxb of its own)", cell=cell).index
        if len(groups) > 1 or not own_bus:  # otherwise its root complex's pxb is its own anyway
            layout.notes.append(f"{', '.join(str(fns[0].address) for fns in group)}: {size} GiB of BARs "
                                "(128 GiB or more), so a pxb-pcie of their own")
        buses.append((parent, [group]))
    return buses


def switch_levels(pos: Position) -> tuple[tuple[PciAddress, PciAddress], ...]:
    """(upstream port, downstream port) of each host switch between the root port and the
    device, nearest the root first; a bridge left over below them (a PCIe-to-PCI bridge) is
    not a switch level."""
    return tuple(zip(pos.path[1::2], pos.path[2::2]))


def _mirrorable(group: list[list[PciFunction]], where: dict[PciAddress, Position]) -> bool:
    """Whether the devices' switch levels form a tree that PCIe ports can hold: every bridge
    above a device is a root port or a switch port, a port's bus holds one device or one
    switch, never both, and no two devices share a port."""
    holds: dict[tuple, set] = {}
    for functions in group:
        pos = where[functions[0].address]
        levels = switch_levels(pos)
        if len(pos.path) != 1 + 2 * len(levels):
            return False  # a bridge left over below the switches (PCIe-to-PCI): NCCL counts it
        for depth in range(len(levels) + 1):
            port = levels[:depth]
            content = levels[depth][0] if depth < len(levels) else ("device", functions[0].address)
            holds.setdefault(port, set()).add(content)
    return all(len(content) == 1 for content in holds.values())


def _hierarchy(builder: _Builder, layout: Layout, parent: int, group: list[list[PciFunction]],
               where: dict[PciAddress, Position]) -> None:
    """One host root port's devices: alone, a guest root port; several, the root port and every
    switch level below it, each host switch an emulated one (upstream port, then a downstream
    port for each of its ports the devices are below), so NCCL and the CUDA driver count the
    same switches between two devices as on the host."""
    if len(group) == 1 or not _mirrorable(group, where):
        if len(group) > 1:
            layout.notes.append(f"{', '.join(str(fns[0].address) for fns in group)}: the bridges above them are "
                                "not a tree of PCIe switches; each gets a root port of its own")
        for functions in group:
            port = builder.add("pcie-root-port", parent, f"{functions[0].address}",
                               host=where[functions[0].address].root_port)
            layout.ports.append(GuestPort(port.index, functions))
        return
    root_port = where[group[0][0].address].root_port
    root = builder.add("pcie-root-port", parent, f"host root port {root_port}", host=root_port)
    _below_port(builder, layout, root.index, [(switch_levels(where[f[0].address]), f) for f in group], 0)
    depth = max(len(switch_levels(where[f[0].address])) for f in group)
    layout.notes.append(f"{', '.join(str(fns[0].address) for fns in group)} are below host root port {root_port} "
                        f"through {depth} switch level(s): mirrored level for level")


def _below_port(builder: _Builder, layout: Layout, port: int, members: list, depth: int) -> None:
    """What the port ``port`` holds at switch level ``depth``: a device, or the switch above the
    members (_mirrorable has made sure it is one or the other)."""
    if len(members) == 1 and len(members[0][0]) == depth:
        layout.ports.append(GuestPort(port, members[0][1]))
        return
    upstream_address = members[0][0][depth][0]
    upstream = builder.add("pcie-switch-upstream-port", port, f"host switch {upstream_address}",
                           host=upstream_address)
    by_port: dict[PciAddress, list] = {}
    for levels, functions in members:
        by_port.setdefault(levels[depth][1], []).append((levels, functions))
    for downstream_address, below in by_port.items():
        down = builder.add("pcie-switch-downstream-port", upstream.index,
                           f"host switch {upstream_address} port {downstream_address}", host=downstream_address)
        _below_port(builder, layout, down.index, below, depth + 1)


def _buses_below(layout: Layout, expander: Controller) -> int:
    """Buses a pxb-pcie's range needs: its own and one per bridge below it."""
    below = {expander.index}
    count = 1
    changed = True
    while changed:
        changed = False
        for c in layout.controllers:
            if c.parent in below and c.index not in below:
                below.add(c.index)
                count += 1
                changed = True
    return count


def _number_expanders(layout: Layout) -> None:
    expanders = layout.expanders
    if not expanders:
        return
    need = max(_buses_below(layout, e) for e in expanders)
    first = PXB_FIRST_BUS
    for stride in sorted({PXB_WIDE_STRIDE, PXB_MIN_STRIDE, -(-need // 8) * 8}, reverse=True):
        if stride >= need and first + stride * len(expanders) <= 0x100:
            break
    else:  # many pxbs: pack them as tightly as their buses allow, top down
        stride = max(8, -(-need // 8) * 8)
        first = 0x100 - stride * len(expanders)
    if first < PXB_LOWEST_BUS:
        raise Refused(f"{len(expanders)} expander buses needing {need} buses each do not fit in the guest's "
                      "256 PCI buses; pass fewer devices or --topology flat")
    for n, expander in enumerate(expanders):
        expander.bus_nr = first + stride * n
