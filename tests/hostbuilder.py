"""Build sysfs/procfs-shaped host trees under a root, as Linux lays them out.

Used by the tests, by the sample-host generator and by the benchmarks. It writes real
files, directories and relative symlinks, so gpuvfio and the real ``lspci -A
linux-sysfs`` read the same tree. Layout references: Documentation/ABI/testing/
sysfs-bus-pci, sysfs-kernel-iommu_groups, sysfs-devices-node; drivers/pci/pci-sysfs.c.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.host.model import format_cpulist, parse_cpulist

IO, MEM, PREFETCH, MEM64 = 0x100, 0x200, 0x2000, 0x100000
BAR64_PREF = MEM | PREFETCH | MEM64
BAR32 = MEM
KiB, MiB, GiB = 1024, 1024**2, 1024**3
SPEED = {1: "2.5 GT/s PCIe", 2: "5.0 GT/s PCIe", 3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe",
         5: "32.0 GT/s PCIe", 6: "64.0 GT/s PCIe"}


# PCI driver name -> the module that provides it, where they differ (None: built into the kernel).
DRIVER_MODULES = {"pcieport": None, "xhci_hcd": "xhci_pci", "nvidia-gpu": "i2c_nvidia_gpu", "shpchp": None}


@dataclass
class Node:
    """A place devices hang from: a root bus or a bridge's secondary bus."""

    path: str  # absolute directory
    numa: int
    function: "Function | None" = None


# The bits drivers/pci/pcie/aer.c (Linux 6.1) names, in bit order: aer_correctable_error_string
# and aer_uncorrectable_error_string.
AER_COR_BITS = ("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF")
AER_UNCOR_BITS = ("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF",
                  "MalfTLP", "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP", "AtomicOpBlocked",
                  "TLPBlockedErr", "PoisonTLPBlocked")


@dataclass
class Function:
    address: PciAddress
    path: str
    numa: int
    group: int | None
    is_bridge: bool
    vfs: list = field(default_factory=list)

    def __str__(self) -> str:
        return str(self.address)


def _relink(path: str, target: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(os.path.relpath(target, os.path.dirname(path)), path)


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text)


def write_uevent(path: str) -> None:
    """A function's ``uevent`` as the kernel shows it (drivers/base/core.c dev_uevent's DRIVER
    line while bound, then drivers/pci/pci-driver.c pci_uevent's), from the tree's attributes and
    ``driver`` link: what the builder and the simulated kernel call after changing either."""
    def value(name: str) -> int:
        with open(os.path.join(path, name)) as handle:
            return int(handle.read().strip(), 16)

    vendor, device, klass = value("vendor"), value("device"), value("class")
    sv, sd = value("subsystem_vendor"), value("subsystem_device")
    link = os.path.join(path, "driver")
    lines = [f"DRIVER={os.path.basename(os.readlink(link))}"] if os.path.islink(link) else []
    lines += [f"PCI_CLASS={klass:04X}", f"PCI_ID={vendor:04X}:{device:04X}", f"PCI_SUBSYS_ID={sv:04X}:{sd:04X}",
              f"PCI_SLOT_NAME={os.path.basename(path)}",
              f"MODALIAS=pci:v{vendor:08X}d{device:08X}sv{sv:08X}sd{sd:08X}"
              f"bc{klass >> 16:02X}sc{(klass >> 8) & 0xFF:02X}i{klass & 0xFF:02x}"]
    _write(os.path.join(path, "uevent"), "".join(f"{line}\n" for line in lines))


class HostBuilder:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.sys = os.path.join(self.root, "sys")
        self._next_group = 0
        self._slot_groups: dict[tuple, int] = {}
        self._mmio64 = 0x200_0000_0000
        self._mmio32 = 0xC000_0000
        self._irq = 16
        self.functions: dict[PciAddress, Function] = {}
        self.node_cpus: dict[int, str] = {}
        self.remote_distance = 21  # SLIT distance between nodes (AMD NPS2 on one socket: 12)
        for sub in ("bus/pci/devices", "bus/pci/drivers", "devices/system/node", "devices/system/cpu",
                    "kernel", "module", "class"):
            os.makedirs(os.path.join(self.sys, sub), exist_ok=True)
        for name in ("drivers_probe", "drivers_autoprobe", "rescan"):
            _write(os.path.join(self.sys, "bus", "pci", name), "")
        os.makedirs(os.path.join(self.root, "proc", "sys", "kernel"), exist_ok=True)
        self.osrelease("6.8.0-gpuvfio")
        # A KVM host: /dev/kvm (a name, as dump-host records it) and the cgroup devices controller.
        _write(os.path.join(self.root, "dev", "kvm"), "")
        self.kernel_log([])  # /dev/kmsg, as dump-host records it: nothing of note logged
        _write(self.proc("cgroups"), "#subsys_name\thierarchy\tnum_cgroups\tenabled\ncpuset\t0\t1\t1\n"
                                     "memory\t0\t1\t1\ndevices\t0\t1\t1\n")
        self.cmdline("BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro quiet")
        self.modules([])
        # What the host itself uses (gpuvfio.host.host_use): its block and net classes and PID 1's
        # mounts and routes, as a host whose root is on a disk no PCI function here holds.
        for sub in ("class/block", "class/net", "class/graphics", "class/drm", "class/vtconsole"):
            os.makedirs(os.path.join(self.sys, sub), exist_ok=True)
        self._mountinfo: list[str] = []
        self._swaps: list[str] = []
        self._routes: list[str] = []
        self._routes6: list[str] = []
        self._inet6: list[str] = []
        self.mount("252:0", "/", "/dev/vda1", "ext4")
        self._write_net()
        _write(self.proc("swaps"), "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n")

    # -- kernel and firmware ----------------------------------------------------------
    def sys_path(self, *parts: str) -> str:
        return os.path.join(self.sys, *parts)

    def proc(self, *parts: str) -> str:
        return os.path.join(self.root, "proc", *parts)

    def cmdline(self, text: str) -> None:
        _write(self.proc("cmdline"), text + "\n")

    def osrelease(self, text: str) -> None:
        self.release = text
        _write(self.proc("sys", "kernel", "osrelease"), text + "\n")

    def modules(self, names: list[str], available: list[str] | None = None,
                builtin: list[str] | None = None) -> None:
        """Loaded modules (/proc/modules); ``available`` go into modules.dep (loadable)."""
        lines = [f"{n} 16384 0 - Live 0x0000000000000000\n" for n in names]
        _write(self.proc("modules"), "".join(lines))
        for name in names:
            os.makedirs(self.sys_path("module", name), exist_ok=True)
        if "vfio" in names:  # the VFIO container appears with the module
            _write(os.path.join(self.root, "dev", "vfio", "vfio"), "")
        moddir = os.path.join(self.root, "lib", "modules", self.release)
        avail = available if available is not None else ["vfio", "vfio_pci", "vfio_iommu_type1",
                                                          "vfio_pci_core", "pci_stub"]
        dep = "".join(f"kernel/drivers/vfio/{n.replace('_', '-')}.ko:\n" for n in avail)
        _write(os.path.join(moddir, "modules.dep"), dep)
        _write(os.path.join(moddir, "modules.builtin"),
               "".join(f"kernel/drivers/vfio/{n.replace('_', '-')}.ko\n" for n in builtin or []))

    def module_param(self, module: str, param: str, value: str) -> None:
        _write(self.sys_path("module", module, "parameters", param), value + "\n")

    def iommu(self, vendor: str | None, units: int = 1, *, interrupt_remapping: bool = True) -> None:
        """IOMMU units under /sys/class/iommu (dmarN for Intel VT-d, ivhdN for AMD-Vi)."""
        os.makedirs(self.sys_path("kernel", "iommu_groups"), exist_ok=True)
        self.iommu_vendor = vendor
        if vendor is None:
            return
        for n in range(units):
            name = f"dmar{n}" if vendor == "intel" else f"ivhd{n}"
            real = self.sys_path("devices", "virtual", "iommu", name)
            if vendor == "intel":
                # ecap bit 3 = IR (interrupt remapping support), VT-d spec 11.4.3
                _write(os.path.join(real, "intel-iommu", "cap"), "d2008c40660462\n")
                _write(os.path.join(real, "intel-iommu", "ecap", ), "f050da\n" if interrupt_remapping else "f050d2\n")
                _write(os.path.join(real, "intel-iommu", "version"), "1:0\n")
            else:
                _write(os.path.join(real, "amd-iommu", "features"), "25bf732fa2295afe\n")
            _relink(self.sys_path("class", "iommu", name), real)
        chip = "IR-PCI-MSI" if interrupt_remapping else "PCI-MSI"
        ioapic = "IR-IO-APIC" if interrupt_remapping else "IO-APIC"
        _write(self.proc("interrupts"),
               f"0: {ioapic} 2-edge timer\n9: {ioapic} 9-fasteoi acpi\n"
               f"120: {chip} 524288-edge eth0\nNMI: Non-maskable interrupts\n")

    def firmware(self, code: str = "usr/share/OVMF/OVMF_CODE_4M.fd",
                 vars_: str = "usr/share/OVMF/OVMF_VARS_4M.fd", descriptor: bool = True) -> None:
        """OVMF images installed on the host (empty placeholders: only their presence matters),
        with the QEMU firmware descriptor Debian's ovmf package installs for them."""
        for rel in (code, vars_):
            _write(os.path.join(self.root, rel), "")
        if descriptor:
            _write(os.path.join(self.root, "usr/share/qemu/firmware/60-edk2-x86_64.json"), json.dumps({
                "description": "UEFI firmware for x86_64", "interface-types": ["uefi"],
                "mapping": {"device": "flash", "mode": "split",
                            "executable": {"filename": "/" + code, "format": "raw"},
                            "nvram-template": {"filename": "/" + vars_, "format": "raw"}},
                "targets": [{"architecture": "x86_64", "machines": ["pc-i440fx-*", "pc-q35-*"]}],
                "features": ["acpi-s3", "amd-sev", "verbose-dynamic"], "tags": []}, indent=4) + "\n")

    def framebuffer(self, name: str | None) -> None:
        _write(self.proc("fb"), f"0 {name}\n" if name else "")

    def os_release(self, pretty: str, ident: str, like: str = "") -> None:
        _write(os.path.join(self.root, "etc", "os-release"),
               f'PRETTY_NAME="{pretty}"\nID={ident}\n' + (f"ID_LIKE={like}\n" if like else ""))

    # -- CPUs and NUMA ----------------------------------------------------------------
    def cpu_topology(self, sockets: int, cores: int, threads: int = 2) -> dict[int, list[int]]:
        """Linux x86 numbering: cpu = thread*sockets*cores + socket*cores + core."""
        per_socket: dict[int, list[int]] = {s: [] for s in range(sockets)}
        total = sockets * cores * threads
        for cpu in range(total):
            thread, rest = divmod(cpu, sockets * cores)
            socket, core = divmod(rest, cores)
            siblings = [t * sockets * cores + socket * cores + core for t in range(threads)]
            topo = self.sys_path("devices", "system", "cpu", f"cpu{cpu}", "topology")
            _write(os.path.join(topo, "core_id"), f"{core}\n")
            _write(os.path.join(topo, "physical_package_id"), f"{socket}\n")
            _write(os.path.join(topo, "thread_siblings_list"), ",".join(map(str, siblings)) + "\n")
            per_socket[socket].append(cpu)
        _write(self.sys_path("devices", "system", "cpu", "online"), f"0-{total - 1}\n")
        return per_socket

    def cpuinfo(self, model: str, phys_bits: int, virt_bits: int = 48, vendor: str = "GenuineIntel",
                flags: str | None = None) -> None:
        """/proc/cpuinfo, first processor only (what gpuvfio records): model, virtualization flags
        (default: the vendor's VT-x/AMD-V) and address sizes."""
        flags = flags if flags is not None else ("svm" if vendor == "AuthenticAMD" else "vmx")
        _write(self.proc("cpuinfo"), f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: {model}\n"
                                     f"flags\t\t: {flags}\n"
                                     f"address sizes\t: {phys_bits} bits physical, {virt_bits} bits virtual\n\n")

    def numa_node(self, node: int, cpus: list[int], mem_gib: int,
                  hugepages: dict[int, tuple[int, int]] | None = None) -> None:
        """``hugepages`` maps page size in kB to (total, free)."""
        ndir = self.sys_path("devices", "system", "node", f"node{node}")
        cpulist = format_cpulist(cpus)
        self.node_cpus[node] = cpulist
        _write(os.path.join(ndir, "cpulist"), cpulist + "\n")
        total = mem_gib * 1024 * 1024
        used_hp = sum(size * t for size, (t, _f) in (hugepages or {}).items())
        _write(os.path.join(ndir, "meminfo"),
               f"Node {node} MemTotal:       {total} kB\nNode {node} MemFree:        "
               f"{max(total - used_hp - total // 20, 0)} kB\n")
        for size, (t, f) in {2048: (0, 0), 1048576: (0, 0), **(hugepages or {})}.items():
            hp = os.path.join(ndir, "hugepages", f"hugepages-{size}kB")
            _write(os.path.join(hp, "nr_hugepages"), f"{t}\n")
            _write(os.path.join(hp, "free_hugepages"), f"{f}\n")
        nodes = sorted(self.node_cpus)
        for other in nodes:  # the ACPI SLIT row of every node (10 local; 21 is two-socket Xeon's remote)
            row = " ".join("10" if n == other else str(self.remote_distance) for n in nodes)
            _write(self.sys_path("devices", "system", "node", f"node{other}", "distance"), row + "\n")
        _write(self.sys_path("devices", "system", "node", "online"), format_cpulist(nodes) + "\n")
        _write(self.sys_path("devices", "system", "node", "possible"), format_cpulist(nodes) + "\n")

    # -- PCI ----------------------------------------------------------------------------
    def root_bus(self, domain: int = 0, bus: int = 0, numa: int = -1) -> Node:
        path = self.sys_path("devices", f"pci{domain:04x}:{bus:02x}")
        os.makedirs(path, exist_ok=True)
        return Node(path, numa)

    def _group_for(self, address: PciAddress, is_bridge: bool, group, vf: bool = False) -> int | None:
        """'auto': one group per physical device; bridges and SR-IOV VFs get their own
        (VFs of an ACS-capable PF are isolated from each other and from the PF)."""
        if group is None or getattr(self, "iommu_vendor", None) is None:
            return None
        if group != "auto":
            return int(group)
        key = ("fn", address) if is_bridge or vf else ("slot", address.device)
        if key not in self._slot_groups:
            self._slot_groups[key] = self._next_group
            self._next_group += 1
        return self._slot_groups[key]

    def new_group(self) -> int:
        gid = self._next_group
        self._next_group += 1
        return gid

    def function(self, parent: Node, address: str, vendor: str, device: str, klass: str, *,
                 driver: str | None = None, subsystem: tuple[str, str] | None = None,
                 revision: str = "a1", group="auto", link: tuple | None = None,
                 bars: list[tuple[int, int, int]] = (), boot_vga: bool | None = None,
                 reset_method: str | None = "flr bus", multifunction: bool = False,
                 secondary_bus: int | None = None, vf: bool = False) -> Function:
        addr = PciAddress.parse(address)
        is_bridge = klass.startswith("0604")
        path = os.path.join(parent.path, str(addr))
        os.makedirs(path, exist_ok=True)
        numa = parent.numa
        sv, sd = subsystem or ((vendor, "0000") if not is_bridge else ("0000", "0000"))
        attrs = {
            "vendor": f"0x{vendor}", "device": f"0x{device}", "class": f"0x{klass}",
            "subsystem_vendor": f"0x{sv}", "subsystem_device": f"0x{sd}", "revision": f"0x{revision}",
            "irq": str(self._irq), "numa_node": str(numa), "enable": "1",
            "local_cpulist": self.node_cpus.get(numa, format_cpulist(sorted(
                c for cl in self.node_cpus.values() for c in parse_cpulist(cl)))),
            "modalias": f"pci:v0000{vendor.upper()}d0000{device.upper()}sv0000{sv.upper()}"
                        f"sd0000{sd.upper()}bc{klass[0:2].upper()}sc{klass[2:4].upper()}i{klass[4:6].upper()}",
            "driver_override": "(null)",
        }
        self._irq += 1
        if reset_method is not None and not is_bridge:
            attrs["reset_method"] = reset_method
        if not is_bridge:  # Documentation/ABI/testing/sysfs-bus-pci: power state, D3cold policy
            attrs["power_state"] = "D0"
            attrs["d3cold_allowed"] = "1"
        if boot_vga is not None:
            attrs["boot_vga"] = "1" if boot_vga else "0"
        if link is not None:
            gen, width, max_gen, max_width = (link + (None, None))[:4] if len(link) == 2 else link
            max_gen = max_gen or gen
            max_width = max_width or width
            attrs.update({"current_link_speed": SPEED[gen], "current_link_width": str(width),
                          "max_link_speed": SPEED[max_gen], "max_link_width": str(max_width)})
        resources = [(0, 0, 0)] * (17 if is_bridge else 13)
        for index, size, flags in bars:
            if flags & MEM64:
                self._mmio64 = _align(self._mmio64, size)
                start, self._mmio64 = self._mmio64, self._mmio64 + size
            elif flags & IO:
                start = 0x1000 + index * 0x100
            else:
                self._mmio32 = _align(self._mmio32, size)
                start, self._mmio32 = self._mmio32, self._mmio32 + size
            resources[index] = (start, start + size - 1, flags)
        attrs["resource"] = "".join(f"0x{s:016x} 0x{e:016x} 0x{f:016x}\n" for s, e, f in resources)
        for name, value in attrs.items():
            _write(os.path.join(path, name), value + ("" if value.endswith("\n") else "\n"))
        if not is_bridge:
            _write(os.path.join(path, "power", "control"), "auto\n")
        if reset_method:  # pci-sysfs.c: "reset" is visible only when the kernel has a method
            _write(os.path.join(path, "reset"), "")
        if is_bridge:  # sysfs-bus-pci: secondary bus reset below the bridge (newer kernels)
            _write(os.path.join(path, "reset_subordinate"), "")
        with open(os.path.join(path, "config"), "wb") as handle:
            handle.write(_config(vendor, device, klass, sv, sd, revision, is_bridge, multifunction,
                                 secondary_bus, flr="flr" in (reset_method or "").split()))
        _relink(self.sys_path("bus", "pci", "devices", str(addr)), path)
        if driver:
            self.bind(addr, driver, path)
        else:
            write_uevent(path)
        gid = self._group_for(addr, is_bridge, group, vf)
        if gid is not None:
            gdir = self.sys_path("kernel", "iommu_groups", str(gid), "devices")
            os.makedirs(gdir, exist_ok=True)
            _relink(os.path.join(gdir, str(addr)), path)
            _relink(os.path.join(path, "iommu_group"), os.path.dirname(gdir))
        fn = Function(addr, path, numa, gid, is_bridge)
        self.functions[addr] = fn
        return fn

    def driver(self, name: str) -> str:
        """A loaded PCI driver: its directory with the bind/unbind/new_id attributes, and the
        ``module`` link to the module that provides it (drivers/base/module.c; none when built in)."""
        ddir = self.sys_path("bus", "pci", "drivers", name)
        os.makedirs(ddir, exist_ok=True)
        for attr in ("bind", "unbind", "new_id", "remove_id"):
            if not os.path.exists(os.path.join(ddir, attr)):
                _write(os.path.join(ddir, attr), "")
        module = DRIVER_MODULES.get(name, name.replace("-", "_"))
        if module is not None and not os.path.lexists(os.path.join(ddir, "module")):
            mdir = self.sys_path("module", module)
            os.makedirs(mdir, exist_ok=True)
            os.symlink(os.path.relpath(mdir, ddir), os.path.join(ddir, "module"))
        return ddir

    def bind(self, addr: PciAddress, driver: str, path: str | None = None) -> None:
        path = path or self.functions[addr].path
        ddir = self.driver(driver)
        _relink(os.path.join(path, "driver"), ddir)
        _relink(os.path.join(ddir, str(addr)), path)
        write_uevent(path)

    def bridge(self, parent: Node, address: str, vendor: str, device: str, *, secondary_bus: int,
               numa: int | None = None, link: tuple | None = None, group="auto",
               klass: str = "060400", driver: str | None = "pcieport",
               subsystem: tuple[str, str] | None = None) -> Node:
        fn = self.function(parent, address, vendor, device, klass, driver=driver, link=link,
                           group=group, secondary_bus=secondary_bus, reset_method=None, subsystem=subsystem)
        return Node(fn.path, parent.numa if numa is None else numa, fn)

    def sriov(self, pf: Function, total: int, vf_addresses: list[str], vf_device: str,
              vendor: str, klass: str, driver: str | None = None, vf_bar: int = 0,
              group="auto") -> list[Function]:
        _write(os.path.join(pf.path, "sriov_totalvfs"), f"{total}\n")
        _write(os.path.join(pf.path, "sriov_numvfs"), f"{len(vf_addresses)}\n")
        parent = Node(os.path.dirname(pf.path), pf.numa)
        vfs = []
        for n, vaddr in enumerate(vf_addresses):
            vf = self.function(parent, vaddr, vendor, vf_device, klass, driver=driver, group=group,
                               bars=[(0, vf_bar, BAR64_PREF)] if vf_bar else [], reset_method="flr",
                               vf=True)
            _relink(os.path.join(pf.path, f"virtfn{n}"), vf.path)
            _relink(os.path.join(vf.path, "physfn"), pf.path)
            vfs.append(vf)
        pf.vfs = vfs
        return vfs

    def mdev_types(self, fn: Function, types: list[tuple[str, str, int, str]]) -> None:
        """Legacy mdev: (type_id, name, available_instances, description)."""
        for type_id, name, avail, desc in types:
            tdir = os.path.join(fn.path, "mdev_supported_types", type_id)
            os.makedirs(os.path.join(tdir, "devices"), exist_ok=True)
            _write(os.path.join(tdir, "name"), name + "\n")
            _write(os.path.join(tdir, "available_instances"), f"{avail}\n")
            _write(os.path.join(tdir, "device_api"), "vfio-pci\n")
            _write(os.path.join(tdir, "description"), desc + "\n")
            _write(os.path.join(tdir, "create"), "")  # write-only in sysfs

    def vgpu_types(self, vf: Function, types: list[tuple[int, str]], current: int = 0) -> None:
        """NVIDIA vGPU 17+ on SR-IOV VFs (nvidia/creatable_vgpu_types, current_vgpu_type)."""
        ndir = os.path.join(vf.path, "nvidia")
        body = "ID    : vGPU Name\n" + "".join(f"{i:<5} : {n}\n" for i, n in types)
        _write(os.path.join(ndir, "creatable_vgpu_types"), body)
        _write(os.path.join(ndir, "current_vgpu_type"), f"{current}\n")

    # -- what the host uses: block devices, mounts, swap, network, console -------------------
    # The kernel's layouts (Documentation/ABI/stable/sysfs-block, testing/sysfs-class-net):
    # a class entry links to the device's directory, beneath the PCI function that owns it.
    def _class_link(self, cls: str, name: str, path: str) -> str:
        os.makedirs(path, exist_ok=True)
        _relink(self.sys_path("class", cls, name), path)
        return path

    def block(self, name: str, dev: str, *, fn: "Function | None" = None, sub: str = "nvme/nvme0",
              disk: str | None = None) -> str:
        """A disk below ``fn`` (in ``sub``: nvme/nvme0, ata1/host0/target0:0:0/0:0:0:0/block), a
        partition of ``disk``, or a virtual one (devices/virtual/block) without ``fn``."""
        if disk is not None:
            path = os.path.join(os.path.realpath(self.sys_path("class", "block", disk)), name)
            _write(os.path.join(path, "partition"), name[-1] + "\n")
        elif fn is not None:
            path = os.path.join(fn.path, sub, name)
        else:
            path = self.sys_path("devices", "virtual", "block", name)
        self._class_link("block", name, path)
        _write(os.path.join(path, "dev"), dev + "\n")
        os.makedirs(os.path.join(path, "holders"), exist_ok=True)
        os.makedirs(os.path.join(path, "slaves"), exist_ok=True)
        return path

    def holds(self, holder: str, *members: str) -> None:
        """``holder`` (dm-N, mdN) stacked on ``members``: holders/ and slaves/ links both ways."""
        hpath = os.path.realpath(self.sys_path("class", "block", holder))
        for member in members:
            mpath = os.path.realpath(self.sys_path("class", "block", member))
            _relink(os.path.join(mpath, "holders", holder), hpath)
            _relink(os.path.join(hpath, "slaves", member), mpath)

    def dm(self, kname: str, dev: str, name: str, uuid: str, *members: str) -> str:
        path = self.block(kname, dev)
        _write(os.path.join(path, "dm", "name"), name + "\n")
        _write(os.path.join(path, "dm", "uuid"), uuid + "\n")
        self.holds(kname, *members)
        return path

    def md(self, kname: str, dev: str, level: str, *members: str) -> str:
        path = self.block(kname, dev)
        _write(os.path.join(path, "md", "level"), level + "\n")
        self.holds(kname, *members)
        return path

    def mount(self, dev: str, point: str, source: str, fstype: str) -> None:
        """A line of /proc/1/mountinfo (proc(5))."""
        n = 20 + len(self._mountinfo)
        self._mountinfo.append(f"{n} 1 {dev} / {point} rw,relatime shared:{n} - {fstype} {source} rw\n")
        _write(self.proc("1", "mountinfo"), "".join(self._mountinfo))

    def swap(self, filename: str) -> None:
        self._swaps.append(f"{filename}\tpartition\t8388604\t0\t-2\n")
        _write(self.proc("swaps"), "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n" + "".join(self._swaps))

    def net(self, name: str, *, fn: "Function | None" = None, devtype: str | None = None) -> str:
        """A network interface below ``fn``, or a virtual one (bond, bridge, vlan: ``devtype``)."""
        path = os.path.join(fn.path, "net", name) if fn is not None else self.sys_path("devices", "virtual", "net", name)
        self._class_link("net", name, path)
        _write(os.path.join(path, "uevent"), f"INTERFACE={name}\n" + (f"DEVTYPE={devtype}\n" if devtype else ""))
        _write(os.path.join(path, "operstate"), "up\n")
        return path

    def upper(self, lower: str, upper: str, *, master: bool = True) -> None:
        """``lower`` enslaved to (or below) ``upper``: upper_X, and master for bonds and bridges."""
        lpath = os.path.realpath(self.sys_path("class", "net", lower))
        upath = os.path.realpath(self.sys_path("class", "net", upper))
        _relink(os.path.join(lpath, f"upper_{upper}"), upath)
        _relink(os.path.join(upath, f"lower_{lower}"), lpath)
        if master:
            _relink(os.path.join(lpath, "master"), upath)

    def route(self, iface: str, dest: str, mask: str, gateway: str = "0.0.0.0") -> None:
        """A line of /proc/net/route: addresses as the kernel prints them (hex of the network-order
        word read in host order, little-endian here)."""
        def hexed(a: str) -> str:
            return "".join(f"{int(b):02X}" for b in reversed(a.split(".")))
        flags = "0003" if gateway != "0.0.0.0" else "0001"
        self._routes.append(f"{iface}\t{hexed(dest)}\t{hexed(gateway)}\t{flags}\t0\t0\t100\t{hexed(mask)}\t0\t0\t0\n")
        self._write_net()

    def route6(self, iface: str, dest: str, plen: int, gateway: str = "::") -> None:
        import ipaddress
        d, g = (ipaddress.IPv6Address(a).exploded.replace(":", "") for a in (dest, gateway))
        self._routes6.append(f"{d} {plen:02x} {'0' * 32} 00 {g} 00000400 00000001 00000000 00000003 {iface:>8}\n")
        self._write_net()

    def inet6(self, iface: str, address: str, plen: int = 64, scope: int = 0) -> None:
        import ipaddress
        a = ipaddress.IPv6Address(address).exploded.replace(":", "")
        self._inet6.append(f"{a} 02 {plen:02x} {scope:02x} 80 {iface:>8}\n")
        self._write_net()

    def _write_net(self) -> None:
        _write(self.proc("1", "net", "route"), "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask"
               "\t\tMTU\tWindow\tIRTT\n" + "".join(self._routes))
        _write(self.proc("1", "net", "ipv6_route"), "".join(self._routes6))
        _write(self.proc("1", "net", "if_inet6"), "".join(self._inet6))

    def fb(self, fn: "Function", name: str = "fb0") -> None:
        self._class_link("graphics", name, os.path.join(fn.path, "graphics", name))

    def vtconsole(self, name: str, label: str, bound: bool) -> None:
        path = self._class_link("vtconsole", name, self.sys_path("devices", "virtual", "vtconsole", name))
        _write(os.path.join(path, "name"), label + "\n")
        _write(os.path.join(path, "bind"), ("1" if bound else "0") + "\n")

    def drm(self, fn: "Function", card: str, connectors: dict[str, bool]) -> None:
        cpath = self._class_link("drm", card, os.path.join(fn.path, "drm", card))
        for connector, lit in connectors.items():
            path = self._class_link("drm", f"{card}-{connector}", os.path.join(cpath, f"{card}-{connector}"))
            _write(os.path.join(path, "enabled"), ("enabled" if lit else "disabled") + "\n")
            _write(os.path.join(path, "status"), ("connected" if lit else "disconnected") + "\n")

    def switch_link(self, switch: str, peer: str) -> None:
        """A Broadcom virtual switch link from ``switch`` to ``peer`` as Broadcom's
        pci_switch_link module lists it: /sys/kernel/pci_switch_link/virtual_switch_links/SWITCH/PEER."""
        os.makedirs(self.sys_path("kernel", "pci_switch_link", "virtual_switch_links", switch, peer), exist_ok=True)

    # -- PCIe health ----------------------------------------------------------------------
    def kernel_log(self, lines: list[str], *, start_usec: int = 5_000_000) -> None:
        """The kernel log as /dev/kmsg gives its records (Documentation/ABI/testing/dev-kmsg):
        ``prio,seq,usec,flags;text``, errors at level 3, a second apart."""
        _write(os.path.join(self.root, "dev", "kmsg"),
               "".join(f"3,{n},{start_usec + n * 1_000_000},-;{line}\n" for n, line in enumerate(lines)))

    def aer_rootport(self, fn: "Function", *, correctable: int = 0, nonfatal: int = 0, fatal: int = 0) -> None:
        """A root port's totals of the error messages it received (aer.c aer_stats_rootport_attr)."""
        for name, count in (("cor", correctable), ("nonfatal", nonfatal), ("fatal", fatal)):
            _write(os.path.join(fn.path, f"aer_rootport_total_err_{name}"), f"{count}\n")

    def aer(self, fn: "Function", *, correctable: dict[str, int] | None = None,
            nonfatal: dict[str, int] | None = None, fatal: dict[str, int] | None = None) -> None:
        """The three AER counter files as drivers/pci/pcie/aer.c (Linux 6.1) writes them: every
        named bit of the severity with its count, then the total (each error counted once, as
        the kernel's total counts error reports)."""
        for name, bits, counts, total in (
                ("aer_dev_correctable", AER_COR_BITS, correctable or {}, "TOTAL_ERR_COR"),
                ("aer_dev_nonfatal", AER_UNCOR_BITS, nonfatal or {}, "TOTAL_ERR_NONFATAL"),
                ("aer_dev_fatal", AER_UNCOR_BITS, fatal or {}, "TOTAL_ERR_FATAL")):
            assert set(counts) <= set(bits), counts
            lines = [f"{bit} {counts.get(bit, 0)}\n" for bit in bits]
            _write(os.path.join(fn.path, name), "".join(lines) + f"{total} {sum(counts.values())}\n")

    def boot_id(self, value: str = "0f4f2a7e-52b5-4bd4-8d7c-3f1e9c2b6a10") -> None:
        """This boot's id, as /proc/sys/kernel/random/boot_id gives it (a new one each boot)."""
        _write(os.path.join(self.root, "proc", "sys", "kernel", "random", "boot_id"), value + "\n")

    def off_the_bus(self, fn: "Function") -> None:
        """What a function that fell off the bus reads: config space all ones (its sysfs
        attributes keep what the kernel read at enumeration)."""
        with open(os.path.join(fn.path, "config"), "wb") as handle:
            handle.write(b"\xff" * 256)

    # -- processes ------------------------------------------------------------------------
    def holder(self, pid: int, comm: str, device_nodes: list[str]) -> None:
        pdir = self.proc(str(pid))
        _write(os.path.join(pdir, "comm"), comm + "\n")
        os.makedirs(os.path.join(pdir, "fd"), exist_ok=True)
        for fd, node in enumerate(device_nodes, start=3):
            link = os.path.join(pdir, "fd", str(fd))
            if os.path.lexists(link):
                os.unlink(link)
            os.symlink(node, link)  # absolute, like /proc/PID/fd; read, never followed

    # -- NVLink (NVML's, recorded: gpuvfio.host.nvlink) ---------------------------------------
    def nvlink(self, links: dict) -> str:
        """The NVLink recording ``dump-host`` makes from NVML: ``links`` maps a GPU's address to
        {far end's address: number of active links}, links numbered from 0 in that order. A far
        end that is a display-class function of this tree is a GPU, anything else an NVSwitch
        (an HGX baseboard's are class 0680 endpoints; an NVL72 rack's are not on the node's PCIe)."""
        import json

        from gpuvfio.host.nvlink import FORMAT, RECORD, VERSION

        def kind(remote: str) -> str:
            fn = self.functions.get(PciAddress.parse(remote))
            if fn is None:
                return "switch"
            with open(os.path.join(fn.path, "class")) as handle:
                return "gpu" if handle.read().strip().removeprefix("0x").startswith("03") else "switch"

        gpus = {}
        for gpu, remotes in links.items():
            numbered = [(remote, count) for remote, count in remotes.items() for _ in range(count)]
            gpus[str(PciAddress.parse(gpu))] = [{"link": n, "remote": str(PciAddress.parse(remote)),
                                                 "type": kind(remote)} for n, (remote, _c) in enumerate(numbered)]
        path = os.path.join(self.root, *RECORD)
        _write(path, json.dumps({"format": FORMAT, "version": VERSION, "gpus": gpus}, indent=1) + "\n")
        return path


def _align(value: int, size: int) -> int:
    return (value + size - 1) // size * size if size else value


def _config(vendor, device, klass, sv, sd, revision, is_bridge, multifunction, secondary_bus,
            flr: bool = False) -> bytes:
    """A 256-byte config space: the header (PCI Local Bus spec 3.0, 6.1) and a PCI Express
    capability at 0x40 whose DevCap advertises FLR when the function has it (PCIe base 7.5.3)."""
    cfg = bytearray(256)
    cfg[0x34] = 0x40
    cfg[0x40], cfg[0x41] = 0x10, 0x00  # PCI Express capability, last in the list
    struct.pack_into("<H", cfg, 0x42, 0x0002)  # capability version 2
    struct.pack_into("<I", cfg, 0x44, (1 << 28) if flr else 0)
    struct.pack_into("<HHHH", cfg, 0, int(vendor, 16), int(device, 16), 0x0406, 0x0010)
    cfg[8] = int(revision, 16)
    cfg[9], cfg[10], cfg[11] = int(klass[4:6], 16), int(klass[2:4], 16), int(klass[0:2], 16)
    cfg[14] = (1 if is_bridge else 0) | (0x80 if multifunction else 0)
    if is_bridge:
        bus = secondary_bus or 0
        cfg[0x18], cfg[0x19], cfg[0x1A] = max(bus - 1, 0), bus, bus
    else:
        struct.pack_into("<HH", cfg, 0x2C, int(sv, 16), int(sd, 16))
    return bytes(cfg)


# -- generated hosts (benchmarks, and the inventory's before/after tests) -------------------------
NIC_VFS = 127  # ConnectX-7 exposes up to 127 VFs per PF (mlx5 SRIOV_NUM_VFS)


def _vf_address(bus: int, n: int) -> str:
    """VF ``n`` of the PF at ``bus:00.0``: routing ID PF + 1 + n (First VF Offset 1, VF Stride 1,
    ARI: the whole devfn byte is the function; PCIe base spec 9.3.3.9-10)."""
    devfn = 1 + n
    return f"0000:{bus:02x}:{devfn >> 3:02x}.{devfn & 7}"


def build_sriov_server(root: str, *, switches_per_socket: int = 4, nic_vfs: int = NIC_VFS) -> HostBuilder:
    """A two-socket HGX-class server with SR-IOV enabled everywhere: per socket
    ``switches_per_socket`` PCIe switches, each with one GPU (H100 SXM5), two single-port
    ConnectX-7 PFs with ``nic_vfs`` VFs each, and an NVMe drive; 4 NVSwitches behind a root
    port of socket 0. The defaults give 16 PFs x 127 VFs beside 8 GPUs and 4 NVSwitches:
    2,119 PCI functions, an IOMMU group for each VF."""
    b = HostBuilder(root)
    b.iommu("intel", 8)
    per_socket = b.cpu_topology(2, 56, 2)
    for node in (0, 1):
        b.numa_node(node, per_socket[node], 1024, {1048576: (256, 256)})
    gpu_bars = [(0, 16 * MiB, BAR32), (1, 128 * GiB, BAR64_PREF), (3, 32 * MiB, BAR64_PREF)]
    for socket in (0, 1):
        base = socket * 0x80
        rb = b.root_bus(0, base, numa=socket)
        b.function(rb, f"0000:{base:02x}:00.0", "8086", "09a2", "060000", reset_method=None)
        for sw in range(switches_per_socket):
            up_bus = base + 0x10 + sw * 0x08
            rp = b.bridge(rb, f"0000:{base:02x}:{sw + 1:02x}.0", "8086", "352a", secondary_bus=up_bus,
                          link=(5, 16))
            up = b.bridge(rp, f"0000:{up_bus:02x}:00.0", "1000", "c030", secondary_bus=up_bus + 1, link=(5, 16))
            ports = [b.bridge(up, f"0000:{up_bus + 1:02x}:{port:02x}.0", "1000", "c030",
                              secondary_bus=up_bus + 2 + port, link=(5, 16)) for port in range(4)]
            b.function(ports[0], f"0000:{up_bus + 2:02x}:00.0", "10de", "2330", "030200", driver="nvidia",
                       link=(5, 16), bars=gpu_bars)
            for port in (1, 2):
                bus = up_bus + 2 + port
                pf = b.function(ports[port], f"0000:{bus:02x}:00.0", "15b3", "1021", "020000",
                                driver="mlx5_core", link=(5, 16), bars=[(0, 32 * MiB, BAR64_PREF)])
                b.sriov(pf, nic_vfs, [_vf_address(bus, n) for n in range(nic_vfs)], "101e", "15b3", "020000",
                        driver="mlx5_core", vf_bar=2 * MiB)
            b.function(ports[3], f"0000:{up_bus + 5:02x}:00.0", "144d", "a80a", "010802", driver="nvme",
                       link=(4, 4), bars=[(0, 16 * KiB, BAR32)])
    sw = b.bridge(b.root_bus(0, 0x7f, numa=0), "0000:7f:01.0", "8086", "352a", secondary_bus=0x7e)
    for n in range(4):
        b.function(sw, f"0000:7e:{n:02x}.0", "10de", "22a3", "068000", driver="nvidia")
    return b
