"""Recording a host as a fixture (gpuvfio dump-host, bug reports, the samples): the parts of a
root that gpuvfio reads, in the format gpuvfio.host.fixture loads.

NVLink, which only NVML knows, goes in as the file ``var/lib/gpuvfio-fixture/nvlink.json``
(gpuvfio.host.nvlink: read from NVML on the live host, copied from a recorded root).
"""

from __future__ import annotations

import os
import re

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError, HostReadError
from gpuvfio.host.firmware import FIRMWARE_DESCRIPTOR_DIRS, OVMF_CANDIDATES
from gpuvfio.host.fixture import HEADER
from gpuvfio.host.host_use import CLASSES, PROC_FILES
from gpuvfio.host.hypervisor import DEV_NODES, RECORDED_FLAGS, SECURE_PARAMS
from gpuvfio.host.inventory import MAX_SWITCH_LINKS, SWITCH_LINKS
from gpuvfio.host.iommu_faults import KMSG, recorded_log
from gpuvfio.host.nvidia import FABRIC_MANAGER_CONFIG
from gpuvfio.host.nvlink import RECORD as NVLINK_RECORD
from gpuvfio.host.nvlink import record_text as nvlink_record
from gpuvfio.host.root import HostRoot

__all__ = ["dump_host", "PCI_ATTRS", "RECORD_LIMIT"]

RECORD_LIMIT = 1 << 20  # a recorded file's first MiB (modules.dep is filtered afterwards)

# Attribute files of a PCI function that gpuvfio (and lspci) reads.
PCI_ATTRS = (
    "uevent", "vendor", "device", "class", "subsystem_vendor", "subsystem_device", "revision",
    "irq", "numa_node", "local_cpulist", "resource", "modalias", "driver_override",
    "current_link_speed", "current_link_width", "max_link_speed", "max_link_width",
    "sriov_totalvfs", "sriov_numvfs", "boot_vga", "reset_method", "enable", "power_state", "d3cold_allowed",
    "power/control", "aer_dev_correctable", "aer_dev_nonfatal", "aer_dev_fatal",
    "aer_rootport_total_err_cor", "aer_rootport_total_err_nonfatal", "aer_rootport_total_err_fatal",
)
PCI_LINKS = ("driver", "iommu_group", "physfn")
MDEV_TYPE_ATTRS = ("name", "available_instances", "device_api", "description")
NVIDIA_VGPU_ATTRS = ("creatable_vgpu_types", "current_vgpu_type")
MODULE_PARAMS = (
    ("vfio_iommu_type1", "allow_unsafe_interrupts"),
    ("vfio", "enable_unsafe_noiommu_mode"),
)
# Kernel modules whose presence in modules.dep / modules.builtin gpuvfio checks.
_MODULE_INTEREST = re.compile(r"(vfio|nvidia|nouveau|pci-stub|pci_stub|kvm)")


def _esc(text: str) -> str:
    return text.encode("unicode_escape").decode("ascii").replace(" ", "\\x20")


class _Recorder:
    def __init__(self, host: HostRoot) -> None:
        self.host = host
        self.lines: list[str] = []
        self.seen: set[str] = set()

    def rel(self, path: str) -> str:
        return os.path.relpath(path, self.host.root)

    def add(self, kind: str, path: str, payload: str | None = None) -> None:
        rel = self.rel(path)
        if rel in self.seen:
            return
        self.seen.add(rel)
        self.lines.append(f"{kind} {_esc(rel)}" + (f" {payload}" if payload is not None else ""))

    def file(self, path: str, transform=None, *, config: bool = False) -> None:
        """Record a regular file (its first MiB); a link, FIFO or device there is refused by the
        file layer, never copied from where it points. ``config``: a host configuration file,
        its links followed as the host follows them (inside the root), recorded under its name."""
        source = self.host.config_path(self.rel(path)) if config else path
        data = self.host.read_head(source, RECORD_LIMIT)
        if data is None:
            return
        text = data.decode("utf-8", "replace")
        if transform:
            text = transform(text)
        self.add("F", path, _esc(text))

    def binary(self, path: str, limit: int) -> None:
        data = self.host.read_head(path, limit)
        if data is not None:
            self.add("B", path, data.hex())

    def link(self, path: str) -> None:
        target = self.host.raw_link(path)
        if target is not None:
            self.add("L", path, _esc(target))

    def directory(self, path: str) -> None:
        self.add("D", path)


def _strip_interrupt_counts(text: str) -> str:
    # /proc/interrupts has one count column per CPU (hundreds on big hosts); gpuvfio
    # only needs the chip names ("IR-PCI-MSI" means interrupt remapping is active).
    out = []
    for line in text.splitlines():
        parts = line.split()
        if not parts or not parts[0].endswith(":"):
            continue
        rest = [p for p in parts[1:] if not p.isdigit()]
        out.append(" ".join([parts[0]] + rest))
    return "\n".join(out) + "\n"


def _first_cpu(text: str) -> str:
    # The first processor's identity, address sizes and the virtualization flags the doctor
    # reads (gpuvfio.host.hypervisor); the rest repeats per CPU.
    keep = ("processor", "vendor_id", "model name", "address sizes")
    lines = []
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keep:
            lines.append(line)
        elif key.strip() == "flags":
            lines.append("flags\t\t: " + " ".join(f for f in value.split() if f in RECORDED_FLAGS))
    return "\n".join(lines) + "\n\n"


def _filter_modules(text: str) -> str:
    return "".join(line + "\n" for line in text.splitlines() if _MODULE_INTEREST.search(line))


def dump_host(host: HostRoot) -> str:
    """Record the parts of ``host`` that gpuvfio reads, as fixture text."""
    rec = _Recorder(host)
    # In this order: a recording's lines are the same on every run of the same host.
    for part in (_record_pci_devices, _record_iommu, _record_numa_and_cpus, _record_proc, _record_config_files,
                 _record_modules_and_devices, _record_firmware, _record_holders, _record_host_use):
        part(rec, host)
    return HEADER + "\n" + "\n".join(rec.lines) + "\n"


def _record_pci_devices(rec: _Recorder, host: HostRoot) -> None:
    """Each PCI function: its attributes, config space head, links, mdev and vGPU types; the drivers."""
    devices_dir = host.require_dir("bus", "pci", "devices")
    for name in host.listdir(devices_dir):
        if PciAddress.try_parse(name) is None:
            continue
        link = os.path.join(devices_dir, name)
        rec.link(link)
        real = host.resolve_in_sys(link)
        rec.directory(real)
        for attr in PCI_ATTRS:
            rec.file(os.path.join(real, attr))
        rec.binary(os.path.join(real, "config"), 256)
        for entry in host.listdir(real):
            if entry in PCI_LINKS or entry.startswith("virtfn"):
                rec.link(os.path.join(real, entry))
        types_dir = os.path.join(real, "mdev_supported_types")
        for type_id in host.listdir(types_dir):
            tdir = os.path.join(types_dir, type_id)
            rec.directory(os.path.join(tdir, "devices"))
            for attr in MDEV_TYPE_ATTRS:
                rec.file(os.path.join(tdir, attr))
        for attr in NVIDIA_VGPU_ATTRS:
            rec.file(os.path.join(real, "nvidia", attr))
    _record_switch_links(rec, host)
    drivers = host.sys_path("bus", "pci", "drivers")
    for name in host.listdir(drivers):
        rec.directory(os.path.join(drivers, name))
        rec.link(os.path.join(drivers, name, "module"))  # its kernel module (persist's softdep)


def _record_switch_links(rec: _Recorder, host: HostRoot) -> None:
    """Broadcom's virtual switch links (inventory.switch_links): a directory per switch, an
    entry per switch it reaches; only the names are read."""
    links = host.sys_path(*SWITCH_LINKS)
    for switch in host.listdir(links):
        if PciAddress.try_parse(switch) is None:
            continue
        rec.directory(os.path.join(links, switch))
        for peer in host.listdir(os.path.join(links, switch))[:MAX_SWITCH_LINKS]:
            if PciAddress.try_parse(peer) is not None:
                rec.directory(os.path.join(links, switch, peer))


def _record_iommu(rec: _Recorder, host: HostRoot) -> None:
    """The IOMMU groups' members and the IOMMU units' capabilities."""
    groups = host.sys_path("kernel", "iommu_groups")
    for group in host.listdir(groups):
        gdir = os.path.join(groups, group, "devices")
        rec.directory(gdir)
        for dev in host.listdir(gdir):
            rec.link(os.path.join(gdir, dev))
    iommu_class = host.sys_path("class", "iommu")
    for unit in host.listdir(iommu_class):
        rec.link(os.path.join(iommu_class, unit))
        try:
            real = host.resolve_in_sys(os.path.join(iommu_class, unit))
        except HostReadError:
            continue
        rec.directory(real)
        for sub, attrs in (("intel-iommu", ("cap", "ecap", "version")), ("amd-iommu", ("features", "cap"))):
            for attr in attrs:
                rec.file(os.path.join(real, sub, attr))


def _record_numa_and_cpus(rec: _Recorder, host: HostRoot) -> None:
    """NUMA nodes (CPUs, memory, distances, huge pages) and each CPU's topology."""
    nodes = host.sys_path("devices", "system", "node")
    for attr in ("online", "possible", "has_cpu"):
        rec.file(os.path.join(nodes, attr))
    for node in host.listdir(nodes):
        if not re.fullmatch(r"node\d+", node):
            continue
        ndir = os.path.join(nodes, node)
        rec.file(os.path.join(ndir, "cpulist"))
        rec.file(os.path.join(ndir, "meminfo"))
        rec.file(os.path.join(ndir, "distance"))
        hp = os.path.join(ndir, "hugepages")
        for size in host.listdir(hp):
            for attr in ("nr_hugepages", "free_hugepages"):
                rec.file(os.path.join(hp, size, attr))
    cpus = host.sys_path("devices", "system", "cpu")
    rec.file(os.path.join(cpus, "online"))
    for cpu in host.listdir(cpus):
        if re.fullmatch(r"cpu\d+", cpu):
            for attr in ("core_id", "physical_package_id", "thread_siblings_list"):
                rec.file(os.path.join(cpus, cpu, "topology", attr))


def _record_proc(rec: _Recorder, host: HostRoot) -> None:
    """Module parameters, the NVIDIA driver's version and GPUs, and /proc's answers."""
    for module, param in MODULE_PARAMS:
        rec.file(host.sys_path("module", module, "parameters", param))
    rec.file(host.sys_path("module", "nvidia", "version"))  # the driver's, so the Fabric Manager's (host.fabric)
    for name in ("cmdline", "modules", "fb", "sys/kernel/osrelease"):
        rec.file(host.path("proc", name))
    rec.file(host.path("proc", "interrupts"), _strip_interrupt_counts)
    rec.file(host.path("proc", "cpuinfo"), _first_cpu)
    gpus = host.path("proc", "driver", "nvidia", "gpus")
    for gpu in host.listdir(gpus):
        if PciAddress.try_parse(gpu):
            rec.file(os.path.join(gpus, gpu, "information"))  # "Device Minor: N" -> /dev/nvidiaN


def _record_config_files(rec: _Recorder, host: HostRoot) -> None:
    """os-release, the Fabric Manager's config and the NVLink recording."""
    rec.file(host.path("etc", "os-release"), config=True)
    rec.file(host.path(*FABRIC_MANAGER_CONFIG), config=True)
    nvlink = nvlink_record(host)
    if nvlink is not None:
        rec.add("F", host.path(*NVLINK_RECORD), _esc(nvlink))


def _record_modules_and_devices(rec: _Recorder, host: HostRoot) -> None:
    """The kernel's module lists, cgroups, device node names and the security parameters."""
    release = (host.read(host.path("proc", "sys", "kernel", "osrelease")) or "").strip()
    if release and "/" not in release and release not in (".", ".."):
        for name in ("modules.dep", "modules.builtin"):
            rec.file(host.path("lib", "modules", release, name), _filter_modules)
    rec.file(host.path("proc", "cgroups"))
    for parts in DEV_NODES:  # /dev/kvm, /dev/vfio/vfio: names only (a fixture holds no device nodes)
        if host.tree.exists("/".join(parts)):
            rec.add("F", host.path(*parts), "")
    # The kernel log: its IOMMU fault records only (what health reads; the rest is the host's
    # own), the newest within a MiB. A log that cannot be read is not recorded (health then says
    # the recording holds none), and the rest of the recording goes on.
    try:
        log = host.tree.read_kernel_log(KMSG)
    except GpuvfioError:
        log = None
    if log is not None:
        rec.add("F", host.path(KMSG), _esc(recorded_log(log)))
    for module, param, _name in SECURE_PARAMS:
        rec.file(host.sys_path("module", module, "parameters", param))


def _record_firmware(rec: _Recorder, host: HostRoot) -> None:
    """QEMU's firmware descriptors and which OVMF images exist."""
    for directory in FIRMWARE_DESCRIPTOR_DIRS:  # QEMU's firmware descriptors (small JSON: libvirt's choice)
        for name in host.listdir(host.path(directory)):
            if name.endswith(".json") and host.raw_link(host.path(directory, name)) is None:
                rec.file(host.path(directory, name))  # a link is a mask or one libvirt's reader skips too
    for pair in OVMF_CANDIDATES:  # which firmware images exist (names only: their bytes do not matter)
        for rel in pair:
            if host.installed(host.path(rel)):  # as find_ovmf asks: a dangling link is not an image
                rec.add("F", host.path(rel), "")


def _record_holders(rec: _Recorder, host: HostRoot) -> None:
    """Processes holding /dev/nvidia* or /dev/vfio/*: their fd links and comm."""
    proc = host.path("proc")
    for pid in host.listdir(proc):
        if not pid.isdigit():
            continue
        fd_dir = os.path.join(proc, pid, "fd")
        held = False
        for fd in host.listdir(fd_dir):
            target = host.raw_link(os.path.join(fd_dir, fd))
            if target is not None and target.startswith(("/dev/nvidia", "/dev/vfio/")):
                rec.add("L", os.path.join(fd_dir, fd), _esc(target))
                held = True
        if held:
            rec.file(os.path.join(proc, pid, "comm"))


# The attributes of a class device that gpuvfio.host.host_use reads, by class.
_HOST_USE_ATTRS = {"block": ("dev", "partition", "dm/name", "dm/uuid", "md/level"), "net": ("uevent", "operstate"),
                   "graphics": (), "drm": ("enabled", "status"), "vtconsole": ("name", "bind")}


def _record_host_use(rec: _Recorder, host: HostRoot) -> None:
    """What the host itself uses (gpuvfio.host.host_use): its class devices with their stacking
    links (holders, uppers, master), mounted btrfs members, an NVMe subsystem's controller links,
    and PID 1's mounts, swaps, routes and addresses."""
    for cls in CLASSES:
        directory = host.sys_path("class", cls)
        rec.directory(directory)
        for name in host.listdir(directory):
            link = os.path.join(directory, name)
            rec.link(link)
            try:
                real = host.resolve_in_sys(link)
            except HostReadError:
                continue
            rec.directory(real)
            for attr in _HOST_USE_ATTRS[cls]:
                rec.file(os.path.join(real, attr))
            for entry in host.listdir(real):
                if entry == "master" or entry.startswith(("upper_", "lower_")):
                    rec.link(os.path.join(real, entry))
            for sub in ("holders", "slaves"):
                if host.is_dir(os.path.join(real, sub)):
                    rec.directory(os.path.join(real, sub))
                for entry in host.listdir(os.path.join(real, sub)):
                    rec.link(os.path.join(real, sub, entry))
            subsystem = os.path.dirname(real)
            if os.path.basename(os.path.dirname(subsystem)) == "nvme-subsystem":
                for entry in host.listdir(subsystem):
                    if re.fullmatch(r"nvme\d+", entry):
                        rec.link(os.path.join(subsystem, entry))
    btrfs = host.sys_path("fs", "btrfs")
    for uuid in host.listdir(btrfs):
        for name in host.listdir(os.path.join(btrfs, uuid, "devices")):
            rec.link(os.path.join(btrfs, uuid, "devices", name))
    for parts in PROC_FILES:
        rec.file(host.path(*parts))
