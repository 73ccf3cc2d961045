"""gpuvfio health: what the host still sees of the devices it hands out (gpuvfio.ops.health).
Exit 0 when every device is ok, 1 when one is degraded or failed. gpuvfio qualify: the reset
methods of devices gpuvfio holds, cycled and checked (gpuvfio.ops.qualify); exit 1 when one
failed."""

from __future__ import annotations

import sys

import typer

from gpuvfio.cli.app import JsonOption, RootOption, emit_json, progress_for, root_of, say
from gpuvfio.cli.devices import DeviceIds, Devices, Yes
from gpuvfio.cli.lazy import command_typer
from gpuvfio.cli.output import printable
from gpuvfio.cli.tables import from_table, options
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.cli.plans import DryRun, preview
from gpuvfio.ops.context import live_context, open_context
from gpuvfio.ops.health import HealthReport, health_report
from gpuvfio.ops.health_metrics import textfile
from gpuvfio.ops.qualify import QualifyResult, plan_qualify, qualify
from gpuvfio.ops.selection import check_devices, resolve
from gpuvfio.ops.uris import NO_LIBVIRT, check_uri
from gpuvfio.options import RUN
from gpuvfio.user_files import check_output_path, write_output

commands = command_typer()  # its commands, listed in gpuvfio.cli.lazy.COMMANDS


@commands.command("health")
@from_table
def health_cmd(addresses: Devices = None, device_ids: DeviceIds = None, run: dict = options(RUN, "health"),
               as_json: JsonOption = False, root: RootOption = None) -> None:
    """PCIe health of the GPUs (and what is on vfio-pci, with --all) and the ports above them:
    AER errors, the link, config space, a broken return, the domain that holds each; exit 1
    when one is degraded or failed.

    --record keeps the AER counts as the last sample (correctable errors above it are rising);
    --acknowledge takes the named devices' errors so far as known. Both last until the next boot."""
    connect = check_uri(run["connect"], source="--connect", keywords=(NO_LIBVIRT,))
    check_devices(addresses, device_ids, required=False)
    if run["textfile"] is not None:
        check_output_path(run["textfile"])  # before anything is read: bad input changes nothing
    keeps = run["record"] or run["acknowledge"]  # the state dir's baseline is written: under the lock
    with open_context(root_of(root), writable=keeps, lock_timeout=run["lock_timeout"]) as (ctx, label):
        report = health_report(ctx, only=resolve(ctx, addresses, device_ids) or None, every_assigned=run["all"],
                               uri=connect, record=run["record"], acknowledge=run["acknowledge"])
    if run["textfile"] is not None:
        try:
            write_output(run["textfile"], textfile(report))
        except GpuvfioError as exc:  # exit 2, not 1 (a device not ok): a timer's unit must fail on it
            raise InputError(f"--textfile: {exc}") from None
    if as_json:
        emit_json(report.to_json())
    else:
        sys.stdout.write("\n".join(render(report, printable(label))) + "\n")
    if not report.ok:
        raise typer.Exit(1)


def render(report: HealthReport, label: str) -> list[str]:
    lines = [f"device health on {label}: " + ("ok" if report.ok else "not ok")]
    if not report.devices:
        lines.append("  no device to watch")
    for device in report.devices:
        held = f", used by {', '.join(device.domains)}" if device.domains else ""
        lines.append(f"{device.address} {device.status.value} (driver {device.driver or 'none'}{held})")
        lines += [f"  {f.status.value:<8} {f.check}: {printable(f.message)}" for f in device.findings]
    if report.libvirt:
        lines.append(f"note: {printable(report.libvirt)}")
    return lines


@commands.command("qualify")
@from_table
def qualify_cmd(addresses: Devices = None, device_ids: DeviceIds = None, yes: Yes = False, dry_run: DryRun = False,
                run: dict = options(RUN, "qualify"), as_json: JsonOption = False, root: RootOption = None) -> None:
    """Before a device's first tenant: reset it by each method the kernel offers, checking config
    space, BARs and link each time; record the verdicts per model and method; exit 1 when one
    failed.

    Each method its reset_method lists is selected alone and used --cycles times; the list is
    put back afterwards. health, doctor and the plans that hand a device out read the verdicts:
    a model whose first reset method failed is degraded."""
    connect = check_uri(run["connect"], source="--connect", keywords=(NO_LIBVIRT,))
    check_devices(addresses, device_ids, required=True)
    if dry_run:
        preview(root_of(root), addresses, device_ids, yes, as_json,
                lambda ctx, wanted: plan_qualify(ctx, wanted, cycles=run["cycles"], uri=connect))
        return
    with live_context(root_of(root), progress=progress_for(as_json), write_timeout=run["write_timeout"],
                      lock_timeout=run["lock_timeout"], writable=True) as ctx:
        wanted = resolve(ctx, addresses, device_ids, changes=True, yes=yes, tell=progress_for(as_json))
        result = qualify(ctx, wanted, cycles=run["cycles"], uri=connect)
    if as_json:
        emit_json(result.to_json())
    else:
        for line in qualified(result):
            say(line)
    if not result.ok:
        raise typer.Exit(1)


def qualified(result: QualifyResult) -> list[str]:
    lines = []
    for method in result.methods:
        outcome = method.outcome.value if method.outcome else "not tried"
        why = f": {printable(method.failure)}" if method.failure else ""
        lines.append(f"{method.address} {method.method}: {outcome} after {method.cycles} reset(s){why}")
    lines += [f"problem: {printable(p)}" for p in result.problems]
    lines.append(f"verdicts: {printable(result.verdicts)}")
    return lines
