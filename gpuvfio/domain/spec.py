"""DomainSpec: every decision about a guest, made in Python from the host model.

The template (templates/domain.xml.j2) only renders what is decided here -- Nova's
split between config objects and the designer that fills them. The request arrives
validated (request.py); placement.py holds the CPU/NUMA/hugepage/MMIO policy and
gpuvfio.host.assignable what a device brings along. Bad input is InputError (exit 2); a
request the host cannot satisfy (a group that is not viable, too few hugepages, no OVMF)
is Refused (exit 1).
"""

from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.domain.placement import (CellPlacement, guest_phys_bits_needed, hugepage_choice, mmio64_window_mb,
                                      place_cell)
from gpuvfio.domain.request import DomainRequest
from gpuvfio.errors import InputError, Refused
from gpuvfio.host import assignable
from gpuvfio.host.firmware import find_ovmf
from gpuvfio.host.inventory import Inventory
from gpuvfio.host.model import NumaNode, PciFunction, format_cpulist
from gpuvfio.host.numa import physical_address_bits, read_cpus
from gpuvfio.host.root import HostRoot
from gpuvfio.vgpu.types import existing_mdev, pick_mdev, pick_vf

# Fixed namespace for deterministic mdev UUIDs (same name + GPU + type -> same UUID).
MDEV_NAMESPACE = uuidlib.UUID("6f1c1a5e-58a2-4c55-9d4e-6770757666f0")


def mdev_uuid(name: str, address: PciAddress, type_id: str) -> str:
    """The UUID gpuvfio gives the mdev of domain ``name`` on ``address`` (the same every time)."""
    return str(uuidlib.uuid5(MDEV_NAMESPACE, f"{name}/{address}/{type_id}"))


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
    console_log: str | None = None
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


def build_spec(host: HostRoot, inventory: Inventory, nodes: list[NumaNode], addresses: list[PciAddress],
               request: DomainRequest, *, pages_held: dict[int, dict[int, int]] | None = None) -> DomainSpec:
    """Every decision about the guest: devices, vGPU instances, NUMA cells, pinning, pages,
    firmware, MMIO window. ``pages_held``: node -> page KiB -> hugepages the running domain this
    definition replaces holds (they count as free for it)."""
    if not addresses and (request.mdev or request.vgpu):
        raise InputError("--mdev/--vgpu need the address of the GPU")
    warnings: list[str] = []
    devices: list[list[PciFunction]] = []
    mdevs: list[tuple[str, str]] = []
    vfs: list[PciAddress] = []
    if request.mdev or request.vgpu:
        for address in addresses:
            assignable.endpoint(inventory, address)
            if request.mdev:
                mdevs.append(_mdev_for(host, inventory, address, request))
            else:
                vfs.append(pick_vf(inventory, address, request.vgpu))
        device_fns = [inventory.functions[a] for a in addresses]
    else:
        refusals = []
        for address in addresses:
            refusals += [p.message for p in assignable.problems(inventory, address) if p.message not in refusals]
        if refusals:
            raise Refused("; ".join(refusals))
        seen = set()
        for address in addresses:
            if address.device not in seen:
                seen.add(address.device)
                devices.append(assignable.slot_functions(inventory, address))
        device_fns = [f for group in devices for f in group]
    node_ids = {n.node_id: n for n in nodes}
    cells = _choose_nodes(request, device_fns, node_ids, warnings)
    placements = _place(host, request, cells, node_ids)
    free = {n.node_id: {size: f for size, (_t, f) in n.hugepages.items()} for n in nodes}
    for node, sizes in (pages_held or {}).items():
        for size, count in sizes.items():
            free.setdefault(node, {})[size] = free.get(node, {}).get(size, 0) + count
    # Without guest NUMA cells the memory may come from any node: the pages of all nodes count.
    demand = [(c.node, c.memory_kib) for c in placements] or [(None, request.memory_kib)]
    hugepage, warning = hugepage_choice(request.hugepages, demand, free, force=request.force)
    if warning:
        warnings.append(warning)
    loader = nvram = None
    if request.firmware == "efi":
        found = find_ovmf(host)
        if found is None:
            raise Refused("OVMF (UEFI firmware) not found under /usr/share/OVMF, /usr/share/edk2 or "
                          "/usr/share/qemu on this host: install ovmf/edk2-ovmf, or use --firmware bios")
        loader, nvram = found
    guest_cells = len(placements) > 1
    spec = DomainSpec(name=request.name, vcpus=request.vcpus, memory_kib=request.memory_kib,
                      firmware=request.firmware, loader=loader, nvram_template=nvram, cells=placements,
                      guest_cells=guest_cells, threads=placements[0].threads if placements else 1,
                      hugepage_kib=hugepage, mdevs=mdevs, vf_hostdevs=vfs, hide_kvm=request.hide_kvm,
                      disk=request.disk, kernel=request.kernel, initrd=request.initrd, cmdline=request.cmdline,
                      network=request.network, virt_type=request.virt_type,
                      ssh_forward_port=request.ssh_forward_port, console_log=request.console_log,
                      warnings=warnings)
    if spec.disk and spec.disk.endswith((".qcow2", ".qcow")):
        spec.disk_format = "qcow2"
    _lay_out_ports(spec, devices, placements)
    spec.mmio64_mb = mmio64_window_mb(devices)
    bits = physical_address_bits(host)
    needed = guest_phys_bits_needed(spec.memory_kib, spec.mmio64_mb)
    if bits is not None and needed > bits:
        raise Refused(f"the guest needs {needed} physical address bits for {spec.memory_kib // 1048576} GiB "
                      f"RAM and a {spec.mmio64_mb} MiB MMIO window; this CPU has {bits}")
    if bits is None and spec.mmio64_mb:
        warnings.append("host physical address width unknown (/proc/cpuinfo): MMIO window not checked")
    return spec


def _mdev_for(host: HostRoot, inventory: Inventory, address: PciAddress, request: DomainRequest) -> tuple[str, str]:
    """(uuid, type id) of the guest's mdev on ``address``. An mdev that already exists with that
    UUID and type on that GPU (gpuvfio vgpu create made it) is this guest's: it is not counted
    against the type's available instances, which it has already taken."""
    type_id = pick_mdev(inventory, address, request.mdev, check_available=False)
    uuid = request.uuid or mdev_uuid(request.name, address, type_id)
    existing = existing_mdev(host, uuid)
    if existing is None:
        pick_mdev(inventory, address, request.mdev)  # one must still be available
    elif existing != (address, type_id):
        raise Refused(f"mdev {uuid} exists already, as type {existing[1]} on {existing[0]}, "
                      f"not {type_id} on {address}")
    return uuid, type_id


def _choose_nodes(request: DomainRequest, device_fns: list[PciFunction], node_ids: dict[int, NumaNode],
                  warnings: list[str]) -> list[int]:
    if request.numa == "none":
        return []
    device_nodes = sorted({f.numa_node for f in device_fns if f.numa_node is not None and f.numa_node in node_ids})
    if request.numa == "auto":
        if not device_nodes:
            if len(node_ids) > 1:
                warnings.append("the devices report no NUMA node; vCPUs and memory are not pinned")
            elif len(node_ids) == 1:
                return list(node_ids)
        return device_nodes
    if request.numa == "remote":
        # The deliberately wrong placement, to measure what NUMA locality is worth (testbeds).
        others = [n for n in sorted(node_ids) if n not in device_nodes]
        if not device_nodes or not others:
            raise Refused("numa 'remote' needs devices on a known NUMA node and another node without them "
                          f"(devices on {device_nodes or 'no node'}, nodes {sorted(node_ids)})")
        node = others[0]
    else:
        node = int(request.numa)
        if node not in node_ids:
            raise InputError(f"NUMA node {node} does not exist on this host (nodes: "
                             f"{', '.join(map(str, sorted(node_ids))) or 'none'})")
    remote = sorted({f.numa_node for f in device_fns if f.numa_node not in (None, node)})
    if remote:
        warnings.append(f"devices are on node(s) {remote}, memory and vCPUs on node {node}: DMA crosses sockets")
    return [node]


def _place(host: HostRoot, request: DomainRequest, cells: list[int],
           node_ids: dict[int, NumaNode]) -> list[CellPlacement]:
    if not cells:
        return []
    if request.vcpus % len(cells):
        raise InputError(f"--vcpus {request.vcpus} must be a multiple of the {len(cells)} NUMA cells "
                         f"(devices on nodes {cells})")
    if request.memory_kib % len(cells):
        raise InputError("memory must divide evenly between the NUMA cells")
    per_cell, mem = request.vcpus // len(cells), request.memory_kib // len(cells)
    placements = []
    for i, node in enumerate(cells):
        node_cpus = node_ids[node].cpus
        cpus = read_cpus(host, node_cpus)
        vcpus = list(range(i * per_cell, (i + 1) * per_cell))
        placements.append(place_cell(node, node_cpus, cpus, vcpus, mem, force=request.force))
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
