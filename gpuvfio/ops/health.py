"""The health service: what the host still sees of the devices it hands out.

The devices: those named, else every NVIDIA function and, with ``every_assigned``, every
function on vfio-pci. Each is rated by gpuvfio.host.pcie_health (config space, the journal's
mark, the AER counters of the device and the ports above it, the link, the IOMMU faults, the
reset's qualification); the service adds the
libvirt domains that assign it, asked by the one policy of gpuvfio.ops.binding (libvirt not
answering is an unknown finding on every device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError
from gpuvfio.host.inventory import Inventory, read_inventory
from gpuvfio.host.pcie_health import DeviceHealth, Rating, device_health, plan_findings, read_records
from gpuvfio.ops.binding import libvirt_view
from gpuvfio.ops.plans import Check, CheckStatus, Plan

if TYPE_CHECKING:  # the annotation only: a Context is passed in, never made here
    from gpuvfio.ops.context import Context

__all__ = ["HealthReport", "health_report", "plan_health"]


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
    records = read_records(ctx.host, ctx.state, ctx.journal().data["broken"])
    devices = [device_health(ctx.host, inventory, inventory.require(a)[0], records) for a in watched]
    view = libvirt_view(ctx, list(watched), uri=uri)
    for device in devices:  # which domains hold a device is no PCIe finding: libvirt down is a note
        if view.users is not None:
            device.domains = view.users.get(device.address, [])
    return HealthReport(devices, view.not_asked or (f"libvirt did not answer: {view.error}" if view.error else None))




def plan_health(ctx: Context, plan: Plan, addresses: list[PciAddress], *, force: bool = False, mends: bool = False,
                inventory: Inventory | None = None, broken: dict | None = None) -> None:
    """The health checks of a plan that hands ``addresses`` out without binding them (a vGPU's
    GPU, a bare-metal testbed variant's) or resets them, by the bind's rule (bind.plan): a
    failed finding refuses -- ``force`` overrides it for counters and links, never for a device
    that does not answer or came back broken -- and a degraded one warns. A reset (``mends``)
    is what mends a failed device, so there every finding warns: the plan says what the reset
    is for. ``inventory`` and ``broken`` (the journal's marks): those the caller's plan read
    already (one journal load per operation), else read here."""
    if not addresses:
        return
    inventory = inventory or read_inventory(ctx.host)
    records = read_records(ctx.host, ctx.state, ctx.journal().data["broken"] if broken is None else broken)
    for address in addresses:
        fn = inventory.functions.get(address)
        if fn is None:
            plan.refuse("health", f"{address}: not on this host")
            continue
        for finding in plan_findings(ctx.host, inventory, fn, records):
            refuse = finding.status is Rating.FAILED and not mends and not (force and finding.overridable)
            plan.checks.append(Check("health", CheckStatus.REFUSE if refuse else CheckStatus.WARN,
                                     f"{address}: {finding.message}", overridable=refuse and finding.overridable))
