"""Hand-offs to Kubernetes: what gpuvfio knows about a host's GPUs, in the shapes KubeVirt and
DRA drivers take.

* KubeVirt's ``permittedHostDevices.pciHostDevices`` (kubevirt.io/api core/v1 PciHostDevice:
  pciVendorSelector "VENDOR:DEVICE", resourceName, externalResourceProvider). KubeVirt matches
  the selector against every function of the node (lower-cased), so it hands out every
  vfio-bound device of a vendor:device pair; a subset of identical GPUs cannot be named there.
  The resource names are the ones NVIDIA's kubevirt-gpu-device-plugin registers
  (pkg/device_plugin/device_plugin.go getDeviceName): its pci.ids name of the device, upper-cased,
  "/", "." and whitespace runs turned into "_", other characters but [A-Z0-9_] dropped, under
  "nvidia.com/"; the device id when pci.ids has no name. That plugin reads its own bundled
  pci.ids: where the host's differs (Debian 12's has no H200), the plugin's name is the one.
* DRA device attributes (k8s.io/dynamic-resource-allocation deviceattribute):
  ``resource.kubernetes.io/pciBusID`` (a lower-case DDDD:BB:SS.F) and
  ``resource.kubernetes.io/pcieRoot`` (``pci<domain>:<bus>``, the first component under
  /sys/devices of the function's sysfs path), typed as in a ResourceSlice; gpuvfio's other
  facts under its own domain.
"""

from __future__ import annotations

import json
import re

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError
from gpuvfio.host.inventory import Inventory, read_inventory
from gpuvfio.host.kernel import read_kernel
from gpuvfio.host.model import PciFunction
from gpuvfio.host.numa import read_numa
from gpuvfio.host.pciids import PciIds
from gpuvfio.host.topology import p2p_cliques, position
from gpuvfio.ops.context import Context

NVIDIA_NAMESPACE = "nvidia.com"
DRA_PREFIX = "resource.kubernetes.io/"
OWN_DOMAIN = "gpuvfio.invalid/"  # no registered domain: a name no driver will clash with
VFIO_DRIVERS = ("vfio-pci", "nvgrace_gpu_vfio_pci")  # what NVIDIA's plugin exposes
DRA_MAX_STRING = 64


def plugin_resource_name(device_name: str | None, device_id: str) -> str:
    """The resource NVIDIA's kubevirt-gpu-device-plugin registers for a device."""
    name = (device_name or "").strip().upper().replace("/", "_").replace(".", "_")
    name = re.sub(r"[^A-Z0-9_]+", "", re.sub(r"\s+", "_", name))
    return f"{NVIDIA_NAMESPACE}/{name or device_id.lower()}"


def _chosen(inventory: Inventory, addresses: list[PciAddress]) -> list[PciFunction]:
    """The functions named, or every NVIDIA GPU on vfio-pci (the ones KubeVirt can hand out)."""
    if not addresses:
        return [f for _a, f in sorted(inventory.functions.items())
                if f.is_nvidia_gpu and f.driver in VFIO_DRIVERS]
    chosen = []
    for address in addresses:
        fn = inventory.functions.get(address)
        if fn is None:
            raise InputError(f"no such PCI function on this host: {address}")
        if not fn.is_nvidia:
            raise InputError(f"{address} is not an NVIDIA device ({fn.vendor_id}:{fn.device_id}); the KubeVirt and "
                             "DRA exports name NVIDIA GPUs")
        chosen.append(fn)
    return chosen


def kubevirt(ctx: Context, addresses: list[PciAddress]) -> dict:
    """``gpuvfio export kubevirt``: the permittedHostDevices entries for the vendor:device pairs
    of ``addresses`` (default: the NVIDIA GPUs on vfio-pci), and what KubeVirt will make of them."""
    inventory = read_inventory(ctx.host, names=PciIds.load(ctx.host))
    chosen = _chosen(inventory, addresses)
    notes = ["KubeVirt selects every vfio-bound device of a vendor:device pair (pciVendorSelector): a subset of "
             "identical GPUs on one node cannot be expressed there"]
    pairs: dict[tuple[str, str], list[PciFunction]] = {}
    for fn in chosen:
        pairs.setdefault((fn.vendor_id, fn.device_id), []).append(fn)
    entries = []
    for (vendor, device), fns in sorted(pairs.items()):
        name = plugin_resource_name(fns[0].device_name, device)
        entries.append({"pciVendorSelector": f"{vendor}:{device}".upper(), "resourceName": name,
                        "externalResourceProvider": True})
        others = [str(f.address) for f in inventory.functions.values()
                  if (f.vendor_id, f.device_id) == (vendor, device) and f not in fns]
        if others:
            notes.append(f"{vendor}:{device}: {len(others)} more on this host ({', '.join(sorted(others))}) go to "
                         f"{name} too once they are on vfio-pci")
        unbound = [str(f.address) for f in fns if f.driver not in VFIO_DRIVERS]
        if unbound:
            notes.append(f"not on vfio-pci, so not offered until bound (gpuvfio bind, gpuvfio persist): "
                         f"{', '.join(unbound)}")
        if fns[0].device_name is None:
            notes.append(f"{vendor}:{device} has no name in this host's pci.ids: the plugin then uses the device id, "
                         f"{name}")
    if entries:
        notes.append("names come from this host's pci.ids; NVIDIA's kubevirt-gpu-device-plugin reads its own copy, so "
                     "check the node's allocatable resources (kubectl describe node)")
    return {"devices": [str(f.address) for f in chosen],
            "permittedHostDevices": {"pciHostDevices": entries}, "notes": notes}


def kubevirt_yaml(report: dict) -> str:
    """The KubeVirt custom resource fragment, as YAML (JSON-quoted strings are YAML strings)."""
    lines = [f"# {note}" for note in report["notes"]]
    lines += ["# Merge into the KubeVirt CR (kubectl edit kubevirt kubevirt -n kubevirt); a merge patch replaces",
              "# the whole pciHostDevices list. VMs ask for them under spec.domain.devices.gpus.",
              "apiVersion: kubevirt.io/v1", "kind: KubeVirt", "metadata:", "  name: kubevirt",
              "  namespace: kubevirt", "spec:", "  configuration:", "    permittedHostDevices:"]
    entries = report["permittedHostDevices"]["pciHostDevices"]
    if not entries:
        lines.append("      pciHostDevices: []")
    else:
        lines.append("      pciHostDevices:")
    for entry in entries:
        lines += [f"      - pciVendorSelector: {json.dumps(entry['pciVendorSelector'])}",
                  f"        resourceName: {json.dumps(entry['resourceName'])}",
                  f"        externalResourceProvider: {'true' if entry['externalResourceProvider'] else 'false'}"]
    return "\n".join(lines) + "\n"


def attributes(ctx: Context, addresses: list[PciAddress]) -> dict:
    """``gpuvfio export attributes``: per device, its facts as DRA device attributes (typed values
    as in a ResourceSlice), under the standard names where they exist."""
    inventory = read_inventory(ctx.host, names=PciIds.load(ctx.host))
    chosen = _chosen(inventory, addresses) if addresses else [
        f for _a, f in sorted(inventory.functions.items()) if f.is_nvidia_gpu]
    cliques = p2p_cliques([f for f in chosen if f.is_nvidia_gpu],
                          acs_override=read_kernel(ctx.host).param("pcie_acs_override") is not None,
                          single_node=len(read_numa(ctx.host)) <= 1)
    devices = []
    for fn in chosen:
        attrs: dict[str, dict] = {
            DRA_PREFIX + "pciBusID": {"string": str(fn.address)},
            DRA_PREFIX + "pcieRoot": {"string": f"pci{position(fn).root_complex}"},
            OWN_DOMAIN + "vendorID": {"string": fn.vendor_id},
            OWN_DOMAIN + "deviceID": {"string": fn.device_id},
        }
        own = {"productName": fn.device_name, "driver": fn.driver, "numaNode": fn.numa_node,
               "iommuGroup": fn.iommu_group, "resetMethod": " ".join(fn.reset_method or []) or None,
               "p2pClique": cliques.clique_of(fn.address), "vgpuType": fn.vgpu_current or None}
        if fn.link is not None and fn.link.max_gen and fn.link.max_width:
            own["pcieLink"] = f"Gen{fn.link.max_gen} x{fn.link.max_width}"
        for bar in fn.bars:
            if bar.size and bar.index <= 5:
                own[f"bar{bar.index}Bytes"] = bar.size
        for key, value in own.items():
            # A ResourceSlice's string values are at most 64 characters (resource.k8s.io validation).
            if value is None or (isinstance(value, int) and value < 0) or len(str(value)) > DRA_MAX_STRING:
                continue
            attrs[OWN_DOMAIN + key] = {"int": value} if isinstance(value, int) else {"string": str(value)}
        devices.append({"name": _dra_name(fn.address), "attributes": attrs})
    return {"devices": devices}


def _dra_name(address: PciAddress) -> str:
    """A device name a ResourceSlice takes (a DNS label): pci-0000-01-00-0."""
    return "pci-" + re.sub(r"[:.]", "-", str(address))
