"""Human output: the tables and reports people read. --json output never comes through here.

rich is imported when something is printed for a person, not when gpuvfio starts: a
machine reading --json does not pay for it. Each print_* takes the report through
output.printable_report(..., "markup") first: every string in it (a journal's, a host's, a
guest's) is then safe to interpolate into rich markup as it is, and is escaped once.
"""

from __future__ import annotations

import sys

from gpuvfio.cli.output import Column, Listing, printable_report, rich_console
from gpuvfio.sizes import pages_text
from gpuvfio.ops.plans import FORCE_HINT


def _table(**kwargs):
    from rich.table import Table

    return Table(**kwargs)


def make_console():
    # Piped output (make demo | less, CI logs) gets a wide table instead of 80 columns.
    return rich_console() if sys.stdout.isatty() else rich_console(width=160)


def print_status(report: dict, console=None) -> None:
    console = console or make_console()
    report = printable_report(report, "markup")  # the journal's fields and the host's drivers
    if not report["devices"] and not report["unfinished_operation"] and not any(
            report.get(k) for k in ("mdevs", "vgpus", "schedulers", "broken", "partitions")):
        console.print(f"gpuvfio holds no devices (state in {report['state_dir']})")
    if report["devices"]:
        table = _table(title="Devices held by gpuvfio", title_justify="left")
        for col in ("Address", "Group", "Driver now", "Override now", "Original driver", "Original override"):
            table.add_column(col, no_wrap=True)
        for dev in report["devices"]:
            table.add_row(dev["address"], str(dev["group"]), dev["driver"] or "none", dev["driver_override"] or "-",
                          dev["original_driver"] or "none", dev["original_override"] or "-")
        console.print(table)
    if report["services_stopped"]:
        console.print("Services stopped by gpuvfio (restore restarts them): " + ", ".join(report["services_stopped"]))
    for uuid, mdev in sorted((report.get("mdevs") or {}).items()):
        console.print(f"mdev {uuid}: type {mdev.get('type')} on {mdev.get('parent')} "
                      f"({mdev.get('state', 'created')})")
    for vf, vgpu in sorted((report.get("vgpus") or {}).items()):
        console.print(f"SR-IOV vGPU on VF {vf}: type {vgpu.get('type')} (parent {vgpu.get('parent')})")
    for gpu, previous in sorted((report.get("schedulers") or {}).items()):
        console.print(f"vGPU scheduler of {gpu} changed by gpuvfio; restore puts back {previous['policy']}")
    for address, mark in sorted((report.get("broken") or {}).items()):
        console.print(f"[bold red]{address} came back broken:[/] {mark.get('reason')} "
                      f"(refused by bind until gpuvfio reset {address})")
    for key, partition in (report.get("partitions") or {}).items():
        modules = ", ".join(map(str, partition["modules"])) or "?"
        console.print(f"Fabric Manager partition {key} ({partition['state']}): GPU modules "
                      f"{modules}, {', '.join(partition['devices'])} (restore deactivates it)")
    op = report["unfinished_operation"]
    if op:
        console.print(f"[yellow]Unfinished {op['kind']} (pid {op['pid']}); run gpuvfio restore:[/]")
        for step in op["steps"]:
            console.print(f"  {step['state'] or '':11} {step['description'] or ''}")


def status_listing(report: dict) -> Listing:
    """status as lspci-like rows (plain, CSV): one row a device gpuvfio holds; the rest of the
    journal (services, vGPUs, broken marks, partitions, an unfinished operation) as notes."""
    listing = Listing("Devices held by gpuvfio", [Column(title, keep=True) for title in (
        "Address", "Group", "Driver now", "Override now", "Original driver", "Original override")],
        empty="gpuvfio holds no device (its journal records none)")
    for dev in report["devices"]:
        listing.add(dev["address"], str(dev["group"]), dev["driver"] or "none", dev["driver_override"] or "-",
                    dev["original_driver"] or "none", dev["original_override"] or "-")
    if report["services_stopped"]:
        listing.notes.append("services stopped by gpuvfio (restore restarts them): "
                             + ", ".join(report["services_stopped"]))
    for uuid, mdev in sorted((report.get("mdevs") or {}).items()):
        listing.notes.append(f"mdev {uuid}: type {mdev.get('type')} on {mdev.get('parent')}")
    for vf, vgpu in sorted((report.get("vgpus") or {}).items()):
        listing.notes.append(f"SR-IOV vGPU on VF {vf}: type {vgpu.get('type')} (parent {vgpu.get('parent')})")
    for gpu, previous in sorted((report.get("schedulers") or {}).items()):
        listing.notes.append(f"vGPU scheduler of {gpu} changed by gpuvfio; restore puts back {previous['policy']}")
    for address, mark in sorted((report.get("broken") or {}).items()):
        listing.notes.append(f"{address} came back broken: {mark.get('reason')} (gpuvfio reset {address})")
    for key, partition in (report.get("partitions") or {}).items():
        listing.notes.append(f"Fabric Manager partition {key} ({partition['state']}): "
                             f"{', '.join(partition['devices'])}")
    op = report["unfinished_operation"]
    if op:
        listing.notes.append(f"unfinished {op['kind']} (pid {op['pid']}); run gpuvfio restore")
    return listing


PLAN_STYLE = {"ok": "green", "refuse": "bold red", "warn": "yellow", "skip": "dim"}


def print_plan(report: dict, console=None) -> None:
    """A bind plan: what ends on vfio-pci, every check (refusals first in red), the steps."""
    console = console or make_console()
    report = printable_report(report, "markup")  # check messages quote the host's drivers and names
    console.print(f"[bold]Devices that end on vfio-pci:[/] {', '.join(report['devices']) or 'none'}")
    _print_checks(console, report["checks"])
    _print_steps(console, "Steps", report["steps"])


def _print_checks(console, checks: list[dict]) -> None:
    """Every check of a plan (gpuvfio.planning.Check as JSON), refusals in red."""
    for check in checks:
        forced = FORCE_HINT if check.get("overridable") and check["status"] == "refuse" else ""
        console.print(f"  [{PLAN_STYLE.get(check['status'], '')}]{check['status']:6}[/] {check['id']}: "
                      f"{check['message']}{forced}")


def _print_steps(console, title: str, steps: list[dict] | None) -> None:
    """A plan's steps (gpuvfio.planning.Step as JSON) in the order the run takes them, each
    with the file it writes."""
    if not steps:
        return
    console.print(f"[bold]{title}:[/]")
    for number, step in enumerate(steps, start=1):
        console.print(f"  {number}. {step['description']}" + (f" ({step['path']})" if step.get("path") else ""))


VERIFY_STYLE = {"pass": "green", "fail": "bold red", "warn": "yellow", "skip": "dim", "expected": "cyan"}


def print_verify(report: dict, console=None) -> None:
    """The in-guest checks, one line each, then the measured bandwidths."""
    console = console or make_console()
    report = printable_report(report, "markup")  # what the guest answered is the guest's to choose
    for check in report["checks"]:
        detail = " ".join(str(x) for x in (
            f"expected {check['expected']}" if check["expected"] is not None else "",
            f"observed {check['observed']}" if check["observed"] is not None else "",
            check["reason"] or "") if x)
        where = f"{check['device']} " if check.get("device") else ""
        console.print(f"  [{VERIFY_STYLE.get(check['status'], 'bold')}]{check['status']:8}[/] {check['id']:15} "
                      f"{where + detail}")
    for bus, rates in report["bandwidth_gbps"].items():
        console.print(f"  bandwidth {bus}: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in rates.items()))


def print_operation_plan(report: dict, console=None, *, show_xml: bool = False) -> None:
    """An operation's plan (gpuvfio.ops.plans.Plan as JSON): its checks (refusals in red), its
    steps in the order the run takes them, the notes, and the domain's differences against
    libvirt's definition."""
    console = console or make_console()
    report = printable_report(report, "markup")  # messages quote the host's drivers and domain names
    verdict = {"refused": "[bold red]refused[/]", "nothing_to_do": "nothing to do", "planned": "planned"}
    console.print(f"[bold]{report['operation']} {report['target']}:[/] {verdict.get(report['result'], '')}")
    _print_checks(console, report["checks"])
    _print_steps(console, "Steps", report["steps"])
    for note in report["notes"]:
        console.print(f"  note: {note}")
    _print_steps(console, "Bind steps", (report.get("bind") or {}).get("steps"))
    _print_placement(console, report.get("placement"))
    _print_verify(console, report.get("verify"))
    if report.get("changes"):
        console.print("[bold]Differences against libvirt's definition:[/]")
        for line in report["changes"]:
            console.print(f"  {line}")
    elif report.get("xml") and report.get("changes") is not None:
        console.print("[bold]Domain:[/] new, none of that name in libvirt" + ("" if show_xml else
                                                                             " (--show-xml prints its XML)"))
    elif report.get("xml") and not show_xml:
        console.print("[bold]Domain:[/] libvirt not asked what it holds (--show-xml prints the XML)")
    if show_xml and report.get("xml"):
        console.print("[bold]Domain XML:[/]")
        console.print(report["xml"], markup=False, highlight=False)


def _print_placement(console, placement: dict | None) -> None:
    """Where the guest sits: each cell's vCPUs on host CPUs, its memory's node and page size."""
    if not placement or not placement.get("cells"):
        return
    pages = pages_text(placement.get("hugepage_kib"))
    console.print(f"[bold]Placement:[/] {pages}" + (", guest NUMA cells mirror the host's"
                                                     if placement.get("guest_numa") else ""))
    for cell in placement["cells"]:
        pins = ", ".join(f"{v}->{c}" for v, c in zip(cell.get("vcpus", []), cell.get("host_cpus", [])))
        node = cell.get("node")
        memory = f"{(cell.get('memory_kib') or 0) // 1024} MiB on node {node}" if node is not None else \
            f"{(cell.get('memory_kib') or 0) // 1024} MiB, not pinned"
        console.print(f"  cell {node}: vCPU->host CPU {pins or 'not pinned'}; memory {memory}; emulator on "
                      f"{_ranges(cell.get('emulator_cpus') or []) or 'any CPU'}")


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> 0-2,5 (the kernel's cpulist form)."""
    out: list[str] = []
    for value in sorted(set(values)):
        if out and value == int(out[-1].rpartition("-")[2]) + 1:
            out[-1] = f"{out[-1].partition('-')[0]}-{value}"
        else:
            out.append(str(value))
    return ",".join(out)


def _print_verify(console, verify: dict | None) -> None:
    if not verify:
        return
    console.print("[bold]Verify:[/] " + "; ".join(filter(None, (
        verify.get("link"), f"copy bandwidth {verify['bandwidth_floor']}" if verify.get("bandwidth") else
        "no bandwidth measured", f"probe within {verify.get('probe_timeout_s'):g}s, verifier within "
        f"{verify.get('verify_timeout_s'):g}s"))))
