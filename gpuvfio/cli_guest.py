"""Typer commands for guests: verify, attach, detach."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from gpuvfio.cli import JsonOption, RootOption, app, resolve_root
from gpuvfio.main import COMMANDS, emit_json, fail

SshHost = Annotated[Optional[str], typer.Option("--ssh-host", help="Guest address (default: discovered).")]
SshPort = Annotated[Optional[int], typer.Option("--ssh-port")]
SshUser = Annotated[str, typer.Option("--ssh-user")]
SshKey = Annotated[Optional[str], typer.Option("--ssh-key", metavar="FILE")]
KnownHosts = Annotated[Optional[str], typer.Option("--known-hosts", metavar="FILE", help="Pinned host keys.")]
Tofu = Annotated[bool, typer.Option("--trust-on-first-use", help="Accept and record an unknown host key.")]
Connect = Annotated[Optional[str], typer.Option("--connect", metavar="URI", help="libvirt URI.")]


def _target(host, port, user, key, known_hosts, tofu):
    from gpuvfio.ssh import SshTarget

    if host is None:
        return None
    return SshTarget(host, port or 22, user, key, known_hosts, tofu)


def _print_report(report: dict) -> None:
    from rich.markup import escape

    from gpuvfio.render import make_console

    console = make_console()
    style = {"pass": "green", "fail": "bold red", "warn": "yellow", "skip": "dim"}
    for check in report["checks"]:
        detail = " ".join(str(x) for x in (
            f"expected {check['expected']}" if check["expected"] is not None else "",
            f"observed {check['observed']}" if check["observed"] is not None else "",
            check["reason"] or "") if x)
        console.print(f"  [{style[check['status']]}]{check['status']:4}[/] {check['id']:14} {escape(detail)}")
    for bus, rates in report["bandwidth_gbps"].items():
        console.print(f"  bandwidth {bus}: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in rates.items()))


@app.command("verify", help=COMMANDS["verify"])
def verify_cmd(
    domain: Annotated[Optional[str], typer.Argument(metavar="[DOMAIN]", help="Find the guest through libvirt.")] = None,
    expect_device: Annotated[Optional[list[str]], typer.Option("--expect-device", metavar="ADDR",
                                                               help="Host device that must be in the guest.")] = None,
    ssh_host: SshHost = None, ssh_port: SshPort = None, ssh_user: SshUser = "root", ssh_key: SshKey = None,
    known_hosts: KnownHosts = None, trust_on_first_use: Tofu = False, connect: Connect = None,
    no_bandwidth: Annotated[bool, typer.Option("--no-bandwidth", help="Skip the copy measurements.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for SSH.")] = 60.0,
    as_json: JsonOption = False, root: RootOption = None,
) -> None:
    from gpuvfio.address import PciAddress
    from gpuvfio.commands import open_host
    from gpuvfio.errors import InputError
    from gpuvfio.inventory import read_inventory
    from gpuvfio.journal import known_hosts_file
    from gpuvfio.ssh import Session, SshTarget
    from gpuvfio.verify import expectations, verify_guest

    wanted = [PciAddress.parse(a) for a in expect_device or []]
    with open_host(resolve_root(root)) as (host, _label):
        expected = expectations(read_inventory(host), wanted)
        default_known = known_hosts_file(host)
    target = _target(ssh_host, ssh_port, ssh_user, ssh_key, known_hosts, trust_on_first_use)
    if target is None:
        if domain is None:
            raise InputError("give --ssh-host (and --ssh-port) or a domain name")
        from gpuvfio import guests

        conn = guests.connect(connect)
        try:
            dom = guests.lookup(conn, domain)
            if dom is None:
                raise InputError(f"no domain named {domain}")
            address, port = guests.ssh_address(conn, dom)
        finally:
            conn.close()
        target = SshTarget(address, ssh_port or port, ssh_user, ssh_key, known_hosts, trust_on_first_use)
    target.connect_timeout = timeout
    with Session(target, default_known) as session:
        report = verify_guest(session, expected, bandwidth=not no_bandwidth)
    report["ssh_notes"] = target.notes
    if as_json:
        emit_json(report)
    else:
        for note in target.notes:
            sys.stderr.write(f"gpuvfio: {note}\n")
        _print_report(report)
    if not report["ok"]:
        raise typer.Exit(1)


def _restore_held(host):
    """Restore only what the journal holds (devices already on vfio-pci before stay)."""
    from gpuvfio import bindcmd
    from gpuvfio.bindapply import live_actions
    from gpuvfio.journal import Journal, state_dir
    from gpuvfio.sysfs_write import SysfsWriter

    def restore(addresses):
        held = set(Journal.load(state_dir(host)).devices)
        mine = [a for a in addresses if str(a) in held]
        if not mine:
            return {"restored": {}}
        return bindcmd.restore(host, mine, writer=SysfsWriter(host), actions=live_actions(host))

    return restore


@app.command("attach", help=COMMANDS["attach"])
def attach_cmd(
    addresses: Annotated[Optional[list[str]], typer.Argument(metavar="[ADDR]...")] = None,
    name: Annotated[str, typer.Option("--name", help="Domain name.")] = ...,
    vcpus: Annotated[int, typer.Option("--vcpus")] = 4,
    memory: Annotated[str, typer.Option("--memory")] = "8G",
    hugepages: Annotated[str, typer.Option("--hugepages")] = "auto",
    numa: Annotated[str, typer.Option("--numa")] = "auto",
    firmware: Annotated[str, typer.Option("--firmware")] = "efi",
    virt_type: Annotated[str, typer.Option("--virt-type")] = "kvm",
    disk: Annotated[Optional[str], typer.Option("--disk")] = None,
    kernel: Annotated[Optional[str], typer.Option("--kernel")] = None,
    initrd: Annotated[Optional[str], typer.Option("--initrd")] = None,
    cmdline: Annotated[Optional[str], typer.Option("--cmdline")] = None,
    network: Annotated[Optional[str], typer.Option("--network")] = None,
    user_net_ssh_port: Annotated[Optional[int], typer.Option(
        "--user-net-ssh-port", metavar="PORT", help="QEMU user networking, 127.0.0.1:PORT -> guest:22.")] = None,
    ssh_host: SshHost = None, ssh_port: SshPort = None, ssh_user: SshUser = "root", ssh_key: SshKey = None,
    known_hosts: KnownHosts = None, trust_on_first_use: Tofu = False, connect: Connect = None,
    force: Annotated[bool, typer.Option("--force")] = False,
    stop_services: Annotated[bool, typer.Option("--stop-services")] = False,
    no_verify: Annotated[bool, typer.Option("--no-verify")] = False,
    keep_on_failure: Annotated[bool, typer.Option("--keep-on-failure")] = False,
    boot_timeout: Annotated[float, typer.Option("--boot-timeout")] = 300.0,
    as_json: JsonOption = False, root: RootOption = None,
) -> None:
    from gpuvfio import bindcmd, guests
    from gpuvfio.address import PciAddress
    from gpuvfio.attach import AttachFailed, attach
    from gpuvfio.bindapply import live_actions
    from gpuvfio.domainspec import DomainOptions
    from gpuvfio.hostroot import HostRoot
    from gpuvfio.libvirt_domains import domain_lookup
    from gpuvfio.sizes import parse_size_kib
    from gpuvfio.journal import known_hosts_file
    from gpuvfio.sysfs_write import SysfsWriter

    wanted = [PciAddress.parse(a) for a in addresses or []]
    options = DomainOptions(name=name, vcpus=vcpus, memory_kib=parse_size_kib(memory), hugepages=hugepages,
                            numa=numa, firmware=firmware, virt_type=virt_type, disk=disk, kernel=kernel,
                            initrd=initrd, cmdline=cmdline, network=network, ssh_forward_port=user_net_ssh_port,
                            force=force)
    host = HostRoot(resolve_root(root))
    if ssh_host is None and user_net_ssh_port:
        ssh_host, ssh_port = "127.0.0.1", user_net_ssh_port
    target = _target(ssh_host, ssh_port, ssh_user, ssh_key, known_hosts, trust_on_first_use)
    uri = connect

    def bind_step(devices):
        return bindcmd.bind(host, devices, writer=SysfsWriter(host), actions=live_actions(host), force=force,
                            stop_services=stop_services, domains_using=domain_lookup(uri) if uri else None,
                            progress=lambda line: None)

    conn = guests.connect(uri)
    say = (lambda line: None) if as_json else (lambda line: sys.stderr.write(f"gpuvfio: {line}\n"))
    try:
        result = attach(host, wanted, options, conn=conn, ssh=target, bind_step=bind_step,
                        restore_step=_restore_held(host), verify=not no_verify, keep_on_failure=keep_on_failure,
                        boot_timeout=boot_timeout, known_hosts_default=known_hosts_file(host), progress=say)
    except AttachFailed as exc:
        if as_json:
            emit_json(exc.result.to_json())
        fail(str(exc), exc.exit_code)
    finally:
        conn.close()
    if as_json:
        emit_json(result.to_json())
    else:
        for note in (result.ssh or {}).get("notes", []):
            sys.stderr.write(f"gpuvfio: {note}\n")
        if result.report:
            _print_report(result.report)
        sys.stderr.write(f"gpuvfio: {name} is running ({'verified' if result.ok else 'verification FAILED'}); "
                         f"gpuvfio detach {name} undoes it\n")
    if not result.ok:
        raise typer.Exit(1)


@app.command("detach", help=COMMANDS["detach"])
def detach_cmd(name: Annotated[str, typer.Argument(metavar="NAME")], connect: Connect = None,
               timeout: Annotated[float, typer.Option("--timeout", help="Seconds for ACPI shutdown.")] = 60.0,
               as_json: JsonOption = False, root: RootOption = None) -> None:
    from gpuvfio import guests
    from gpuvfio.attach import detach
    from gpuvfio.hostroot import HostRoot

    host = HostRoot(resolve_root(root))
    conn = guests.connect(connect)
    try:
        report = detach(conn, name, restore_step=_restore_held(host), timeout=timeout,
                        progress=(lambda line: None) if as_json else (lambda line: sys.stderr.write(
                            f"gpuvfio: {line}\n")))
    finally:
        conn.close()
    if as_json:
        emit_json(report)
