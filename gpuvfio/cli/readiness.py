"""gpuvfio doctor and dump-host: a host's readiness for passthrough, and its recording (a
directory, or a recorded fixture)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from gpuvfio.cli.app import JsonOption, RootOption, emit_json, root_of, say
from gpuvfio.cli.lazy import command_typer
from gpuvfio.cli.output import Cell, Column, FormatOption, Listing, chosen_format, print_listing
from gpuvfio.ops.context import open_context
from gpuvfio.ops.readiness import DoctorReport, doctor_report, dump_host

commands = command_typer()  # its commands, listed in gpuvfio.cli.lazy.COMMANDS

STATUS_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def doctor_listing(report: DoctorReport, title: str) -> Listing:
    """gpuvfio doctor: a row per check; the fixes under the table, whole, to copy."""
    listing = Listing(title, [Column("Check", keep=True), Column("Status", keep=True), Column("Summary"),
                              Column("Fix", below=True)])
    for check in report.checks:
        listing.add(check.check_id, Cell(check.status.value, STATUS_STYLE.get(check.status.value, "")), check.summary,
                    check.fix or "")
    return listing


@commands.command("doctor")
def doctor_cmd(output_format: FormatOption = None, as_json: JsonOption = False, root: RootOption = None) -> None:
    """Host readiness checks for passthrough, each with a fix. Exit 1 when one fails."""
    fmt = chosen_format(output_format, as_json)
    with open_context(root_of(root)) as (ctx, label):
        report = doctor_report(ctx)
    if fmt == "json":
        emit_json({"checks": [c.to_json() for c in report.checks]})
    else:
        print_listing(doctor_listing(report, f"Readiness of {label}"), fmt)
    if report.failed:
        raise typer.Exit(1)


@commands.command("dump-host")
def dump_host_cmd(
    out: Annotated[str, typer.Argument(metavar="OUT", help="Fixture file to write ('-' for stdout).")],
    root: RootOption = None,
) -> None:
    """Record what gpuvfio reads from this host into a text fixture (bug reports, tests)."""
    with open_context(root_of(root)) as (ctx, _label):
        text = dump_host(ctx, out)
    if out == "-":
        sys.stdout.write(text)
    else:
        say(f"wrote {text.count(chr(10)) - 1} records to {out}")
