"""vGPU services: the types a GPU offers, instances (created and removed, journaled) and the
scheduler policy (through NVML, journaled). gpuvfio vgpu and the testbed's vGPU variants call
these; gpuvfio restore undoes what is left (ops.binding).
"""

from __future__ import annotations

from gpuvfio.address import PciAddress
from gpuvfio.domain.spec import mdev_uuid
from gpuvfio.bind.journal import Journal, state_dir
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.pciids import PciIds
from gpuvfio.ops import binding
from gpuvfio.ops.context import Context
from gpuvfio.vgpu import instances, scheduler
from gpuvfio.vgpu.types import mig_backed, pick_mdev
from gpuvfio.virt.usage import assignments

__all__ = ["types", "instances_list", "create", "remove", "scheduler_state", "set_scheduler", "undo_scheduler", "create_for_domain",
           "mig_backed", "parse_policy", "POLICIES"]
POLICIES = scheduler.POLICIES
parse_policy = scheduler.parse_policy


def types(ctx: Context, address: PciAddress) -> dict:
    return instances.types(read_inventory(ctx.host), address)


def instances_list(ctx: Context, *, uri: str | None = None) -> dict:
    """``gpuvfio vgpu list``: every vGPU instance with its type, parent, the domains using it
    (libvirt asked by the one policy of ops.binding), persisted or not."""
    inventory = read_inventory(ctx.host)
    found = instances.existing_instances(ctx.host, inventory, Journal.load(state_dir(ctx.host)))
    used: dict[str, list[str]] = {}
    libvirt_note = binding.libvirt_not_asked(ctx, uri)
    if libvirt_note is None:
        try:
            used = assignments(ctx.libvirt(uri))
        except GpuvfioError as exc:
            libvirt_note = str(exc)
    for item in found:
        item["domains"] = None if libvirt_note else used.get(item["instance"], [])
    return {"instances": found, "libvirt": libvirt_note or "asked"}


def create(ctx: Context, address: PciAddress, wanted: str, *, uuid: str | None = None,
           persist: bool = False) -> dict:
    return instances.create(ctx.host, address, wanted, writer=ctx.writer(), uuid=uuid, persist=persist,
                            lock_timeout=ctx.lock_timeout)


def create_for_domain(ctx: Context, domain_name: str, address: PciAddress, profile: str) -> dict:
    """The vGPU instance a domain will use: a legacy mdev gets the UUID the domain XML names
    (the same derivation as gpuvfio xml), an SR-IOV vGPU a free VF set to the type."""
    inventory = read_inventory(ctx.host, names=PciIds.load(ctx.host))
    fn = inventory.functions.get(address)
    if fn is None:
        raise InputError(f"no such PCI function on this host: {address}")
    uuid = mdev_uuid(domain_name, address, pick_mdev(inventory, address, profile, check_available=False)) \
        if fn.mdev_types else None
    return create(ctx, address, profile, uuid=uuid)


def remove(ctx: Context, instance: str) -> dict:
    return instances.remove(ctx.host, instance, writer=ctx.writer(), lock_timeout=ctx.lock_timeout)


def scheduler_state(ctx: Context, address: PciAddress) -> dict:
    with ctx.nvml() as nvml:
        return nvml.read(address)


def set_scheduler(ctx: Context, address: PciAddress, policy: str) -> dict:
    scheduler.parse_policy(policy)
    with ctx.nvml() as nvml:
        return scheduler.set_policy(ctx.host, nvml, address, policy, lock_timeout=ctx.lock_timeout)


def undo_scheduler(ctx: Context, address: PciAddress, before: dict, journaled: bool) -> list[str]:
    return scheduler.undo_set(ctx.host, address, before, journaled, nvml_factory=ctx.nvml,
                              lock_timeout=ctx.lock_timeout)
