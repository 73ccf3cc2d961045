"""gpuvfio bind, unbind, restore, status, persist, unpersist."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from gpuvfio.cli import render
from gpuvfio.cli.app import JsonOption, RootOption, emit_json, progress_for, root_of, say
from gpuvfio.cli.lazy import command_typer
from gpuvfio.cli.tables import from_table, options
from gpuvfio.cli.devices import DeviceIds, Devices, Yes
from gpuvfio.cli.plans import DryRun, command_context, confirmation, needs_yes, preview
from gpuvfio.cli.output import Column, FormatOption, Listing, chosen_format, print_listing, write_text
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.ops import binding
from gpuvfio.ops import unbind as unbinding
from gpuvfio.ops.reset import plan_reset, reset
from gpuvfio.ops.binding import BindPolicy, BindReport, BindStatus, PersistReport, PersistStatus
from gpuvfio.ops.context import live_context, open_context
from gpuvfio.ops.uris import NO_LIBVIRT, check_uri
from gpuvfio.ops.selection import check_devices, resolve
from gpuvfio.options import RUN

commands = command_typer()  # its commands, listed in gpuvfio.cli.lazy.COMMANDS

# Each command's shared options (connect, force, the timeouts, ...) come from gpuvfio.options.RUN.


def reporting_failure(as_json: bool, call):
    """Run a service; when it fails with a report and --json was asked, print the report first
    (the one error line follows at the CLI edge)."""
    try:
        return call()
    except GpuvfioError as exc:
        if as_json and exc.report is not None:
            emit_json(exc.report)
        raise


@commands.command("bind")
@from_table
def bind_cmd(addresses: Devices = None, device_ids: DeviceIds = None, yes: Yes = False, dry_run: DryRun = False,
             run: dict = options(RUN, "bind"), as_json: JsonOption = False, root: RootOption = None) -> None:
    """Move devices (their whole IOMMU group) to vfio-pci: planned, checked, journaled, rolled back on
    failure."""
    connect = check_uri(run["connect"], source="--connect", keywords=(NO_LIBVIRT,))
    check_devices(addresses, device_ids, required=True)
    policy = BindPolicy(force=run["force"], stop_services=run["stop_services"],
                        allow_unsafe_host=run["allow_unsafe_host"], take_host_devices=run["take_host_devices"])
    try:
        with command_context(root_of(root), dry_run, progress=progress_for(as_json),
                             write_timeout=run["write_timeout"], lock_timeout=run["lock_timeout"]) as ctx:
            wanted = resolve(ctx, addresses, device_ids, changes=True, yes=yes or dry_run,
                             tell=progress_for(as_json))
            unconfirmed = needs_yes(ctx, addresses, device_ids) if dry_run and not yes else None
            try:
                report = _bind_dry_run(ctx, wanted, policy, connect, confirmation(
                    ctx, addresses, device_ids, True) if yes else None) if dry_run else \
                    binding.bind(ctx, wanted, policy, uri=connect)
            except Refused as exc:
                if unconfirmed is None:
                    raise
                if exc.report is not None:  # the plan, then the refusal the run meets first
                    emit_json(exc.report) if as_json else render.print_plan(exc.report)
                raise unconfirmed from None
            if unconfirmed is not None:
                emit_json(report.to_json()) if as_json else render.print_plan(report.to_json())
                raise unconfirmed
    except Refused as exc:
        if exc.report is not None:
            emit_json(exc.report) if as_json else render.print_plan(exc.report)
        raise
    if as_json:
        emit_json(report.to_json())
        return
    if report.status in (BindStatus.DRY_RUN, BindStatus.NOTHING_TO_DO):
        render.print_plan(report.to_json())
    devices = ", ".join(map(str, report.devices))
    if report.status is BindStatus.NOTHING_TO_DO:
        say(f"nothing to do: {devices} already on vfio-pci")
    elif report.status is BindStatus.APPLIED:
        say(f"bound to vfio-pci: {devices} (gpuvfio restore gives them back)")


def _bind_dry_run(ctx, wanted, policy: BindPolicy, connect: str | None, confirmed) -> BindReport:
    """The bind's plan as the dry run shows it, with its --yes line (``confirmed``) first."""
    operation = binding.plan_operation(ctx, wanted, policy, uri=connect)
    if confirmed is not None:
        operation.outcome.checks.insert(0, confirmed)
    return operation.shown()


@commands.command("unbind")
@from_table
def unbind_cmd(addresses: Devices = None, device_ids: DeviceIds = None, yes: Yes = False, dry_run: DryRun = False,
               run: dict = options(RUN, "unbind"), as_json: JsonOption = False, root: RootOption = None) -> None:
    """Give devices back to the host: clear driver_override, leave vfio-pci, reprobe (no journal)."""
    connect = check_uri(run["connect"], source="--connect", keywords=(NO_LIBVIRT,))
    check_devices(addresses, device_ids, required=True)
    if dry_run:
        preview(root_of(root), addresses, device_ids, yes, as_json,
                lambda ctx, wanted: unbinding.plan_unbind(ctx, wanted, uri=connect))
        return
    ctx = live_context(root_of(root), write_timeout=run["write_timeout"], lock_timeout=run["lock_timeout"],
                       writable=True)
    wanted = resolve(ctx, addresses, device_ids, changes=True, yes=yes, tell=progress_for(as_json))
    result = reporting_failure(as_json, lambda: unbinding.unbind(ctx, wanted, uri=connect))
    if as_json:
        emit_json(result.to_json())
        return
    for address, driver in result.drivers.items():
        say(f"{address}: now on {driver}")


@commands.command("restore")
@from_table
def restore_cmd(addresses: Devices = None, device_ids: DeviceIds = None, yes: Yes = False, dry_run: DryRun = False,
                run: dict = options(RUN, "restore"), as_json: JsonOption = False, root: RootOption = None) -> None:
    """Return devices gpuvfio bound to exactly their recorded drivers (all, when none is named); works
    after a crash."""
    check_devices(addresses, device_ids, required=False)
    if dry_run:
        preview(root_of(root), addresses, device_ids, yes, as_json, binding.plan_restore)
        return
    ctx = live_context(root_of(root), progress=progress_for(as_json), write_timeout=run["write_timeout"],
                       lock_timeout=run["lock_timeout"], writable=True)
    wanted = resolve(ctx, addresses, device_ids, changes=True, yes=yes, tell=progress_for(as_json))
    result = reporting_failure(as_json, lambda: binding.restore(ctx, wanted))
    if as_json:
        emit_json(result.to_json())
    elif result.nothing:
        say("nothing to restore")


@commands.command("reset")
@from_table
def reset_cmd(addresses: Devices = None, device_ids: DeviceIds = None, yes: Yes = False, bus: Annotated[bool, typer.Option(
                  "--bus", help="Reset the bus below the devices' bridge (reset_subordinate): only when every "
                                "device below it is gpuvfio's.")] = False,
              forget: Annotated[bool, typer.Option(
                  "--forget", help="Clear the broken mark without a reset, once the device answers again.")] = False,
              dry_run: DryRun = False, run: dict = options(RUN, "reset"), as_json: JsonOption = False,
              root: RootOption = None) -> None:
    """Reset devices gpuvfio holds through the kernel (a device that came back broken from a guest);
    one that answers again may be bound or restored."""
    connect = check_uri(run["connect"], source="--connect", keywords=(NO_LIBVIRT,))
    check_devices(addresses, device_ids, required=True)
    if bus and forget:
        raise InputError("--bus and --forget exclude each other")
    if dry_run:
        preview(root_of(root), addresses, device_ids, yes, as_json,
                lambda ctx, wanted: plan_reset(ctx, wanted, bus=bus, forget=forget, uri=connect))
        return
    with live_context(root_of(root), progress=progress_for(as_json), write_timeout=run["write_timeout"],
                      lock_timeout=run["lock_timeout"], writable=True) as ctx:
        wanted = resolve(ctx, addresses, device_ids, changes=True, yes=yes, tell=progress_for(as_json))
        result = reporting_failure(as_json, lambda: reset(ctx, wanted, bus=bus, forget=forget, uri=connect))
    if as_json:
        emit_json(result.to_json())
        return
    for address in result.devices:
        cleared = " (broken mark cleared)" if address in result.cleared else ""
        say(f"{address}: answers{cleared}")


@commands.command("status")
def status_cmd(output_format: FormatOption = None, as_json: JsonOption = False, root: RootOption = None) -> None:
    """Show the devices gpuvfio holds, their original drivers and any unfinished operation."""
    fmt = chosen_format(output_format, as_json)
    with command_context(root_of(root), True) as ctx:
        report = binding.status(ctx).to_json()
    if fmt == "json":
        emit_json(report)
    elif fmt == "table":
        render.print_status(report)
    else:
        print_listing(render.status_listing(report), fmt)


def _persist(addresses, device_ids, yes: bool, remove: bool, dry_run: bool, force: bool, as_json: bool,
             lock_timeout: float, root: str | None, take_host_devices: bool = False) -> None:
    check_devices(addresses, device_ids, required=True)
    with command_context(root_of(root), dry_run, lock_timeout=lock_timeout) as ctx:
        wanted = resolve(ctx, addresses, device_ids, changes=True, yes=yes or dry_run,
                         tell=progress_for(as_json))
        unconfirmed = needs_yes(ctx, addresses, device_ids) if dry_run and not yes else None
        confirmed = confirmation(ctx, addresses, device_ids, True) if dry_run and yes else None
        if confirmed is not None:  # the plan's --yes line
            say(f"{confirmed.status.value} {confirmed.check_id}: {confirmed.message}")
        try:
            report = (binding.plan_persist if dry_run else binding.persist)(
                ctx, wanted, remove=remove, force=force, take_host_devices=take_host_devices)
        except Refused:
            if unconfirmed is None:
                raise
            raise unconfirmed from None  # the run without --yes stops there first
        _persist_output(report, remove, dry_run, as_json)
        if unconfirmed is not None:  # the diff shown; then refused, as the run is without --yes
            raise unconfirmed


def _persist_output(report: PersistReport, remove: bool, dry_run: bool, as_json: bool) -> None:
    if as_json:
        emit_json(report.to_json())
        return
    for change in report.changes:
        write_text(change.diff() if dry_run else f"{change.action.value}: {change.path}\n")  # the host's files
    if report.status is PersistStatus.NOTHING_TO_DO:
        say(f"nothing to do: {', '.join(map(str, report.devices))} already "
            + ("not persisted" if remove else f"persisted ({report.mechanism.value})"))
    elif report.next_step is not None:
        say(("would then need to " if dry_run else "next: ") + report.next_step)


@commands.command("persist")
@from_table
def persist_cmd(addresses: Devices = None, device_ids: DeviceIds = None, yes: Yes = False, dry_run: DryRun = False,
                run: dict = options(RUN, "persist"),
                list_: Annotated[bool, typer.Option("--list", help="List the boot-time overrides (driverctl's and "
                                                              "gpuvfio's), as driverctl list-overrides.")] = False,
                output_format: FormatOption = None, as_json: JsonOption = False, root: RootOption = None) -> None:
    """Keep devices on vfio-pci across reboots, by address (driverctl, or a udev rule + softdep)."""
    if list_:
        if addresses or device_ids or dry_run or run["force"] or run["take_host_devices"]:
            raise InputError("--list takes no devices and no --dry-run/--force/--take-host-devices")
        fmt = chosen_format(output_format, as_json)
        with open_context(root_of(root)) as (ctx, _label):
            report = binding.persisted_overrides(ctx)
        if fmt == "json":
            emit_json(report.to_json())
            return
        listing = Listing("Boot-time driver overrides", [Column("Address", keep=True), Column("Driver", keep=True),
                                                         Column("Mechanism", keep=True)],
                          empty="no boot-time driver override on this host")
        for item in report.overrides:
            listing.add(str(item.address), item.driver, item.source)
        print_listing(listing, fmt)
        return
    if output_format is not None:
        raise InputError("--format goes with --list")
    _persist(addresses, device_ids, yes, False, dry_run, run["force"], as_json, run["lock_timeout"], root,
             run["take_host_devices"])


@commands.command("unpersist")
@from_table
def unpersist_cmd(addresses: Devices = None, device_ids: DeviceIds = None, yes: Yes = False, dry_run: DryRun = False,
                  run: dict = options(RUN, "unpersist"), as_json: JsonOption = False, root: RootOption = None) -> None:
    """Stop keeping devices on vfio-pci across reboots."""
    _persist(addresses, device_ids, yes, True, dry_run, False, as_json, run["lock_timeout"], root)
