"""gpuvfio vgpu types / create / remove / scheduler."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from gpuvfio.cli.app import JsonOption, RootOption, emit_json, root_of
from gpuvfio.cli.lazy import COMMANDS, command_typer
from gpuvfio.cli.tables import from_table, options
from gpuvfio.cli.plans import DryRun, command_context, show_plan
from gpuvfio.cli.output import Column, FormatOption, Listing, chosen_format, print_listing, printable, printable_report
from gpuvfio.ops import vgpu
from gpuvfio.ops.context import live_context, open_context
from gpuvfio.ops.domains import parse_uuid
from gpuvfio.ops.uris import NO_LIBVIRT, check_uri
from gpuvfio.ops.selection import resolve_one
from gpuvfio.options import DOMAIN, RUN
from gpuvfio.selector import SELECTOR_HELP, Selector

vgpu_app = command_typer(help=COMMANDS["vgpu"].help, no_args_is_help=True)
Address = Annotated[str, typer.Argument(metavar="DEVICE", help=f"The GPU (one function): {SELECTOR_HELP}.")]


@vgpu_app.command("types")
def types_cmd(address: Address, as_json: JsonOption = False, root: RootOption = None) -> None:
    """The vGPU profiles a GPU offers (legacy mdev types, or SR-IOV types on its VFs)."""
    Selector.parse(address)
    with open_context(root_of(root)) as (ctx, _label):
        offered = vgpu.types(ctx, resolve_one(ctx, address))
    if as_json:
        emit_json(offered.to_json())
        return
    report, address = printable_report(offered.to_json()), printable(address)  # type names and ids are sysfs's
    if report["kind"] == "vf":
        sys.stdout.write(f"{address} is an SR-IOV VF of {report['physfn']}: vGPU types are listed on the physical "
                         f"function (gpuvfio vgpu types {report['physfn']})\n")
    if report["kind"] == "none":
        sys.stdout.write(f"{address}: no vGPU types (no mdev_supported_types, no SR-IOV VFs)\n")
    for mdev in report["mdev_types"]:
        sys.stdout.write(f"{mdev['id']:16} {mdev['name'] or '':24} available {mdev['available_instances']}\n")
    for vtype in report["sriov_types"]:
        mig = vtype.get("mig_backed")
        note = f"  MIG-backed: {mig['slices']} slice(s), {mig['memory_gb']} GB" if mig else ""
        sys.stdout.write(f"{vtype['id']:<6} {vtype['name']:28} free VFs {vtype['available_instances']}{note}\n")
    for used in report["sriov_in_use"]:
        sys.stdout.write(f"in use: VF {used['vf']} has type {used['type']}\n")


@vgpu_app.command("list")
@from_table
def list_cmd(run: dict = options(RUN, "vgpu list"), output_format: FormatOption = None, as_json: JsonOption = False,
             root: RootOption = None) -> None:
    """The vGPU instances on this host, as mdevctl list shows mdevs, with SR-IOV vGPUs: type, parent
    GPU, the domains using each, whether gpuvfio made it and whether it is persisted."""
    connect = check_uri(run["connect"], source="--connect", keywords=(NO_LIBVIRT,))
    fmt = chosen_format(output_format, as_json)
    with open_context(root_of(root)) as (ctx, _label):
        report = vgpu.instances_list(ctx, uri=connect)
    if fmt == "json":
        emit_json(report.to_json())
        return
    listing = Listing("vGPU instances", [Column("Instance", keep=True), Column("Kind", keep=True),
                                         Column("Type", keep=True), Column("Parent", keep=True),
                                         Column("Domains", rank=1), Column("Persisted", rank=2),
                                         Column("Made by", rank=3)], empty="no vGPU instance on this host")
    for item in report.instances:
        domains = "not asked" if item.domains is None else (", ".join(item.domains) or "none")
        listing.add(item.instance, item.kind, str(item.type_id), item.parent, domains,
                    {True: "yes", False: "no", None: "-"}[item.persisted], "gpuvfio" if item.by_gpuvfio else "other")
    if report.libvirt != "asked":
        listing.notes.append(f"libvirt: {report.libvirt}")
    print_listing(listing, fmt)


@vgpu_app.command("create")
@from_table
def create_cmd(address: Address,
               vgpu_type: Annotated[str, typer.Argument(metavar="TYPE", help="Type id or name.")],
               domain: dict = options(DOMAIN, "vgpu create"),
               persist: Annotated[bool, typer.Option("--persist", help="Recreate it at boot (mdevctl's store, "
                                                                       "/etc/mdevctl.d).")] = False,
               dry_run: DryRun = False, as_json: JsonOption = False, root: RootOption = None) -> None:
    """Create a vGPU instance (legacy: an mdev; SR-IOV: a type on a free VF), journaled."""
    Selector.parse(address)
    uuid = None if domain["uuid"] is None else parse_uuid(domain["uuid"])
    if dry_run:
        with command_context(root_of(root), True) as ctx:
            show_plan(vgpu.plan_create(ctx, resolve_one(ctx, address), vgpu_type, uuid=uuid, persist=persist),
                      as_json)
        return
    ctx = live_context(root_of(root), writable=True)
    report = vgpu.create(ctx, resolve_one(ctx, address), vgpu_type, uuid=uuid, persist=persist).to_json()
    if as_json:
        emit_json(report)
        return
    report = printable_report(report)
    what = report.get("uuid") or report.get("vf")
    sys.stdout.write(f"{report['result']}: {report['kind']} {what} type {report['type']} on {report['parent']}\n")


@vgpu_app.command("remove")
def remove_cmd(instance: Annotated[str, typer.Argument(
                   metavar="UUID|VF", help="The mdev UUID, or the VF holding an SR-IOV vGPU.")],
               dry_run: DryRun = False,
               as_json: JsonOption = False, root: RootOption = None) -> None:
    """Remove a vGPU instance gpuvfio created (an mdev UUID, or the VF address of an SR-IOV vGPU)."""
    if dry_run:
        with command_context(root_of(root), True) as ctx:
            show_plan(vgpu.plan_remove(ctx, instance), as_json)
        return
    report = vgpu.remove(live_context(root_of(root), writable=True), instance).to_json()
    emit_json(report) if as_json else sys.stdout.write(f"removed {printable(instance)}\n")


@vgpu_app.command("scheduler")
def scheduler_cmd(address: Address,
                  policy: Annotated[Optional[str], typer.Option(
                      "--set", metavar="POLICY", help="best-effort, equal-share or fixed-share (journaled; gpuvfio "
                                                      "restore puts the previous one back).")] = None,
                  dry_run: DryRun = False, as_json: JsonOption = False, root: RootOption = None) -> None:
    """Show (or set) a GPU's vGPU scheduler policy, where the driver exposes it through NVML."""
    Selector.parse(address)
    if policy is not None:
        vgpu.parse_policy(policy)
    if dry_run and policy is not None:
        with command_context(root_of(root), True) as ctx:
            show_plan(vgpu.plan_scheduler(ctx, resolve_one(ctx, address), policy), as_json)
        return
    ctx = live_context(root_of(root), writable=policy is not None)
    wanted = resolve_one(ctx, address)
    report = (vgpu.set_scheduler(ctx, wanted, policy) if policy else vgpu.scheduler_state(ctx, wanted)).to_json()
    if as_json:
        emit_json(report)
        return
    report, address = printable_report(report), printable(address)  # NVML's words
    sys.stdout.write(f"{address}: vGPU scheduler {report['policy']} (ARR {report['arr']}, timeslice "
                     f"{report['timeslice']}; supported: {', '.join(report['supported'])})"
                     + (f"; was {report['previous']}" if report.get("previous") else "") + "\n")
