"""Typer commands for domains: xml (and --define), vgpu types/create/remove."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from gpuvfio.cli import JsonOption, RootOption, app, resolve_root
from gpuvfio.commands import open_host
from gpuvfio.main import COMMANDS, emit_json

Addresses = Annotated[list[str], typer.Argument(metavar="ADDR...", help="GPUs (DDDD:BB:SS.F).")]


@app.command("xml", help=COMMANDS["xml"])
def xml_cmd(
    addresses: Addresses,
    name: Annotated[str, typer.Option("--name", help="Domain name.")],
    vcpus: Annotated[int, typer.Option("--vcpus")] = 4,
    memory: Annotated[str, typer.Option("--memory", help="Guest memory: 64G, 64GiB, 65536M.")] = "8G",
    hugepages: Annotated[str, typer.Option("--hugepages", help="auto | 1G | 2M | none")] = "auto",
    numa: Annotated[str, typer.Option("--numa", help="auto | none | N")] = "auto",
    firmware: Annotated[str, typer.Option("--firmware", help="efi (OVMF) | bios")] = "efi",
    hide_kvm: Annotated[bool, typer.Option("--hide-kvm", help="Hide the hypervisor from the guest driver.")] = False,
    mdev: Annotated[Optional[str], typer.Option("--mdev", metavar="TYPE", help="Legacy mdev vGPU type.")] = None,
    vgpu: Annotated[Optional[str], typer.Option("--vgpu", metavar="TYPE", help="SR-IOV vGPU type.")] = None,
    uuid: Annotated[Optional[str], typer.Option("--uuid", help="mdev UUID (default: derived).")] = None,
    disk: Annotated[Optional[str], typer.Option("--disk", metavar="PATH")] = None,
    kernel: Annotated[Optional[str], typer.Option("--kernel", metavar="PATH")] = None,
    initrd: Annotated[Optional[str], typer.Option("--initrd", metavar="PATH")] = None,
    cmdline: Annotated[Optional[str], typer.Option("--cmdline", metavar="STR")] = None,
    network: Annotated[Optional[str], typer.Option("--network", metavar="NAME")] = None,
    virt_type: Annotated[str, typer.Option("--virt-type", help="kvm | qemu (TCG)")] = "kvm",
    force: Annotated[bool, typer.Option("--force", help="Share cores / accept short hugepages.")] = False,
    define: Annotated[bool, typer.Option("--define", help="Define it in libvirt (idempotent).")] = False,
    update: Annotated[bool, typer.Option("--update", help="With --define: redefine when it differs.")] = False,
    connect: Annotated[Optional[str], typer.Option("--connect", metavar="URI")] = None,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    from gpuvfio.address import PciAddress
    from gpuvfio.domainspec import DomainOptions, build_spec
    from gpuvfio.domainxml import domain_xml
    from gpuvfio.errors import InputError
    from gpuvfio.inventory import read_inventory
    from gpuvfio.numa import read_numa
    from gpuvfio.sizes import parse_size_kib

    if uuid is not None:
        import uuid as uuidlib

        try:
            uuid = str(uuidlib.UUID(uuid))
        except ValueError:
            raise InputError(f"not a UUID: {uuid!r}") from None
    options = DomainOptions(name=name, vcpus=vcpus, memory_kib=parse_size_kib(memory), hugepages=hugepages,
                            numa=numa, firmware=firmware, hide_kvm=hide_kvm, mdev=mdev, vgpu=vgpu, uuid=uuid,
                            disk=disk, kernel=kernel, initrd=initrd, cmdline=cmdline, network=network,
                            virt_type=virt_type, force=force)
    wanted = [PciAddress.parse(a) for a in addresses]
    from gpuvfio.pciids import PciIds

    with open_host(resolve_root(root)) as (host, _label):
        inventory = read_inventory(host, names=PciIds.load(host.root))
        spec = build_spec(host, inventory, read_numa(host), wanted, options)
    xml = domain_xml(spec)
    for warning in spec.warnings:
        sys.stderr.write(f"gpuvfio: warning: {warning}\n")
    result = None
    if define:
        from gpuvfio.define import default_uri, define as define_domain

        result = define_domain(xml, connect or default_uri(), update=update)
    if as_json:
        emit_json({"name": spec.name, "xml": xml, "warnings": spec.warnings, "define": result})
        return
    if result is None:
        sys.stdout.write(xml)
        return
    sys.stderr.write(f"{result['name']}: {result['result']}\n")
    for line in result["changes"]:
        sys.stdout.write(line + "\n")
    if result["result"] == "differs":
        sys.stderr.write("the domain exists and differs; nothing changed (--update to redefine)\n")


vgpu_app = typer.Typer(help=COMMANDS["vgpu"], no_args_is_help=True)
app.add_typer(vgpu_app, name="vgpu")


def _writer(root: str | None):
    from gpuvfio.hostroot import HostRoot
    from gpuvfio.sysfs_write import SysfsWriter

    host = HostRoot(resolve_root(root))
    return host, SysfsWriter(host)


@vgpu_app.command("types")
def vgpu_types_cmd(address: Annotated[str, typer.Argument(metavar="ADDR")], as_json: JsonOption = False,
                   root: RootOption = None) -> None:
    """The vGPU profiles a GPU offers (legacy mdev types, or SR-IOV types on its VFs)."""
    from gpuvfio.address import PciAddress
    from gpuvfio.inventory import read_inventory
    from gpuvfio.vgpucmd import types

    wanted = PciAddress.parse(address)
    with open_host(resolve_root(root)) as (host, _label):
        report = types(read_inventory(host), wanted)
    if as_json:
        emit_json(report)
        return
    if report["kind"] == "none":
        sys.stdout.write(f"{address}: no vGPU types (no mdev_supported_types, no SR-IOV VFs)\n")
    for mdev in report["mdev_types"]:
        sys.stdout.write(f"{mdev['id']:16} {mdev['name'] or '':24} available {mdev['available_instances']}\n")
    for vtype in report["sriov_types"]:
        mig = vtype.get("mig_backed")
        note = f"  MIG-backed: {mig['slices']} slice(s), {mig['memory_gb']} GB" if mig else ""
        sys.stdout.write(f"{vtype['id']:<6} {vtype['name']:28} free VFs {vtype['available_instances']}{note}\n")
    for used in report["sriov_in_use"]:
        sys.stdout.write(f"in use: VF {used['vf']} has type {used['type']}\n")


@vgpu_app.command("create")
def vgpu_create_cmd(address: Annotated[str, typer.Argument(metavar="ADDR")],
                    vgpu_type: Annotated[str, typer.Argument(metavar="TYPE", help="Type id or name.")],
                    uuid: Annotated[Optional[str], typer.Option("--uuid", help="mdev UUID (default: random).")] = None,
                    persist: Annotated[bool, typer.Option("--persist", help="Recreate it at boot (mdevctl's "
                                                          "store, /etc/mdevctl.d).")] = False,
                    as_json: JsonOption = False, root: RootOption = None) -> None:
    """Create a vGPU instance (legacy: an mdev; SR-IOV: a type on a free VF), journaled."""
    from gpuvfio.address import PciAddress
    from gpuvfio.errors import InputError
    from gpuvfio.vgpucmd import create

    wanted = PciAddress.parse(address)
    if uuid is not None:
        import uuid as uuidlib

        try:
            uuid = str(uuidlib.UUID(uuid))
        except ValueError:
            raise InputError(f"not a UUID: {uuid!r}") from None
    host, writer = _writer(root)
    report = create(host, wanted, vgpu_type, writer=writer, uuid=uuid, persist=persist)
    if as_json:
        emit_json(report)
    else:
        what = report.get("uuid") or report.get("vf")
        sys.stdout.write(f"{report['result']}: {report['kind']} {what} type {report['type']} on {report['parent']}\n")


@vgpu_app.command("remove")
def vgpu_remove_cmd(instance: Annotated[str, typer.Argument(metavar="UUID|VF")], as_json: JsonOption = False,
                    root: RootOption = None) -> None:
    """Remove a vGPU instance gpuvfio created (an mdev UUID, or the VF address of an SR-IOV vGPU)."""
    from gpuvfio.vgpucmd import remove

    host, writer = _writer(root)
    report = remove(host, instance, writer=writer)
    emit_json(report) if as_json else sys.stdout.write(f"removed {instance}\n")


@vgpu_app.command("scheduler")
def vgpu_scheduler_cmd(address: Annotated[str, typer.Argument(metavar="ADDR")],
                       policy: Annotated[Optional[str], typer.Option(
                           "--set", metavar="POLICY", help="best-effort, equal-share or fixed-share (journaled; "
                           "gpuvfio restore puts the previous one back).")] = None,
                       as_json: JsonOption = False, root: RootOption = None) -> None:
    """Show (or set) a GPU's vGPU scheduler policy, where the driver exposes it through NVML."""
    from gpuvfio.address import PciAddress
    from gpuvfio.vgpusched import Nvml, parse_policy, set_policy

    wanted = PciAddress.parse(address)
    if policy is not None:
        parse_policy(policy)
    host, _writer_unused = _writer(root)
    with Nvml() as nvml:
        report = set_policy(host, nvml, wanted, policy) if policy else nvml.read(wanted)
    if as_json:
        emit_json(report)
        return
    sys.stdout.write(f"{address}: vGPU scheduler {report['policy']} (ARR {report['arr']}, timeslice "
                     f"{report['timeslice']}; supported: {', '.join(report['supported'])})"
                     + (f"; was {report['previous']}" if report.get("previous") else "") + "\n")
