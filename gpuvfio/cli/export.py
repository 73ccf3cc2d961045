"""gpuvfio export kubevirt / attributes: hand-offs to Kubernetes."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from gpuvfio.cli.app import JsonOption, RootOption, emit_json, root_of
from gpuvfio.cli.lazy import COMMANDS, command_typer
from gpuvfio.cli.devices import DeviceIds, Devices
from gpuvfio.cli.output import write_text
from gpuvfio.ops import export, kubevirt_yaml
from gpuvfio.ops.context import open_context
from gpuvfio.ops.kubevirt_names import from_pci_ids
from gpuvfio.ops.selection import check_devices, resolve

export_app = command_typer(help=COMMANDS["export"].help, no_args_is_help=True)

class Format(str, Enum):
    PATCH = "patch"
    CR = "cr"


ProviderOption = Annotated[export.Provider, typer.Option(
    "--provider", case_sensitive=False,
    help="Who registers the resources: nvidia (NVIDIA's kubevirt-gpu-device-plugin; entries carry "
         "externalResourceProvider and the plugin's own names) or kubevirt (KubeVirt's own device plugin, "
         "which registers any valid name).")]
PciIdsOption = Annotated[Optional[str], typer.Option(
    "--pci-ids", metavar="FILE",
    help="Names as a plugin image with this pci.ids registers them (copy its /usr/pci.ids out). Default: the "
         "names of NVIDIA/kubevirt-gpu-device-plugin v1.6.0's bundled pci.ids (Version 2025.07.11), shipped "
         "with gpuvfio; the host's pci.ids is never used for them.")]
VgpuTypeOption = Annotated[Optional[list[str]], typer.Option(
    "--vgpu-type", metavar="TYPE",
    help="Also permit this mdev vGPU type (its name as mdev_type/name spells it, e.g. 'GRID T4-1Q', or an "
         "nvidia-N type id a GPU of this host offers); repeatable. Existing mdev instances are exported anyway.",
    show_default=False)]
FormatOption = Annotated[Format, typer.Option(
    "--format", case_sensitive=False,
    help="patch: an RFC 6902 JSON patch (YAML) that adds each entry at the end of the cluster's lists, for "
         "kubectl patch --type json. cr: the KubeVirt CR fragment, which REPLACES the cluster's whole "
         "pciHostDevices and mediatedDevices lists when applied or merged.")]


@export_app.command("kubevirt")
def kubevirt_cmd(addresses: Devices = None, device_ids: DeviceIds = None, provider: ProviderOption =
                 export.Provider.NVIDIA, pci_ids: PciIdsOption = None, vgpu_types: VgpuTypeOption = None,
                 output_format: FormatOption = Format.PATCH, as_json: JsonOption = False,
                 root: RootOption = None) -> None:
    """KubeVirt permittedHostDevices for the devices' vendor:device pairs (default: every NVIDIA GPU
    and NVSwitch on vfio-pci) and for the mdev vGPU types in use, with the resource names the
    provider registers. Printed as a JSON patch that adds to the cluster's lists (kubectl patch
    kubevirt kubevirt -n kubevirt --type json --patch-file FILE), or with --format cr as the CR
    fragment that replaces them. GPUs and vGPUs go under a VM's spec.domain.devices.gpus,
    NVSwitches under hostDevices (the HostDevices feature gate). Nothing to export: exit 1."""
    check_devices(addresses, device_ids, required=False)
    names = from_pci_ids(pci_ids) if pci_ids is not None else None
    with open_context(root_of(root)) as (ctx, _label):
        report = export.kubevirt(ctx, resolve(ctx, addresses, device_ids), provider=provider,
                                 names=names, vgpu_types=vgpu_types)
    if as_json:
        emit_json(report.to_json())
    elif output_format is Format.CR:
        write_text(kubevirt_yaml.cr_text(report))  # its comments quote the pci.ids names
    else:
        write_text(kubevirt_yaml.patch_text(report))


@export_app.command("attributes")
def attributes_cmd(addresses: Devices = None, device_ids: DeviceIds = None, as_json: JsonOption = False,
                   root: RootOption = None) -> None:
    """Per device, its facts as DRA device attributes: resource.kubernetes.io/pciBusID and pcieRoot,
    and gpuvfio's own (NUMA node, IOMMU group, BARs, link, P2P clique, reset method, vGPU type).
    Always JSON."""
    check_devices(addresses, device_ids, required=False)
    with open_context(root_of(root)) as (ctx, _label):
        emit_json(export.attributes(ctx, resolve(ctx, addresses, device_ids)).to_json())
