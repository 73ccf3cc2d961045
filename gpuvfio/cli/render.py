"""Human output: the tables and reports people read. --json output never comes through here.

rich is imported when something is printed for a person, not when gpuvfio starts: a
machine reading --json does not pay for it. Each print_* takes the report through
output.printable_report(..., "markup") first: every string in it (a journal's, a host's, a
guest's) is then safe to interpolate into rich markup as it is, and is escaped once.
"""

from __future__ import annotations

import sys

from gpuvfio.cli.output import Column, Listing, printable_report, rich_console


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
        "Address", "Group", "Driver now", "Override now", "Original driver", "Original override")])
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
    for check in report["checks"]:
        forced = " (overridable with --force)" if check["overridable"] and check["status"] == "refuse" else ""
        console.print(f"  [{PLAN_STYLE.get(check['status'], '')}]{check['status']:6}[/] {check['id']}: "
                      f"{check['message']}{forced}")
    if report["steps"]:
        console.print("[bold]Steps:[/]")
        for number, step in enumerate(report["steps"], start=1):
            console.print(f"  {number}. {step['description']}")


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


def print_operation_plan(report: dict, console=None) -> None:
    """An operation's plan (gpuvfio.ops.plans.Plan as JSON): its checks (refusals in red), its
    steps in the order the run takes them, the notes, and the domain's differences against
    libvirt's definition."""
    console = console or make_console()
    report = printable_report(report, "markup")  # messages quote the host's drivers and domain names
    verdict = {"refused": "[bold red]refused[/]", "nothing_to_do": "nothing to do", "planned": "planned"}
    console.print(f"[bold]{report['operation']} {report['target']}:[/] {verdict.get(report['result'], '')}")
    for check in report["checks"]:
        console.print(f"  [{PLAN_STYLE.get(check['status'], '')}]{check['status']:6}[/] {check['id']}: "
                      f"{check['message']}")
    if report["steps"]:
        console.print("[bold]Steps:[/]")
        for number, step in enumerate(report["steps"], start=1):
            console.print(f"  {number}. {step['step']}" + (f": {step['detail']}" if step["detail"] else ""))
    for note in report["notes"]:
        console.print(f"  note: {note}")
    if report.get("changes"):
        console.print("[bold]Differences against libvirt's definition:[/]")
        for line in report["changes"]:
            console.print(f"  {line}")
