"""Fabric Manager partitions around a guest's life (HGX shared-NVSwitch mode): bind, then
activate the partition, then start; stop, then deactivate, then restore (NVIDIA Fabric Manager
user guide, "Shared NVSwitch Virtualization Model": the partition is activated after the GPUs
are bound to vfio-pci and before the VM starts, and deactivated after it stops).

Each activation is journaled before fmpm is asked (gpuvfio.bind.fabric_manager), under the
run lock, so a crash between steps leaves a partition gpuvfio restore deactivates.
"""

from __future__ import annotations

from gpuvfio.address import PciAddress
from gpuvfio.bind.fabric_manager import (FabricManagerClient, apply_partition_steps, deactivate_journaled, plan_attach,
                                         plan_detach)
from gpuvfio.errors import GpuvfioError, Refused
from gpuvfio.host.fabric import FULL_PASSTHROUGH, SHARED_NVSWITCH, Decision, fabric_decision, read_fabric
from gpuvfio.host.inventory import Inventory
from gpuvfio.host.nvlink import read_nvlink
from gpuvfio.ops.context import Context


def companions(ctx: Context, inventory: Inventory, gpus: list[PciAddress], held: list[PciAddress]) -> list[PciAddress]:
    """The NVSwitches that go with ``gpus`` in full-passthrough mode: bound with all the
    baseboard's GPUs, persisted with them, and given back (or unpersisted) with the last of them
    (``held``: the baseboard GPUs that stay where they are afterwards count as still there)."""
    if not any(f.is_nvswitch for f in inventory.functions.values()):
        return []
    fabric = read_fabric(ctx.host, inventory)
    if fabric.effective_mode != FULL_PASSTHROUGH or not set(gpus) & set(fabric.gpus):
        return []
    if set(fabric.gpus) & (set(held) - set(gpus)):
        return []  # other baseboard GPUs still need them
    return [s for s in fabric.nvswitches if s not in gpus]


def decide(ctx: Context, inventory: Inventory, addresses: list[PciAddress]) -> Decision:
    """What an HGX NVSwitch fabric means for giving ``addresses`` to one guest: all GPUs with all
    NVSwitches, one Fabric Manager partition, a lone GPU with NVLink off in the guest, or a
    refusal that says which mode is needed (kind "none" without a fabric). The one decision
    xml, attach, bind and the Ansible modules apply; reads the host and asks the Fabric Manager
    for its partitions, changes nothing."""
    modules = None
    if any(f.is_nvswitch for f in inventory.functions.values()):
        # The Fabric Manager names partition GPUs by module id (on HGX H100 with no bus id):
        # NVML's module ids, read with the NVLinks (or recorded with them), map them to addresses.
        modules = read_nvlink(ctx.host).module_map() or None
    fabric = read_fabric(ctx.host, inventory, modules)
    partitions = None
    if fabric.effective_mode == SHARED_NVSWITCH and fabric.fm_running and ctx.fabric_manager is not None:
        partitions = ctx.fabric_manager().list_partitions()
    return fabric_decision(fabric, addresses, partitions)


def client(ctx: Context) -> FabricManagerClient:
    if ctx.fabric_manager is None:
        raise Refused(f"the Fabric Manager is reached on the live host only; {ctx.host.root} is not it")
    return ctx.fabric_manager()


def activate(ctx: Context, decision: Decision | None) -> list[int]:
    """Activate the partition ``decision`` names (nothing for other decisions); its id(s)."""
    steps = plan_attach(decision) if decision is not None else []
    if not steps:
        return []
    with ctx.lock():
        apply_partition_steps(ctx.journal(), client(ctx), steps, ctx.progress)
    return [step.partition_id for step in steps]


def deactivate(ctx: Context, *, devices: list[PciAddress] | None = None,
               partition_ids: list[int] | None = None) -> list[str]:
    """Deactivate the journaled partitions holding ``devices`` (or the ones named; all with
    neither). Nothing journaled: nothing asked of the Fabric Manager."""
    with ctx.lock():
        journal = ctx.journal()
        if not journal.data["partitions"]:
            return []
        if partition_ids is not None:
            results = deactivate_journaled(journal, client(ctx), partition_ids, ctx.progress)
            failed = {k: m for k, (ok, m) in results.items() if not ok}
            if failed:
                raise GpuvfioError("partition deactivation failed: " + "; ".join(
                    f"partition {k}: {m}" for k, m in failed.items()) + " (the journal keeps it for gpuvfio restore)")
            return [f"partition {k} deactivated" for k in results]
        steps = plan_detach(journal, devices)
        if not steps:
            return []
        return apply_partition_steps(journal, client(ctx), steps, ctx.progress).done
