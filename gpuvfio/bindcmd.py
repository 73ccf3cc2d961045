"""``gpuvfio bind / unbind / restore / status``: locking, journal and reporting around
the planner (bindplan) and the executor (bindapply)."""

from __future__ import annotations

import os

from gpuvfio.address import PciAddress
from gpuvfio.bindapply import Actions, apply_bind, current_driver, current_override, give_back, reconcile
from gpuvfio.bindplan import REFUSE, plan_bind
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.hostroot import HostRoot
from gpuvfio.inventory import read_inventory
from gpuvfio.journal import Journal, RunLock, state_dir
from gpuvfio.kernel import read_kernel
from gpuvfio.sysfs_write import SysfsWriter


class Refused(GpuvfioError):
    """Pre-checks refused the request; nothing was changed. Carries the report."""

    def __init__(self, message: str, report: dict) -> None:
        super().__init__(message)
        self.report = report


def bind(host: HostRoot, addresses: list[PciAddress], *, writer: SysfsWriter, actions: Actions,
         dry_run: bool = False, force: bool = False, stop_services: bool = False,
         allow_unsafe_host: bool = False, domains_using=None, lock_timeout: float = 30.0,
         progress=lambda line: None) -> dict:
    directory = state_dir(host)
    if dry_run:
        if os.path.exists(os.path.join(directory, "journal.json")):
            Journal.load(directory)  # a corrupt journal is reported even on a dry run
        return _plan_report(host, addresses, force, stop_services, allow_unsafe_host, domains_using, "dry_run")[0]
    with RunLock(directory, lock_timeout):
        journal = Journal.load(directory)
        report, plan = _plan_report(host, addresses, force, stop_services, allow_unsafe_host, domains_using, None)
        if plan.nothing_to_do:  # already on vfio-pci: nothing to refuse (e.g. a domain using it)
            return report
        refusals = plan.refusals(force)
        if refusals:
            report["result"] = "refused"
            raise Refused("refused: " + "; ".join(c.message for c in refusals), report)
        result = apply_bind(host, plan, journal, writer, actions, progress)
        report["result"] = result.status
        return report


def _plan_report(host, addresses, force, stop_services, allow_unsafe_host, domains_using, result):
    from gpuvfio.pciids import PciIds

    inventory = read_inventory(host, names=PciIds.load(host.root))
    plan = plan_bind(host, inventory, read_kernel(host), addresses, stop_services=stop_services,
                     allow_unsafe_host=allow_unsafe_host, domains_using=domains_using)
    report = plan.to_json()
    report["moving"] = [str(a) for a in plan.moving]
    report["refused"] = [c.to_json() for c in plan.refusals(force)]
    if plan.nothing_to_do:
        report["result"] = "nothing_to_do"
    elif result:
        report["result"] = result
    return report, plan


def restore(host: HostRoot, addresses: list[PciAddress], *, writer: SysfsWriter, actions: Actions,
            lock_timeout: float = 30.0, progress=lambda line: None) -> dict:
    directory = state_dir(host)
    with RunLock(directory, lock_timeout):
        journal = Journal.load(directory)
        wanted = [str(a) for a in addresses]
        unknown = [a for a in wanted if a not in journal.devices]
        if unknown:
            raise InputError(f"not held by gpuvfio: {', '.join(unknown)} (see gpuvfio status)")
        vgpu_failures, undone = [], []

        def note(line: str) -> None:
            undone.append(line)
            progress(line)

        if not wanted:  # a full restore also removes the vGPU instances gpuvfio created
            from gpuvfio.vgpucmd import remove_all

            vgpu_failures = remove_all(host, journal, writer, note)
            if journal.data.get("schedulers"):  # after the vGPUs: NVML changes it only with none running
                from gpuvfio.vgpusched import put_back

                vgpu_failures += put_back(host, journal, progress=note)
        results = reconcile(host, journal, writer, actions, wanted or None, progress)
        report = {"restored": {a: msg for a, (ok, msg) in results.items() if ok},
                  "failed": {a: msg for a, (ok, msg) in results.items() if not ok},
                  "services_not_restarted": list(journal.data["services_stopped"]), "vgpu": undone}
        if report["failed"] or report["services_not_restarted"] or vgpu_failures:
            problems = vgpu_failures + [f"{a}: {m}" for a, m in report["failed"].items()]
            problems += [f"service {s} not restarted" for s in report["services_not_restarted"]]
            error = GpuvfioError("restore incomplete: " + "; ".join(problems))
            error.report = report
            raise error
        return report


def unbind(host: HostRoot, addresses: list[PciAddress], *, writer: SysfsWriter,
           lock_timeout: float = 30.0) -> dict:
    if not addresses:
        raise InputError("no PCI address given")
    inventory = read_inventory(host)
    for address in addresses:
        if address not in inventory.functions:
            raise InputError(f"no such PCI function on this host: {address}")
    with RunLock(state_dir(host), lock_timeout):
        return {"drivers": give_back(host, sorted(set(addresses)), writer)}


def status(host: HostRoot) -> dict:
    directory = state_dir(host)
    journal = Journal.load(directory)
    devices = []
    for address, record in sorted(journal.devices.items()):
        try:
            driver, override = current_driver(host, address), current_override(host, address)
        except GpuvfioError:
            driver, override = None, None
        devices.append({"address": address, "driver": driver, "driver_override": override,
                        "original_driver": record.get("original_driver"),
                        "original_override": record.get("original_override"),
                        "group": record.get("group")})
    operation = journal.data.get("operation")
    pending = None
    if operation and not operation.get("finished"):
        pending = {"kind": operation.get("kind"), "pid": operation.get("pid"),
                   "steps": [{"description": s.get("description"), "state": s.get("state")}
                             for s in operation.get("steps", [])]}
    return {"state_dir": directory, "devices": devices, "services_stopped": journal.data["services_stopped"],
            "mdevs": journal.data.get("mdevs", {}), "vgpus": journal.data.get("vgpus", {}),
            "schedulers": journal.data.get("schedulers", {}), "unfinished_operation": pending}


def persist(host: HostRoot, addresses: list[PciAddress], *, remove: bool = False, dry_run: bool = False,
            lock_timeout: float = 30.0, commit=None) -> dict:
    """``gpuvfio persist`` / ``unpersist``: the whole IOMMU group of each address, by address."""
    from gpuvfio import persist as store

    inventory = read_inventory(host)
    store.check_addresses(set(inventory.functions), addresses)
    endpoints: set[PciAddress] = set()
    for address in addresses:
        group = inventory.group_of(address)
        members = group.devices if group else [address]
        endpoints |= {m for m in members if not inventory.functions[m].is_bridge}
    journal = Journal.load(state_dir(host))
    host_drivers = set()
    for address in endpoints:
        driver = inventory.functions[address].driver
        if driver == "vfio-pci":  # bound by gpuvfio already: its recorded host driver
            driver = journal.devices.get(str(address), {}).get("original_driver")
        if driver:
            host_drivers.add(driver)
    add, drop = ([], sorted(endpoints)) if remove else (sorted(endpoints), [])
    changes = store.plan_persist(host, add, drop, set() if remove else host_drivers)
    report = {"devices": [str(a) for a in sorted(endpoints)],
              "mechanism": "driverctl" if store.uses_driverctl(host) else "udev",
              "changes": [{"path": c.path, "action": "remove" if c.new is None else
                           ("create" if c.old is None else "update"), "diff": c.diff(host.root)} for c in changes],
              "result": "dry_run" if dry_run else ("nothing_to_do" if not changes else "applied")}
    if changes and not remove:
        report["next"] = store.initramfs_hint(host)
    if dry_run or not changes:
        return report
    with RunLock(state_dir(host), lock_timeout):
        store.commit(changes, **({"rename": commit} if commit else {}))
    return report


__all__ = ["bind", "restore", "unbind", "status", "persist", "Refused", "REFUSE"]
