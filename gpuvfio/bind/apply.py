"""Carrying out binding plans: apply with rollback, restore, unbind. All host changes here.

Order, as libvirt's virhostdev does it for a set of devices: prepare everything
first (overrides), detach all from their host drivers, then attach all to vfio-pci,
verifying each step by reading the ``driver`` link back. Any failure rolls back every
device of the operation to its recorded original through the same reconcile logic
``gpuvfio restore`` uses, so a rollback and a restore after a crash are one code path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from gpuvfio.address import PciAddress
from gpuvfio.commands import Actions
from gpuvfio.bind.plan import VFIO_DRIVER, BindPlan, BindStatus
from gpuvfio.planning import Step, StepKind
from gpuvfio.errors import GpuvfioError
from gpuvfio.host.health import return_problem
from gpuvfio.host.root import HostRoot
from gpuvfio.bind.journal import Journal
from gpuvfio.bind.sysfs_write import SysfsWriter, SysfsWriteTimeout



class BindError(GpuvfioError):
    """A step failed; the message says which, where, what the kernel said, and the rollback."""


class DeviceDead(GpuvfioError):
    """The function does not answer its config space: not given to a host driver, marked broken."""


def current_driver(host: HostRoot, address: PciAddress | str) -> str | None:
    # The driver link is relative to the device's real directory (under sys/devices, as deep
    # as its bridges), not to the sys/bus/pci/devices entry: resolve that first.
    device = host.resolve_in_sys(host.sys_path("bus", "pci", "devices", str(address)))
    return host.link_name(os.path.join(device, "driver"))


def current_override(host: HostRoot, address: PciAddress | str) -> str | None:
    value = host.read(host.sys_path("bus", "pci", "devices", str(address), "driver_override"))
    return None if value in (None, "", "(null)") else value


@dataclass
class ApplyResult:
    status: BindStatus  # applied | nothing_to_do
    bound: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Reconciled:
    """One journaled device that reconcile handled: back on its recorded driver, or why not."""

    address: str
    driver: str | None  # the recorded driver it went back to (None: no driver)
    failure: str | None = None  # why it did not (it stays in the journal)

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def outcome(self) -> str:
        """The driver it is back on, or the reason it is not, in words."""
        return self.failure if self.failure is not None else (self.driver or "no driver")


def apply_bind(host: HostRoot, plan: BindPlan, journal: Journal, writer: SysfsWriter, actions: Actions,
               progress: Callable[[str], None] = lambda line: None,
               after_step: Callable[[int], None] = lambda number: None) -> ApplyResult:
    """Carry out ``plan``, journaled step by step; a failed step rolls back what went before.
    ``after_step(N)`` runs once step N is done and journaled (the Context's: a test's way to
    stop a bind half-way)."""
    if plan.nothing_to_do:
        return ApplyResult(BindStatus.NOTHING_TO_DO, [str(d) for d in plan.devices])
    for step in plan.steps:  # every target as the writer will open it, before the first change
        if step.path is not None:
            writer.check(step.path)
    for address in plan.moving:
        # A device already in the journal keeps its *first* original: a second bind after
        # a half-finished one must not record vfio-pci as "the host driver".
        key = str(address)
        if key not in journal.devices:
            driver, override = plan.originals[address]
            journal.devices[key] = {"original_driver": driver, "original_override": override,
                                    "group": plan.groups.get(address)}
    for unit in plan.services:
        if unit not in journal.data["services_stopped"]:
            journal.data["services_stopped"].append(unit)
    journal.data["operation"] = {"kind": "bind", "pid": os.getpid(), "started": journal.clock.time(),
                                 "devices": [str(a) for a in plan.moving],
                                 "steps": [dict(s.to_json(), state="pending") for s in plan.steps]}
    journal.save()
    for index, step in enumerate(plan.steps):
        journal.set_step(index, "running")
        try:
            _execute(host, step, writer, actions)
        except GpuvfioError as exc:
            hung = isinstance(exc, SysfsWriteTimeout)
            journal.set_step(index, "uncertain" if hung else "failed", str(exc))
            # A write that did not return is still running in the kernel and holds the device's
            # lock (an unbind waits in the driver's remove()): any further write for that device
            # would block the same way. Leave it to a later gpuvfio restore; roll back the others.
            stuck = [step.address] if hung and step.address else []
            rollback = _rollback(host, journal, writer, actions,
                                 [str(a) for a in plan.moving if str(a) not in stuck], stuck, progress)
            raise BindError(f"step {index + 1} ({step.describe()}) failed: {exc}; {rollback}") from None
        journal.set_step(index, "done")
        progress(f"[{index + 1}/{len(plan.steps)}] {step.describe()}: done")
        after_step(index + 1)
    journal.data["operation"]["finished"] = journal.clock.time()
    journal.save()
    return ApplyResult(BindStatus.APPLIED, [str(d) for d in plan.devices])


def _execute(host: HostRoot, step: Step, writer: SysfsWriter, actions: Actions) -> None:
    if step.kind is StepKind.MODPROBE:
        actions.modprobe(step.name)
        if not host.is_dir(host.sys_path("bus", "pci", "drivers", step.name)):
            raise GpuvfioError(f"module {step.name} loaded but sys/bus/pci/drivers/{step.name} did not appear")
        return
    if step.kind is StepKind.STOP_SERVICE:
        actions.stop_service(step.name)
        return
    writer.write(step.path, step.value + "\n" if step.kind is StepKind.OVERRIDE else step.value)
    # Against a recorded tree nothing reacts to the writes; say so when it shows.
    hint = "" if host.root == "/" else f" (is {host.root} a live sysfs?)"
    if step.kind is StepKind.OVERRIDE:
        got = current_override(host, step.address)
        if got != step.value:
            raise GpuvfioError(f"{step.address}: driver_override reads back {got!r}, not {step.value!r}")
    elif step.kind is StepKind.UNBIND:
        got = current_driver(host, step.address)
        if got is not None:
            raise GpuvfioError(f"{step.address}: still bound to {got} after unbind{hint}")
    elif step.kind is StepKind.PROBE:
        got = current_driver(host, step.address)
        if got != step.expect:
            raise GpuvfioError(f"{step.address}: bound to {got or 'no driver'} after drivers_probe, "
                               f"expected {step.expect}{hint}")


def _rollback(host, journal, writer, actions, addresses, stuck, progress) -> str:
    results = sorted(reconcile(host, journal, writer, actions, addresses, progress=progress),
                     key=lambda r: r.address)
    if all(r.ok for r in results) and not journal.data["services_stopped"] and not stuck:
        return "rolled back: " + ", ".join(f"{r.address} on {r.outcome}" for r in results)
    done = [f"{r.address} on {r.outcome}" for r in results if r.ok]
    failed = [f"{r.address}: {r.outcome}" for r in results if not r.ok]
    left = [f"{a} left as it is (its write is still stuck in the kernel, which holds the device)"
            for a in stuck] + failed + [f"service {s} not restarted" for s in journal.data["services_stopped"]]
    return ((f"rolled back: {', '.join(done)}; " if done else "") + "rollback incomplete ("
            + "; ".join(left) + "); the journal keeps them for gpuvfio restore")


def reconcile(host: HostRoot, journal: Journal, writer: SysfsWriter, actions: Actions,
              addresses: list[str] | None = None, progress=lambda line: None) -> list[Reconciled]:
    """Return journaled devices to their recorded originals, from whatever state sysfs shows.

    Safe to run at any point after a crash: each action is decided from the current
    driver link and override, not from the step log. Restored devices leave the
    journal; services stopped by gpuvfio are restarted once no device is left.
    """
    targets = sorted(journal.devices) if addresses is None else [a for a in addresses if a in journal.devices]
    results: list[Reconciled] = []
    for address in targets:
        record = journal.devices[address]
        try:
            _restore_one(host, address, record, writer)
        except GpuvfioError as exc:
            results.append(Reconciled(address, record.get("original_driver"), str(exc)))
            progress(f"{address}: restore failed: {exc}")
            if isinstance(exc, DeviceDead):
                journal.data["broken"][address] = {"reason": str(exc), "since": journal.clock.time()}
                journal.save()
            continue
        results.append(Reconciled(address, record["original_driver"]))
        del journal.devices[address]
        journal.save()
        progress(f"{address}: back on {record['original_driver'] or 'no driver'}")
    if not journal.devices:
        for unit in list(journal.data["services_stopped"]):
            try:
                actions.start_service(unit)
            except GpuvfioError as exc:
                progress(f"service {unit}: restart failed: {exc}")
                continue
            journal.data["services_stopped"].remove(unit)
            journal.save()
            progress(f"service {unit}: restarted")
        journal.data["operation"] = None
        journal.save()
    return results


def _restore_one(host: HostRoot, address: str, record: dict, writer: SysfsWriter) -> None:
    original_driver = record.get("original_driver")
    original_override = record.get("original_override")
    device_dir = host.sys_path("bus", "pci", "devices", address)
    if not host.exists(device_dir):
        raise GpuvfioError(f"{address} is gone from sysfs (hot-removed?)")
    problem = return_problem(host, address) if current_driver(host, address) != original_driver else None
    if problem:
        # Back from a guest dead (config space 0xffff) or with its BARs gone: not free. A host
        # driver probing it would fail or hang; it stays where it is, marked, until it is reset.
        raise DeviceDead(f"{problem}; not given to {original_driver or 'the host'} "
                         f"(gpuvfio reset {address} once the kernel can reach it)")
    if current_override(host, address) != original_override:
        writer.write(os.path.join(device_dir, "driver_override"), (original_override or "") + "\n")
    driver = current_driver(host, address)
    if driver is not None and driver != original_driver:
        writer.write(host.sys_path("bus", "pci", "drivers", driver, "unbind"), address)
    if original_driver is not None and current_driver(host, address) != original_driver:
        writer.write(host.sys_path("bus", "pci", "drivers_probe"), address)
        if current_driver(host, address) is None and host.is_dir(
                host.sys_path("bus", "pci", "drivers", original_driver)):
            writer.write(host.sys_path("bus", "pci", "drivers", original_driver, "bind"), address)
    got = current_driver(host, address)
    if got != original_driver:
        raise GpuvfioError(f"on {got or 'no driver'}, expected {original_driver or 'no driver'}")
