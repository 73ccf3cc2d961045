"""Typer commands for comparison testbeds: testbed plan / run / report."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from gpuvfio.cli import JsonOption, RootOption, app, resolve_root
from gpuvfio.main import COMMANDS, emit_json

testbed_app = typer.Typer(help=COMMANDS["testbed"], no_args_is_help=True)
app.add_typer(testbed_app, name="testbed")
SpecArg = Annotated[str, typer.Argument(metavar="SPEC", help="Testbed spec (TOML).")]


@testbed_app.command("plan")
def plan_cmd(spec_path: SpecArg, as_json: JsonOption = False, root: RootOption = None) -> None:
    """What each variant would provision (bind plans, XML and its diff to the first); changes nothing."""
    from gpuvfio.commands import open_host
    from gpuvfio.testbed.plan import plan
    from gpuvfio.testbed.spec import load_spec

    spec = load_spec(spec_path)
    with open_host(resolve_root(root)) as (host, _label):
        report = plan(host, spec)
    if as_json:
        emit_json(report)
        return
    for variant in report["variants"]:
        sys.stdout.write(f"== {variant['name']} ({variant['kind']})\n")
        if "action" in variant:
            sys.stdout.write(f"   {variant['action']}\n")
            continue
        pages = f"{variant['hugepages_kib']} KiB pages" if variant['hugepages_kib'] else "4K pages"
        sys.stdout.write(f"   domain {variant['domain']}, {pages}, "
                         f"NUMA nodes {variant['numa_nodes'] or 'not pinned'}\n")
        if "bind" in variant:
            sys.stdout.write(f"   bind: {', '.join(variant['bind']['devices'])} -> vfio-pci "
                             f"({len(variant['bind']['steps'])} steps)\n")
        for warning in variant["warnings"]:
            sys.stdout.write(f"   warning: {warning}\n")
        sys.stdout.write(variant.get("xml_diff") or "")


@testbed_app.command("run")
def run_cmd(spec_path: SpecArg, out: Annotated[str, typer.Option("--out", metavar="DIR")],
            connect: Annotated[Optional[str], typer.Option("--connect", metavar="URI")] = None,
            root: RootOption = None) -> None:
    """Provision each variant in turn, measure it, tear it down; resumes an interrupted run."""
    import os

    from gpuvfio import guests
    from gpuvfio.cli_guest import _known_hosts_default, _restore_held
    from gpuvfio.hostroot import HostRoot
    from gpuvfio.sysfs_write import SysfsWriter
    from gpuvfio.testbed.run import run_testbed
    from gpuvfio.testbed.spec import load_spec

    spec = load_spec(spec_path)
    host = HostRoot(resolve_root(root))
    os.makedirs(out, exist_ok=True)

    def bind_step(devices):
        from gpuvfio import bindcmd
        from gpuvfio.bindapply import live_actions

        return bindcmd.bind(host, devices, writer=SysfsWriter(host), actions=live_actions(host))

    conn = guests.connect(connect or spec.connect)
    try:
        run_testbed(host, spec, out, conn=conn, known_hosts_default=_known_hosts_default(host),
                    bind_step=bind_step, restore_step=_restore_held(host), vgpu_writer=SysfsWriter(host),
                    progress=lambda line: sys.stderr.write(f"gpuvfio: {line}\n"))
    finally:
        conn.close()
    sys.stderr.write(f"gpuvfio: results in {out}; gpuvfio testbed report {out}\n")


@testbed_app.command("report")
def report_cmd(out: Annotated[str, typer.Argument(metavar="DIR")], as_json: JsonOption = False) -> None:
    """report.md, report.html (self-contained, with plots) and results.json from a run's results."""
    from gpuvfio.testbed.report import write_report

    summary = write_report(out)
    if as_json:
        emit_json(summary)
    else:
        sys.stdout.write("".join(f"{out}/{name}\n" for name in summary["files"]))
