"""Typer commands for binding: bind, unbind, restore, status (registered on cli.app)."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from gpuvfio.cli import JsonOption, RootOption, app, resolve_root
from gpuvfio.main import COMMANDS, emit_json, fail

Addresses = Annotated[list[str], typer.Argument(metavar="ADDR...", help="PCI functions (DDDD:BB:SS.F).")]
OptionalAddresses = Annotated[Optional[list[str]], typer.Argument(metavar="[ADDR]...",
                                                                  help="Only these devices (default: all).")]
WriteTimeout = Annotated[float, typer.Option("--timeout", metavar="SECONDS",
                                             help="Give up on a sysfs write the kernel does not return from.")]
LockTimeoutOpt = Annotated[float, typer.Option("--lock-timeout", metavar="SECONDS",
                                               help="Wait this long for another gpuvfio run to finish.")]


def _parse(addresses: list[str] | None):
    from gpuvfio.address import PciAddress

    return [PciAddress.parse(a) for a in addresses or []]


def _live(root: str | None, timeout: float):
    from gpuvfio.bindapply import live_actions
    from gpuvfio.hostroot import HostRoot
    from gpuvfio.sysfs_write import SysfsWriter

    host = HostRoot(resolve_root(root))
    return host, SysfsWriter(host, timeout=timeout), live_actions(host)


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")


def _print_plan(report: dict) -> None:
    from rich.markup import escape

    from gpuvfio.render import make_console

    console = make_console()
    style = {"ok": "green", "refuse": "bold red", "warn": "yellow", "skip": "dim"}
    console.print(f"[bold]Devices that end on vfio-pci:[/] {', '.join(report['devices']) or 'none'}")
    for check in report["checks"]:
        forced = " (overridable with --force)" if check["overridable"] and check["status"] == "refuse" else ""
        console.print(f"  [{style.get(check['status'], '')}]{check['status']:6}[/] {check['id']}: "
                      f"{escape(check['message'])}{forced}")
    if report["steps"]:
        console.print("[bold]Steps:[/]")
        for number, step in enumerate(report["steps"], start=1):
            console.print(f"  {number}. {escape(step['description'])}")


@app.command("bind", help=COMMANDS["bind"])
def bind_cmd(
    addresses: Addresses,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Override the checks marked overridable "
                                        "(non-viable group, boot VGA).")] = False,
    stop_services: Annotated[bool, typer.Option("--stop-services", help="Stop nvidia-persistenced, "
                                                "fabricmanager, DCGM now; restore restarts them.")] = False,
    allow_unsafe_host: Annotated[bool, typer.Option("--allow-unsafe-host", help="DANGEROUS: bind even with "
                                                    "ACS override, unsafe interrupts or no-IOMMU mode.")] = False,
    connect: Annotated[Optional[str], typer.Option("--connect", metavar="URI", help="libvirt URI to check for "
                                                   "domains using the devices (default qemu:///system on /).")] = None,
    timeout: WriteTimeout = 10.0,
    lock_timeout: LockTimeoutOpt = 30.0,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    from gpuvfio import bindcmd
    from gpuvfio.libvirt_domains import domain_lookup

    wanted = _parse(addresses)
    host, writer, actions = _live(root, timeout)
    uri = connect or ("qemu:///system" if host.root == "/" else None)
    try:
        report = bindcmd.bind(host, wanted, writer=writer, actions=actions, dry_run=dry_run, force=force,
                              stop_services=stop_services, allow_unsafe_host=allow_unsafe_host,
                              domains_using=domain_lookup(uri) if uri else None, lock_timeout=lock_timeout,
                              progress=_say if not as_json else (lambda line: None))
    except bindcmd.Refused as exc:
        emit_json(exc.report) if as_json else _print_plan(exc.report)
        fail(str(exc), 1)
    if as_json:
        emit_json(report)
        return
    if dry_run or report.get("result") == "nothing_to_do":
        _print_plan(report)
    if report.get("result") == "nothing_to_do":
        _say(f"nothing to do: {', '.join(report['devices'])} already on vfio-pci")
    elif report.get("result") == "applied":
        _say(f"bound to vfio-pci: {', '.join(report['devices'])} (gpuvfio restore gives them back)")


@app.command("unbind", help=COMMANDS["unbind"])
def unbind_cmd(addresses: Addresses, timeout: WriteTimeout = 10.0, lock_timeout: LockTimeoutOpt = 30.0,
               as_json: JsonOption = False, root: RootOption = None) -> None:
    from gpuvfio import bindcmd

    wanted = _parse(addresses)
    host, writer, _actions = _live(root, timeout)
    report = bindcmd.unbind(host, wanted, writer=writer, lock_timeout=lock_timeout)
    if as_json:
        emit_json(report)
    else:
        for address, driver in report["drivers"].items():
            _say(f"{address}: now on {driver}")


@app.command("restore", help=COMMANDS["restore"])
def restore_cmd(addresses: OptionalAddresses = None, timeout: WriteTimeout = 10.0,
                lock_timeout: LockTimeoutOpt = 30.0, as_json: JsonOption = False, root: RootOption = None) -> None:
    from gpuvfio import bindcmd
    from gpuvfio.errors import GpuvfioError

    wanted = _parse(addresses)
    host, writer, actions = _live(root, timeout)
    try:
        report = bindcmd.restore(host, wanted, writer=writer, actions=actions, lock_timeout=lock_timeout,
                                 progress=(lambda line: None) if as_json else _say)
    except GpuvfioError as exc:
        if as_json and hasattr(exc, "report"):
            emit_json(exc.report)
        raise
    if as_json:
        emit_json(report)
    elif not report["restored"] and not report.get("vgpu"):
        _say("nothing to restore")


@app.command("status", help=COMMANDS["status"])
def status_cmd(as_json: JsonOption = False, root: RootOption = None) -> None:
    from gpuvfio import bindcmd
    from gpuvfio.hostroot import HostRoot

    report = bindcmd.status(HostRoot(resolve_root(root)))
    if as_json:
        emit_json(report)
        return
    from gpuvfio.render import print_status

    print_status(report)


def _persist(addresses, remove, dry_run, as_json, lock_timeout, root) -> None:
    from gpuvfio import bindcmd
    from gpuvfio.hostroot import HostRoot

    wanted = _parse(addresses)
    report = bindcmd.persist(HostRoot(resolve_root(root)), wanted, remove=remove, dry_run=dry_run,
                             lock_timeout=lock_timeout)
    if as_json:
        emit_json(report)
        return
    for change in report["changes"]:
        sys.stdout.write(change["diff"] if dry_run else f"{change['action']}: {change['path']}\n")
    if report["result"] == "nothing_to_do":
        _say(f"nothing to do: {', '.join(report['devices'])} already "
             + ("not persisted" if remove else f"persisted ({report['mechanism']})"))
    elif "next" in report:
        _say(("would then need to " if dry_run else "next: ") + report["next"])


DryRun = Annotated[bool, typer.Option("--dry-run", help="Show the file changes as a diff; change nothing.")]


@app.command("persist", help=COMMANDS["persist"])
def persist_cmd(addresses: Addresses, dry_run: DryRun = False, lock_timeout: LockTimeoutOpt = 30.0,
                as_json: JsonOption = False, root: RootOption = None) -> None:
    _persist(addresses, False, dry_run, as_json, lock_timeout, root)


@app.command("unpersist", help=COMMANDS["unpersist"])
def unpersist_cmd(addresses: Addresses, dry_run: DryRun = False, lock_timeout: LockTimeoutOpt = 30.0,
                  as_json: JsonOption = False, root: RootOption = None) -> None:
    _persist(addresses, True, dry_run, as_json, lock_timeout, root)
