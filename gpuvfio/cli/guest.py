"""gpuvfio verify, attach, detach."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from gpuvfio.cli import render
from gpuvfio.cli.app import JsonOption, RootOption, emit_json, progress_for, root_of, say
from gpuvfio.cli.lazy import command_typer
from gpuvfio.cli.devices import DeviceIds, Devices, Yes, complete_device
from gpuvfio.cli.plans import DryRun, command_context, confirmation, show_plan
from gpuvfio.cli.tables import from_table, options
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.ops.binding import BindPolicy, libvirt_not_asked
from gpuvfio.ops.context import live_context
from gpuvfio.ops.uris import check_uri, default_uri, libvirt_uri
from gpuvfio.ops.attach_plan import plan_attach
from gpuvfio.ops.domain_completion import domain_candidates
from gpuvfio.ops.domains import domain_request
from gpuvfio.ops.guests import AttachFailed, attach, detach, parse_expect, plan_detach, verify, verify_options
from gpuvfio.ops.targets import ssh_from_table
from gpuvfio.ops.selection import check_devices, resolve
from gpuvfio.options import DOMAIN, RUN, SSH, VERIFY

commands = command_typer()  # its commands, listed in gpuvfio.cli.lazy.COMMANDS

def _complete_domain(ctx: typer.Context, incomplete: str) -> list[str]:
    # completion opens libvirt itself: a URI the policy refuses completes nothing, and a Tab
    # prints no warning into the shell's line
    try:
        uri = check_uri(ctx.params.get("connect") or default_uri(), source="--connect", warn=lambda _line: None)
    except GpuvfioError:
        return []
    return domain_candidates(uri, incomplete)


@commands.command("verify")
@from_table
def verify_cmd(
    domain: Annotated[Optional[str], typer.Argument(metavar="[DOMAIN]", help="Find the guest through libvirt.",
                                                    autocompletion=_complete_domain)] = None,
    expect_device: Annotated[Optional[list[str]], typer.Option(
        "--expect-device", metavar="DEVICE", help="Host device that must be in the guest, as a device argument "
                                                  "(01:00 is every function of the slot; default: the devices "
                                                  "gpuvfio assigned to DOMAIN).",
        autocompletion=complete_device)] = None,
    expect_ids: Annotated[Optional[list[str]], typer.Option(
        "--expect", metavar="VENDOR:DEVICE[xN]", help="N functions with these IDs must be in the guest (a guest "
                                                      "gpuvfio did not define; e.g. 10de:2335x4).")] = None,
    ssh: dict = options(SSH, "verify"), run: dict = options(RUN, "verify"), checks: dict = options(VERIFY, "verify"),
    as_json: JsonOption = False, root: RootOption = None,
) -> None:
    """Check a guest over SSH: the assigned devices are there, driver, CUDA, PCIe link, bandwidth."""
    connect = libvirt_uri(run["connect"], needed_for=None if domain is None else "finding the guest by its domain")
    check_devices(expect_device, None, required=False)
    wanted_ids = parse_expect(expect_ids) if expect_ids else None
    target = ssh_from_table(ssh, wait="ssh_timeout")
    if target.host is None and domain is None:
        raise InputError("give --ssh-host (and --ssh-port) or a domain name")
    settings = verify_options(**checks)
    with live_context(root_of(root), progress=progress_for(as_json), writable=True) as ctx:
        expect = resolve(ctx, expect_device, None) if expect_device else None
        report = verify(ctx, ssh=target, domain=domain, uri=connect, expect=expect, expect_ids=wanted_ids,
                        options=settings)
    if as_json:
        emit_json(report.to_json())
    else:
        for note in report.ssh_notes or []:
            say(note)
        render.print_verify(report.to_json())
    if not report.ok:
        raise typer.Exit(1)


@commands.command("attach")
@from_table
def attach_cmd(
    addresses: Devices = None, device_ids: DeviceIds = None, yes: Yes = False,
    domain: dict = options(DOMAIN, "attach"), ssh: dict = options(SSH, "attach"), run: dict = options(RUN, "attach"),
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Wait for SSH, skip the in-guest checks.")] = False,
    checks: dict = options(VERIFY, "attach"),
    keep_on_failure: Annotated[bool, typer.Option("--keep-on-failure", help="Leave a failed attach as it is, for "
                                                                            "inspection.")] = False,
    dry_run: DryRun = False, as_json: JsonOption = False, root: RootOption = None,
    show_xml: Annotated[bool, typer.Option("--show-xml", help="With --dry-run: print the whole domain XML "
                                                              "too (the plan shows its differences).")] = False,
) -> None:
    """Bind, define, start, wait and verify a guest with GPUs passed through; undone on failure."""
    connect = libvirt_uri(run.pop("connect"), needed_for="attach")
    check_devices(addresses, device_ids, required=False)
    cloud_init = ssh.pop("cloud_init")
    request = domain_request(**domain)
    target = ssh_from_table(ssh, wait="boot_timeout")
    settings = verify_options(**checks)  # checked even with --no-verify: bad input is bad input
    if no_verify:
        settings = None
    policy = BindPolicy(force=domain["force"], stop_services=run["stop_services"],
                        take_host_devices=run["take_host_devices"])
    if dry_run:
        with command_context(root_of(root), True, progress=progress_for(as_json)) as ctx:
            wanted = resolve(ctx, addresses, device_ids, changes=True, yes=True, tell=progress_for(as_json))
            confirm = confirmation(ctx, addresses, device_ids, yes)
            plan = plan_attach(ctx, wanted, request, uri=connect, ssh=target, verify=settings, policy=policy,
                               ask_libvirt=libvirt_not_asked(ctx, connect) is None, cloud_init=cloud_init)
            show_plan(plan, as_json, confirm=confirm, show_xml=show_xml)
        return
    try:
        with live_context(root_of(root), progress=progress_for(as_json), writable=True) as ctx:
            wanted = resolve(ctx, addresses, device_ids, changes=True, yes=yes, tell=progress_for(as_json))
            result = attach(ctx, wanted, request, uri=connect, ssh=target, verify=settings,
                            keep_on_failure=keep_on_failure, policy=policy, cloud_init=cloud_init)
    except AttachFailed as exc:
        if as_json:
            emit_json(exc.result.to_json())
        raise
    if as_json:
        emit_json(result.to_json())
    else:
        for note in (result.ssh or {}).get("notes", []) + [f"note: {n}" for n in result.notes]:
            say(note)
        if result.start_to_ssh_s is not None:
            say(f"the guest answered SSH {result.start_to_ssh_s:.1f}s after libvirt started it")
        if result.report is not None:
            render.print_verify(result.report.to_json())
        nccl = result.nccl_topology
        if nccl is not None:
            if not nccl.written:
                say(f"warning: NCCL topology NOT written: {nccl.error}")
            else:
                say(f"{'' if nccl.named else 'warning: '}NCCL topology written in the guest: {nccl.use}")
        say(f"{request.name} is running ({'verified' if result.ok else 'verification FAILED'}); "
            f"gpuvfio detach {request.name} undoes it")
    if not result.ok:
        raise typer.Exit(1)


@commands.command("detach")
@from_table
def detach_cmd(name: Annotated[str, typer.Argument(
                   metavar="NAME", help="The libvirt domain.", autocompletion=_complete_domain)],
               run: dict = options(RUN, "detach"),
               dry_run: DryRun = False, as_json: JsonOption = False, root: RootOption = None) -> None:
    """Stop a guest, undefine it if gpuvfio defined it, and give its devices back."""
    connect = libvirt_uri(run["connect"], needed_for="detach")
    if dry_run:
        with command_context(root_of(root), True, progress=progress_for(as_json)) as ctx:
            show_plan(plan_detach(ctx, name, uri=connect, timeout=run["stop_timeout"]), as_json)
        return
    with live_context(root_of(root), progress=progress_for(as_json), writable=True) as ctx:
        result = detach(ctx, name, uri=connect, timeout=run["stop_timeout"])
    if as_json:
        emit_json(result.to_json())
