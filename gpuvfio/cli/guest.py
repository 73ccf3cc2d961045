"""gpuvfio verify, attach, detach."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from gpuvfio.cli import render
from gpuvfio.cli.app import JsonOption, RootOption, app, emit_json, progress_for, root_of, say
from gpuvfio.cli.devices import DeviceIds, Devices, Yes, complete_device
from gpuvfio.cli.domain import (ConsoleLog, DomainArgs, Firmware, ForwardPort, Hugepages, Loader, Memory, Name, Numa,
                                NvramTemplate, P2p, Path, QemuVersion, RomBar, RomFile, Text, Topology, Vcpus,
                                VirtType)
from gpuvfio.cli.plans import DryRun, command_context, needs_yes, show_plan
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.ops.binding import BindPolicy, libvirt_not_asked
from gpuvfio.ops.context import check_uri, default_uri, live_context
from gpuvfio.ops.attach_plan import plan_attach
from gpuvfio.ops.domains import complete_domains
from gpuvfio.ops.guests import (PROBE_TIMEOUT, VERIFY_TIMEOUT, AttachFailed, attach, detach, parse_expect, verify,
                                verify_options)
from gpuvfio.ops.targets import ssh_options
from gpuvfio.ops.selection import check_devices, resolve

SshHost = Annotated[Optional[str], typer.Option("--ssh-host", help="Guest address (default: discovered).")]
SshPort = Annotated[Optional[int], typer.Option("--ssh-port", help="Guest SSH port (default: discovered, else 22).")]
SshUser = Annotated[Optional[str], typer.Option("--ssh-user", help="Default: the SSH config's User, else root.")]
SshConfig = Annotated[Optional[str], typer.Option(
    "--ssh-config", metavar="FILE", help="An ssh_config file instead of ~/.ssh/config (Host aliases, HostName, User, "
                                         "Port, IdentityFile, UserKnownHostsFile, ProxyJump).")]
SshKey = Annotated[Optional[str], typer.Option("--ssh-key", metavar="FILE")]
KnownHosts = Annotated[Optional[str], typer.Option("--known-hosts", metavar="FILE", help="Pinned host keys.")]
Tofu = Annotated[bool, typer.Option("--trust-on-first-use", help="Accept and record an unknown host key.")]
Connect = Annotated[Optional[str], typer.Option("--connect", metavar="URI", help="libvirt URI.")]
ProbeTimeout = Annotated[float, typer.Option("--probe-timeout", metavar="SECONDS",
                                             help="Allow the in-guest probe this long (slow, emulated guests).")]
VerifyTimeout = Annotated[float, typer.Option("--verify-timeout", metavar="SECONDS",
                                              help="Allow the in-guest verifier (bandwidth runs) this long.")]


# The verifier's measurement options: verify takes them, and attach for its verification.
NoBandwidth = Annotated[bool, typer.Option("--no-bandwidth", help="Skip the copy measurements.")]
LinkEfficiency = Annotated[Optional[float], typer.Option(
    "--link-efficiency", metavar="FRACTION", help="Share of the slot's link each copy must reach "
                                                  "(default 0.762: 48 GB/s at Gen5 x16).")]
MinGbps = Annotated[Optional[float], typer.Option("--min-gbps", metavar="GBPS",
                                                  help="Absolute bandwidth floor per direction instead.")]
SizeMib = Annotated[Optional[int], typer.Option("--size-mib", help="Copy buffer (default 512, as nvbandwidth).")]
Copies = Annotated[Optional[int], typer.Option("--copies", help="Copies per sample (default 16).")]
Samples = Annotated[Optional[int], typer.Option("--samples", help="Samples, median reported (default 3).")]


def _complete_domain(ctx: typer.Context, incomplete: str) -> list[str]:
    # completion opens libvirt itself: a URI the policy refuses completes nothing, and a Tab
    # prints no warning into the shell's line
    try:
        uri = check_uri(ctx.params.get("connect") or default_uri(), source="--connect", warn=lambda _line: None)
    except GpuvfioError:
        return []
    return complete_domains(uri, incomplete)


@app.command("verify")
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
    ssh_host: SshHost = None, ssh_port: SshPort = None, ssh_user: SshUser = None, ssh_key: SshKey = None,
    ssh_config: SshConfig = None,
    known_hosts: KnownHosts = None, trust_on_first_use: Tofu = False, connect: Connect = None,
    no_bandwidth: NoBandwidth = False, link_efficiency: LinkEfficiency = None, min_gbps: MinGbps = None,
    size_mib: SizeMib = None, copies: Copies = None, samples: Samples = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for SSH.")] = 60.0,
    probe_timeout: ProbeTimeout = PROBE_TIMEOUT, verify_timeout: VerifyTimeout = VERIFY_TIMEOUT,
    as_json: JsonOption = False, root: RootOption = None,
) -> None:
    """Check a guest over SSH: the assigned devices are there, driver, CUDA, PCIe link, bandwidth."""
    check_uri(connect, source="--connect")
    check_devices(expect_device, None, required=False)
    wanted_ids = parse_expect(expect_ids) if expect_ids else None
    ssh = ssh_options(host=ssh_host, port=ssh_port, user=ssh_user, key=ssh_key, known_hosts=known_hosts,
                      ssh_config=ssh_config, trust_on_first_use=trust_on_first_use, timeout=timeout)
    if ssh.host is None and domain is None:
        raise InputError("give --ssh-host (and --ssh-port) or a domain name")
    options = verify_options(bandwidth=not no_bandwidth, probe_timeout=probe_timeout, timeout=verify_timeout,
                             link_efficiency=link_efficiency, min_gbps=min_gbps, size_mib=size_mib, copies=copies,
                             samples=samples)
    with live_context(root_of(root), progress=progress_for(as_json)) as ctx:
        expect = resolve(ctx.host, expect_device, None) if expect_device else None
        report = verify(ctx, ssh=ssh, domain=domain, uri=connect, expect=expect, expect_ids=wanted_ids,
                        options=options)
    if as_json:
        emit_json(report)
    else:
        for note in report["ssh_notes"]:
            say(note)
        render.print_verify(report)
    if not report["ok"]:
        raise typer.Exit(1)


@app.command("attach")
def attach_cmd(
    addresses: Devices = None, device_ids: DeviceIds = None, yes: Yes = False,
    name: Name = ..., vcpus: Vcpus = 4, memory: Memory = "8G", hugepages: Hugepages = "auto", numa: Numa = "auto",
    firmware: Firmware = "efi", virt_type: VirtType = "kvm", loader: Loader = None,
    nvram_template: NvramTemplate = None, rom_bar: RomBar = None, rom_file: RomFile = None,
    disk: Path = None, kernel: Path = None, initrd: Path = None, cmdline: Text = None,
    network: Annotated[Optional[str], typer.Option("--network", metavar="NAME")] = None,
    user_net_ssh_port: ForwardPort = None, console_log: ConsoleLog = None,
    topology: Topology = "auto", p2p: P2p = "auto", qemu_version: QemuVersion = None,
    ssh_host: SshHost = None, ssh_port: SshPort = None, ssh_user: SshUser = None, ssh_key: SshKey = None,
    ssh_config: SshConfig = None,
    known_hosts: KnownHosts = None, trust_on_first_use: Tofu = False, connect: Connect = None,
    force: Annotated[bool, typer.Option("--force", help="Share cores / accept short hugepages, and override the "
                                                        "overridable bind checks.")] = False,
    stop_services: Annotated[bool, typer.Option("--stop-services", help="Stop NVIDIA services that hold the GPU "
                                                                        "while binding; restore restarts them.")]
    = False,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Wait for SSH, skip the in-guest checks.")] = False,
    no_bandwidth: NoBandwidth = False, link_efficiency: LinkEfficiency = None, min_gbps: MinGbps = None,
    size_mib: SizeMib = None, copies: Copies = None, samples: Samples = None,
    keep_on_failure: Annotated[bool, typer.Option("--keep-on-failure", help="Leave a failed attach as it is, for "
                                                                            "inspection.")] = False,
    boot_timeout: Annotated[float, typer.Option("--boot-timeout", help="Seconds from start until SSH answers.")]
    = 300.0,
    probe_timeout: ProbeTimeout = PROBE_TIMEOUT, verify_timeout: VerifyTimeout = VERIFY_TIMEOUT,
    dry_run: DryRun = False, as_json: JsonOption = False, root: RootOption = None,
) -> None:
    """Bind, define, start, wait and verify a guest with GPUs passed through; undone on failure."""
    check_uri(connect, source="--connect")
    check_devices(addresses, device_ids, required=False)
    request = DomainArgs(name, vcpus, memory, hugepages, numa, firmware, virt_type, disk, kernel, initrd, cmdline,
                         network, user_net_ssh_port, console_log, force, topology, p2p, qemu_version, loader,
                         nvram_template, rom_bar, rom_file).request()
    ssh = ssh_options(host=ssh_host, port=ssh_port, user=ssh_user, key=ssh_key, known_hosts=known_hosts,
                      ssh_config=ssh_config, trust_on_first_use=trust_on_first_use, timeout=boot_timeout)
    checks = verify_options(bandwidth=not no_bandwidth, probe_timeout=probe_timeout, timeout=verify_timeout,
                            link_efficiency=link_efficiency, min_gbps=min_gbps, size_mib=size_mib, copies=copies,
                            samples=samples)  # checked even with --no-verify: bad input is bad input
    if no_verify:
        checks = None
    policy = BindPolicy(force=force, stop_services=stop_services)
    if dry_run:
        with command_context(root_of(root), True, progress=progress_for(as_json)) as ctx:
            wanted = resolve(ctx.host, addresses, device_ids, changes=True, yes=True, tell=progress_for(as_json))
            unconfirmed = None if yes else needs_yes(ctx, addresses, device_ids)
            plan = plan_attach(ctx, wanted, request, uri=connect, ssh=ssh, verify=checks, policy=policy,
                               ask_libvirt=libvirt_not_asked(ctx, connect) is None)
            show_plan(plan, as_json, unconfirmed=unconfirmed)
        return
    try:
        with live_context(root_of(root), progress=progress_for(as_json)) as ctx:
            wanted = resolve(ctx.host, addresses, device_ids, changes=True, yes=yes, tell=progress_for(as_json))
            result = attach(ctx, wanted, request, uri=connect, ssh=ssh, verify=checks,
                            keep_on_failure=keep_on_failure, policy=policy)
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
        if result.report:
            render.print_verify(result.report)
        nccl = result.nccl_topology
        if nccl is not None:
            say(f"NCCL topology written in the guest: {nccl['use']}" if nccl["written"]
                else f"warning: NCCL topology NOT written: {nccl['error']}")
        say(f"{name} is running ({'verified' if result.ok else 'verification FAILED'}); "
            f"gpuvfio detach {name} undoes it")
    if not result.ok:
        raise typer.Exit(1)


@app.command("detach")
def detach_cmd(name: Annotated[str, typer.Argument(metavar="NAME", autocompletion=_complete_domain)],
               connect: Connect = None,
               timeout: Annotated[float, typer.Option("--timeout", help="Seconds for ACPI shutdown.")] = 60.0,
               as_json: JsonOption = False, root: RootOption = None) -> None:
    """Stop a guest, undefine it if gpuvfio defined it, and give its devices back."""
    check_uri(connect, source="--connect")
    with live_context(root_of(root), progress=progress_for(as_json)) as ctx:
        report = detach(ctx, name, uri=connect, timeout=timeout)
    if as_json:
        emit_json(report)
