"""gpuvfio export kubevirt / attributes: hand-offs to Kubernetes."""

from __future__ import annotations

import typer

from gpuvfio.cli.app import JsonOption, RootOption, app, emit_json, root_of
from gpuvfio.cli.devices import DeviceIds, Devices
from gpuvfio.cli.output import write_text
from gpuvfio.ops import export
from gpuvfio.ops.context import Context
from gpuvfio.ops.inventory import open_host
from gpuvfio.ops.selection import check_devices, resolve

export_app = typer.Typer(help="What gpuvfio knows about the host's GPUs, for KubeVirt and DRA drivers.",
                         no_args_is_help=True)
app.add_typer(export_app, name="export")


@export_app.command("kubevirt")
def kubevirt_cmd(addresses: Devices = None, device_ids: DeviceIds = None, as_json: JsonOption = False,
                 root: RootOption = None) -> None:
    """KubeVirt permittedHostDevices for the GPUs' vendor:device pairs (default: every NVIDIA GPU on
    vfio-pci), with the resource names NVIDIA's kubevirt device plugin registers."""
    check_devices(addresses, device_ids, required=False)
    with open_host(root_of(root)) as (host, _label):
        report = export.kubevirt(Context(host=host), resolve(host, addresses, device_ids))
    if as_json:
        emit_json(report)
    else:
        write_text(export.kubevirt_yaml(report))  # its comments quote the host's pci.ids


@export_app.command("attributes")
def attributes_cmd(addresses: Devices = None, device_ids: DeviceIds = None, as_json: JsonOption = False,
                   root: RootOption = None) -> None:
    """Per device, its facts as DRA device attributes: resource.kubernetes.io/pciBusID and pcieRoot,
    and gpuvfio's own (NUMA node, IOMMU group, BARs, link, P2P clique, reset method, vGPU type).
    Always JSON."""
    check_devices(addresses, device_ids, required=False)
    with open_host(root_of(root)) as (host, _label):
        emit_json(export.attributes(Context(host=host), resolve(host, addresses, device_ids)))
