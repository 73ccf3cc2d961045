"""The health service: what the host still sees of the devices it hands out.

The devices: those named, else every NVIDIA function and, with ``every_assigned``, every
function on vfio-pci. Each is rated by gpuvfio.host.pcie_health (config space, the journal's
mark, the AER counters of the device and the ports above it, the link); the service adds the
libvirt domains that assign it, asked by the one policy of gpuvfio.ops.binding (libvirt not
answering is an unknown finding on every device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.pcie_health import DeviceHealth, Rating, device_health
from gpuvfio.ops.binding import libvirt_view

if TYPE_CHECKING:  # the annotation only: a Context is passed in, never made here
    from gpuvfio.ops.context import Context

__all__ = ["HealthReport", "health_report"]


@dataclass
class HealthReport:
    devices: list[DeviceHealth]
    libvirt: str | None = None  # why libvirt was not asked or did not answer

    @property
    def ok(self) -> bool:
        return all(d.status is Rating.OK for d in self.devices)

    def to_json(self) -> dict:
        return {"ok": self.ok, "libvirt": self.libvirt, "devices": [d.to_json() for d in self.devices]}


def health_report(ctx: Context, *, only: list[PciAddress] | None = None, every_assigned: bool = False,
                  uri: str | None = None) -> HealthReport:
    """The health of ``only`` (the devices named), else of every NVIDIA function and, with
    ``every_assigned``, of every function on vfio-pci."""
    inventory = read_inventory(ctx.host)
    for address in only or []:
        if inventory.require(address)[0].is_bridge:
            raise InputError(f"{address} is a PCI bridge: health rates the devices below it, and its AER "
                             "counters count for them")
    watched = only or [a for a, f in sorted(inventory.functions.items())
                       if f.is_nvidia or (every_assigned and f.driver == "vfio-pci")]
    broken = ctx.journal().data["broken"]
    devices = [device_health(ctx.host, inventory, inventory.require(a)[0], broken) for a in watched]
    view = libvirt_view(ctx, list(watched), uri=uri)
    for device in devices:  # which domains hold a device is no PCIe finding: libvirt down is a note
        if view.users is not None:
            device.domains = view.users.get(device.address, [])
    return HealthReport(devices, view.not_asked or (f"libvirt did not answer: {view.error}" if view.error else None))


