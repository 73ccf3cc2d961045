"""DomainSpec: every decision about a guest, made in Python from the host model.

The template (templates/domain.xml.j2) only renders what is decided here -- Nova's
split between config objects and the designer that fills them. See placement.py for
the CPU/NUMA/hugepage/MMIO policy.
"""

from __future__ import annotations

import os
import uuid as uuidlib
from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError
from gpuvfio.hostroot import HostRoot
from gpuvfio.inventory import Inventory
from gpuvfio.model import NumaNode, PciFunction, format_cpulist
from gpuvfio.numa import physical_address_bits, read_cpus
from gpuvfio.placement import (CellPlacement, guest_phys_bits_needed, hugepage_choice, mmio64_window_mb,
                               place_cell)

# Where distributions install OVMF (code, vars template), most specific first.
OVMF_CANDIDATES = (
    ("usr/share/OVMF/OVMF_CODE_4M.fd", "usr/share/OVMF/OVMF_VARS_4M.fd"),
    ("usr/share/OVMF/OVMF_CODE.fd", "usr/share/OVMF/OVMF_VARS.fd"),
    ("usr/share/edk2/ovmf/OVMF_CODE.fd", "usr/share/edk2/ovmf/OVMF_VARS.fd"),
    ("usr/share/edk2/x64/OVMF_CODE.4m.fd", "usr/share/edk2/x64/OVMF_VARS.4m.fd"),
    ("usr/share/qemu/ovmf-x86_64-code.bin", "usr/share/qemu/ovmf-x86_64-vars.bin"),
)
# Fixed namespace for deterministic mdev UUIDs (same name + GPU + type -> same UUID).
MDEV_NAMESPACE = uuidlib.UUID("6f1c1a5e-58a2-4c55-9d4e-6770757666f0")


@dataclass
class DomainOptions:
    name: str
    vcpus: int = 4
    memory_kib: int = 8 * 1024 * 1024
    hugepages: str = "auto"  # auto | 1G | 2M | none
    numa: str = "auto"  # auto | none | N
    firmware: str = "efi"  # efi | bios
    hide_kvm: bool = False
    mdev: str | None = None
    vgpu: str | None = None
    uuid: str | None = None
    disk: str | None = None
    kernel: str | None = None
    initrd: str | None = None
    cmdline: str | None = None
    network: str | None = None
    virt_type: str = "kvm"  # kvm | qemu (TCG, for hosts without KVM such as the test lanes)
    ssh_forward_port: int | None = None  # QEMU user networking, host 127.0.0.1:PORT -> guest:22
    force: bool = False


@dataclass
class GuestPort:
    """A pcie-root-port (controller index = its bus number) holding one physical device."""

    index: int
    parent: int  # 0 = pcie-root, else a pxb-pcie index
    chassis: int
    functions: list[PciFunction]
    slot: int = 0  # slot on a pxb-pcie bus (on pcie-root libvirt assigns the address)


@dataclass
class Expander:
    index: int
    bus_nr: int
    cell: int


@dataclass
class DomainSpec:
    name: str
    vcpus: int
    memory_kib: int
    firmware: str
    loader: str | None
    nvram_template: str | None
    cells: list[CellPlacement]
    guest_cells: bool  # expose NUMA cells to the guest (devices on more than one node)
    threads: int
    hugepage_kib: int | None
    expanders: list[Expander] = field(default_factory=list)
    ports: list[GuestPort] = field(default_factory=list)
    mdevs: list[tuple[str, str]] = field(default_factory=list)  # (uuid, type id)
    vf_hostdevs: list[PciAddress] = field(default_factory=list)  # SR-IOV vGPU VFs, managed='no'
    mmio64_mb: int | None = None
    hide_kvm: bool = False
    disk: str | None = None
    disk_format: str = "raw"
    kernel: str | None = None
    initrd: str | None = None
    cmdline: str | None = None
    network: str | None = None
    virt_type: str = "kvm"
    ssh_forward_port: int | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def qemu_args(self) -> list[str]:
        """Extra QEMU arguments (<qemu:commandline>); libvirt marks the domain custom-argv."""
        args = []
        if self.mmio64_mb and self.firmware == "efi":
            args += ["-fw_cfg", f"name=opt/ovmf/X-PciMmio64Mb,string={self.mmio64_mb}"]
        if self.ssh_forward_port:
            # libvirt 9.0 in Debian has passt disabled: user networking with a host forward
            # is the way to reach a guest without a bridge.
            args += ["-netdev", f"user,id=gpuvfio-net0,hostfwd=tcp:127.0.0.1:{self.ssh_forward_port}-:22",
                     # A fixed slot on pcie.0 high above the ones libvirt hands out from 0x01
                     # for its own controllers (QEMU would otherwise take slot 1 first).
                     "-device", "virtio-net-pci,netdev=gpuvfio-net0,bus=pcie.0,addr=0x1c,romfile="]
        return args

    @property
    def emulator_cpuset(self) -> str:
        return format_cpulist(sorted({c for cell in self.cells for c in cell.emulator_cpus}))

    @property
    def nodeset(self) -> str:
        return format_cpulist(sorted({cell.node for cell in self.cells}))

    @property
    def host_devices(self) -> list[str]:
        return [str(f.address) for port in self.ports for f in port.functions] + [str(v) for v in self.vf_hostdevs]

    @property
    def cores(self) -> int:
        return self.vcpus // max(1, len(self.cells) or 1) // self.threads

    @property
    def sockets(self) -> int:
        return max(1, len(self.cells)) if self.guest_cells else 1


def validate_name(name: str) -> str:
    """libvirt refuses '/' and newlines in names (virDomainDefParseXML); we also refuse other
    control characters and leading dots; XML-special characters are escaped when rendered."""
    if not name or len(name) > 200:
        raise InputError("domain name must be 1 to 200 characters")
    if "/" in name or any(ord(c) < 0x20 or ord(c) == 0x7F for c in name) or name.startswith("."):
        raise InputError(f"domain name {name!r} contains '/', a control character or a leading dot")
    return name


def _absolute(path: str | None, what: str) -> str | None:
    if path is None:
        return None
    if not os.path.isabs(path) or "\n" in path:
        raise InputError(f"{what} must be an absolute path: {path!r}")
    return path


def _find_ovmf(host: HostRoot) -> tuple[str, str]:
    for code, vars_ in OVMF_CANDIDATES:
        if os.path.exists(host.path(code)) and os.path.exists(host.path(vars_)):
            return "/" + code, "/" + vars_
    raise InputError("OVMF (UEFI firmware) not found under /usr/share/OVMF, /usr/share/edk2 or "
                     "/usr/share/qemu on this host: install ovmf/edk2-ovmf, or use --firmware bios")


def _slot_functions(inventory: Inventory, address: PciAddress) -> list[PciFunction]:
    fn = inventory.functions.get(address)
    if fn is None:
        raise InputError(f"no such PCI function on this host: {address}")
    if fn.is_bridge:
        raise InputError(f"{address} is a PCI bridge, not a device to pass through")
    if inventory.groups is None:
        raise InputError(f"{address} has no IOMMU group: the IOMMU is off (see gpuvfio doctor)")
    group = inventory.group_of(address)
    if group is None or not group.viable:
        problems = "; ".join(group.problems) if group else "no IOMMU group"
        raise InputError(f"{address}: IOMMU group not viable: {problems}")
    return [f for a, f in sorted(inventory.functions.items())
            if a.device == address.device and not f.is_bridge]


def build_spec(host: HostRoot, inventory: Inventory, nodes: list[NumaNode], addresses: list[PciAddress],
               options: DomainOptions) -> DomainSpec:
    name = validate_name(options.name)
    if options.vcpus < 1 or options.vcpus > 4096:
        raise InputError(f"--vcpus must be between 1 and 4096, not {options.vcpus}")
    if options.mdev and options.vgpu:
        raise InputError("--mdev and --vgpu exclude each other")
    if options.kernel is None and (options.initrd or options.cmdline):
        raise InputError("--initrd and --cmdline need --kernel")
    if options.disk and options.kernel:
        raise InputError("--disk and --kernel exclude each other (one boot source)")
    if not addresses and (options.mdev or options.vgpu):
        raise InputError("--mdev/--vgpu need the address of the GPU")
    warnings: list[str] = []
    devices: list[list[PciFunction]] = []
    mdevs: list[tuple[str, str]] = []
    vfs: list[PciAddress] = []
    if options.mdev or options.vgpu:
        from gpuvfio.vgpu import pick_mdev, pick_vf

        for address in addresses:
            if options.mdev:
                type_id = pick_mdev(inventory, address, options.mdev)
                mdevs.append((options.uuid or str(uuidlib.uuid5(MDEV_NAMESPACE, f"{name}/{address}/{type_id}")),
                              type_id))
            else:
                vfs.append(pick_vf(inventory, address, options.vgpu))
        device_fns = [inventory.functions[a] for a in addresses]
    else:
        seen = set()
        for address in addresses:
            if address.device in seen:
                continue
            seen.add(address.device)
            devices.append(_slot_functions(inventory, address))
        device_fns = [f for group in devices for f in group]
    node_ids = {n.node_id: n for n in nodes}
    cells = _choose_nodes(options, device_fns, node_ids, warnings)
    placements = _place(host, options, cells, node_ids)
    free = {n.node_id: {size: f for size, (_t, f) in n.hugepages.items()} for n in nodes}
    hugepage, warning = hugepage_choice(options.hugepages, placements, free, force=options.force) \
        if placements else (None, None)
    if options.hugepages not in ("auto", "none", "1G", "2M"):
        raise InputError(f"--hugepages must be auto, 1G, 2M or none, not {options.hugepages!r}")
    if not placements and options.hugepages in ("1G", "2M"):
        hugepage = 1024 * 1024 if options.hugepages == "1G" else 2048
    if warning:
        warnings.append(warning)
    if options.firmware not in ("efi", "bios"):
        raise InputError(f"--firmware must be efi or bios, not {options.firmware!r}")
    loader, nvram = _find_ovmf(host) if options.firmware == "efi" else (None, None)
    guest_cells = len(placements) > 1
    spec = DomainSpec(name=name, vcpus=options.vcpus, memory_kib=options.memory_kib, firmware=options.firmware,
                      loader=loader, nvram_template=nvram, cells=placements, guest_cells=guest_cells,
                      threads=placements[0].threads if placements else 1, hugepage_kib=hugepage,
                      mdevs=mdevs, vf_hostdevs=vfs, hide_kvm=options.hide_kvm,
                      disk=_absolute(options.disk, "--disk"), kernel=_absolute(options.kernel, "--kernel"),
                      initrd=_absolute(options.initrd, "--initrd"), cmdline=options.cmdline,
                      network=options.network, virt_type=options.virt_type,
                      ssh_forward_port=options.ssh_forward_port, warnings=warnings)
    if options.ssh_forward_port is not None and not 0 < options.ssh_forward_port < 65536:
        raise InputError(f"SSH forward port out of range: {options.ssh_forward_port}")
    if options.virt_type not in ("kvm", "qemu"):
        raise InputError(f"--virt-type must be kvm or qemu, not {options.virt_type!r}")
    if spec.disk and spec.disk.endswith((".qcow2", ".qcow")):
        spec.disk_format = "qcow2"
    _lay_out_ports(spec, devices, placements)
    spec.mmio64_mb = mmio64_window_mb(devices)
    bits = physical_address_bits(host)
    needed = guest_phys_bits_needed(spec.memory_kib, spec.mmio64_mb)
    if bits is not None and needed > bits:
        raise InputError(f"the guest needs {needed} physical address bits for {spec.memory_kib // 1048576} GiB "
                         f"RAM and a {spec.mmio64_mb} MiB MMIO window; this CPU has {bits}")
    if bits is None and spec.mmio64_mb:
        warnings.append("host physical address width unknown (/proc/cpuinfo): MMIO window not checked")
    return spec


def _choose_nodes(options: DomainOptions, device_fns: list[PciFunction], node_ids: dict[int, NumaNode],
                  warnings: list[str]) -> list[int]:
    if options.numa == "none":
        return []
    if options.numa == "auto":
        chosen = sorted({f.numa_node for f in device_fns if f.numa_node is not None and f.numa_node in node_ids})
        if not chosen:
            if len(node_ids) > 1:
                warnings.append("the devices report no NUMA node; vCPUs and memory are not pinned")
            elif len(node_ids) == 1:
                return list(node_ids)
        return chosen
    try:
        node = int(options.numa)
    except ValueError:
        raise InputError(f"--numa must be auto, none or a node number, not {options.numa!r}") from None
    if node not in node_ids:
        raise InputError(f"NUMA node {node} does not exist on this host (nodes: "
                         f"{', '.join(map(str, sorted(node_ids))) or 'none'})")
    remote = sorted({f.numa_node for f in device_fns if f.numa_node not in (None, node)})
    if remote:
        warnings.append(f"devices are on node(s) {remote}, memory and vCPUs on node {node}: DMA crosses sockets")
    return [node]


def _place(host: HostRoot, options: DomainOptions, cells: list[int],
           node_ids: dict[int, NumaNode]) -> list[CellPlacement]:
    if not cells:
        return []
    if options.vcpus % len(cells):
        raise InputError(f"--vcpus {options.vcpus} must be a multiple of the {len(cells)} NUMA cells "
                         f"(devices on nodes {cells})")
    if options.memory_kib % len(cells):
        raise InputError("memory must divide evenly between the NUMA cells")
    per_cell, mem = options.vcpus // len(cells), options.memory_kib // len(cells)
    placements = []
    for i, node in enumerate(cells):
        node_cpus = node_ids[node].cpus
        cpus = read_cpus(host, node_cpus)
        vcpus = list(range(i * per_cell, (i + 1) * per_cell))
        placements.append(place_cell(node, node_cpus, cpus, vcpus, mem, force=options.force))
    return placements


def _lay_out_ports(spec: DomainSpec, devices: list[list[PciFunction]], placements: list[CellPlacement]) -> None:
    """One pcie-root-port per physical device; with several NUMA cells, each device's port
    sits on a pxb-pcie bound to the cell of its host node."""
    index = 1
    cell_of_node = {p.node: i for i, p in enumerate(placements)}
    expander_of_cell: dict[int, int] = {}
    if spec.guest_cells:
        for cell, _placement in enumerate(placements):
            spec.expanders.append(Expander(index, 0x80 + 0x20 * cell, cell))
            expander_of_cell[cell] = index
            index += 1
    used_slots: dict[int, int] = {}
    for chassis, functions in enumerate(devices, start=1):
        parent = 0
        if spec.guest_cells:
            node = functions[0].numa_node
            parent = expander_of_cell.get(cell_of_node.get(node, 0), expander_of_cell[0])
        # Each root port on an expander bus needs its own slot there (libvirt rejects a
        # double use of the same PCI address).
        slot = used_slots.get(parent, 0)
        used_slots[parent] = slot + 1
        spec.ports.append(GuestPort(index, parent, chassis, functions, slot))
        index += 1
