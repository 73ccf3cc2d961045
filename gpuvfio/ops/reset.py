"""gpuvfio reset: the kernel's own reset of a device gpuvfio holds, and the end of a "broken" mark.

A device that came back from a guest dead (config space 0xffff) or with its BARs gone is kept
on vfio-pci, marked broken in the journal, and refused by later binds (gpuvfio.bind.apply).
This is the one way out that gpuvfio offers, and only through the kernel's paths:

* ``<dev>/reset`` (drivers/pci/pci-sysfs.c reset_store -> pci_reset_function): the methods
  in ``reset_method``, in order; the file exists only when the device has one.
* ``<bridge>/reset_subordinate`` (Documentation/ABI/testing/sysfs-bus-pci, newer kernels): a
  secondary bus reset of everything below the bridge -- so only when every function below it
  is gpuvfio's, no domain uses any of them, and none is on a host driver.

No config-space pokes (setpci), no remove/rescan: those bypass the kernel's save and restore
of config space and its locking. ``--forget`` clears the mark without a reset, once the device
answers again (a reboot, a reseated card).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum

from gpuvfio.address import PciAddress
from gpuvfio.bind.apply import current_driver
from gpuvfio.bind.journal import Journal
from gpuvfio.bind.plan import VFIO_DRIVER
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.host.health import return_problem
from gpuvfio.host.inventory import Inventory, read_inventory
from gpuvfio.ops.binding import libvirt_view
from gpuvfio.ops.context import Context
from gpuvfio.ops.health import plan_health
from gpuvfio.ops.plans import Plan, Step, StepKind

__all__ = ["reset", "plan_reset", "run_reset", "ResetPlan", "ResetResult", "ResetMethod", "check_held", "check_unused",
           "kernel_file"]


class ResetMethod(str, Enum):
    FUNCTION = "function"  # <dev>/reset: the kernel's methods in reset_method, in order
    BUS = "bus"  # <bridge>/reset_subordinate: a secondary bus reset of everything below it
    NONE = "none"  # --forget: the mark cleared once the device answers, no reset


@dataclass
class ResetPlan(Plan):
    method: ResetMethod = ResetMethod.NONE
    devices: list[PciAddress] = field(default_factory=list)  # every device the reset reaches

    def extra_json(self) -> dict:
        return {"method": self.method.value, "devices": [str(a) for a in self.devices],
                "reset": [os.path.relpath(s.path, self.root) for s in self.steps if s.kind is StepKind.RESET]}


def plan_reset(ctx: Context, addresses: list[PciAddress], *, bus: bool = False, forget: bool = False,
               uri: str | None = None) -> ResetPlan:
    """What ``reset`` will write and every refusal it will meet; reads only."""
    return _plan(ctx, addresses, bus=bus, forget=forget, uri=uri)[0]


def _plan(ctx: Context, addresses: list[PciAddress], *, bus: bool, forget: bool,
          uri: str | None) -> tuple[ResetPlan, Journal]:
    """plan_reset, and the journal it was made against (loaded once the request is known to be
    well formed): the run settles with that same journal, one load per operation."""
    if not addresses:
        raise InputError("no PCI address given")
    if bus and forget:
        raise InputError("--bus and --forget exclude each other")
    inventory = read_inventory(ctx.host)
    inventory.require(*addresses)
    plan = ResetPlan("reset", ", ".join(map(str, addresses)), root=ctx.host.root)
    journal = ctx.journal()
    try:
        bridge = _bridge(inventory, addresses) if bus else None
    except Refused as exc:
        plan.refuse("bridge", str(exc))
        return plan, journal
    below = [f.address for f in inventory.functions.values() if bridge in f.parents and not f.is_bridge]
    affected = sorted(set(below) if bridge else set(addresses))
    plan.devices = affected
    method, targets = ResetMethod.NONE, []
    for check_id, check in (("ours", lambda: check_held(ctx, journal, affected, bridge)),
                            ("libvirt", lambda: check_unused(ctx, affected, uri))):
        try:
            check()
        except Refused as exc:
            plan.refuse(check_id, str(exc))
    try:
        if forget:
            pass
        elif bridge:
            method, targets = ResetMethod.BUS, [kernel_file(ctx, bridge, "reset_subordinate", "its bridge has no "
                                                   "reset_subordinate (older kernel)")]
        else:
            method = ResetMethod.FUNCTION
            for address in affected:
                health = inventory.functions[address].health
                if health is not None and health.reset_method == []:
                    raise Refused(f"refused: {address} has no reset method the kernel offers (reset_method is "
                                  "empty); --bus resets the bus below its bridge")
                targets.append(kernel_file(ctx, address, "reset", "the kernel offers no reset for it"))
    except Refused as exc:
        plan.refuse("reset_method", str(exc))
    plan.method = method
    plan_health(ctx, plan, affected, mends=True, inventory=inventory, broken=journal.data["broken"])
    for path in targets:  # the writer opens it afresh beneath the root
        plan.step(StepKind.RESET, "write 1", path=path, value="1\n")
    broken = [str(a) for a in affected if str(a) in journal.data["broken"]]
    plan.step(StepKind.SETTLE, "read each device back; clear the broken mark of "
                               + (", ".join(broken) if broken else "none (none is marked)") + " if it answers")
    return plan, journal


def reset(ctx: Context, addresses: list[PciAddress], *, bus: bool = False, forget: bool = False,
          uri: str | None = None) -> ResetResult:
    """Reset gpuvfio's devices by the kernel's function reset (or, with ``bus``, the secondary
    bus reset of their bridge); a device that answers afterwards loses its broken mark. The plan
    is made under the run lock and its writes carried out.
    """
    with ctx.lock():
        plan, journal = _plan(ctx, addresses, bus=bus, forget=forget, uri=uri)
        return run_reset(ctx, plan, journal)


def run_reset(ctx: Context, plan: ResetPlan, journal: Journal) -> ResetResult:
    """Carry out ``plan`` (made under the run lock the caller holds, from ``journal``): each
    planned write, then the settle that reads the devices back."""
    plan.raise_if_refused()
    taken: list[Step] = []
    for step in plan.steps:
        if step.kind is StepKind.RESET:
            ctx.progress(f"reset: {os.path.relpath(step.path, ctx.host.root)}")
            ctx.writer().write(step.path, step.value)
            taken.append(step)
    taken += [s for s in plan.steps if s.kind is StepKind.SETTLE]
    return _settle(ctx, journal, plan, taken)


def _bridge(inventory: Inventory, addresses: list[PciAddress]) -> PciAddress:
    """The one bridge above all of ``addresses``."""
    bridges = {inventory.functions[a].parents[-1] if inventory.functions[a].parents else None for a in addresses}
    if None in bridges:
        raise Refused("refused: a device on a root bus has no bridge whose bus could be reset")
    if len(bridges) > 1:
        raise InputError("--bus: the devices sit below different bridges "
                         f"({', '.join(sorted(map(str, bridges)))}); reset one bus at a time")
    return bridges.pop()


def check_held(ctx: Context, journal: Journal, affected: list[PciAddress], bridge: PciAddress | None) -> None:
    """Refused unless gpuvfio holds every device (its journal) and each is on vfio-pci or none."""
    ours = set(journal.devices) | set(journal.data["broken"])
    foreign = [str(a) for a in affected if str(a) not in ours]
    if foreign:
        where = f"on the bus below {bridge}, " if bridge else ""
        raise Refused(f"refused: {where}gpuvfio resets only devices it holds; not held: {', '.join(foreign)} "
                      "(see gpuvfio status)")
    on_host = [f"{a} ({driver})" for a in affected
               if (driver := current_driver(ctx.host, a)) not in (None, VFIO_DRIVER)]
    if on_host:
        raise Refused(f"refused: on a host driver: {', '.join(on_host)}")


def check_unused(ctx: Context, affected: list[PciAddress], uri: str | None) -> None:
    """Refused when a libvirt domain uses one, or when libvirt cannot say (fail closed)."""
    view = libvirt_view(ctx, affected, uri=uri)
    if view.error:  # a check that could not run is not a pass
        raise Refused(f"refused: cannot tell whether a domain uses them: {view.error}")
    used = {str(a): names for a, names in (view.users or {}).items() if names}
    if used:
        raise Refused("refused: in use by " + "; ".join(f"{a}: {', '.join(n)}" for a, n in sorted(used.items())))


def kernel_file(ctx: Context, address: PciAddress, name: str, missing: str) -> str:
    """The path of a device's sysfs attribute ``name`` beneath the root; refused with ``missing``
    when the kernel does not offer it."""
    device = ctx.host.resolve_in_sys(ctx.host.sys_path("bus", "pci", "devices", str(address)))
    path = os.path.join(device, name)
    if not ctx.host.exists(path):
        raise Refused(f"refused: {address}: {missing}")
    return path


@dataclass
class ResetResult:
    method: ResetMethod
    reset: list[str]  # the files written, as the host names them
    devices: dict[str, str | None]  # address -> what is still wrong with it (None: it answers)
    cleared: list[str]  # the devices whose broken mark went
    steps: list[Step] = field(default_factory=list)  # the plan's steps, as carried out
    root: str | None = None  # step paths are shown as the host beneath this root names them

    def to_json(self) -> dict:
        return {"method": self.method.value, "reset": list(self.reset), "devices": dict(self.devices),
                "cleared": list(self.cleared), "steps": [s.to_json(self.root) for s in self.steps]}


def _settle(ctx: Context, journal: Journal, plan: ResetPlan, taken: list[Step]) -> ResetResult:
    devices = {str(a): return_problem(ctx.host, a) for a in plan.devices}
    cleared = [a for a, problem in devices.items() if problem is None and a in journal.data["broken"]]
    for address in cleared:
        del journal.data["broken"][address]
    if cleared:
        journal.save()
    result = ResetResult(plan.method, [os.path.relpath(s.path, ctx.host.root) for s in taken if s.kind is StepKind.RESET], devices,
                         cleared, taken, ctx.host.root)
    still = {a: p for a, p in devices.items() if p}
    if still:
        raise GpuvfioError("still broken: " + "; ".join(f"{a}: {p}" for a, p in sorted(still.items()))
                           + " (reseat the card or reboot)", result.to_json())
    return result
