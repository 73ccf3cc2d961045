"""Binding services: bind, restore (all or named devices; restore_groups: their IOMMU groups), status,
persist.

Each step is written here once; gpuvfio bind, attach and detach, the testbed and the Ansible
device and domain modules all call these. Two policies live here and nowhere else:

* Asking libvirt whether a domain uses the devices (libvirt_view): on ``--connect URI`` or
  the connection the command already has open (attach: the one it defines the domain on);
  else, on this machine, libvirt's default URI. ``--connect none`` (or a root that is not
  this machine) does not ask, and says so. A libvirt that should answer and does not
  refuses the bind: a check that could not run is not a pass.
* Giving devices back (restore_groups): bind moves whole IOMMU groups, so what goes back is every
  device gpuvfio holds in the groups of the devices named -- and only what gpuvfio holds
  (a device that was on vfio-pci before gpuvfio stays there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.bind import persist as store
from gpuvfio.bind.apply import apply_bind, current_driver, current_override, reconcile
from gpuvfio.bind.fabric_manager import PartitionStep, deactivate_journaled, plan_checks, plan_detach
from gpuvfio.bind.journal import Journal, RunLock
from gpuvfio.bind.persist import Mechanism, Override, PersistedOverrides, PersistReport, PersistStatus
from gpuvfio.bind.plan import (WARN, BindPlan, BindPolicy, BindReport, BindStatus, LibvirtView,
                               plan_bind)
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.host import assignable
from gpuvfio.host.fabric import SHARED_NVSWITCH
from gpuvfio.host.inventory import Inventory, read_inventory
from gpuvfio.host.kernel import read_kernel
from gpuvfio.host.pciids import PciIds
from gpuvfio.host.pcie_health import read_records
from gpuvfio.ops import fabric
from gpuvfio.ops.context import Context
from gpuvfio.ops.plans import Check, CheckStatus, Plan, Step, StepKind
from gpuvfio.ops.uris import NO_LIBVIRT
from gpuvfio.vgpu.instances import remove_instance
from gpuvfio.vgpu.scheduler import put_back
from gpuvfio.vgpu.types import existing_mdev
from gpuvfio.virt.defined import listed
from gpuvfio.virt.usage import domains_using

__all__ = ["BindPolicy", "libvirt_view", "libvirt_not_asked", "plan_report", "bind",
           "BindOperation", "BindReport", "BindStatus", "CheckStatus", "Check", "plan_operation", "apply_operation",
           "RestoreResult", "Status", "HeldDevice", "restore", "held", "restore_groups", "status",
           "plan_restore", "plan_restore_groups", "run_restore", "RestorePlan", "persist", "plan_persist",
           "run_persist", "PersistReport", "PersistStatus", "Mechanism", "Override",
           "PersistedOverrides", "persisted_overrides", "current_drivers", "addresses_in_groups"]


def libvirt_view(ctx: Context, addresses: list[PciAddress], *, uri: str | None = None,
                 exclude: str | None = None) -> LibvirtView:
    """Which domains use ``addresses``, by the one policy above."""
    not_asked = libvirt_not_asked(ctx, uri)
    if not_asked:
        return LibvirtView(not_asked=not_asked)

    def mdev_parent(uuid: str) -> PciAddress | None:
        found = existing_mdev(ctx.host, uuid)
        return found[0] if found else None

    try:
        domains = listed(ctx.libvirt(uri), ctx.listing)
        return LibvirtView(users=domains_using(domains, addresses, exclude=exclude, mdev_parent=mdev_parent))
    except GpuvfioError as exc:
        return LibvirtView(error=str(exc))


def libvirt_not_asked(ctx: Context, uri: str | None) -> str | None:
    """Why libvirt is not asked (--connect none, a root that is not this machine), by the one
    policy above; None: it is."""
    if uri == NO_LIBVIRT:
        return "libvirt not asked (--connect none)"
    if uri is None and not ctx.live and not ctx.connections:
        return "libvirt not asked: the host root is not this machine (--connect URI asks one)"
    return None


def plan_report(ctx: Context, addresses: list[PciAddress], policy: BindPolicy, *, uri: str | None = None,
                exclude: str | None = None) -> tuple[BindPlan, BindReport]:
    """The plan and its report (status nothing_to_do when every device is on vfio-pci already,
    else not judged yet)."""
    inventory = read_inventory(ctx.host, names=PciIds.load(ctx.host))
    for address in addresses:
        assignable.endpoint(inventory, address)
    # An HGX baseboard's rules hold for a bind as for a guest: in full-passthrough mode all its
    # GPUs go with all its NVSwitches (bound too), a subset is a Fabric Manager partition.
    decision = fabric.decide(ctx, inventory, addresses)
    if decision.kind == "full_passthrough":
        addresses = sorted(set(addresses) | set(decision.add_devices))
    view = libvirt_view(ctx, addresses_in_groups(inventory, addresses), uri=uri, exclude=exclude)
    records = read_records(ctx.host, ctx.state, ctx.journal().data["broken"])
    bind_plan = plan_bind(ctx.host, inventory, read_kernel(ctx.host), addresses, policy, view, records)
    if decision.kind != "none":
        bind_plan.checks += plan_checks(decision)
    if ctx.actions is None and not bind_plan.nothing_to_do:
        # A plan for a recorded host (a testbed on a remote hypervisor) is right for that host;
        # carried out here against the recording, these steps would stop the run: say so.
        needs = [s.describe() for s in bind_plan.steps if s.kind in ("modprobe", "stop_service")]
        if needs:
            bind_plan.checks.append(Check("live_host", WARN, f"{'; '.join(needs)}: modprobe/systemctl act on "
                                              "the live host only; a run against this root stops there"))
    # Step paths are shown as the host names them (the root is where this process sees it).
    report = BindReport.of(bind_plan, bind_plan.refusals(policy.force), root=ctx.host.root,
                           fabric=decision if decision.kind != "none" else None)
    return bind_plan, report


def addresses_in_groups(inventory: Inventory, addresses: list[PciAddress]) -> list[PciAddress]:
    """``addresses`` and every other endpoint of their IOMMU groups (what a bind moves)."""
    found = set(addresses)
    for address in addresses:
        group = inventory.group_of(address)
        if group is not None:
            found |= {m for m in group.devices if not inventory.functions[m].is_bridge}
    return sorted(found)


def operation_lock(ctx: Context) -> RunLock:
    """The run lock for an operation of many steps (attach, a testbed variant): held from its
    first change to its verdict, re-entrant for the binds and vGPU steps inside it."""
    return ctx.lock()


@dataclass
class BindOperation:
    """A bind decided: the plan, its report (``outcome``, whose status the run sets), and the
    refusals that stop this bind (devices already on vfio-pci are refused only when broken, or
    used by a domain with ``require_unused``)."""

    plan: BindPlan
    outcome: BindReport
    refusals: list[str]

    @property
    def nothing_to_do(self) -> bool:
        return self.plan.nothing_to_do

    @property
    def report(self) -> dict:
        """The report as JSON, as plans shown whole carry it (attach's plan, testbed plan)."""
        return self.outcome.to_json()

    def refusal(self) -> Refused:
        return Refused("refused: " + "; ".join(self.refusals), self.outcome.to_json())

    def shown(self) -> BindReport:
        """The plan as a dry run and Ansible check mode show it: refused as the run would be,
        else the report with status ``dry_run`` (or ``nothing_to_do``)."""
        if self.refusals:
            raise self.refusal()
        if not self.nothing_to_do:
            self.outcome.status = BindStatus.DRY_RUN
        return self.outcome


@dataclass
class RestoreResult:
    """What a restore (or restore_groups) gave back: address -> the driver it is on now, the ones that
    failed and why, the ones kept on vfio-pci (a Fabric Manager partition still active), the
    services left stopped, and what happened to gpuvfio's vGPU instances and policies."""

    restored: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    services_not_restarted: list[str] = field(default_factory=list)
    vgpu: list[str] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)  # the plan's steps, as carried out

    @property
    def nothing(self) -> bool:
        return not self.restored and not self.vgpu

    def to_json(self) -> dict:
        return {"restored": dict(self.restored), "failed": dict(self.failed), "kept": dict(self.kept),
                "services_not_restarted": list(self.services_not_restarted), "vgpu": list(self.vgpu),
                "steps": [s.to_json() for s in self.steps]}


def plan_operation(ctx: Context, addresses: list[PciAddress], policy: BindPolicy, *, uri: str | None = None,
                   exclude: str | None = None, require_unused: bool = False) -> BindOperation:
    """The bind of ``addresses`` as the run will carry it out (bind, attach's bind step, a dry
    run, Ansible check mode and testbed plan all take this one decision)."""
    if not addresses:
        raise InputError("no PCI address given")
    ctx.journal()  # a damaged journal is reported by the plan too (reading writes nothing)
    bind_plan, report = plan_report(ctx, addresses, policy, uri=uri, exclude=exclude)
    if bind_plan.nothing_to_do:
        # Devices already on vfio-pci: still refused when broken (always), or used by a domain
        # (when one is about to get them).
        refusing = [c.reason for c in report.refused
                    if c.check_id == "health" or (require_unused and c.check_id == "libvirt")]
    else:
        refusing = [c.reason for c in report.refused]
    if refusing:
        report.status = BindStatus.REFUSED
    return BindOperation(bind_plan, report, refusing)


def apply_operation(ctx: Context, operation: BindOperation, journal: Journal) -> BindReport:
    """Carry out a planned bind; the caller holds the run lock and made the plan under it."""
    if operation.refusals:
        raise operation.refusal()
    report = operation.outcome
    if operation.nothing_to_do:
        return report
    report.status = apply_bind(ctx.host, operation.plan, journal, ctx.writer(), ctx.host_actions(),
                               ctx.progress, ctx.after_step).status
    return report


def bind(ctx: Context, addresses: list[PciAddress], policy: BindPolicy, *, uri: str | None = None,
         exclude: str | None = None, require_unused: bool = False) -> BindReport:
    """Move the IOMMU groups of ``addresses`` to vfio-pci: the plan (plan_operation), made under
    the run lock, carried out. Devices already on vfio-pci are "nothing to do" (gpuvfio bind: in
    use by a domain is the expected state then); with ``require_unused`` (attach: a domain is
    about to get them) a domain using them still refuses."""
    if not addresses:
        raise InputError("no PCI address given")
    with ctx.lock():
        journal = ctx.journal()
        operation = plan_operation(ctx, addresses, policy, uri=uri, exclude=exclude, require_unused=require_unused)
        return apply_operation(ctx, operation, journal)


@dataclass
class RestorePlan(Plan):
    """What a restore (or restore_groups) gives back, decided from the journal: ``everything`` (a
    full restore: also the vGPU instances and scheduler policies gpuvfio made), else the
    ``devices`` named with their group members and companions."""

    everything: bool = False
    devices: list[str] = field(default_factory=list)
    partitions: list[PartitionStep] = field(default_factory=list)

    def extra_json(self) -> dict:
        return {"devices": list(self.devices), "everything": self.everything}


def plan_restore(ctx: Context, addresses: list[PciAddress], journal: Journal | None = None) -> RestorePlan:
    """What ``restore`` will give back, from the journal (``journal``: the one the run loaded
    under its lock; else it is read now): the partitions to deactivate, on a full restore the
    vGPU instances and scheduler policies gpuvfio made, each device's recorded driver and the
    services to restart; reads only."""
    journal = ctx.journal() if journal is None else journal
    wanted = [str(a) for a in addresses]
    unknown = [a for a in wanted if a not in journal.devices]
    if unknown:
        raise InputError(f"not held by gpuvfio: {', '.join(unknown)} (see gpuvfio status)")
    if wanted:
        wanted = _with_companions(ctx, read_inventory(ctx.host), journal, wanted)
    return _restore_plan(journal, "restore", wanted, everything=not wanted)


def plan_restore_groups(ctx: Context, addresses: list[PciAddress], journal: Journal | None = None) -> RestorePlan:
    """What ``restore_groups`` gives back: what gpuvfio holds in the IOMMU groups of ``addresses``
    (detach, attach's rollback, a testbed variant's teardown, the Ansible device module's
    state=host); nothing held is nothing to do."""
    journal = ctx.journal() if journal is None else journal
    held = held_in_groups(ctx, journal, addresses)
    # The partitions of the devices named go too, held or not: an attach of GPUs that were on
    # vfio-pci already bound nothing, yet activated their partition.
    return _restore_plan(journal, "restore groups", held, everything=False,
                         reach=sorted({*map(str, addresses), *held}))


def _restore_plan(journal: Journal, operation: str, wanted: list[str], *, everything: bool,
                  reach: list[str] | None = None) -> RestorePlan:
    """``reach``: the devices whose Fabric Manager partitions go (``wanted`` by default)."""
    partitions = plan_detach(journal, None if everything else [PciAddress.parse(a) for a in (reach or wanted)])
    plan = RestorePlan(operation, ", ".join(wanted) if wanted else
                       ("everything gpuvfio holds" if everything else "nothing gpuvfio holds"), everything=everything)
    if not wanted and not everything and not partitions:
        return plan
    plan.partitions = partitions
    for step in plan.partitions:
        plan.step(StepKind.DEACTIVATE_PARTITION, f"Fabric Manager partition {step.partition_id} (devices "
                                                 f"{', '.join(step.devices)})", name=str(step.partition_id))
    if everything:
        for instance in list(journal.data.get("mdevs", {})) + list(journal.data.get("vgpus", {})):
            plan.step(StepKind.REMOVE_VGPU, instance, name=instance)
        for address in journal.data.get("schedulers", {}):
            plan.step(StepKind.PUT_BACK_SCHEDULER, address, address=address)
    plan.devices = sorted(journal.devices) if everything else wanted
    for address in plan.devices:
        record = journal.devices[address]
        override = record.get("original_override")
        plan.step(StepKind.RESTORE, f"{address}: back to {record.get('original_driver') or 'no driver'}"
                  + (f" (driver_override {override})" if override else ""), address=address)
    if not set(journal.devices) - set(plan.devices):  # services are restarted with the last device
        for service in journal.data["services_stopped"]:
            plan.step(StepKind.START_SERVICE, service, name=service)
        if _unfinished(journal) and (everything or plan.devices):
            # A bind that died half-way is marked in the journal; with nothing left the mark goes.
            plan.step(StepKind.FORGET_OPERATION, "clear the journal's mark of an unfinished operation")
    return plan


def _unfinished(journal: Journal) -> bool:
    """The journal marks an operation that never finished (a bind killed half-way)."""
    operation = journal.data.get("operation")
    return bool(operation) and not operation.get("finished")


def restore(ctx: Context, addresses: list[PciAddress]) -> "RestoreResult":
    """Return devices gpuvfio holds to their recorded drivers (all of them, and the vGPU
    instances and scheduler policies it changed, when no address is given): the plan, made
    under the run lock, carried out."""
    with ctx.lock():
        journal = ctx.journal()
        return run_restore(ctx, plan_restore(ctx, addresses, journal), journal)


def restore_groups(ctx: Context, addresses: list[PciAddress]) -> "RestoreResult":
    """Give back what gpuvfio holds in the IOMMU groups of ``addresses``: plan_restore_groups, made
    under the run lock, carried out."""
    with ctx.lock():
        journal = ctx.journal()
        return run_restore(ctx, plan_restore_groups(ctx, addresses, journal), journal)


def run_restore(ctx: Context, plan: RestorePlan, journal: Journal) -> "RestoreResult":
    """Carry out a restore plan made under the run lock the caller holds, against ``journal``
    (the one the plan was made from); each step taken is recorded in the result."""
    result = RestoreResult()
    if plan.nothing_to_do:
        return result
    marked = _unfinished(journal)

    def note(line: str) -> None:
        result.vgpu.append(line)
        ctx.progress(line)

    problems = _deactivate_planned(ctx, plan, journal, result, note)
    if plan.everything and not result.kept:  # the vGPU instances gpuvfio created, then the schedulers
        problems += _undo_vgpu(ctx, plan, journal, result, note)
    elif plan.everything and any(s.kind in (StepKind.REMOVE_VGPU, StepKind.PUT_BACK_SCHEDULER) for s in plan.steps):
        problems.append("vGPU instances and scheduler policies left for the next restore (a partition is still "
                        "active)")
    targets = [a for a in plan.devices if a not in result.kept]
    services = list(journal.data["services_stopped"])
    for done in reconcile(ctx.host, journal, ctx.writer(), ctx.host_actions(), targets, ctx.progress):
        (result.restored if done.ok else result.failed)[done.address] = done.outcome
        result.steps.append(Step(StepKind.RESTORE, address=done.address, detail=done.outcome))
    result.steps += [Step(StepKind.START_SERVICE, name=s) for s in services if s not in journal.data["services_stopped"]]
    if marked and journal.data.get("operation") is None:  # reconcile clears it with the last device
        result.steps += [s for s in plan.steps if s.kind is StepKind.FORGET_OPERATION]
    result.services_not_restarted = list(journal.data["services_stopped"])
    # Services stay stopped while gpuvfio still holds other devices (they are restarted with the
    # last one): only a restart that should have happened and did not is a failure.
    unrestarted = result.services_not_restarted if not journal.devices else []
    if result.failed or unrestarted or problems:
        problems += [f"{a}: {m}" for a, m in result.failed.items()]
        problems += [f"service {s} not restarted" for s in unrestarted]
        raise GpuvfioError("restore incomplete: " + "; ".join(problems), result.to_json())
    return result


def _deactivate_planned(ctx: Context, plan: RestorePlan, journal: Journal, result: "RestoreResult",
                        note: Callable[[str], None]) -> list[str]:
    """The Fabric Manager partitions gpuvfio activated for these devices go first (stop,
    deactivate, restore), whatever state a crash left them in. A partition that stays active
    keeps its GPUs (and their groups) on vfio-pci: the host driver must not take a GPU the
    fabric still routes to a partition (NVIDIA Fabric Manager user guide, "Shared NVSwitch
    Virtualization Model")."""
    problems: list[str] = []
    for step in plan.partitions:
        if ctx.fabric_manager is None:
            failed = {str(step.partition_id): "the Fabric Manager is reached on the live host only"}
        else:
            failed = {key: message for key, (ok, message) in deactivate_journaled(
                journal, ctx.fabric_manager(), [step.partition_id], note).items() if not ok}
        for key, message in failed.items():
            problems.append(f"partition {key} still active ({message}): its devices stay on vfio-pci")
            for address in _with_group_members(journal, step.devices):
                result.kept[address] = f"partition {key} still active"
        if not failed:
            result.steps.append(Step(StepKind.DEACTIVATE_PARTITION, name=str(step.partition_id)))
    return problems


def _undo_vgpu(ctx: Context, plan: RestorePlan, journal: Journal, result: "RestoreResult",
               note: Callable[[str], None]) -> list[str]:
    """The vGPU instances of a full restore, one step each, then the scheduler policies (NVML
    changes them only with no vGPU running)."""
    problems: list[str] = []
    for step in plan.steps:
        if step.kind is StepKind.REMOVE_VGPU:
            try:
                remove_instance(ctx.host, journal, step.name, ctx.writer())
            except GpuvfioError as exc:
                problems.append(f"vGPU {step.name}: {exc}")
                continue
            note(f"vGPU {step.name}: removed")
            result.steps.append(step)
    schedulers = [s for s in plan.steps if s.kind is StepKind.PUT_BACK_SCHEDULER]
    if schedulers:
        failed = put_back(journal, nvml_factory=ctx.nvml, progress=note)
        problems += failed
        if not failed:
            result.steps += schedulers
    return problems


def _with_group_members(journal: Journal, devices) -> list[str]:
    """``devices`` and the journaled devices of their IOMMU groups."""
    groups = {journal.devices[d].get("group") for d in devices if d in journal.devices} - {None}
    return sorted(set(devices) | {a for a, record in journal.devices.items() if record.get("group") in groups})


def held_in_groups(ctx: Context, journal: Journal, addresses: list[PciAddress]) -> list[str]:
    """The devices gpuvfio holds among ``addresses`` and in their IOMMU groups (as journaled),
    with the NVSwitches a full-passthrough bind brought along once their last GPU goes."""
    inventory = read_inventory(ctx.host)
    named = {str(a) for a in addresses}
    groups = {inventory.functions[a].iommu_group for a in addresses if a in inventory.functions} - {None}
    found = sorted(a for a, record in journal.devices.items()
                   if a in named or (record.get("group") is not None and record.get("group") in groups))
    return _with_companions(ctx, inventory, journal, found) if found else found


def _with_companions(ctx: Context, inventory: Inventory, journal: Journal, leaving: list[str]) -> list[str]:
    """``leaving`` and the journaled NVSwitches (with their groups) that go with it: a
    full-passthrough bind took them along with the GPUs (fabric.companions)."""
    held = [PciAddress.parse(a) for a in journal.devices]
    gone = [PciAddress.parse(a) for a in leaving]
    along = [str(s) for s in fabric.companions(ctx, inventory, gone, held) if str(s) in journal.devices]
    return _with_group_members(journal, sorted(set(leaving) | set(along))) if along else leaving


def held(ctx: Context, addresses: list[PciAddress]) -> dict[str, "HeldDevice"]:
    """What restore_groups(addresses) would give back: address -> the device as gpuvfio holds it (its
    driver now, and the original driver restore gives it back to), in address order."""
    inventory = read_inventory(ctx.host)
    inventory.require(*addresses)
    journal = ctx.journal()
    return {a: _held_device(ctx, a, journal.devices[a]) for a in held_in_groups(ctx, journal, addresses)}


def current_drivers(ctx: Context, addresses) -> dict[str, str | None]:
    """The driver each device is bound to now (read from its driver link)."""
    return {str(a): current_driver(ctx.host, a) for a in addresses}


@dataclass(frozen=True)
class HeldDevice:
    """A device gpuvfio holds: where it is now and what restore gives it back to."""

    address: str
    driver: str | None
    driver_override: str | None
    original_driver: str | None
    original_override: str | None
    group: int | None

    def to_json(self) -> dict:
        return {"address": self.address, "driver": self.driver, "driver_override": self.driver_override,
                "original_driver": self.original_driver, "original_override": self.original_override,
                "group": self.group}


@dataclass
class Status:
    """What gpuvfio holds (gpuvfio status, the Ansible facts' status): devices, stopped services,
    vGPU instances and scheduler policies, broken devices, Fabric Manager partitions, and an
    operation a crash left unfinished."""

    state_dir: str
    devices: list[HeldDevice]
    services_stopped: list[str]
    mdevs: dict
    vgpus: dict
    schedulers: dict
    broken: dict
    partitions: dict
    unfinished_operation: dict | None

    def to_json(self) -> dict:
        return {"state_dir": self.state_dir, "devices": [d.to_json() for d in self.devices],
                "services_stopped": list(self.services_stopped), "mdevs": self.mdevs, "vgpus": self.vgpus,
                "schedulers": self.schedulers, "broken": self.broken, "partitions": self.partitions,
                "unfinished_operation": self.unfinished_operation}


def _held_device(ctx: Context, address: str, record: dict) -> HeldDevice:
    """A journaled device as it is now (a device gone from sysfs shows no driver)."""
    try:
        driver, override = current_driver(ctx.host, address), current_override(ctx.host, address)
    except GpuvfioError:
        driver, override = None, None
    return HeldDevice(address, driver, override, record.get("original_driver"), record.get("original_override"),
                      record.get("group"))


def status(ctx: Context) -> Status:
    journal = ctx.journal()
    devices = [_held_device(ctx, address, record) for address, record in sorted(journal.devices.items())]
    operation = journal.unfinished_operation()
    pending = None
    if operation is not None:
        pending = {"kind": operation.get("kind"), "pid": operation.get("pid"),
                   "steps": [{"description": s.get("description"), "state": s.get("state")}
                             for s in operation.get("steps", [])]}
    return Status(ctx.state.path(), devices, list(journal.data["services_stopped"]), journal.data.get("mdevs", {}),
                  journal.data.get("vgpus", {}), journal.data.get("schedulers", {}), journal.data["broken"],
                  {key: {"state": record.get("state"), "modules": record.get("modules", []),
                         "devices": record.get("devices", [])}
                   for key, record in sorted(journal.data["partitions"].items(), key=lambda kv: int(kv[0]))},
                  pending)


def plan_persist(ctx: Context, addresses: list[PciAddress], *, remove: bool = False, force: bool = False,
                 take_host_devices: bool = False) -> PersistReport:
    """What gpuvfio persist / unpersist will write: the whole IOMMU group of each address, by
    address; the same group policy as bind (a group with a foreign device is refused unless
    forced). Its status is ``dry_run`` (files to change) or ``nothing_to_do``; reads only."""
    inventory = read_inventory(ctx.host)
    store.check_addresses(set(inventory.functions), addresses)
    # All of an HGX baseboard's GPUs persist (and unpersist) with its NVSwitches, as bind takes them.
    asked = sorted(set(addresses) | set(fabric.companions(ctx, inventory, addresses, [] if remove else addresses)))
    if remove:
        endpoints = set(addresses_in_groups(inventory, asked))
    else:  # what a bind of them would move (the group policy judges what was asked for)
        endpoints = set(_check_persistable(ctx, asked, BindPolicy(force=force, take_host_devices=take_host_devices)))
    return _persist_changes(ctx, endpoints, remove)


def persist(ctx: Context, addresses: list[PciAddress], *, remove: bool = False, force: bool = False,
            take_host_devices: bool = False, fault=None) -> PersistReport:
    """gpuvfio persist / unpersist: the plan, made and written under the lock (two persists at
    once must not lose each other's devices)."""
    with ctx.lock():
        plan = plan_persist(ctx, addresses, remove=remove, force=force, take_host_devices=take_host_devices)
        return run_persist(ctx, plan, fault=fault)


def run_persist(ctx: Context, plan: PersistReport, *, fault=None) -> PersistReport:
    """Write the plan's file changes, all or none (gpuvfio.bind.persist.commit)."""
    if not plan.changes:
        return plan
    store.commit(ctx.host, plan.changes, fault=fault)
    return dataclasses.replace(plan, status=PersistStatus.APPLIED)


# Checks of a bind plan that are about moving the devices now, not about where they belong
# at boot: a domain or a service using them today does not make persisting them unsafe.
NOT_FOR_PERSIST = {"libvirt", "services", "vfio_modules"}


def persisted_overrides(ctx: Context) -> PersistedOverrides:
    """``gpuvfio persist --list``: the boot-time overrides (driverctl's, gpuvfio's udev rules)."""
    return PersistedOverrides(store.overrides(ctx.host), store.mechanism(ctx.host))


def _check_persistable(ctx: Context, addresses: list[PciAddress], policy: BindPolicy) -> list[PciAddress]:
    """persist refuses what bind refuses (one policy): the IOMMU, group viability, boot VGA,
    SR-IOV, holders, health -- the boot VGA persisted to vfio-pci is a host without a console
    at the next boot, a foreign device in the group a host without its NIC. The devices a bind
    would move are what persists. In shared-NVSwitch mode the fabric's checks are about now (the
    Fabric Manager running, a partition free), not about the boot: they do not refuse it. What
    the host runs on (host_use) refuses it too: persisted, the host boots without its disk."""
    bind_plan, report = plan_report(ctx, addresses, policy, uri=NO_LIBVIRT)
    skip = set(NOT_FOR_PERSIST)
    if report.fabric is not None and report.fabric.mode == SHARED_NVSWITCH:
        skip.add("fabric")
    refused = [c for c in bind_plan.refusals(policy.force) if c.check_id not in skip]
    if refused:
        raise Refused("refused: " + "; ".join(dict.fromkeys(c.reason for c in refused)))
    return bind_plan.devices


def _persist_changes(ctx: Context, endpoints: set[PciAddress], remove: bool) -> PersistReport:
    host = ctx.host
    inventory = read_inventory(host)
    journal = ctx.journal()
    modules = set()
    for address in endpoints:
        driver = inventory.functions[address].driver
        if driver == "vfio-pci":  # bound by gpuvfio already: its recorded host driver
            driver = journal.devices.get(str(address), {}).get("original_driver")
        module = store.driver_module(host, driver) if driver else None
        if module:
            modules.add(module)
    add, drop = ([], sorted(endpoints)) if remove else (sorted(endpoints), [])
    changes = store.plan_persist(host, add, drop, set() if remove else modules)
    ended = PersistStatus.DRY_RUN if changes else PersistStatus.NOTHING_TO_DO
    return PersistReport(sorted(endpoints), store.mechanism(host), changes, ended,
                         store.initramfs_hint(host) if changes and not remove else None)
