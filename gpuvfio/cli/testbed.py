"""gpuvfio testbed plan / run / report."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from gpuvfio.cli.app import JsonOption, RootOption, emit_json, progress_for, root_of, say
from gpuvfio.cli.lazy import COMMANDS, command_typer
from gpuvfio.cli.tables import from_table, options
from gpuvfio.cli.devices import Yes
from gpuvfio.cli.plans import DryRun
from gpuvfio.cli.output import printable_report, write_text
from gpuvfio.sizes import pages_text
from gpuvfio.errors import Refused
from gpuvfio.options import RUN
from gpuvfio.user_files import user_dir
from gpuvfio.ops.context import live_context, open_context
from gpuvfio.ops.uris import libvirt_uri
from gpuvfio.testbed.plan import gpus_on, plan
from gpuvfio.testbed.remote import plan_remote, run_remote
from gpuvfio.testbed.report import out_tree, result_files, write_report
from gpuvfio.testbed.run import run_testbed
from gpuvfio.testbed.spec import Spec, load_spec

testbed_app = command_typer(help=COMMANDS["testbed"].help, no_args_is_help=True)
SpecArg = Annotated[str, typer.Argument(metavar="SPEC", help="Testbed spec (TOML).")]
def _this_machine():
    """The Context of this machine for a remote hypervisor's session: writable, since a host key
    trusted on first use is recorded in this machine's state dir (--root names the hypervisor's
    host, or a recording of it, not this machine)."""
    return live_context("/", writable=True)


@testbed_app.command("plan")
@from_table
def plan_cmd(spec_path: SpecArg, run: dict = options(RUN, "testbed plan"), yes: Yes = False,
             as_json: JsonOption = False, root: RootOption = None) -> None:
    """What each variant would provision (bind plans, XML and its diff to the first); changes nothing.
    Exit 1 when the run would refuse a variant (a selection beyond one device without --yes too)."""
    connect = libvirt_uri(run["connect"], needed_for="a testbed")
    _show_plan(load_spec(spec_path), connect, yes, as_json, run["here"], root)


def _show_plan(spec: Spec, connect: str | None, yes: bool, as_json: bool, here: bool, root: str | None) -> None:
    """testbed plan, and testbed run --dry-run: each variant's plan, the exit the run would have."""
    if spec.host is not None and not here:
        with _this_machine() as here_ctx:
            report = plan_remote(here_ctx, spec, yes=yes)
    else:
        with open_context(root_of(root)) as (ctx, _label):
            report = plan(ctx, spec, uri=connect or spec.connect, yes=yes)
    shown = report.to_json()
    if as_json:
        emit_json(shown)
    else:
        _print_plan(shown)
    if report.refused:
        raise Refused(f"the run would refuse variant(s) {', '.join(report.refused)}", shown)


def _print_plan(raw: dict) -> None:
    """The plan as text: every value from the spec or the host escaped (printable_report), the XML
    diffs line by line (write_text), so a variant name with ESC in it is shown, not obeyed."""
    diffs = [variant.get("xml_diff") or "" for variant in raw["variants"]]
    report = printable_report(raw)
    if "host" in report:
        sys.stdout.write(f"hypervisor {report['host']} (over SSH)\n")
    for line in report["selected"]:
        sys.stdout.write(f"{line}\n")
    for variant, diff in zip(report["variants"], diffs):
        sys.stdout.write(f"== {variant['name']} ({variant['kind']})\n")
        for refusal in variant["refused"]:
            sys.stdout.write(f"   REFUSED: {refusal}\n")
        for note in variant["notes"]:
            sys.stdout.write(f"   note: {note}\n")
        if "domain" not in variant:
            _print_steps(variant["steps"])
            continue
        pages = pages_text(variant["hugepages_kib"])
        sys.stdout.write(f"   domain {variant['domain']}, {pages}, "
                         f"NUMA nodes {variant['numa_nodes'] or 'not pinned'}\n")
        if "bind" in variant:
            bind = variant["bind"]
            what = "already on vfio-pci" if bind.get("result") == "nothing_to_do" else \
                f"{len(bind['steps'])} steps" + (", refused" if variant["refused"] else "")
            sys.stdout.write(f"   bind: {', '.join(bind['devices'])} -> vfio-pci ({what})\n")
        if "vgpu" in variant:
            vgpu = variant["vgpu"]
            mig = vgpu["mig_backed"]
            sys.stdout.write(f"   vGPU {vgpu['profile']}" + (f" (MIG-backed: {mig['slices']} slice(s), "
                                                               f"{mig['memory_gb']} GB)" if mig else "")
                             + f"; scheduler {vgpu['scheduler_note']}\n")
        for warning in variant["warnings"]:
            sys.stdout.write(f"   warning: {warning}\n")
        _print_steps(variant["steps"])
        if "plan" in variant:  # attach's own plan (gpuvfio.ops.attach_plan), steps in the run's order
            sys.stdout.write(f"   attach steps: {', '.join(step['kind'] for step in variant['plan']['steps'])}\n")
        write_text(diff)


def _print_steps(steps: list[dict]) -> None:
    """The variant's steps, in the order testbed run takes them."""
    for number, step in enumerate(steps, start=1):
        sys.stdout.write(f"   {number}. {step['description']}\n")


@testbed_app.command("run")
@from_table
def run_cmd(spec_path: SpecArg, out: Annotated[str, typer.Option(
                "--out", metavar="DIR", help="Directory for the results and the report (made when missing).")],
            run: dict = options(RUN, "testbed run"),
            yes: Yes = False, dry_run: DryRun = False, as_json: JsonOption = False,
            root: RootOption = None) -> None:
    """Provision each variant in turn, measure it, tear it down; resumes an interrupted run."""
    connect = libvirt_uri(run["connect"], needed_for="a testbed")
    spec, here = load_spec(spec_path), run["here"]
    if dry_run:  # the plan testbed plan prints; --out is neither made nor read
        local = spec.host is None or here
        unconfirmed = None
        if local and not yes:  # the run's first refusal: a selection beyond one device without --yes
            with open_context(root_of(root)) as (ctx, _label):
                try:
                    gpus_on(ctx, spec, yes=False)
                except Refused as exc:
                    unconfirmed = exc
        try:
            _show_plan(spec, connect, True if local else yes, as_json, here, root)
        except Refused:
            if unconfirmed is None:
                raise
        if unconfirmed is not None:  # shown, then refused as the run without --yes is, in its words
            raise unconfirmed
        return
    progress = progress_for(False)  # a run takes long: progress always goes to stderr
    if spec.host is not None and not here:
        with _this_machine() as here_ctx:
            remote = run_remote(here_ctx, spec, out, connect=connect, yes=yes, progress=progress)
        _finished(spec, out, remote["host"], as_json)
        return
    user_dir(out, create=True)
    with live_context(root_of(root), progress=progress, writable=True) as ctx:
        run_testbed(ctx, spec, out, uri=connect or spec.connect, yes=yes)
    _finished(spec, out, None, as_json)


def _finished(spec: Spec, out: str, host: str | None, as_json: bool) -> None:
    """What the run left in OUT, per variant (the same for a local and a remote run)."""
    if as_json:
        results = {}
        recorded = [rel.split("/")[1] for rel in result_files(out_tree(out))]
        for variant in spec.variants:
            results[variant.name] = {"kind": variant.kind, "repetitions": recorded.count(variant.name),
                                     "wanted": spec.repetitions}
        emit_json({"out": out, "host": host, "results": results})
    say(f"results in {out}; gpuvfio testbed report {out}")


@testbed_app.command("report")
def report_cmd(out: Annotated[str, typer.Argument(
                  metavar="DIR", help="A testbed run's --out directory.")], as_json: JsonOption = False) -> None:
    """report.md, report.html (self-contained, with plots) and results.json from a run's results."""
    summary = write_report(out)
    if as_json:
        emit_json(summary)
    else:
        sys.stdout.write("".join(f"{out}/{name}\n" for name in summary["files"]))
