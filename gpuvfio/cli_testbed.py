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
HereOption = Annotated[bool, typer.Option(
    "--here", help="Use this machine even when the spec names a remote [host] (how gpuvfio runs itself there).")]


def _local_known_hosts(root: str | None) -> str:
    """Where host keys trusted on first use are recorded: this machine's state dir."""
    from gpuvfio.hostroot import HostRoot
    from gpuvfio.journal import known_hosts_file

    return known_hosts_file(HostRoot(resolve_root(root) or "/"))


def _progress(line: str) -> None:
    # On a remote run our stderr is a pty that goes away on hangup: a progress line that
    # cannot be written must not stop the teardown that follows it.
    try:
        sys.stderr.write(f"gpuvfio: {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


@testbed_app.command("plan")
def plan_cmd(spec_path: SpecArg, as_json: JsonOption = False, here: HereOption = False,
             root: RootOption = None) -> None:
    """What each variant would provision (bind plans, XML and its diff to the first); changes nothing."""
    from gpuvfio.commands import open_host
    from gpuvfio.testbed.plan import plan
    from gpuvfio.testbed.spec import load_spec

    spec = load_spec(spec_path)
    if spec.host is not None and not here:
        from gpuvfio.testbed.remote import plan_remote

        report = plan_remote(spec, _local_known_hosts(root))
    else:
        with open_host(resolve_root(root)) as (host, _label):
            report = plan(host, spec)
    if as_json:
        emit_json(report)
        return
    if "host" in report:
        sys.stdout.write(f"hypervisor {report['host']} (over SSH)\n")
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
        if "vgpu" in variant:
            vgpu = variant["vgpu"]
            mig = vgpu["mig_backed"]
            sys.stdout.write(f"   vGPU {vgpu['profile']}" + (f" (MIG-backed: {mig['slices']} slice(s), "
                                                               f"{mig['memory_gb']} GB)" if mig else "")
                             + f"; scheduler {vgpu['scheduler_note']}\n")
        for warning in variant["warnings"]:
            sys.stdout.write(f"   warning: {warning}\n")
        sys.stdout.write(variant.get("xml_diff") or "")


@testbed_app.command("run")
def run_cmd(spec_path: SpecArg, out: Annotated[str, typer.Option("--out", metavar="DIR")],
            connect: Annotated[Optional[str], typer.Option("--connect", metavar="URI")] = None,
            here: HereOption = False, as_json: JsonOption = False, root: RootOption = None) -> None:
    """Provision each variant in turn, measure it, tear it down; resumes an interrupted run."""
    import os

    from gpuvfio import guests
    from gpuvfio.cli_guest import _restore_held
    from gpuvfio.journal import known_hosts_file
    from gpuvfio.hostroot import HostRoot
    from gpuvfio.sysfs_write import SysfsWriter
    from gpuvfio.testbed.run import run_testbed
    from gpuvfio.testbed.spec import load_spec

    spec = load_spec(spec_path)
    if spec.host is not None and not here:
        from gpuvfio.testbed.remote import run_remote

        remote = run_remote(spec, out, default_known_hosts=_local_known_hosts(root), connect=connect,
                            progress=_progress)
        _finished(spec, out, remote["host"], as_json)
        return
    host = HostRoot(resolve_root(root))
    os.makedirs(out, exist_ok=True)

    def bind_step(devices):
        from gpuvfio import bindcmd
        from gpuvfio.bindapply import live_actions

        return bindcmd.bind(host, devices, writer=SysfsWriter(host), actions=live_actions(host))

    conn = guests.connect(connect or spec.connect)
    try:
        run_testbed(host, spec, out, conn=conn, known_hosts_default=known_hosts_file(host),
                    bind_step=bind_step, restore_step=_restore_held(host), vgpu_writer=SysfsWriter(host),
                    progress=_progress)
    finally:
        conn.close()
    _finished(spec, out, None, as_json)


def _finished(spec, out: str, host: str | None, as_json: bool) -> None:
    """What the run left in OUT, per variant (the same for a local and a remote run)."""
    import os

    if as_json:
        results = {}
        for variant in spec.variants:
            directory = os.path.join(out, "results", variant.name)
            reps = sorted(f for f in os.listdir(directory) if f.startswith("rep-")) if os.path.isdir(directory) else []
            results[variant.name] = {"kind": variant.kind, "repetitions": len(reps), "wanted": spec.repetitions}
        emit_json({"out": out, "host": host, "results": results})
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
