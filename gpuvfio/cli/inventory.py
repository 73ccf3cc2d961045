"""gpuvfio list, doctor, dump-host: reading a host (a directory, or a recorded fixture)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from gpuvfio.cli import render
from gpuvfio.cli.app import JsonOption, RootOption, app, emit_json, root_of, say
from gpuvfio.cli.devices import DeviceIds, Devices
from gpuvfio.cli.output import FormatOption, chosen_format, print_listing
from gpuvfio.ops.inventory import doctor_report, dump_host, list_report, open_host
from gpuvfio.ops.selection import check_devices, resolve


@app.command("list")
def list_cmd(
    addresses: Devices = None,
    device_ids: DeviceIds = None,
    show_all: Annotated[bool, typer.Option("--all", help="Every PCI function, not only NVIDIA.")] = False,
    output_format: FormatOption = None,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """Inventory: NVIDIA devices (or --all) with IOMMU group, viability, driver, NUMA node, PCIe link
    and largest BAR."""
    check_devices(addresses, device_ids, required=False)
    fmt = chosen_format(output_format, as_json)
    with open_host(root_of(root)) as (host, label):
        report = list_report(host, show_all=show_all, only=resolve(host, addresses, device_ids))
    if fmt == "json":
        emit_json(report)
        return
    print_listing(render.list_listing(report, f"PCI functions on {label}" if show_all else f"NVIDIA devices on {label}"),
                  fmt)


@app.command("doctor")
def doctor_cmd(output_format: FormatOption = None, as_json: JsonOption = False, root: RootOption = None) -> None:
    """Host readiness checks for passthrough, each with a fix. Exit 1 when one fails."""
    fmt = chosen_format(output_format, as_json)
    with open_host(root_of(root)) as (host, label):
        report = doctor_report(host)
    if fmt == "json":
        emit_json({"checks": report["checks"]})
    else:
        print_listing(render.doctor_listing(report, f"Readiness of {label}"), fmt)
    if any(c["status"] == "fail" for c in report["checks"]):
        raise typer.Exit(1)


@app.command("dump-host")
def dump_host_cmd(
    out: Annotated[str, typer.Argument(metavar="OUT", help="Fixture file to write ('-' for stdout).")],
    root: RootOption = None,
) -> None:
    """Record what gpuvfio reads from this host into a text fixture (bug reports, tests)."""
    with open_host(root_of(root)) as (host, _label):
        text = dump_host(host, out)
    if out == "-":
        sys.stdout.write(text)
    else:
        say(f"wrote {text.count(chr(10)) - 1} records to {out}")
