"""gpuvfio health: what the host still sees of the devices it hands out (gpuvfio.ops.health).
Exit 0 when every device is ok, 1 when one is degraded or failed."""

from __future__ import annotations

import sys

import typer

from gpuvfio.cli.app import JsonOption, RootOption, emit_json, root_of
from gpuvfio.cli.devices import DeviceIds, Devices
from gpuvfio.cli.lazy import command_typer
from gpuvfio.cli.output import printable
from gpuvfio.cli.tables import from_table, options
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.ops.context import open_context
from gpuvfio.ops.health import HealthReport, health_report
from gpuvfio.ops.health_metrics import textfile
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
    when one is degraded or failed."""
    connect = check_uri(run["connect"], source="--connect", keywords=(NO_LIBVIRT,))
    check_devices(addresses, device_ids, required=False)
    if run["textfile"] is not None:
        check_output_path(run["textfile"])  # before anything is read: bad input changes nothing
    with open_context(root_of(root)) as (ctx, label):
        report = health_report(ctx, only=resolve(ctx, addresses, device_ids) or None, every_assigned=run["all"],
                               uri=connect)
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
