"""What goes where, decided once: the host functions a guest gets, the guest slot each physical
device lands on, and the ROM, P2P clique and guest NUMA cell it has there; the SR-IOV VFs and
mdev instances of a vGPU guest.

The plan (gpuvfio.domain.spec) decides; this is its result in terms of no consumer. The libvirt
domain (gpuvfio.domain.render: hostdevs, <qemu:override>), the NCCL topology file
(gpuvfio.ops.domains.nccl_topology_file) and the plan's --json read it, and so would another
hand-off (a Proxmox ``hostpciN`` line, a KubeVirt VM's hostDevices) instead of working the
slot grouping, ROM and clique policy out again.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuvfio.address import PciAddress
from gpuvfio.domain.layout import Controller, GuestPort
from gpuvfio.host.model import PciFunction
from gpuvfio.host.topology import CliquePlan

__all__ = ["Rom", "Slot", "Assignment", "assign"]

EXPANDER = "pcie-expander-bus"


@dataclass(frozen=True)
class Rom:
    """The option ROM a guest's GPU shows (libvirt ``<rom bar= file=>``): the BAR on or off,
    or an image in place of the GPU's own."""

    bar: str | None
    file: str | None


@dataclass(frozen=True)
class Slot:
    """One physical device, all its functions, on slot 0 of the bus of guest controller
    ``port`` (a root port or a switch's downstream port), function numbers kept."""

    port: int
    functions: tuple[PciFunction, ...]
    cell: int  # the guest NUMA cell its bus belongs to (0 without a pxb-pcie above it)
    clique: int | None  # QEMU's x-nv-gpudirect-clique id, None: no P2P clique
    alias: str | None  # libvirt's user alias of function 0 (ua-...), what <qemu:override> names
    rom: Rom | None  # what its GPU functions show; None: libvirt's default

    def guest_address(self, function: PciFunction) -> PciAddress:
        return PciAddress(0, self.port, 0, function.address.function)

    @property
    def host_addresses(self) -> list[PciAddress]:
        return [f.address for f in self.functions]


@dataclass(frozen=True)
class Assignment:
    slots: tuple[Slot, ...]
    vfs: tuple[PciAddress, ...]  # SR-IOV vGPU VFs: the vGPU host driver keeps them (managed='no')
    mdevs: tuple[tuple[str, str], ...]  # legacy vGPU instances: (UUID, type id)

    @property
    def passthrough(self) -> list[PciAddress]:
        """The functions passed through whole, bound to vfio-pci for the guest."""
        return [a for slot in self.slots for a in slot.host_addresses]

    @property
    def host_functions(self) -> list[PciAddress]:
        """Every host PCI function the guest gets: the whole devices, then the VFs."""
        return self.passthrough + list(self.vfs)

    @property
    def cliques(self) -> list[tuple[str, int]]:
        """(alias, clique id) of each device in a P2P clique."""
        return [(slot.alias, slot.clique) for slot in self.slots if slot.clique is not None and slot.alias]


def _cell_of(index: int, controllers: dict[int, Controller]) -> int:
    """The guest NUMA cell of bus ``index``: the cell of the pxb-pcie above it, else 0."""
    while index:
        controller = controllers[index]
        if controller.model == EXPANDER:
            return controller.cell or 0
        index = controller.parent
    return 0


def assign(ports: list[GuestPort], controllers: list[Controller], p2p: CliquePlan, *, rom: Rom | None,
           vfs: list[PciAddress], mdevs: list[tuple[str, str]]) -> Assignment:
    """The assignment the plan's ports, controllers and cliques make, with the ROM asked for."""
    by_index = {c.index: c for c in controllers}
    slots = tuple(Slot(port.index, tuple(port.functions), _cell_of(port.index, by_index),
                       p2p.clique_of(port.functions[0].address), port.alias or None, rom)
                  for port in ports)
    return Assignment(slots, tuple(vfs), tuple(mdevs))
