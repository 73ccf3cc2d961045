"""vGPU services: the types a GPU offers, instances (created and removed, journaled) and the
scheduler policy (through NVML, journaled). gpuvfio vgpu and the testbed's vGPU variants call
these; gpuvfio restore undoes what is left (ops.binding).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gpuvfio.address import PciAddress
from gpuvfio.domain.spec import mdev_uuid
from gpuvfio.domain.request import parse_uuid
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.pciids import PciIds
from gpuvfio.ops import binding
from gpuvfio.ops.context import Context
from gpuvfio.ops.plans import CheckStatus, Plan, StepKind
from gpuvfio.vgpu import instances, scheduler
from gpuvfio.vgpu.instances import Creation, VgpuInstance
from gpuvfio.vgpu.scheduler import SchedulerChange, SchedulerOutcome, SchedulerSnapshot, SchedulerState
from gpuvfio.vgpu.types import MigProfile, OfferedTypes, TypesKind, mig_backed, pick_mdev
from gpuvfio.virt.defined import listed
from gpuvfio.virt.usage import assignments

__all__ = ["types", "instances_list", "create", "remove", "plan_create", "plan_remove", "plan_scheduler", "run_create",
           "run_remove", "run_scheduler", "VgpuCreatePlan", "VgpuRemovePlan", "SchedulerPlan", "scheduler_state",
           "set_scheduler", "undo_scheduler", "create_for_domain",
           "mig_backed", "parse_policy", "POLICIES", "OfferedTypes", "TypesKind", "VgpuInstance", "VgpuListing",
           "MigProfile", "SchedulerState", "SchedulerChange", "SchedulerOutcome", "SchedulerSnapshot"]
POLICIES = scheduler.POLICIES
parse_policy = scheduler.parse_policy


def types(ctx: Context, address: PciAddress) -> OfferedTypes:
    return instances.types(read_inventory(ctx.host), address)


@dataclass(frozen=True)
class VgpuListing:
    """``gpuvfio vgpu list``: the instances, and whether libvirt was asked ("asked", or why not)."""

    instances: list[VgpuInstance]
    libvirt: str

    def to_json(self) -> dict:
        return {"instances": [i.to_json() for i in self.instances], "libvirt": self.libvirt}


def instances_list(ctx: Context, *, uri: str | None = None) -> VgpuListing:
    """``gpuvfio vgpu list``: every vGPU instance with its type, parent, the domains using it
    (libvirt asked by the one policy of ops.binding), persisted or not."""
    inventory = read_inventory(ctx.host)
    found = instances.existing_instances(ctx.host, inventory, ctx.journal())
    used: dict[str, list[str]] = {}
    libvirt_note = binding.libvirt_not_asked(ctx, uri)
    if libvirt_note is None:
        try:
            used = assignments(listed(ctx.libvirt(uri), ctx.listing))
        except GpuvfioError as exc:
            libvirt_note = str(exc)
    return VgpuListing([dataclasses.replace(item, domains=None if libvirt_note else used.get(item.instance, []))
                        for item in found], libvirt_note or "asked")


@dataclass
class VgpuCreatePlan(Plan):
    creation: Creation | None = None  # None: refused
    persist: bool = False

    def extra_json(self) -> dict:
        if self.creation is None:
            return {}
        return {"kind": self.creation.kind, "parent": str(self.creation.parent), "type": self.creation.type_id,
                "instance": self.creation.instance}


def plan_create(ctx: Context, address: PciAddress, wanted: str, *, uuid: str | None = None,
                persist: bool = False) -> VgpuCreatePlan:
    """What ``vgpu create`` will make (gpuvfio.vgpu.instances.decide_create, the run's decision);
    reads only. A type the GPU does not offer, or with no instance left, is refused."""
    plan = VgpuCreatePlan("vgpu create", f"{wanted} on {address}", persist=persist)
    inventory = read_inventory(ctx.host, names=PciIds.load(ctx.host))
    try:
        creation = instances.decide_create(ctx.host, inventory, address, wanted, uuid)
    except Refused as exc:
        plan.refuse("vgpu_type", str(exc))
        return plan
    plan.creation = creation
    plan.check("vgpu_type", CheckStatus.OK, f"{address} offers {creation.type_id}")
    if creation.exists:
        plan.notes.append(f"{creation.instance} exists with type {creation.type_id}")
    else:
        plan.step(StepKind.CREATE_VGPU, creation.describe(), address=str(address), name=creation.instance)
    if persist and creation.kind == "mdev":  # an instance there already is persisted too
        plan.step(StepKind.PERSIST_VGPU, "define it in mdevctl's store (/etc/mdevctl.d), started at boot",
                  address=str(address))
    return plan


def create(ctx: Context, address: PciAddress, wanted: str, *, uuid: str | None = None,
           persist: bool = False) -> instances.InstanceResult:
    """Make a vGPU instance: its plan, made under the run lock, carried out."""
    with ctx.lock():
        return run_create(ctx, plan_create(ctx, address, wanted, uuid=uuid, persist=persist))


def run_create(ctx: Context, plan: VgpuCreatePlan) -> instances.InstanceResult:
    """Make the instance the plan decided (under the run lock the caller holds), journaled."""
    plan.raise_if_refused()
    creation = plan.creation
    result = instances.make(ctx.host, read_inventory(ctx.host), creation, persist=plan.persist,
                            writer=ctx.writer(), journal=ctx.journal())
    for step in plan.steps:  # an mdev made with a random UUID is named by the one it got
        if step.kind is StepKind.CREATE_VGPU:
            result.steps.append(dataclasses.replace(step, name=result.instance) if step.name is None else step)
        elif result.persist_asked:
            result.steps.append(step)
    return result


def create_for_domain(ctx: Context, domain_name: str, address: PciAddress,
                      profile: str) -> instances.InstanceResult:
    """The vGPU instance a domain will use: a legacy mdev gets the UUID the domain XML names
    (the same derivation as gpuvfio xml), an SR-IOV vGPU a free VF set to the type."""
    inventory = read_inventory(ctx.host, names=PciIds.load(ctx.host))
    fn = inventory.require(address)[0]
    uuid = mdev_uuid(domain_name, address, pick_mdev(inventory, address, profile, check_available=False)) \
        if fn.mdev_types else None
    return create(ctx, address, profile, uuid=uuid)


@dataclass
class VgpuRemovePlan(Plan):
    instance: str = ""  # the mdev UUID or the VF address, as the journal names it


def plan_remove(ctx: Context, instance: str) -> VgpuRemovePlan:
    """What ``vgpu remove`` will undo, from the journal (an instance gpuvfio did not create is
    bad input, as the run says); reads only."""
    journal = ctx.journal()
    address = PciAddress.try_parse(instance)
    if address is not None:
        record = journal.data.get("vgpus", {}).get(str(address))
        if record is None:
            raise InputError(f"{address} has no vGPU type set by gpuvfio (see gpuvfio status)")
        plan = VgpuRemovePlan("vgpu remove", str(address), instance=str(address))
        plan.step(StepKind.REMOVE_VGPU, f"{address}: nvidia/current_vgpu_type <- {record.get('previous', 0)}",
                  name=str(address))
        return plan
    try:
        uuid = parse_uuid(instance)
    except InputError:
        raise InputError(f"not an mdev UUID or a VF address: {instance!r}") from None
    record = journal.data.get("mdevs", {}).get(uuid)
    if record is None:
        raise InputError(f"mdev {uuid} was not created by gpuvfio (see gpuvfio status)")
    plan = VgpuRemovePlan("vgpu remove", uuid, instance=uuid)
    plan.step(StepKind.REMOVE_VGPU, f"write 1 to /sys/bus/mdev/devices/{uuid}/remove", name=uuid)
    plan.step(StepKind.FORGET_VGPU, f"its mdevctl definition under {record.get('parent', '-')}, if any", name=uuid)
    return plan


def remove(ctx: Context, instance: str) -> instances.InstanceResult:
    """Remove a vGPU instance gpuvfio made: its plan, made under the run lock, carried out."""
    with ctx.lock():
        return run_remove(ctx, plan_remove(ctx, instance))


def run_remove(ctx: Context, plan: VgpuRemovePlan) -> instances.InstanceResult:
    result = instances.remove_instance(ctx.host, ctx.journal(), plan.instance, ctx.writer())
    result.steps = list(plan.steps)  # remove_instance takes them all, or raises
    return result


def scheduler_state(ctx: Context, address: PciAddress) -> SchedulerState:
    with ctx.nvml() as nvml:
        return nvml.read(address)


@dataclass
class SchedulerPlan(Plan):
    address: PciAddress | None = None
    policy: str = ""
    current: SchedulerState | None = None

    def extra_json(self) -> dict:
        return {"current": self.current.policy, "supported": list(self.current.supported)} if self.current else {}


def plan_scheduler(ctx: Context, address: PciAddress, policy: str) -> SchedulerPlan:
    """What ``vgpu scheduler --set`` will change, read from NVML (the run's checks: a policy the
    GPU supports, a current one that can be put back); reads only."""
    scheduler.parse_policy(policy)
    plan = SchedulerPlan("vgpu scheduler", f"{address} -> {policy}", address=address, policy=policy)
    with ctx.nvml() as nvml:
        plan.current = current = nvml.read(address)
    if policy not in current.supported:
        plan.refuse("policy", f"{address} supports the vGPU scheduler policies {', '.join(current.supported)}, "
                              f"not {policy}")
    elif current.policy == policy:
        plan.notes.append(f"{address} runs {policy} already: nothing to do")
    elif current.policy not in POLICIES:
        plan.refuse("policy", f"{address}: the current vGPU scheduler policy ({current.policy}) could not be "
                              "put back afterwards; not changing it")
    else:
        plan.step(StepKind.SET_SCHEDULER, f"{current.policy} -> {policy} through NVML (ARR mode and timeslice "
                                          "kept; journaled, gpuvfio restore puts it back)", address=str(address),
                  value=policy)
    return plan


def set_scheduler(ctx: Context, address: PciAddress, policy: str) -> SchedulerChange:
    """Set a GPU's vGPU scheduler policy: its plan, made under the run lock, carried out."""
    with ctx.lock():
        return run_scheduler(ctx, plan_scheduler(ctx, address, policy))


def run_scheduler(ctx: Context, plan: SchedulerPlan) -> SchedulerChange:
    plan.raise_if_refused()
    if plan.nothing_to_do:
        return SchedulerChange(plan.current, SchedulerOutcome.UNCHANGED)
    with ctx.nvml() as nvml:
        change = scheduler.apply_policy(nvml, ctx.journal(), plan.address, plan.policy, plan.current)
    return dataclasses.replace(change, steps=list(plan.steps))


def undo_scheduler(ctx: Context, address: PciAddress, before: SchedulerSnapshot, journaled: bool) -> list[str]:
    with ctx.lock():
        return scheduler.undo_set(ctx.journal(), address, before, journaled, nvml_factory=ctx.nvml)
