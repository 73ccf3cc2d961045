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
from dataclasses import dataclass
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
from gpuvfio.ops.plans import Plan

__all__ = ["reset", "plan_reset", "ResetResult", "ResetMethod"]


def plan_reset(ctx: Context, addresses: list[PciAddress], *, bus: bool = False, forget: bool = False,
               uri: str | None = None) -> Plan:
    """What ``reset`` will write and every refusal it will meet; reads only."""
    return _plan(ctx, addresses, bus=bus, forget=forget, uri=uri)[0]


def _plan(ctx: Context, addresses: list[PciAddress], *, bus: bool, forget: bool,
          uri: str | None) -> tuple[Plan, Journal]:
    """plan_reset, and the journal it was made against (loaded once the request is known to be
    well formed): the run settles with that same journal, one load per operation."""
    if not addresses:
        raise InputError("no PCI address given")
    if bus and forget:
        raise InputError("--bus and --forget exclude each other")
    inventory = read_inventory(ctx.host)
    unknown = [str(a) for a in addresses if a not in inventory.functions]
    if unknown:
        raise InputError(f"no such PCI function on this host: {', '.join(unknown)}")
    plan = Plan("reset", ", ".join(map(str, addresses)))
    journal = ctx.journal()
    try:
        bridge = _bridge(inventory, addresses) if bus else None
    except Refused as exc:
        plan.refuse("bridge", _words(exc))
        return plan, journal
    below = [f.address for f in inventory.functions.values() if bridge in f.parents and not f.is_bridge]
    affected = sorted(set(below) if bridge else set(addresses))
    method, targets = "none", []
    for check_id, check in (("ours", lambda: _check_ours(ctx, journal, affected, bridge)),
                            ("libvirt", lambda: _check_unused(ctx, affected, uri))):
        try:
            check()
        except Refused as exc:
            plan.refuse(check_id, _words(exc))
    try:
        if forget:
            pass
        elif bridge:
            method, targets = "bus", [_kernel_file(ctx, bridge, "reset_subordinate", "its bridge has no "
                                                   "reset_subordinate (older kernel)")]
        else:
            method = "function"
            for address in affected:
                health = inventory.functions[address].health
                if health is not None and health.reset_method == []:
                    raise Refused(f"refused: {address} has no reset method the kernel offers (reset_method is "
                                  "empty); --bus resets the bus below its bridge")
                targets.append(_kernel_file(ctx, address, "reset", "the kernel offers no reset for it"))
    except Refused as exc:
        plan.refuse("reset_method", _words(exc))
    for path in targets:
        plan.step("reset", f"write 1 to {'/' + os.path.relpath(path, ctx.host.root)}")
    broken = [str(a) for a in affected if str(a) in journal.data["broken"]]
    plan.step("settle", "read each device back; clear the broken mark of "
                        + (", ".join(broken) if broken else "none (none is marked)") + " if it answers")
    plan.details = {"method": method, "devices": [str(a) for a in affected],
                    "reset": [os.path.relpath(p, ctx.host.root) for p in targets]}
    return plan, journal


def reset(ctx: Context, addresses: list[PciAddress], *, bus: bool = False, forget: bool = False,
          uri: str | None = None) -> ResetResult:
    """Reset gpuvfio's devices by the kernel's function reset (or, with ``bus``, the secondary
    bus reset of their bridge); a device that answers afterwards loses its broken mark. The plan
    is made under the run lock and its writes carried out.
    """
    with ctx.lock():
        plan, journal = _plan(ctx, addresses, bus=bus, forget=forget, uri=uri)
        plan.raise_if_refused()
        targets = [os.path.join(ctx.host.root, rel) for rel in plan.details["reset"]]
        for path in targets:
            ctx.progress(f"reset: {os.path.relpath(path, ctx.host.root)}")
            ctx.writer().write(path, "1\n")
        affected = [PciAddress.parse(a) for a in plan.details["devices"]]
        return _settle(ctx, journal, affected, plan.details["method"], targets)


def _words(exc: Refused) -> str:
    """A refusal's reason, without the "refused: " its plan puts in front of all of them."""
    text = str(exc)
    return text[len("refused: "):] if text.startswith("refused: ") else text


def _bridge(inventory: Inventory, addresses: list[PciAddress]) -> PciAddress:
    """The one bridge above all of ``addresses``."""
    bridges = {inventory.functions[a].parents[-1] if inventory.functions[a].parents else None for a in addresses}
    if None in bridges:
        raise Refused("refused: a device on a root bus has no bridge whose bus could be reset")
    if len(bridges) > 1:
        raise InputError("--bus: the devices sit below different bridges "
                         f"({', '.join(sorted(map(str, bridges)))}); reset one bus at a time")
    return bridges.pop()


def _check_ours(ctx: Context, journal: Journal, affected: list[PciAddress], bridge: PciAddress | None) -> None:
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


def _check_unused(ctx: Context, affected: list[PciAddress], uri: str | None) -> None:
    view = libvirt_view(ctx, affected, uri=uri)
    if view.error:  # a check that could not run is not a pass
        raise Refused(f"refused: cannot tell whether a domain uses them: {view.error}")
    used = {str(a): names for a, names in (view.users or {}).items() if names}
    if used:
        raise Refused("refused: in use by " + "; ".join(f"{a}: {', '.join(n)}" for a, n in sorted(used.items())))


def _kernel_file(ctx: Context, address: PciAddress, name: str, missing: str) -> str:
    device = ctx.host.resolve_in_sys(ctx.host.sys_path("bus", "pci", "devices", str(address)))
    path = os.path.join(device, name)
    if not os.path.exists(path):
        raise Refused(f"refused: {address}: {missing}")
    return path


class ResetMethod(str, Enum):
    FUNCTION = "function"  # <dev>/reset: the kernel's methods in reset_method, in order
    BUS = "bus"  # <bridge>/reset_subordinate: a secondary bus reset of everything below it
    NONE = "none"  # --forget: the mark cleared once the device answers, no reset


@dataclass
class ResetResult:
    method: ResetMethod
    reset: list[str]  # the files written, as the host names them
    devices: dict[str, str | None]  # address -> what is still wrong with it (None: it answers)
    cleared: list[str]  # the devices whose broken mark went

    def to_json(self) -> dict:
        return {"method": self.method.value, "reset": list(self.reset), "devices": dict(self.devices),
                "cleared": list(self.cleared)}


def _settle(ctx: Context, journal: Journal, affected: list[PciAddress], method: str,
            targets: list[str]) -> ResetResult:
    devices = {str(a): return_problem(ctx.host, a) for a in affected}
    cleared = [a for a, problem in devices.items() if problem is None and a in journal.data["broken"]]
    for address in cleared:
        del journal.data["broken"][address]
    if cleared:
        journal.save()
    result = ResetResult(ResetMethod(method), [os.path.relpath(p, ctx.host.root) for p in targets], devices,
                         cleared)
    still = {a: p for a, p in devices.items() if p}
    if still:
        raise GpuvfioError("still broken: " + "; ".join(f"{a}: {p}" for a, p in sorted(still.items()))
                           + " (reseat the card or reboot)", result.to_json())
    return result
