"""The guest's PCIe tree: where each passed-through device sits, and the controllers above it.

Two layouts:

* ``flat``: one pcie-root-port per device, on pcie-root, or with several guest NUMA cells on
  the pxb-pcie of the device's cell (what gpuvfio did before mirroring).
* ``mirror`` (default for two or more devices): the guest sees the host's shape. Devices under
  one host PCIe switch share one emulated switch (pcie-root-port -> pcie-switch-upstream-port
  -> one pcie-switch-downstream-port each, libvirt formatdomain "PCI controllers"), so NCCL and
  the CUDA driver see them as PIX neighbours and a GPU keeps its NIC beside it; devices from
  several host root complexes get one pxb-pcie each, bound to the guest NUMA cell of the
  host node (KubeVirt VEP 115 does the same); a hierarchy whose BARs reach 128 GiB gets a
  pxb of its own (KubeVirt VEP 199), so its bridge window does not share a bus range with
  others. Devices keep host order within each level.

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
    # Hierarchies: devices sharing their nearest host switch, or a device alone on its root port.
    hierarchies: dict[tuple, list[list[PciFunction]]] = {}
    for functions in devices:
        pos = where[functions[0].address]
        key = (pos.root_complex, pos.switch) if pos.switch else (pos.root_complex, functions[0].address)
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
        for parent, hierarchy_list in buses:
            for group in hierarchy_list:
                _hierarchy(builder, layout, parent, group, where)


def _hierarchy(builder: _Builder, layout: Layout, parent: int, group: list[list[PciFunction]],
               where: dict[PciAddress, Position]) -> None:
    first = where[group[0][0].address]
    if len(group) == 1:
        port = builder.add("pcie-root-port", parent, f"{group[0][0].address}")
        layout.ports.append(GuestPort(port.index, group[0]))
        return
    switch = first.switch
    root = builder.add("pcie-root-port", parent, f"root port above host switch {switch}")
    upstream = builder.add("pcie-switch-upstream-port", root.index, f"host switch {switch}")
    for functions in group:
        down = builder.add("pcie-switch-downstream-port", upstream.index,
                           f"host switch {switch} port for {functions[0].address}")
        layout.ports.append(GuestPort(down.index, functions))
    layout.notes.append(f"{', '.join(str(fns[0].address) for fns in group)} share host switch {switch}: "
                        "one emulated switch in the guest")


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
