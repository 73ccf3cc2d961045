"""Host readiness checks with concrete fixes (``gpuvfio doctor``).

What libvirt's ``virt-host-validate qemu`` checks for device assignment (KVM usable,
/dev/vfio/vfio, cgroup device control, secure guests: gpuvfio.host.hypervisor; the IOMMU), plus
what GPU passthrough needs beyond it: ACS-override detection, vfio modules, hugepages
per NUMA node and on each GPU's own node, interrupt remapping, processes holding
/dev/nvidia*, boot VGA.
"""

from __future__ import annotations

from gpuvfio.host.checks import FAIL, OK, SKIP, WARN, Check
from gpuvfio.host.hypervisor import check_cgroup_devices, check_kvm, check_secure_guest, check_vfio_device
from gpuvfio.host.root import HostRoot
from gpuvfio.host.inventory import Inventory
from gpuvfio.host.kernel import VFIO_MODULES, KernelInfo
from gpuvfio.host.model import NumaNode
from gpuvfio.host.nvidia import nvidia_holders
from gpuvfio.host.pcie_health import Rating, device_health, read_records
from gpuvfio.sizes import page_label

__all__ = ["Check", "OK", "WARN", "FAIL", "SKIP", "run_doctor"]


def _bootloader_fix(host: HostRoot, params: str) -> str:
    os_release = host.read(host.config_path("etc", "os-release")) or ""
    ids = " ".join(line.split("=", 1)[1].strip('"') for line in os_release.splitlines()
                   if line.startswith(("ID=", "ID_LIKE=")))
    if any(name in ids.split() for name in ("rhel", "fedora", "centos", "rocky", "almalinux")):
        return f"grubby --update-kernel=ALL --args='{params}' and reboot"
    if "suse" in ids:
        return f"add '{params}' to GRUB_CMDLINE_LINUX_DEFAULT in /etc/default/grub, run update-bootloader, reboot"
    return (f"add '{params}' to GRUB_CMDLINE_LINUX_DEFAULT in /etc/default/grub, "
            "run update-grub (or kernelstub -a on Pop!_OS), reboot")


def check_iommu(host: HostRoot, kernel: KernelInfo) -> Check:
    vendor = kernel.iommu_vendor
    opt = "amd_iommu=on iommu=pt" if vendor == "amd" else "intel_iommu=on iommu=pt"
    off = [p for p in ("intel_iommu", "amd_iommu") if kernel.param(p) == "off"]
    if kernel.param("iommu") == "off":
        off.append("iommu")
    if kernel.iommu_groups == 0:
        why = f" ({', '.join(p + '=off' for p in off)} on the command line)" if off else ""
        return Check("iommu", FAIL, f"no IOMMU groups: the IOMMU is off or missing{why}",
                     "enable VT-d / AMD-Vi (IOMMU) in the firmware setup, then " + _bootloader_fix(host, opt))
    summary = f"{vendor or 'unknown'} IOMMU on, {kernel.iommu_groups} groups, {len(kernel.iommu_units)} units"
    if kernel.param("iommu") != "pt" and "pt" not in (kernel.param("intel_iommu") or "").split(","):
        return Check("iommu", OK, summary + "; iommu=pt not set (host devices pay DMA translation)",
                     _bootloader_fix(host, "iommu=pt") + " (optional)")
    return Check("iommu", OK, summary + ", passthrough mode for host devices")


def check_acs_override(kernel: KernelInfo) -> Check:
    value = kernel.param("pcie_acs_override")
    if value is not None:
        return Check("acs_override", FAIL,
                     f"pcie_acs_override={value} is on the command line: IOMMU groups may not reflect "
                     "real isolation (a guest could DMA into devices of other groups)",
                     "remove pcie_acs_override from the kernel command line; put the GPU in a slot "
                     "whose root port has ACS, or accept the shared group")
    return Check("acs_override", OK, "no ACS override: IOMMU groups reflect the hardware")


def check_vfio_modules(kernel: KernelInfo) -> Check:
    missing = [m for m in VFIO_MODULES if not kernel.module_available(m) and m not in kernel.builtin_modules]
    loaded = [m for m in VFIO_MODULES if m in kernel.loaded_modules or m in kernel.builtin_modules]
    if not missing and len(loaded) == len(VFIO_MODULES):
        return Check("vfio_modules", OK, "vfio, vfio_pci, vfio_iommu_type1 loaded")
    if not missing:
        todo = [m for m in VFIO_MODULES if m not in loaded]
        return Check("vfio_modules", OK, f"loadable, not loaded yet: {', '.join(todo)}",
                     "gpuvfio bind loads them; to load at boot: echo vfio-pci > /etc/modules-load.d/vfio.conf")
    return Check("vfio_modules", FAIL, f"not available in this kernel: {', '.join(missing)}",
                 "install a kernel built with CONFIG_VFIO_PCI and CONFIG_VFIO_IOMMU_TYPE1 "
                 f"(modules for {kernel.release or 'the running kernel'})")


def check_hugepages(nodes: list[NumaNode]) -> Check:
    if not nodes:
        return Check("hugepages", SKIP, "no NUMA information under /sys/devices/system/node")
    parts, any_free = [], False
    for node in nodes:
        sizes = []
        for size, (total, free) in sorted(node.hugepages.items()):
            if total:
                sizes.append(f"{free}/{total} x {page_label(size)} free")
                any_free = any_free or free > 0
        parts.append(f"node{node.node_id}: " + (", ".join(sizes) if sizes else "none reserved"))
    summary = "; ".join(parts)
    if any_free:
        return Check("hugepages", OK, summary)
    return Check("hugepages", WARN, summary + " (guest memory will use 4K pages: slower DMA mapping, TLB misses)",
                 "reserve 1G pages on the GPU's node, e.g. echo 64 > /sys/devices/system/node/node0/"
                 "hugepages/hugepages-1048576kB/nr_hugepages, or hugepagesz=1G hugepages=N at boot")


def check_hugepages_near_gpus(host: HostRoot, inventory: Inventory, nodes: list[NumaNode]) -> Check:
    """Hugepages on each NVIDIA GPU's own NUMA node: gpuvfio binds a guest's memory to its GPU's
    node (numatune strict), so pages reserved on another node do not back it. A GPU without a
    node (numa_node -1: firmware without _PXM) on a one-node host is on that node."""
    if not nodes:
        return Check("hugepages_near_gpus", SKIP, "no NUMA information under /sys/devices/system/node")
    gpus = sorted((f for f in inventory.functions.values() if f.is_nvidia_gpu and f.physfn is None),
                  key=lambda f: f.address)
    if not gpus:
        return Check("hugepages_near_gpus", SKIP, "no NVIDIA GPU")
    by_id = {n.node_id: n for n in nodes}
    near: dict[int, list[str]] = {}
    unknown = []
    for fn in gpus:
        node = fn.numa_node if fn.numa_node in by_id else (nodes[0].node_id if len(nodes) == 1 else None)
        if node is None:
            unknown.append(str(fn.address))
        else:
            near.setdefault(node, []).append(str(fn.address))
    lost = (f"{', '.join(unknown)} report(s) no NUMA node (firmware without _PXM): guests on them are not "
            "bound to a node") if unknown else ""
    if not near:
        return Check("hugepages_near_gpus", SKIP, lost)
    parts, short = [], []
    for node_id, addresses in sorted(near.items()):
        gpus_there = ", ".join(addresses[:4]) + (f" +{len(addresses) - 4} more" if len(addresses) > 4 else "")
        sizes = [f"{free}/{total} x {page_label(size)} free"
                 for size, (total, free) in sorted(by_id[node_id].hugepages.items()) if total]
        if not sizes:
            short.append(node_id)
        elif not any(free for total, free in by_id[node_id].hugepages.values() if total):
            short.append(node_id)
            sizes.append("all in use")
        parts.append(f"node{node_id} ({gpus_there}): " + (", ".join(sizes) if sizes else "none reserved"))
    summary = "; ".join(parts + ([lost] if lost else []))
    if not short:
        return Check("hugepages_near_gpus", OK, summary)
    elsewhere = [n.node_id for n in nodes if n.node_id not in near
                 and any(free for _total, free in n.hugepages.values())]
    if elsewhere:
        summary += (f" (free hugepages on node{', node'.join(map(str, elsewhere))} do not back guests bound to "
                    "their GPU's node)")
    # Per-node reservation now (Documentation/admin-guide/mm/hugetlbpage.rst; 1G pages need
    # unfragmented memory, so early), or at boot with hugepages=<node>:<count> (Linux 5.16+,
    # Documentation/admin-guide/kernel-parameters.txt).
    now = "; ".join(f"echo N > /sys/devices/system/node/node{n}/hugepages/hugepages-1048576kB/nr_hugepages"
                    for n in short)
    boot = "hugepagesz=1G hugepages=" + ",".join(f"{n}:N" for n in short)
    return Check("hugepages_near_gpus", WARN,
                 summary + " (guests on these GPUs get 4K pages: slower DMA mapping, TLB misses)",
                 f"{now} (N: GiB of guest memory for that node's GPUs), or at boot: {_bootloader_fix(host, boot)} "
                 "(per-node form since Linux 5.16)")


def check_interrupt_remapping(kernel: KernelInfo) -> Check:
    if kernel.unsafe_interrupts:
        return Check("interrupt_remapping", FAIL,
                     "vfio_iommu_type1 allow_unsafe_interrupts=Y: a guest can forge MSIs to the host",
                     "remove allow_unsafe_interrupts from /etc/modprobe.d and the command line; "
                     "enable interrupt remapping (x2APIC/IR) in the firmware")
    if kernel.unsafe_noiommu:
        return Check("interrupt_remapping", FAIL, "vfio enable_unsafe_noiommu_mode=Y: no DMA isolation at all",
                     "remove enable_unsafe_noiommu_mode and enable the IOMMU")
    disabled = kernel.param("intremap") == "off" or "nointremap" in kernel.params
    if kernel.iommu_groups == 0:
        # IR can stay active with intel_iommu=off (it is set up separately), but without
        # DMA remapping there is nothing to pass through: the iommu check fails instead.
        state = {True: "active", False: "inactive", None: "unknown"}[kernel.interrupts_remapped]
        return Check("interrupt_remapping", SKIP, f"no IOMMU groups, so no device assignment "
                     f"(interrupt remapping {state})")
    if kernel.interrupts_remapped:
        return Check("interrupt_remapping", OK, "active (IR- interrupt chips in /proc/interrupts)")
    if disabled:
        return Check("interrupt_remapping", FAIL, "disabled on the command line (intremap=off / nointremap)",
                     "remove intremap=off / nointremap from the kernel command line")
    if kernel.interrupts_remapped is None:
        return Check("interrupt_remapping", WARN, "cannot tell: /proc/interrupts not readable",
                     "run as root on the host")
    cap = " although the IOMMU supports it" if kernel.intel_ir_capable else ""
    return Check("interrupt_remapping", FAIL, f"not active{cap}: vfio refuses MSI without it",
                 "enable interrupt remapping / x2APIC in the firmware setup and do not pass intremap=off")


def check_nvidia_holders(host: HostRoot) -> Check:
    holders = nvidia_holders(host)
    if not holders:
        return Check("nvidia_holders", OK, "no process holds /dev/nvidia*")
    return Check("nvidia_holders", WARN, "; ".join(h.describe() for h in holders),
                 "stop them before binding (systemctl stop nvidia-persistenced nvidia-fabricmanager "
                 "nvidia-dcgm; end CUDA processes and Xorg); unbinding nvidia under them can hang")


def check_boot_vga(inventory: Inventory, kernel: KernelInfo) -> Check:
    console = [f for f in inventory.functions.values() if f.boot_vga and f.is_nvidia]
    fbs = ", ".join(kernel.framebuffers) or "none"
    if console:
        names = ", ".join(str(f.address) for f in console)
        return Check("boot_vga", WARN, f"{names} drives the host console (boot_vga=1; framebuffers: {fbs})",
                     "move the console to the BMC/iGPU in the firmware, or pass video=efifb:off "
                     "(and initcall_blacklist=sysfb_init on 5.15+) before passing this GPU through")
    return Check("boot_vga", OK, f"no NVIDIA GPU drives the host console (framebuffers: {fbs})")


def check_gpu_groups(inventory: Inventory) -> Check:
    if inventory.groups is None:
        return Check("gpu_groups", SKIP, "no IOMMU groups")
    nvidia_groups = sorted({f.iommu_group for f in inventory.nvidia() if f.iommu_group is not None})
    if not nvidia_groups:
        return Check("gpu_groups", SKIP, "no NVIDIA devices")
    bad = [inventory.groups[g] for g in nvidia_groups if not inventory.groups[g].viable]
    if not bad:
        return Check("gpu_groups", OK, f"{len(nvidia_groups)} NVIDIA group(s), all viable")
    problems = "; ".join(p for g in bad for p in g.problems)
    return Check("gpu_groups", WARN, f"{len(bad)} of {len(nvidia_groups)} NVIDIA group(s) not viable: {problems}",
                 "move the GPU to a CPU-attached slot with its own group; do not use pcie_acs_override")


def check_device_health(host: HostRoot, inventory: Inventory) -> Check:
    """The GPUs and the functions on vfio-pci: do they answer, can the kernel reset them, can they
    drop into D3cold while idle (see gpuvfio.host.health), and what ``gpuvfio health`` finds in
    their AER counters, their ports' and their links (gpuvfio.host.pcie_health)."""
    watched = [f for f in inventory.functions.values()
               if f.health is not None and (f.is_nvidia_gpu or f.driver == "vfio-pci")]
    if not watched:
        return Check("device_health", SKIP, "no GPU and no function on vfio-pci")
    failed, degraded, uncounted = _pcie_findings(host, inventory, [
        f for f in inventory.functions.values() if not f.is_bridge and (f.is_nvidia or f.driver == "vfio-pci")])
    dead, no_reset, d3cold, fixes = [], [], [], []
    for fn in sorted(watched, key=lambda f: f.address):
        health = fn.health
        if health.alive is False:
            dead.append(str(fn.address))
        if health.reset_method == []:
            no_reset.append(str(fn.address))
        if (health.d3cold_allowed and fn.driver == "vfio-pci") or health.power_state == "D3cold":
            d3cold.append(f"{fn.address}" + (" (in D3cold now)" if health.power_state == "D3cold" else ""))
            fixes.append(f"echo 0 > /sys/bus/pci/devices/{fn.address}/d3cold_allowed")
    problems = failed + degraded
    if uncounted:
        problems.append(f"{', '.join(uncounted)}: no AER counters, so PCIe errors cannot be seen (no AER "
                        "capability, or a kernel without CONFIG_PCIEAER or with pci=noaer)")
    if dead:
        problems.append(f"{', '.join(dead)} do(es) not answer config space (vendor ID 0xffff): dead, not free")
    if no_reset:
        problems.append(f"{', '.join(no_reset)} have no reset method: state carries over between guests")
    if d3cold:
        problems.append(f"{', '.join(d3cold)} may enter D3cold while idle on vfio-pci, and some GPUs do not "
                        "come back from it")
    if not problems:
        return Check("device_health", OK, f"{len(watched)} function(s) answer, have a reset method, stay "
                                          "out of D3cold and count no fatal or non-fatal PCIe error")
    fix = "; ".join(fixes[:4]) + (" (now, per device; vfio_pci.disable_idle_d3=1 takes effect when the module "
                                  "loads)" if fixes else "")
    if dead:
        fix = "gpuvfio reset ADDR (the kernel's reset), else reseat the card or reboot; " + fix
    if failed or degraded:
        fix = "gpuvfio health for each device's findings; reseat or replace a card with fatal errors; " + fix
    if uncounted:
        fix += "; boot without pci=noaer, on a kernel with CONFIG_PCIEAER=y (the distributions' kernels have it)"
    return Check("device_health", FAIL if dead or failed else WARN, "; ".join(problems), fix.strip("; ") or None)


def _pcie_findings(host: HostRoot, inventory: Inventory, watched: list) -> tuple[list[str], list[str], list[str]]:
    """What gpuvfio health rates failed, and degraded or could not trust, in the AER counters, the
    links and the IOMMU faults of ``watched`` (health's devices: every NVIDIA function and what is on vfio-pci),
    one line per finding, and the functions whose kernel offers no AER counters."""
    failed, degraded, uncounted = [], [], []
    records = read_records(host, None, {})
    for fn in sorted(watched, key=lambda f: f.address):
        for finding in device_health(host, inventory, fn, records).findings:
            if finding.check not in ("aer", "pf_aer", "port_aer", "link", "iommu", "reset"):
                continue  # config space: the dead check below; the journal: its own check
            line = f"{fn.address}: {finding.message}"
            if finding.status is Rating.FAILED:
                failed.append(line)
            elif finding.status is Rating.DEGRADED or (finding.status is Rating.UNKNOWN and not finding.absent):
                degraded.append(line)
            elif finding.status is Rating.UNKNOWN and finding.check == "aer":
                uncounted.append(str(fn.address))
    return failed, degraded, uncounted


def run_doctor(host: HostRoot, inventory: Inventory, kernel: KernelInfo, nodes: list[NumaNode]) -> list[Check]:
    return [
        check_kvm(host, kernel),
        check_iommu(host, kernel),
        check_acs_override(kernel),
        check_vfio_modules(kernel),
        check_vfio_device(host, kernel),
        check_cgroup_devices(host),
        check_hugepages(nodes),
        check_hugepages_near_gpus(host, inventory, nodes),
        check_interrupt_remapping(kernel),
        check_nvidia_holders(host),
        check_boot_vga(inventory, kernel),
        check_gpu_groups(inventory),
        check_device_health(host, inventory),
        check_secure_guest(host),
    ]
