"""The NVLink fabric of an HGX/DGX host: its NVSwitches, the GPUs of its baseboard, the Fabric
Manager's mode, and what that means for a guest asking for some of those GPUs.

Sources (NVIDIA Fabric Manager user guide, "GPU Baseboard Topologies", "Supported Virtualization
Models", "Full Passthrough Virtualization Model", "GPU Partitions", "Fabric Manager SDK"):

* HGX-2, HGX A100 and HGX H100 baseboards show their NVSwitches on the PCIe tree as NVIDIA
  endpoints of class 0x0680 ("Bridge: other"; device ids 1ac2, 1af1, 22a3 in the guide's lspci
  listings) next to their GPUs (3D controllers). HGX B200/B300/B100 hide the NVSwitches behind a
  ConnectX-7 bridge: no 0x0680 endpoint shows, and gpuvfio sees no fabric there.
* ``FABRIC_MODE`` in fabricmanager.cfg: 0 bare metal or full passthrough (the default),
  1 shared NVSwitch, 2 vGPU.
* Full passthrough: the GPUs and the NVSwitches of a baseboard go to one guest, which runs the
  driver and its own Fabric Manager. For H100 the only other full-passthrough size is one GPU
  with no NVSwitch, with the GPU's NVLinks disabled (the 2- and 4-GPU full-passthrough VMs of
  older baseboards need the hypervisor to filter NVSwitch MMIO, which QEMU does not do).
* Shared NVSwitch: only GPUs go to guests; the Fabric Manager keeps running on the host and
  enables NVLink among the GPUs of one *partition* it activates. Partitions are fixed sets
  (on H100: one of 8, two of 4, four of 2, eight of 1) named by GPU physical id, which "has the
  same value as the GPU Module ID" nvidia-smi prints -- not by PCI address, and module ids do not
  follow bus order.
* vGPU: GPUs stay on the host and guests get SR-IOV VFs (gpuvfio vgpu).

A GPU in a guest without its fabric fails CUDA with error 802 (CUDA_ERROR_SYSTEM_NOT_READY);
a lone GPU of an NVLink baseboard works with ``NVreg_NvLinkDisable=1`` for the guest's nvidia
module (open-gpu-kernel-modules, kernel-open/nvidia/nv-reg.h: "the NVIDIA kernel module will not
attempt to initialize or train NVLink connections").

Telling baseboard GPUs from PCIe cards: a GPU belongs to the fabric when the host has NVSwitch
endpoints and the GPU is an NVIDIA physical function of an SXM part of a generation that has
PCIe-visible NVSwitches (SXM_GPUS below: device ids from the guide's lspci listings and the
PCI ID repository). When NVSwitches show but no GPU is a known SXM part (a newer board), every
NVIDIA 3D controller (class 0x0302) physical function is taken as the baseboard's, and the
fabric says so. Two-baseboard systems (HGX-2, HGX A100 16-GPU) are one fabric here: the PCIe
tree does not show which baseboard a GPU sits on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.errors import Refused
from gpuvfio.host.inventory import Inventory
from gpuvfio.host.model import PciFunction
from gpuvfio.host.nvidia import FABRIC_MANAGER_UNIT, fabric_mode, running_services
from gpuvfio.host.root import HostRoot

FULL_PASSTHROUGH, SHARED_NVSWITCH, VGPU = 0, 1, 2
MODE_NAMES = {FULL_PASSTHROUGH: "bare metal / full passthrough", SHARED_NVSWITCH: "shared NVSwitch", VGPU: "vGPU"}
NVLINK_DISABLE = "NVreg_NvLinkDisable=1"
# SXM GPUs of the baseboards with PCIe-visible NVSwitches (the guide's lspci listings: V100 SXM3
# with NVSwitch 1ac2, A100 20b0 with 1af1, H100 2330 with 22a3; the PCI ID repository for the
# other SXM parts of those generations: A100 SXM4 80GB, A800 SXM4, H800; H200 SXM as lspci names
# it with a current pci.ids).
SXM_GPUS = {
    "1db8": "V100 SXM3", "20b0": "A100 SXM4 40GB", "20b2": "A100 SXM4 80GB", "20b3": "A100 SXM 64GB",
    "20f3": "A800 SXM4 80GB", "2330": "H100 SXM5", "2324": "H800", "2335": "H200 SXM",
}
# The module parameter file of the loaded nvidia module (kernel/params.c exposes MODULE_VERSION
# as /sys/module/<name>/version; kernel-open/nvidia/nv.c sets it to the driver version). The
# Fabric Manager refuses to start against a driver of another version ("During initialization,
# the FM service checks the currently loaded kernel driver stack version for compatibility"),
# and its packages are versioned with the driver's, so while it runs this is its version.
DRIVER_VERSION = ("module", "nvidia", "version")
_VERSION = re.compile(r"[0-9]{2,4}(?:\.[0-9]{1,4}){1,3}")
OK, REFUSE, WARN = "ok", "refuse", "warn"  # the statuses of bind.plan's checks


@dataclass(frozen=True, slots=True)
class PartitionGpu:
    """One GPU of a Fabric Manager partition (fmFabricPartitionGpuInfo_t)."""

    module_id: int  # physicalId: the GPU module id
    pci: PciAddress | None = None  # pciBusId; empty on HGX H100 and later (FM user guide, "Data Structures")
    uuid: str | None = None
    nvlinks: int | None = None  # numNvLinksAvailable
    max_nvlinks: int | None = None

    def to_json(self) -> dict:
        return {"module_id": self.module_id, "pci": str(self.pci) if self.pci else None, "uuid": self.uuid,
                "nvlinks": self.nvlinks, "max_nvlinks": self.max_nvlinks}


@dataclass(frozen=True, slots=True)
class Partition:
    """One supported fabric partition (fmFabricPartitionInfo_t)."""

    partition_id: int
    active: bool
    gpus: tuple[PartitionGpu, ...]

    @property
    def module_ids(self) -> list[int]:
        return sorted(g.module_id for g in self.gpus)

    def addresses(self, modules: dict[int, PciAddress] | None = None) -> list[PciAddress] | None:
        """The PCI addresses of its GPUs (the pciBusId FM gave, else ``modules``); None when one
        of them cannot be told."""
        found = []
        for gpu in self.gpus:
            address = gpu.pci or (modules or {}).get(gpu.module_id)
            if address is None:
                return None
            found.append(address)
        return sorted(found)

    def describe(self, modules: dict[int, PciAddress] | None = None) -> str:
        where = self.addresses(modules)
        at = f": {', '.join(map(str, where))}" if where else ""
        return f"partition {self.partition_id} (GPU modules {', '.join(map(str, self.module_ids))}{at})"

    def to_json(self) -> dict:
        return {"id": self.partition_id, "active": self.active, "gpus": [g.to_json() for g in self.gpus]}


@dataclass(slots=True)
class Fabric:
    nvswitches: list[PciAddress]
    gpus: list[PciAddress]  # the baseboard's GPUs
    others: list[PciAddress]  # NVIDIA GPUs not on the baseboard (PCIe cards)
    mode: int | None  # FABRIC_MODE; None: no Fabric Manager configuration on the host
    fm_running: bool
    fm_version: str | None
    baseboard_by: str = "device id"  # or "class" (no known SXM part: every 3D controller)
    modules: dict[int, PciAddress] = field(default_factory=dict)  # module id -> GPU, when known (NVML)
    notes: list[str] = field(default_factory=list)

    @property
    def present(self) -> bool:
        return bool(self.nvswitches)

    @property
    def effective_mode(self) -> int:
        """FABRIC_MODE, with no configuration taken as FM's default (0)."""
        return FULL_PASSTHROUGH if self.mode is None else self.mode

    @property
    def guest_driver_version(self) -> str | None:
        """The NVIDIA driver a guest with this baseboard's GPUs needs: in shared-NVSwitch mode the
        host Fabric Manager's version (FM user guide: the guest driver and FM versions match);
        none asked otherwise."""
        return self.fm_version if self.effective_mode == SHARED_NVSWITCH else None

    def to_json(self) -> dict:
        return {"nvswitches": [str(a) for a in self.nvswitches], "gpus": [str(a) for a in self.gpus],
                "others": [str(a) for a in self.others], "fabric_mode": self.mode,
                "mode_name": MODE_NAMES.get(self.effective_mode, "unknown") if self.present else None,
                "fabric_manager_running": self.fm_running, "fabric_manager_version": self.fm_version,
                "baseboard_by": self.baseboard_by,
                "modules": {str(m): str(a) for m, a in sorted(self.modules.items())}, "notes": list(self.notes)}


def _is_gpu_pf(fn: PciFunction) -> bool:
    return fn.is_nvidia_gpu and fn.physfn is None


def read_fabric(host: HostRoot, inventory: Inventory, modules: dict[int, PciAddress] | None = None) -> Fabric:
    """The fabric as the host shows it; reads the host, changes nothing. ``modules``: GPU module
    id -> PCI address, when the caller has it (NVML's nvmlDeviceGetModuleId, read while the GPUs
    are on nvidia); needed to match partitions on H100, whose partition list has no bus ids."""
    fns = sorted(inventory.functions.values(), key=lambda f: f.address)
    switches = [f.address for f in fns if f.is_nvswitch]
    gpus = [f for f in fns if _is_gpu_pf(f)]
    notes: list[str] = []
    by = "device id"
    if not switches:
        board: list[PciFunction] = []
    else:
        board = [f for f in gpus if f.device_id in SXM_GPUS]
        if not board:
            board = [f for f in gpus if f.class_id.startswith("0302")]
            by = "class"
            if board:
                notes.append("no GPU is a known SXM part: every NVIDIA 3D controller is taken as the baseboard's")
    on_board = {f.address for f in board}
    mode = fabric_mode(host)
    running = FABRIC_MANAGER_UNIT in running_services(host)
    version = host.read(host.sys_path(*DRIVER_VERSION))
    if version is not None and not _VERSION.fullmatch(version):
        notes.append(f"sys/module/nvidia/version reads {version[:40]!r}, not a driver version; ignored")
        version = None
    if switches and mode is None:
        notes.append("no Fabric Manager configuration (fabricmanager.cfg): taken as FABRIC_MODE=0, its default")
    known = {m: a for m, a in (modules or {}).items() if a in on_board}
    return Fabric(switches, sorted(on_board), [f.address for f in gpus if f.address not in on_board], mode,
                  running, version if running or mode is not None else None, by, known, notes)


@dataclass(slots=True)
class FabricLine:
    status: str  # ok | refuse | warn
    message: str

    def to_json(self) -> dict:
        return {"id": "fabric", "status": self.status, "message": self.message}


@dataclass(slots=True)
class Decision:
    """What the fabric means for one guest. ``kind``: none (no NVSwitch fabric, or no baseboard
    GPU asked for), full_passthrough, partition, single_gpu (no partition: NVLink off in the
    guest), refused."""

    kind: str
    mode: int | None
    gpus: list[PciAddress] = field(default_factory=list)  # the baseboard GPUs asked for
    add_devices: list[PciAddress] = field(default_factory=list)  # NVSwitches the guest gets as well
    partition: Partition | None = None
    guest_module_options: list[str] = field(default_factory=list)  # for the guest's nvidia module
    guest_driver_version: str | None = None  # the guest's driver must be this (the host's FM)
    lines: list[FabricLine] = field(default_factory=list)

    @property
    def refused(self) -> bool:
        return self.kind == "refused"

    @property
    def message(self) -> str:
        return "; ".join(line.message for line in self.lines if line.status == REFUSE)

    def check(self) -> "Decision":
        """Raise Refused (the decision as its report) when the fabric forbids the request."""
        if self.refused:
            raise Refused("refused: " + self.message, {"fabric": self.to_json()})
        return self

    def to_json(self) -> dict:
        return {"kind": self.kind, "fabric_mode": self.mode, "gpus": [str(a) for a in self.gpus],
                "add_devices": [str(a) for a in self.add_devices],
                "partition": self.partition.to_json() if self.partition else None,
                "guest_module_options": {"nvidia": list(self.guest_module_options)} if self.guest_module_options
                else {}, "guest_driver_version": self.guest_driver_version,
                "checks": [line.to_json() for line in self.lines]}


def _listed(addresses) -> str:
    return ", ".join(str(a) for a in sorted(addresses))


def fabric_decision(fabric: Fabric, requested: list[PciAddress], partitions: list[Partition] | None) -> Decision:
    """What giving ``requested`` to one guest takes on this fabric. ``partitions``: the Fabric
    Manager's supported partitions (fmpm -l), None when it was not asked."""
    wanted = sorted(set(requested))
    gpus = [a for a in wanted if a in fabric.gpus]
    switches = [a for a in wanted if a in fabric.nvswitches]
    if not fabric.present:
        return Decision("none", fabric.mode, lines=[FabricLine(OK, "no NVSwitch on this host: no NVLink fabric")])
    if not gpus and not switches:
        return Decision("none", fabric.mode, lines=[FabricLine(OK, "no GPU of the NVSwitch baseboard asked for")])
    mode = fabric.effective_mode
    named = f"FABRIC_MODE={fabric.mode}" if fabric.mode is not None else "no FABRIC_MODE (default 0)"
    if mode == FULL_PASSTHROUGH:
        return _full_passthrough(fabric, gpus, switches, named)
    if mode == SHARED_NVSWITCH:
        return _shared(fabric, gpus, switches, partitions)
    if mode == VGPU:
        return _refuse(fabric, gpus, "the Fabric Manager runs in vGPU mode (FABRIC_MODE=2): GPUs are not passed "
                       "through whole on this host (vGPU mode: use gpuvfio vgpu)")
    return _refuse(fabric, gpus, f"unknown FABRIC_MODE={fabric.mode} in fabricmanager.cfg (0 full passthrough, "
                   "1 shared NVSwitch, 2 vGPU)")


def _refuse(fabric: Fabric, gpus, message: str) -> Decision:
    return Decision("refused", fabric.mode, gpus=list(gpus), lines=[FabricLine(REFUSE, message)])


def _single_gpu(fabric: Fabric, gpu: PciAddress, why: str) -> Decision:
    shared = fabric.effective_mode == SHARED_NVSWITCH
    lines = [FabricLine(WARN, f"{gpu} alone, {why}: the guest's nvidia module needs {NVLINK_DISABLE} "
                        "(options nvidia NVreg_NvLinkDisable=1), or CUDA fails there with error 802 waiting for an "
                        "NVLink fabric it cannot reach")]
    if fabric.fm_running and not shared:
        # FM user guide, "High Availability Mode Comparison", DGX/HGX H100, ABORT_CUDA_JOBS_ON_FM_EXIT:
        # with FM stopped, running CUDA jobs go on and new ones fail to launch.
        lines.append(FabricLine(WARN, "the host's nvidia-fabricmanager (bare-metal mode) is stopped for the bind "
                                "(--stop-services): until restore restarts it, new CUDA jobs on the host's other "
                                "GPUs of this baseboard fail to launch"))
    return Decision("single_gpu", fabric.mode, gpus=[gpu], guest_module_options=[NVLINK_DISABLE],
                    guest_driver_version=fabric.guest_driver_version, lines=lines)


def _full_passthrough(fabric: Fabric, gpus, switches, named: str) -> Decision:
    missing = [a for a in fabric.gpus if a not in gpus]
    if not missing:
        add = [a for a in fabric.nvswitches if a not in switches]
        lines = [FabricLine(OK, f"full passthrough ({named}): all {len(fabric.gpus)} baseboard GPUs with all "
                            f"{len(fabric.nvswitches)} NVSwitches ({_listed(fabric.nvswitches)}); the guest runs the "
                            "driver and its own Fabric Manager")]
        if fabric.fm_running:
            lines.append(FabricLine(WARN, "the host's nvidia-fabricmanager holds the NVSwitches: it is stopped for the "
                                    "bind (--stop-services) and restarted by restore"))
        return Decision("full_passthrough", fabric.mode, gpus=list(gpus), add_devices=add, lines=lines)
    if len(gpus) == 1 and not switches:
        return _single_gpu(fabric, gpus[0], f"without the NVSwitches ({named}, full passthrough)")
    what = f"{len(gpus)} of the {len(fabric.gpus)} baseboard GPUs" if gpus else "NVSwitches without the GPUs"
    return _refuse(fabric, gpus, f"{what} in full-passthrough mode ({named}): a guest gets all GPUs of the baseboard "
                   f"with all its NVSwitches, or one GPU; missing {_listed(missing)}; for a subset use FABRIC_MODE=1 "
                   "(shared NVSwitch) with a Fabric Manager partition")


def _shared(fabric: Fabric, gpus, switches, partitions: list[Partition] | None) -> Decision:
    if switches:
        return _refuse(fabric, gpus, f"NVSwitches {_listed(switches)} asked for in shared-NVSwitch mode "
                       "(FABRIC_MODE=1): they stay with the host's Fabric Manager; ask for the GPUs only")
    if not fabric.fm_running:
        return _refuse(fabric, gpus, "shared-NVSwitch mode (FABRIC_MODE=1) but nvidia-fabricmanager is not running: "
                       "it activates the guest's partition and must keep running "
                       "(systemctl start nvidia-fabricmanager)")
    if partitions is None:
        return _refuse(fabric, gpus, "shared-NVSwitch mode (FABRIC_MODE=1): the Fabric Manager's partition list is "
                       "needed to match the GPUs to a partition (fmpm -l)")
    unmapped = sorted({g.module_id for p in partitions for g in p.gpus if g.pci is None}
                      - set(fabric.modules))
    matches = [p for p in partitions if p.addresses(fabric.modules) == gpus]
    if not matches:
        if len(gpus) == 1 and not unmapped:
            return _single_gpu(fabric, gpus[0], "in no 1-GPU Fabric Manager partition")
        same_size = [p.describe(fabric.modules) for p in partitions if len(p.gpus) == len(gpus)]
        hint = (f"; {len(gpus)}-GPU partitions: {'; '.join(same_size)}" if same_size
                else f"; no {len(gpus)}-GPU partition exists (sizes: "
                f"{', '.join(map(str, sorted({len(p.gpus) for p in partitions}))) or 'none'})")
        if unmapped:
            hint += (f"; module ids {', '.join(map(str, unmapped))} have no PCI address (FM gives none on HGX H100) "
                     "and NVML's module ids are not known here: run gpuvfio while the GPUs are on the nvidia driver "
                     "(NVML reads nvmlDeviceGetModuleId), or record them with dump-host then")
        return _refuse(fabric, gpus, f"GPUs {_listed(gpus)} are not exactly one Fabric Manager partition in "
                       f"shared-NVSwitch mode (FABRIC_MODE=1){hint}")
    chosen = matches[0]
    taken = set(gpus)
    busy = [p for p in partitions if p.active and p is not chosen and taken & set(p.addresses(fabric.modules) or [])]
    if chosen.active or busy:
        who = chosen if chosen.active else busy[0]
        return _refuse(fabric, gpus, f"{who.describe(fabric.modules)} is active: another guest uses "
                       f"{'these GPUs' if who is chosen else 'some of these GPUs'}; stop it first (its partition is "
                       "deactivated on detach)")
    lines = [FabricLine(OK, f"shared NVSwitch (FABRIC_MODE=1): {chosen.describe(fabric.modules)}; bind, activate the "
                        "partition, start; stop, deactivate, restore; the NVSwitches stay with the host's Fabric "
                        "Manager (kept running)")]
    if fabric.fm_version:
        lines.append(FabricLine(OK, f"the guest's NVIDIA driver must be {fabric.fm_version}, the host's Fabric "
                                "Manager version (the verifier checks it)"))
    else:
        lines.append(FabricLine(WARN, "the host's Fabric Manager version is not known (no sys/module/nvidia/version): "
                                "the guest's driver cannot be checked against it"))
    return Decision("partition", fabric.mode, gpus=list(gpus), partition=chosen,
                    guest_driver_version=fabric.guest_driver_version, lines=lines)
