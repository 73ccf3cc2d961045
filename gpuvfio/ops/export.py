"""Hand-offs to Kubernetes: what gpuvfio knows about a host's GPUs, in the shapes KubeVirt and
DRA drivers take.

* KubeVirt's ``permittedHostDevices`` (kubevirt.io/api core/v1 at v1.9.0: PciHostDevice
  pciVendorSelector "VENDOR:DEVICE", resourceName, externalResourceProvider; MediatedHostDevice
  mdevNameSelector, resourceName, externalResourceProvider). KubeVirt matches a PCI selector
  against every vfio-bound function of the node (lower-cased), so a subset of identical GPUs
  cannot be named there. With NVIDIA's kubevirt-gpu-device-plugin as the provider
  (externalResourceProvider), KubeVirt only permits the names and the plugin must register them:
  the names are the plugin's own (gpuvfio.ops.kubevirt_names), from the pci.ids in its image,
  never the host's. With KubeVirt's own device plugin (virt-handler, pkg/virt-handler/
  device-manager) any valid name works.
* DRA device attributes (k8s.io/dynamic-resource-allocation deviceattribute):
  ``resource.kubernetes.io/pciBusID`` (a lower-case DDDD:BB:SS.F) and
  ``resource.kubernetes.io/pcieRoot`` (``pci<domain>:<bus>``, the first component under
  /sys/devices of the function's sysfs path), typed as in a ResourceSlice; gpuvfio's other
  facts under its own domain.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError, Refused
from gpuvfio.files import ATTRIBUTE_LIMIT
from gpuvfio.host.inventory import Inventory, read_inventory
from gpuvfio.host.kernel import read_kernel
from gpuvfio.host.model import PciFunction
from gpuvfio.host.numa import cpu_vendor, read_numa
from gpuvfio.host.pciids import PciIds
from gpuvfio.host.topology import p2p_cliques, position
from gpuvfio.ops import kubevirt_names
from gpuvfio.ops.context import Context
from gpuvfio.ops.kubevirt_names import NAMESPACE, PluginNames, repaired, valid_resource_name
from gpuvfio.vgpu.types import existing_mdev

DRA_PREFIX = "resource.kubernetes.io/"
OWN_DOMAIN = "gpuvfio.invalid/"  # no registered domain: a name no driver will clash with
VFIO_DRIVERS = ("vfio-pci", "nvgrace_gpu_vfio_pci")  # the plugin's supportedVfioDrivers
DRA_MAX_STRING = 64
PERMITTED = "/spec/configuration/permittedHostDevices"
PCI_LIST = "pciHostDevices"
MDEV_LIST = "mediatedDevices"
HOST_DEVICES_GATE = "HostDevices"
_MDEV_TYPE_ID = re.compile(r"nvidia-[0-9]+", re.ASCII)


class Provider(str, Enum):
    """Who registers the resources KubeVirt permits."""

    NVIDIA = "nvidia"  # NVIDIA's kubevirt-gpu-device-plugin: externalResourceProvider, its names
    KUBEVIRT = "kubevirt"  # virt-handler's own device plugins: any valid name, no flag


class Request(str, Enum):
    """Where a VirtualMachineInstance asks for the resource (spec.domain.devices)."""

    GPUS = "gpus"
    HOST_DEVICES = "hostDevices"


@dataclass(frozen=True)
class PciHostDevice:
    selector: str  # VENDOR:DEVICE, upper-case as KubeVirt's examples write it
    resource_name: str
    external: bool
    request: Request
    functions: tuple[str, ...]  # this host's functions named or chosen

    def entry(self) -> dict:
        """The PciHostDevice as KubeVirt reads it (externalResourceProvider omitted when false)."""
        entry: dict = {"pciVendorSelector": self.selector, "resourceName": self.resource_name}
        if self.external:
            entry["externalResourceProvider"] = True
        return entry


@dataclass(frozen=True)
class MediatedDevice:
    selector: str  # mdev_type/name as the driver spells it ("GRID T4-1Q")
    resource_name: str
    external: bool
    instances: tuple[str, ...]  # the mdev UUIDs of that type on this host

    def entry(self) -> dict:
        entry: dict = {"mdevNameSelector": self.selector, "resourceName": self.resource_name}
        if self.external:
            entry["externalResourceProvider"] = True
        return entry


@dataclass(frozen=True)
class LeftOut:
    """A device or type not exported, and why."""

    what: str
    reason: str

    def to_json(self) -> dict:
        return {"what": self.what, "reason": self.reason}


@dataclass
class KubevirtExport:
    """``gpuvfio export kubevirt``: the permittedHostDevices entries and what KubeVirt needs besides."""

    devices: list[str]
    provider: Provider
    names: PluginNames
    pci: list[PciHostDevice] = field(default_factory=list)
    mediated: list[MediatedDevice] = field(default_factory=list)
    left_out: list[LeftOut] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def feature_gates(self) -> list[str]:
        """KubeVirt feature gates the VMs will need (v1.9.0: HostDevices is Alpha, off by default)."""
        return [HOST_DEVICES_GATE] if any(p.request is Request.HOST_DEVICES for p in self.pci) else []

    def permitted(self) -> dict:
        """The permittedHostDevices lists (only those with entries)."""
        lists: dict[str, list[dict]] = {}
        if self.pci:
            lists[PCI_LIST] = [p.entry() for p in self.pci]
        if self.mediated:
            lists[MDEV_LIST] = [m.entry() for m in self.mediated]
        return lists

    def patch(self) -> list[dict]:
        """An RFC 6902 JSON patch (kubectl patch --type json): one ``add`` at the end of each
        list per entry, so the entries the cluster has stay (a merge patch or apply would
        replace the atomic lists whole)."""
        return [{"op": "add", "path": f"{PERMITTED}/{name}/-", "value": entry}
                for name, entries in self.permitted().items() for entry in entries]

    def to_json(self) -> dict:
        return {"devices": self.devices, "provider": self.provider.value, "names": self.names.to_json(),
                "permittedHostDevices": self.permitted(), "patch": self.patch(),
                "requests": {r.value: [p.resource_name for p in self.pci if p.request is r]
                             + ([m.resource_name for m in self.mediated] if r is Request.GPUS else [])
                             for r in Request},
                "featureGates": self.feature_gates, "leftOut": [x.to_json() for x in self.left_out],
                "notes": self.notes}


def plugin_resource_name(device_name: str | None, device_id: str) -> str:
    """The resource NVIDIA's plugin registers for a device whose pci.ids name (the rest of its
    line) is ``device_name`` (gpuvfio.ops.kubevirt_names.derive; the id when that is empty)."""
    return f"{NAMESPACE}/{kubevirt_names.derive(device_name or '') or device_id.lower()}"


def _chosen(inventory: Inventory, addresses: list[PciAddress]) -> list[PciFunction]:
    """The functions named (each an NVIDIA one)."""
    chosen = []
    for address in addresses:
        fn = inventory.require(address)[0]
        if not fn.is_nvidia:
            raise InputError(f"{address} is not an NVIDIA device ({fn.vendor_id}:{fn.device_id}); the KubeVirt and "
                             "DRA exports name NVIDIA GPUs")
        chosen.append(fn)
    return chosen


@dataclass(frozen=True)
class _Mdev:
    uuid: str
    parent: PciAddress
    type_name: str  # mdev_type/name, its newlines trimmed (readVgpuIDFromFileFunc)


def _mdev_instances(ctx: Context) -> list[_Mdev]:
    """Every mdev of /sys/bus/mdev/devices with its type's name, as the plugin walks them
    (createVgpuIDMap: ``<mdev>/mdev_type/name``)."""
    host = ctx.host
    found = []
    for name in host.listdir(host.sys_path("bus", "mdev", "devices")):
        existing = existing_mdev(host, name)
        if existing is None:
            continue
        raw = host.read_head(host.sys_path("bus", "mdev", "devices", name, "mdev_type", "name"), ATTRIBUTE_LIMIT,
                             head=False)
        if raw is None:
            continue
        found.append(_Mdev(name, existing[0], raw.decode("utf-8", "replace").strip("\n")))
    return found


def _wanted_type(inventory: Inventory, wanted: str) -> tuple[str, str | None]:
    """(mdev_type/name, a note) for ``--vgpu-type``: an mdev type id or name a GPU of this host
    offers, or a name as given (for nodes other than this one)."""
    for fn in inventory.nvidia():
        for mdev in fn.mdev_types:
            if wanted in (mdev.type_id, mdev.name) and mdev.name:
                return mdev.name, None
    sriov = {n for fn in inventory.nvidia() for t in fn.vgpu_creatable or [] for n in (t.name, str(t.type_id))}
    if wanted in sriov:
        raise InputError(f"{wanted!r} is an SR-IOV vGPU type on this host: NVIDIA's plugin and KubeVirt discover "
                         "only mdev-based vGPUs (/sys/bus/mdev/devices); export the VF it is set on instead")
    if _MDEV_TYPE_ID.fullmatch(wanted):
        raise InputError(f"no GPU of this host offers mdev type {wanted}; give the type's name as "
                         "mdev_type/name spells it, e.g. 'GRID T4-1Q'")
    if not wanted.strip():
        raise InputError("--vgpu-type is empty")
    return wanted, f"vGPU type {wanted!r}: no GPU of this host offers it; exported by the name given"


def _pci_entry(names: PluginNames, provider: Provider, vendor: str, device: str, fns: list[PciFunction],
               left_out: list[LeftOut], notes: list[str]) -> PciHostDevice | None:
    selector = f"{vendor}:{device}".upper()
    resource = names.resource(device)
    if not valid_resource_name(resource):
        if provider is Provider.NVIDIA:
            left_out.append(LeftOut(selector, f"the plugin's name {resource} is not a valid Kubernetes extended "
                                              "resource name (63 characters at most, alphanumeric at both ends): "
                                              "the plugin cannot register it"))
            return None
        fixed = f"{NAMESPACE}/{repaired(resource.partition('/')[2]) or device}"
        notes.append(f"{selector}: NVIDIA's plugin would name it {resource}, which Kubernetes refuses; KubeVirt's "
                     f"plugin registers {fixed}")
        resource = fixed
    if names.name(device) == "":
        notes.append(f"{selector}: {names.describe()} has no name for device {device}; the plugin then registers "
                     f"the id, {resource}")
    request = Request.GPUS if fns[0].is_nvidia_gpu else Request.HOST_DEVICES
    return PciHostDevice(selector, resource, provider is Provider.NVIDIA, request,
                         tuple(str(f.address) for f in fns))


def kubevirt(ctx: Context, addresses: list[PciAddress], *, provider: Provider = Provider.NVIDIA,
             names: PluginNames | None = None, vgpu_types: list[str] | None = None) -> KubevirtExport:
    """``gpuvfio export kubevirt``: the permittedHostDevices entries for the vendor:device pairs of
    ``addresses`` (default: every NVIDIA GPU and NVSwitch on vfio-pci), for the vGPU (mdev)
    instances on them (default: every one on an NVIDIA GPU) and for ``vgpu_types``. Nothing to
    export is refused (exit 1): an empty list applied would permit nothing."""
    names = names or kubevirt_names.bundled()
    inventory = read_inventory(ctx.host, names=PciIds.load(ctx.host))
    mdevs = [m for m in _mdev_instances(ctx)
             if (fn := inventory.functions.get(m.parent)) is not None and fn.is_nvidia]
    if addresses:
        chosen = _chosen(inventory, addresses)
        mdevs = [m for m in mdevs if m.parent in set(addresses)]
    else:
        chosen = [f for _a, f in sorted(inventory.functions.items())
                  if (f.is_nvidia_gpu or f.is_nvswitch) and f.driver in VFIO_DRIVERS]
    report = KubevirtExport(devices=[str(f.address) for f in chosen], provider=provider, names=names)
    notes, left_out = report.notes, report.left_out
    notes.append("KubeVirt selects every vfio-bound device of a vendor:device pair (pciVendorSelector): a subset of "
                 "identical GPUs on one node cannot be expressed there")
    vgpu_parents = {m.parent for m in mdevs}
    pairs: dict[tuple[str, str], list[PciFunction]] = {}
    for fn in chosen:
        if fn.address in vgpu_parents and fn.driver not in VFIO_DRIVERS:
            left_out.append(LeftOut(str(fn.address), "it hosts vGPU instances: their types are exported instead"))
            continue
        pairs.setdefault((fn.vendor_id, fn.device_id), []).append(fn)
    for (vendor, device), fns in sorted(pairs.items()):
        entry = _pci_entry(names, provider, vendor, device, fns, left_out, notes)
        if entry is None:
            continue
        report.pci.append(entry)
        others = [str(f.address) for f in inventory.functions.values()
                  if (f.vendor_id, f.device_id) == (vendor, device) and f not in fns]
        if others:
            notes.append(f"{vendor}:{device}: {len(others)} more on this host ({', '.join(sorted(others))}) go to "
                         f"{entry.resource_name} too once they are on vfio-pci")
        unbound = [str(f.address) for f in fns if f.driver not in VFIO_DRIVERS]
        if unbound:
            notes.append(f"not on vfio-pci, so not offered until bound (gpuvfio bind, gpuvfio persist): "
                         f"{', '.join(unbound)}")
    _mediated(report, names, provider, mdevs, [_wanted_type(inventory, t) for t in vgpu_types or []])
    if not addresses:
        others = sorted({f"{f.vendor_id}:{f.device_id}" for f in inventory.nvidia()
                         if f.driver in VFIO_DRIVERS and not (f.is_nvidia_gpu or f.is_nvswitch)})
        if others:
            notes.append(f"other NVIDIA functions on vfio-pci ({', '.join(others)}, e.g. a GPU's audio) get a "
                         "resource from the plugin too; name them to permit them")
    sriov = [str(a) for a, f in sorted(inventory.functions.items()) if f.physfn is not None and f.vgpu_current]
    if sriov:
        notes.append(f"SR-IOV vGPU instances ({', '.join(sriov)}) are not exported: NVIDIA's plugin and KubeVirt "
                     "discover only mdev-based vGPUs (/sys/bus/mdev/devices)")
    if not report.pci and not report.mediated:
        raise Refused("nothing to export: " + _nothing_reason(report, bool(addresses)))
    _usage_notes(report)
    return report


def _mediated(report: KubevirtExport, names: PluginNames, provider: Provider, mdevs: list[_Mdev],
              wanted: list[tuple[str, str | None]]) -> None:
    """One mediatedDevices entry per vGPU type (the plugin keys its vGPU resources by type name
    across all GPUs of the node): the instances' types, then the ones asked for."""
    by_type: dict[str, list[str]] = {}
    for mdev in mdevs:
        by_type.setdefault(mdev.type_name, []).append(mdev.uuid)
    for type_name, note in wanted:
        by_type.setdefault(type_name, [])
        if note:
            report.notes.append(note)
    for type_name, uuids in by_type.items():
        resource = names.vgpu_resource(type_name)
        if not valid_resource_name(resource):
            if provider is Provider.NVIDIA:
                report.left_out.append(LeftOut(type_name, f"the plugin's name {resource} is not a valid Kubernetes "
                                                          "extended resource name: the plugin cannot register it"))
                continue
            resource = f"{NAMESPACE}/{repaired(resource.partition('/')[2])}"
            if not valid_resource_name(resource):
                report.left_out.append(LeftOut(type_name, "no valid resource name can be made of it"))
                continue
        report.mediated.append(MediatedDevice(type_name, resource, provider is Provider.NVIDIA, tuple(sorted(uuids))))


def _nothing_reason(report: KubevirtExport, named: bool) -> str:
    if report.left_out:
        return "; ".join(f"{x.what}: {x.reason}" for x in report.left_out)
    if named:
        return "the devices named give no entry"
    return ("no NVIDIA GPU or NVSwitch is on vfio-pci and no vGPU (mdev) instance exists (bind one with gpuvfio "
            "bind, name devices, or give --vgpu-type)")


def _usage_notes(report: KubevirtExport) -> None:
    notes = report.notes
    if report.provider is Provider.NVIDIA:
        notes.append(f"resource names: {report.names.describe()}, as NVIDIA's kubevirt-gpu-device-plugin registers "
                     "them (it never reads the host's pci.ids); for another plugin image give its /usr/pci.ids with "
                     "--pci-ids FILE")
    else:
        notes.append("KubeVirt's own device plugin registers these names (no externalResourceProvider); do not run "
                     "NVIDIA's kubevirt-gpu-device-plugin for the same devices")
    gpus = [p.resource_name for p in report.pci if p.request is Request.GPUS] + \
        [m.resource_name for m in report.mediated]
    if gpus:
        notes.append(f"VMs ask for {', '.join(gpus)} under spec.domain.devices.gpus (deviceName); GA since KubeVirt "
                     "v1.4.0, earlier releases need the GPU feature gate")
    host_devices = [p.resource_name for p in report.pci if p.request is Request.HOST_DEVICES]
    if host_devices:
        notes.append(f"VMs ask for {', '.join(host_devices)} (NVSwitches, other functions) under "
                     f"spec.domain.devices.hostDevices, which needs the {HOST_DEVICES_GATE} feature gate (Alpha in "
                     "KubeVirt v1.9.0, off by default) in spec.configuration.developerConfiguration.featureGates")
    if report.mediated and report.provider is Provider.NVIDIA:
        notes.append("NVIDIA's plugin discovers only mdev-based vGPUs; the mdevNameSelector is mdev_type/name as the "
                     "driver spells it")


@dataclass(frozen=True)
class DraAttribute:
    """One ResourceSlice device attribute: a typed value (resource.k8s.io DeviceAttribute)."""

    name: str
    value: str | int

    def to_json(self) -> dict:
        return {"int": self.value} if isinstance(self.value, int) else {"string": self.value}


@dataclass(frozen=True)
class DraDevice:
    name: str  # a DNS label: pci-0000-01-00-0
    attributes: tuple[DraAttribute, ...]

    def to_json(self) -> dict:
        return {"name": self.name, "attributes": {a.name: a.to_json() for a in self.attributes}}


@dataclass(frozen=True)
class DraAttributes:
    devices: tuple[DraDevice, ...]

    def to_json(self) -> dict:
        return {"devices": [d.to_json() for d in self.devices]}


def attributes(ctx: Context, addresses: list[PciAddress]) -> DraAttributes:
    """``gpuvfio export attributes``: per device, its facts as DRA device attributes (typed values
    as in a ResourceSlice), under the standard names where they exist."""
    inventory = read_inventory(ctx.host, names=PciIds.load(ctx.host))
    chosen = _chosen(inventory, addresses) if addresses else [
        f for _a, f in sorted(inventory.functions.items()) if f.is_nvidia_gpu]
    cliques = p2p_cliques([f for f in chosen if f.is_nvidia_gpu],
                          acs_override=read_kernel(ctx.host).param("pcie_acs_override") is not None,
                          single_node=len(read_numa(ctx.host)) <= 1, cpu_vendor=cpu_vendor(ctx.host))
    devices = []
    for fn in chosen:
        attrs = [DraAttribute(DRA_PREFIX + "pciBusID", str(fn.address)),
                 DraAttribute(DRA_PREFIX + "pcieRoot", f"pci{position(fn).root_complex}"),
                 DraAttribute(OWN_DOMAIN + "vendorID", fn.vendor_id),
                 DraAttribute(OWN_DOMAIN + "deviceID", fn.device_id)]
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
            attrs.append(DraAttribute(OWN_DOMAIN + key, value if isinstance(value, int) else str(value)))
        devices.append(DraDevice(_dra_name(fn.address), tuple(attrs)))
    return DraAttributes(tuple(devices))


def _dra_name(address: PciAddress) -> str:
    """A device name a ResourceSlice takes (a DNS label): pci-0000-01-00-0."""
    return "pci-" + re.sub(r"[:.]", "-", str(address))
