"""gpuvfio xml: the domain XML (and --define). Its domain options, which attach shares, are
gpuvfio.options.DOMAIN's."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from gpuvfio.cli.app import JsonOption, RootOption, emit_json, root_of, say
from gpuvfio.cli.lazy import command_typer
from gpuvfio.cli.devices import DeviceIds, Devices
from gpuvfio.cli.output import printable
from gpuvfio.cli.plans import DryRun
from gpuvfio.cli.tables import from_table, options
from gpuvfio.ops.cloud_init import plan_seed, write_seed
from gpuvfio.ops.context import open_context
from gpuvfio.ops.uris import libvirt_uri
from gpuvfio.ops.plans import CheckStatus
from gpuvfio.ops.targets import ssh_from_table
from gpuvfio.errors import InputError, Refused
from gpuvfio.user_files import check_output_path, write_output
from gpuvfio.ops.domains import (NCCL_GUEST_FILE, domain_request, existing_domain, plan_define, run_define,
                                 nccl_topology_file, provision_xml)
from gpuvfio.ops.selection import check_devices, resolve
from gpuvfio.options import DOMAIN, RUN, SSH

commands = command_typer()  # its commands, listed in gpuvfio.cli.lazy.COMMANDS


def version_lines(rows) -> list[str]:
    """The minimum-version table, as lines: each version that is too old, then the unknown ones."""
    lines = [f"warning: {row.feature} needs {row.needed}, this has {row.have}: {row.why}"
             for row in rows if row.status == "missing"]
    unknown = [f"{row.needed} ({row.feature})" for row in rows if row.status == "unknown"]
    if unknown:
        lines.append(f"versions not checked, unknown here: {', '.join(unknown)}")
    return lines


@commands.command("xml")
@from_table
def xml_cmd(
    addresses: Devices = None,
    device_ids: DeviceIds = None,
    domain: dict = options(DOMAIN, "xml"),
    ssh: dict = options(SSH, "xml"),
    define: Annotated[bool, typer.Option("--define", help="Define it in libvirt (idempotent).")] = False,
    update: Annotated[bool, typer.Option("--update", help="With --define: redefine when it differs.")] = False,
    run: dict = options(RUN, "xml"),
    nccl_topo: Annotated[Optional[str], typer.Option(
        "--nccl-topo", metavar="FILE", help="Also write the predicted NCCL topology file (NCCL_TOPO_FILE) for the "
        "guest; attach writes the real one inside the guest.")] = None,
    dry_run: DryRun = False,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """Libvirt domain XML for passing GPUs through (q35, OVMF, NUMA pinning, hugepages, MMIO window sized
    from the BARs), or a vGPU; --define defines it idempotently."""
    connect = libvirt_uri(run["connect"], needed_for="--define" if define else None)
    cloud_init = ssh.pop("cloud_init")
    request = domain_request(**domain)
    if cloud_init is None and any(value is not None for value in ssh.values()):
        raise InputError("--ssh-user and --ssh-key go with --cloud-init here: the user and key the seed lets in")
    target = ssh_from_table(ssh, wait="ssh_timeout") if cloud_init is not None else None
    check_devices(addresses, device_ids, required=True)
    if nccl_topo is not None:
        if nccl_topo == "-" or request.mdev or request.vgpu:
            raise InputError("--nccl-topo needs a file name (stdout carries the XML) and GPUs passed through "
                             "whole (not --mdev/--vgpu)")
        check_output_path(nccl_topo)
    # --cloud-init writes a seed and pins its host key in the state dir, --define defines the
    # domain: such a run changes the host.
    with open_context(root_of(root), writable=(cloud_init is not None or define) and not dry_run) as (ctx, _label):
        wanted = resolve(ctx, addresses, device_ids)
        seed = _seed_plan(ctx, request, cloud_init, target) if target is not None else None
        # With --define, the domain it would replace: a running one's hugepages count as its own.
        existing = existing_domain(ctx, request.name, uri=connect) if define else None
        provisioned = provision_xml(ctx, wanted, request, replacing=existing, uri=connect,
                                    ask_libvirt=define or connect is not None, seed_iso=cloud_init)
        _tell_spec(provisioned.spec)
        _write_files(ctx, provisioned, nccl_topo, seed, dry_run)
        # The define's plan: what libvirt holds under the name, and what the run does to it. A dry
        # run prints it ("would_define", "unchanged", "would_update", or "differs": exit 1).
        plan = plan_define(ctx, provisioned.xml, uri=connect, update=update) if define else None
        if plan is not None and plan.refused and plan.held is None:
            raise plan.refusal()  # someone else's domain: not shown as a definition
        result = plan.to_json()["define"] if plan is not None else None
        if plan is not None and not dry_run and not plan.refused:
            result = run_define(ctx, plan).to_json()
    _show_xml(request, provisioned, seed, result, as_json)
    if result is not None and result["result"] == "differs":
        raise typer.Exit(1)


def _seed_plan(ctx, request, cloud_init: str, target):
    """--cloud-init's seed, planned; its warnings said, its refusals raised."""
    seed = plan_seed(ctx, request.name, cloud_init, ssh=target, forward_port=request.user_net_ssh_port)
    for check in seed.checks:
        if check.status is CheckStatus.WARN:
            say(f"warning: {check.message}")
    if seed.refusals:
        raise Refused("; ".join(seed.refusals))
    return seed


def _tell_spec(spec) -> None:
    for warning in spec.warnings:
        say(f"warning: {warning}")
    for note in spec.notes:
        say(f"note: {note}")
    for line in version_lines(spec.versions):
        say(line)


def _write_files(ctx, provisioned, nccl_topo: str | None, seed, dry_run: bool) -> None:
    """--nccl-topo's file and --cloud-init's seed (before the define: the domain's cdrom and the
    pin are there first); a dry run says what it would write."""
    if nccl_topo is not None and dry_run:
        say(f"dry run: {nccl_topo} not written")
    elif nccl_topo is not None:
        write_output(nccl_topo, nccl_topology_file(ctx, provisioned))
        say(f"wrote {nccl_topo}: a PREDICTION of the guest's bus ids (firmware numbers them at boot); attach "
            f"writes the file from what the guest shows, as {NCCL_GUEST_FILE}")
    if seed is not None and dry_run:
        say(f"dry run: {seed.describe()}: not written")
    elif seed is not None:
        write_seed(ctx, seed)
        say(seed.describe())


def _show_xml(request, provisioned, seed, result: dict | None, as_json: bool) -> None:
    """The XML (or, with --define, the define's result and libvirt's definition diffed)."""
    if as_json:
        emit_json({"name": request.name, "xml": provisioned.xml, "warnings": provisioned.spec.warnings,
                   "notes": provisioned.spec.notes, "topology": provisioned.layout_json(),
                   "address_space": provisioned.spec.address.to_json() if provisioned.spec.address else None,
                   "versions": [row.to_json() for row in provisioned.spec.versions], "define": result}
                  | ({"cloud_init": seed.to_json()} if seed is not None else {}))
    elif result is None:
        sys.stdout.write(provisioned.xml)
    else:
        say(f"{result['name']}: {result['result']}")
        for line in result["changes"]:  # libvirt's definition, diffed
            sys.stdout.write(printable(line) + "\n")
        if result["result"] == "would_define":  # against nothing: every line of it is new
            sys.stdout.write("".join(f"+ {line}\n" for line in provisioned.xml.splitlines()))
        if result["result"] == "differs":
            say("the domain exists and differs; nothing changed (--update to redefine)")
