"""gpuvfio xml: the domain XML (and --define); the domain options attach shares."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated, Optional

import typer

from gpuvfio.cli.app import JsonOption, RootOption, app, emit_json, root_of, say
from gpuvfio.cli.devices import DeviceIds, Devices
from gpuvfio.cli.output import printable
from gpuvfio.ops.inventory import open_host
from gpuvfio.ops.context import Context, check_uri
from gpuvfio.errors import InputError
from gpuvfio.files import check_output_path, write_output
from gpuvfio.ops.domains import (NCCL_GUEST_FILE, DomainRequest, define_domain, domain_request, existing_domain,
                                 nccl_topology_file, provision_xml)
from gpuvfio.ops.selection import check_devices, resolve

Name = Annotated[str, typer.Option("--name", help="Domain name.")]
Vcpus = Annotated[int, typer.Option("--vcpus")]
Memory = Annotated[str, typer.Option("--memory", help="Guest memory: 64G, 64GiB, 65536M.")]
Hugepages = Annotated[str, typer.Option("--hugepages", help="auto | none | 4K | 2M | 1G")]
Numa = Annotated[str, typer.Option("--numa", help="auto | none | remote | N")]
Firmware = Annotated[str, typer.Option("--firmware", help="efi (UEFI: libvirt picks it from QEMU's firmware "
                                                          "descriptors) | bios")]
Loader = Annotated[Optional[str], typer.Option("--loader", metavar="PATH", help="UEFI code image by path instead of "
                                               "libvirt's choice (with --nvram-template).")]
NvramTemplate = Annotated[Optional[str], typer.Option("--nvram-template", metavar="PATH",
                                                      help="UEFI variables template (with --loader).")]
RomBar = Annotated[Optional[str], typer.Option("--rom-bar", metavar="on|off", help="Show the GPUs' ROM BAR to the "
                                               "guest or hide it (off: the usual fix for a GPU that drove the host "
                                               "console).")]
RomFile = Annotated[Optional[str], typer.Option("--rom-file", metavar="PATH", help="A ROM image (a dumped, clean "
                                                "VBIOS) the guest sees instead of the GPU's own.")]
VirtType = Annotated[str, typer.Option("--virt-type", help="kvm | qemu (TCG)")]
Path = Annotated[Optional[str], typer.Option(metavar="PATH")]
Text = Annotated[Optional[str], typer.Option(metavar="STR")]
ForwardPort = Annotated[Optional[int], typer.Option(
    "--user-net-ssh-port", metavar="PORT", help="QEMU user networking, 127.0.0.1:PORT -> guest:22.")]
ConsoleLog = Annotated[Optional[str], typer.Option(
    "--console-log", metavar="FILE", help="Also write the guest's serial console to this host file.")]
DomainForce = Annotated[bool, typer.Option("--force", help="Share cores / accept short hugepages.")]
Topology = Annotated[str, typer.Option(
    "--topology", help="auto | mirror | flat: mirror the host's PCIe switches and root complexes in the guest "
    "(auto: for two or more devices).")]
P2p = Annotated[str, typer.Option(
    "--p2p", help="auto | off: P2P cliques (x-nv-gpudirect-clique) for GPUs the host can route P2P between.")]
QemuVersion = Annotated[Optional[str], typer.Option(
    "--qemu-version", metavar="X.Y", help="QEMU version the domain will run on (default: asked from libvirt "
    "when a connection is used).")]


@dataclass
class DomainArgs:
    """The options xml and attach share, as the user typed them."""

    name: str
    vcpus: int = 4
    memory: str = "8G"
    hugepages: str = "auto"
    numa: str = "auto"
    firmware: str = "efi"
    virt_type: str = "kvm"
    disk: str | None = None
    kernel: str | None = None
    initrd: str | None = None
    cmdline: str | None = None
    network: str | None = None
    user_net_ssh_port: int | None = None
    console_log: str | None = None
    force: bool = False
    topology: str = "auto"
    p2p: str = "auto"
    qemu_version: str | None = None
    loader: str | None = None
    nvram_template: str | None = None
    rom_bar: str | None = None
    rom_file: str | None = None

    def request(self, **extra) -> DomainRequest:
        return domain_request(self.name, vcpus=self.vcpus, memory=self.memory, hugepages=self.hugepages,
                              numa=self.numa, firmware=self.firmware, virt_type=self.virt_type, disk=self.disk,
                              kernel=self.kernel, initrd=self.initrd, cmdline=self.cmdline, network=self.network,
                              ssh_forward_port=self.user_net_ssh_port, console_log=self.console_log,
                              force=self.force, topology=self.topology, p2p=self.p2p,
                              qemu_version=self.qemu_version, loader=self.loader,
                              nvram_template=self.nvram_template, rom_bar=self.rom_bar, rom_file=self.rom_file,
                              **extra)


def version_lines(rows) -> list[str]:
    """The minimum-version table, as lines: each version that is too old, then the unknown ones."""
    lines = [f"warning: {row.feature} needs {row.needed}, this has {row.have}: {row.why}"
             for row in rows if row.status == "missing"]
    unknown = [f"{row.needed} ({row.feature})" for row in rows if row.status == "unknown"]
    if unknown:
        lines.append(f"versions not checked, unknown here: {', '.join(unknown)}")
    return lines


@app.command("xml")
def xml_cmd(
    addresses: Devices = None,
    device_ids: DeviceIds = None,
    name: Name = ..., vcpus: Vcpus = 4, memory: Memory = "8G", hugepages: Hugepages = "auto", numa: Numa = "auto",
    firmware: Firmware = "efi", virt_type: VirtType = "kvm", loader: Loader = None,
    nvram_template: NvramTemplate = None, rom_bar: RomBar = None, rom_file: RomFile = None,
    hide_kvm: Annotated[bool, typer.Option("--hide-kvm", help="Hide the hypervisor from the guest driver.")] = False,
    mdev: Annotated[Optional[str], typer.Option("--mdev", metavar="TYPE", help="Legacy mdev vGPU type.")] = None,
    vgpu: Annotated[Optional[str], typer.Option("--vgpu", metavar="TYPE", help="SR-IOV vGPU type.")] = None,
    uuid: Annotated[Optional[str], typer.Option("--uuid", help="mdev UUID (default: derived).")] = None,
    disk: Path = None, kernel: Path = None, initrd: Path = None, cmdline: Text = None,
    network: Annotated[Optional[str], typer.Option("--network", metavar="NAME")] = None,
    user_net_ssh_port: ForwardPort = None, console_log: ConsoleLog = None, force: DomainForce = False,
    topology: Topology = "auto", p2p: P2p = "auto", qemu_version: QemuVersion = None,
    define: Annotated[bool, typer.Option("--define", help="Define it in libvirt (idempotent).")] = False,
    update: Annotated[bool, typer.Option("--update", help="With --define: redefine when it differs.")] = False,
    connect: Annotated[Optional[str], typer.Option("--connect", metavar="URI")] = None,
    nccl_topo: Annotated[Optional[str], typer.Option(
        "--nccl-topo", metavar="FILE", help="Also write the predicted NCCL topology file (NCCL_TOPO_FILE) for the "
        "guest; attach writes the real one inside the guest.")] = None,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """Libvirt domain XML for passing GPUs through (q35, OVMF, NUMA pinning, hugepages, MMIO window sized
    from the BARs), or a vGPU; --define defines it idempotently."""
    check_uri(connect, source="--connect")
    args = DomainArgs(name, vcpus, memory, hugepages, numa, firmware, virt_type, disk, kernel, initrd, cmdline,
                      network, user_net_ssh_port, console_log, force, topology, p2p, qemu_version, loader,
                      nvram_template, rom_bar, rom_file)
    request = args.request(hide_kvm=hide_kvm, mdev=mdev, vgpu=vgpu, uuid=uuid)
    check_devices(addresses, device_ids, required=True)
    if nccl_topo is not None:
        if nccl_topo == "-" or mdev or vgpu:
            raise InputError("--nccl-topo needs a file name (stdout carries the XML) and GPUs passed through "
                             "whole (not --mdev/--vgpu)")
        check_output_path(nccl_topo)
    with open_host(root_of(root)) as (host, _label), Context(host=host) as ctx:
        wanted = resolve(host, addresses, device_ids)
        # With --define, the domain it would replace: a running one's hugepages count as its own.
        existing = existing_domain(ctx, request.name, uri=connect) if define else None
        provisioned = provision_xml(ctx, wanted, request, replacing=existing, uri=connect,
                                    ask_libvirt=define or connect is not None)
        for warning in provisioned.spec.warnings:
            say(f"warning: {warning}")
        for note in provisioned.spec.notes:
            say(f"note: {note}")
        for line in version_lines(provisioned.spec.versions):
            say(line)
        if nccl_topo is not None:
            write_output(nccl_topo, nccl_topology_file(ctx, provisioned))
            say(f"wrote {nccl_topo}: a PREDICTION of the guest's bus ids (firmware numbers them at boot); attach "
                f"writes the file from what the guest shows, as {NCCL_GUEST_FILE}")
        result = define_domain(ctx, provisioned.xml, uri=connect, update=update).to_json() if define else None
    if as_json:
        emit_json({"name": request.name, "xml": provisioned.xml, "warnings": provisioned.spec.warnings,
                   "notes": provisioned.spec.notes, "topology": provisioned.layout_json(),
                   "address_space": provisioned.spec.address.to_json() if provisioned.spec.address else None,
                   "versions": [row.to_json() for row in provisioned.spec.versions], "define": result})
    elif result is None:
        sys.stdout.write(provisioned.xml)
    else:
        say(f"{result['name']}: {result['result']}")
        for line in result["changes"]:  # libvirt's definition, diffed
            sys.stdout.write(printable(line) + "\n")
        if result["result"] == "differs":
            say("the domain exists and differs; nothing changed (--update to redefine)")
    if result is not None and result["result"] == "differs":
        raise typer.Exit(1)
