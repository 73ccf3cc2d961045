"""gpuvfio unbind: give devices back to the host without the journal.

For a device gpuvfio does not hold (bound by hand, by another tool, or before gpuvfio): clear
driver_override, leave vfio-pci, write the address to drivers_probe so the host's driver
takes it (the kernel's Documentation/ABI/testing/sysfs-bus-pci). What gpuvfio holds is given
back by restore, to exactly the recorded drivers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.bind.apply import current_driver, current_override
from gpuvfio.bind.plan import VFIO_DRIVER
from gpuvfio.errors import InputError
from gpuvfio.host.inventory import read_inventory
from gpuvfio.ops.binding import libvirt_view
from gpuvfio.ops.context import Context
from gpuvfio.ops.plans import CheckStatus, Plan, Step, StepKind

__all__ = ["UnbindPlan", "UnbindResult", "plan_unbind", "run_unbind", "unbind"]


@dataclass
class UnbindResult:
    """Each device and the driver it is on after gpuvfio unbind ("no driver" when none took it)."""

    drivers: dict[str, str]
    steps: list[Step] = field(default_factory=list)  # the plan's steps, as carried out
    root: str | None = None  # step paths are shown as the host beneath this root names them

    def to_json(self) -> dict:
        return {"drivers": dict(self.drivers), "steps": [s.to_json(self.root) for s in self.steps]}


@dataclass
class UnbindPlan(Plan):
    devices: list[str] = field(default_factory=list)

    def extra_json(self) -> dict:
        return {"devices": list(self.devices)}


def plan_unbind(ctx: Context, addresses: list[PciAddress], *, uri: str | None = None) -> UnbindPlan:
    """What ``unbind`` will write: per device, clear driver_override, leave vfio-pci, reprobe. A
    device a domain uses is refused (vfio-pci's release waits for the guest to let go: the write
    would hang), and so is one when libvirt cannot be asked (fail closed; --connect none)."""
    if not addresses:
        raise InputError("no PCI address given")
    inventory = read_inventory(ctx.host)
    inventory.require(*addresses)
    targets = sorted(set(addresses))
    plan = UnbindPlan("unbind", ", ".join(map(str, targets)), root=ctx.host.root, devices=[str(a) for a in targets])
    view = libvirt_view(ctx, targets, uri=uri)
    used = {str(a): names for a, names in (view.users or {}).items() if names}
    if view.error:
        plan.refuse("libvirt", f"cannot tell whether a domain uses them: {view.error}")
    elif used:
        plan.refuse("libvirt", "in use by " + "; ".join(f"{a}: {', '.join(n)}" for a, n in sorted(used.items())))
    else:
        plan.check("libvirt", CheckStatus.WARN if view.not_asked else CheckStatus.OK,
                   view.not_asked or "no libvirt domain uses these devices")
    journal = ctx.journal()
    held = [str(a) for a in targets if str(a) in journal.devices]
    if held:
        plan.check("journal", CheckStatus.WARN, f"gpuvfio holds {', '.join(held)}: unbind leaves its record; "
                                                "gpuvfio restore gives back exactly the recorded drivers")
    for address in map(str, targets):
        driver = current_driver(ctx.host, address)
        if current_override(ctx.host, address) is not None:
            plan.step(StepKind.CLEAR_OVERRIDE, f"{address}: driver_override <- (none)", address=address,
                      path=ctx.host.sys_path("bus", "pci", "devices", address, "driver_override"), value="\n")
        if driver == VFIO_DRIVER:
            plan.step(StepKind.UNBIND, f"{address}: unbind from vfio-pci", address=address, name=VFIO_DRIVER,
                      path=ctx.host.sys_path("bus", "pci", "drivers", VFIO_DRIVER, "unbind"), value=address)
        if driver in (None, VFIO_DRIVER):
            plan.step(StepKind.PROBE, f"{address}: drivers_probe (the host's driver takes it)", address=address,
                      path=ctx.host.sys_path("bus", "pci", "drivers_probe"), value=address)
    return plan


def unbind(ctx: Context, addresses: list[PciAddress], *, uri: str | None = None) -> "UnbindResult":
    """Give devices back to the host without the journal (gpuvfio unbind): its plan, made under
    the run lock, carried out."""
    with ctx.lock():
        return run_unbind(ctx, plan_unbind(ctx, addresses, uri=uri))


def run_unbind(ctx: Context, plan: UnbindPlan) -> "UnbindResult":
    """Write each planned step's value to its file, in order (the writer opens each afresh
    beneath the root); then read each device's driver back."""
    plan.raise_if_refused()
    writer = ctx.writer()
    taken: list[Step] = []
    for step in plan.steps:
        writer.write(step.path, step.value)
        taken.append(step)
    return UnbindResult({a: current_driver(ctx.host, a) or "no driver" for a in plan.devices}, taken, ctx.host.root)
