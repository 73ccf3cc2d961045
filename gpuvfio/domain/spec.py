"""DomainSpec: every decision about a guest, made in Python from the host model.

The renderer (gpuvfio.domain.render) only lays out what is decided here -- Nova's
split between config objects and the designer that fills them. The request arrives
validated (request.py); placement.py holds the CPU/NUMA/hugepage/MMIO policy and
gpuvfio.host.assignable what a device brings along. Bad input is InputError (exit 2); a
request the host cannot satisfy (a group that is not viable, too few hugepages, no OVMF)
is Refused (exit 1).
"""

from __future__ import annotations

import os
import uuid as uuidlib
from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.domain.layout import Controller, GuestPort, plan_layout
from gpuvfio.domain import versions
from gpuvfio.domain.address_space import AddressPlan, plan_address_space
from gpuvfio.domain.assignment import Assignment, Rom, assign
from gpuvfio.domain.placement import CellPlacement, hugepage_choice, place_cell
from gpuvfio.domain.request import DomainRequest
from gpuvfio.errors import InputError, Refused, UnsafePathError
from gpuvfio.options import OptionError, cli_flag, value_shown
from gpuvfio.user_files import read_regular
from gpuvfio.host import assignable
from gpuvfio.host.firmware import find_ovmf, uefi_descriptors
from gpuvfio.host.fabric import Decision
from gpuvfio.host.inventory import Inventory
from gpuvfio.host.model import NumaNode, PciFunction, format_cpulist
from gpuvfio.host.kernel import read_kernel
from gpuvfio.host.numa import cpu_vendor, physical_address_bits, read_cpus
from gpuvfio.host.root import HostRoot
from gpuvfio.host.topology import CliquePlan, p2p_cliques
from gpuvfio.vgpu.types import existing_mdev, pick_mdev, pick_vf

# Fixed namespace for deterministic mdev UUIDs (same name + GPU + type -> same UUID).
MDEV_NAMESPACE = uuidlib.UUID("6f1c1a5e-58a2-4c55-9d4e-6770757666f0")


def mdev_uuid(name: str, address: PciAddress, type_id: str) -> str:
    """The UUID gpuvfio gives the mdev of domain ``name`` on ``address`` (the same every time)."""
    return str(uuidlib.uuid5(MDEV_NAMESPACE, f"{name}/{address}/{type_id}"))


# The first QEMU that places NVIDIA's P2P clique capability where Turing and newer GPUs have
# none of their own (hw/vfio/pci-quirks.c vfio_add_nv_gpudirect_cap; before it the capability
# collides with their MSI-X and QEMU refuses to start the guest).
CLIQUE_QEMU = (8, 1)


@dataclass
class DomainSpec:
    name: str
    vcpus: int
    memory_kib: int
    firmware: str
    loader: str | None  # UEFI by path; None with firmware_auto: libvirt picks from QEMU's descriptors
    nvram_template: str | None
    cells: list[CellPlacement]
    guest_cells: bool  # expose NUMA cells to the guest (devices on more than one node)
    threads: int
    hugepage_kib: int | None
    # What the admin asked for, as asked: the options the domain takes as given (hide_kvm, disk,
    # kernel, network, console_log, rom_bar, ...) are read from here, so such an option needs no
    # field of its own; the fields beside it are what the plan decided.
    asked: DomainRequest
    controllers: list[Controller] = field(default_factory=list)
    ports: list[GuestPort] = field(default_factory=list)
    topology: str = "flat"
    distances: dict[int, dict[int, int]] = field(default_factory=dict)  # guest cell -> cell -> SLIT distance
    p2p: CliquePlan = field(default_factory=lambda: CliquePlan([], []))
    notes: list[str] = field(default_factory=list)  # what the plan decided and why
    fabric: Decision | None = None  # an HGX NVSwitch fabric's decision (gpuvfio.host.fabric)
    address: AddressPlan | None = None  # the 64-bit MMIO window, phys-bits, firmware fallbacks
    versions: list[versions.Row] = field(default_factory=list)  # minimum versions the plan relies on
    warnings: list[str] = field(default_factory=list)
    firmware_auto: bool = False  # <os firmware='efi'>: libvirt's firmware auto-selection
    # What auto-selection must honour (libvirt formatdomain "BIOS bootloader", <firmware><feature>):
    # no secure boot, since NVIDIA's guest drivers are out-of-tree modules that a secure-boot guest
    # refuses unless signed with an enrolled key (the descriptors with enrolled keys are picked first).
    firmware_features: list[tuple[str, bool]] = field(default_factory=lambda: [("secure-boot", False)])
    # A cloud-init NoCloud seed image (gpuvfio.domain.cloud_init), attached as a read-only cdrom.
    seed_iso: str | None = None
    # What goes where (gpuvfio.domain.assignment): made once the layout and cliques are decided;
    # the domain, the NCCL topology and the plan's --json render it.
    assignment: Assignment = field(default_factory=lambda: Assignment((), (), ()))

    @property
    def qemu_args(self) -> list[str]:
        """Extra QEMU arguments (<qemu:commandline>); libvirt marks the domain custom-argv."""
        args = []
        if self.address and self.address.ovmf_mmio64_mb and self.firmware == "efi":
            # Only where the window OVMF sizes from phys-bits is too small: a minimum it honours
            # (libvirt refuses opt/ovmf/ names in <sysinfo type='fwcfg'>, so through the command line).
            args += ["-fw_cfg", f"name=opt/ovmf/X-PciMmio64Mb,string={self.address.ovmf_mmio64_mb}"]
        port = self.asked.user_net_ssh_port
        if port:
            # libvirt 9.0 in Debian has passt disabled: user networking with a host forward
            # is the way to reach a guest without a bridge.
            args += ["-netdev", f"user,id=gpuvfio-net0,hostfwd=tcp:127.0.0.1:{port}-:22",
                     # A fixed slot on pcie.0 high above the ones libvirt hands out from 0x01
                     # for its own controllers (QEMU would otherwise take slot 1 first).
                     "-device", "virtio-net-pci,netdev=gpuvfio-net0,bus=pcie.0,addr=0x1c,romfile="]
        return args

    @property
    def disk_format(self) -> str:
        return "qcow2" if self.asked.disk and self.asked.disk.endswith((".qcow2", ".qcow")) else "raw"

    @property
    def cliques(self) -> list[tuple[str, int]]:
        """(hostdev alias, clique id) for each GPU in a P2P clique (``<qemu:override>``)."""
        return self.assignment.cliques

    @property
    def uses_qemu_namespace(self) -> bool:
        return bool(self.qemu_args or self.cliques)

    @property
    def emulator_cpuset(self) -> str:
        return format_cpulist(sorted({c for cell in self.cells for c in cell.emulator_cpus}))

    @property
    def nodeset(self) -> str:
        return format_cpulist(sorted({cell.node for cell in self.cells}))

    @property
    def host_devices(self) -> list[str]:
        return [str(a) for a in self.assignment.host_functions]

    @property
    def cores(self) -> int:
        return self.vcpus // max(1, len(self.cells) or 1) // self.threads

    @property
    def sockets(self) -> int:
        return max(1, len(self.cells)) if self.guest_cells else 1


def build_spec(host: HostRoot, inventory: Inventory, nodes: list[NumaNode], addresses: list[PciAddress],
               request: DomainRequest, *, pages_held: dict[int, dict[int, int]] | None = None,
               pinned: dict[int, list[str]] | None = None) -> DomainSpec:
    """Every decision about the guest: devices, vGPU instances, NUMA cells, pinning, pages,
    firmware, MMIO window. ``pages_held``: node -> page KiB -> hugepages the running domain this
    definition replaces holds (they count as free for it). ``pinned``: host CPU -> the other
    domains whose vCPUs are pinned there (gpuvfio.virt.pins): their cores are stayed off."""
    warnings: list[str] = []
    devices, device_fns, mdevs, vfs = _devices(host, inventory, addresses, request)
    node_ids = {n.node_id: n for n in nodes}
    cells = _choose_nodes(request, device_fns, node_ids, warnings)
    placements = _place(host, request, cells, node_ids, pinned or {})
    warnings += [w for cell in placements for w in cell.warnings]
    hugepage = _hugepage(request, placements, nodes, pages_held, warnings)
    loader, nvram, firmware_auto = _uefi(host, request, warnings)
    if request.rom_file is not None:
        _check_rom(host, request.rom_file, warnings)
    guest_cells = len(placements) > 1
    spec = DomainSpec(name=request.name, vcpus=request.vcpus, memory_kib=request.memory_kib,
                      firmware=request.firmware, loader=loader, nvram_template=nvram, cells=placements,
                      guest_cells=guest_cells, threads=placements[0].threads if placements else 1,
                      hugepage_kib=hugepage, asked=request, warnings=warnings,
                      firmware_auto=firmware_auto)
    kernel = read_kernel(host)
    _lay_out(spec, host, request, devices, node_ids, kernel, single_node=len(nodes) <= 1)
    asked = request
    rom = Rom(asked.rom_bar, asked.rom_file) if asked.rom_bar or asked.rom_file else None
    spec.assignment = assign(spec.ports, spec.controllers, spec.p2p, rom=rom, vfs=vfs, mdevs=mdevs)
    _address_space(spec, host, request, kernel)
    return spec


def _devices(host: HostRoot, inventory: Inventory, addresses: list[PciAddress], request: DomainRequest):
    """(devices: each slot's functions, passed through whole; every function; mdevs; VFs)."""
    if not addresses and (request.mdev or request.vgpu):
        raise OptionError("{mdev}/{vgpu} need the address of the GPU")
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
        return devices, [inventory.functions[a] for a in addresses], mdevs, vfs
    refusals = []
    for address in addresses:
        refusals += [p.message for p in assignable.problems(inventory, address, addresses) if p.message not in refusals]
    if refusals:
        raise Refused("; ".join(refusals))
    seen = set()
    for address in addresses:
        if address.device not in seen:
            seen.add(address.device)
            devices.append(assignable.slot_functions(inventory, address))
    return devices, [f for group in devices for f in group], mdevs, vfs


def _hugepage(request: DomainRequest, placements, nodes: list[NumaNode], pages_held, warnings: list[str]):
    """The huge page size the guest's memory comes from (hugepage_choice), the pages a replaced
    running domain holds counted as free."""
    free = {n.node_id: {size: f for size, (_t, f) in n.hugepages.items()} for n in nodes}
    for node, sizes in (pages_held or {}).items():
        for size, count in sizes.items():
            free.setdefault(node, {})[size] = free.get(node, {}).get(size, 0) + count
    # Without guest NUMA cells the memory may come from any node: the pages of all nodes count.
    demand = [(c.node, c.memory_kib) for c in placements] or [(None, request.memory_kib)]
    hugepage, warning = hugepage_choice(request.hugepages, demand, free, force=request.force)
    if warning:
        warnings.append(warning)
    return hugepage


def _lay_out(spec: DomainSpec, host: HostRoot, request: DomainRequest, devices, node_ids, kernel, *,
             single_node: bool) -> None:
    """The guest's PCIe layout (ports, controllers, topology), cell distances and P2P cliques."""
    placements, guest_cells = spec.cells, spec.guest_cells
    cell_of_node = {p.node: i for i, p in enumerate(placements)}
    topology = request.topology if request.topology != "auto" else ("mirror" if len(devices) > 1 else "flat")
    layout = plan_layout(devices, topology, cell_of_node, guest_cells)
    spec.controllers, spec.ports, spec.topology = layout.controllers, layout.ports, layout.topology
    spec.notes += [note for cell in placements for note in cell.notes] + layout.notes
    if guest_cells:
        spec.distances, note = _cell_distances(placements, node_ids)
        spec.notes += [note] if note else []
    spec.p2p = _p2p(request, devices, single_node, acs_override=kernel.param("pcie_acs_override") is not None,
                    cpu_vendor=cpu_vendor(host))
    spec.notes += spec.p2p.notes
    spec.warnings += spec.p2p.forced
    gpu_ports = [port for port in spec.ports if spec.p2p.clique_of(port.functions[0].address) is not None]
    for n, port in enumerate(gpu_ports):
        port.alias = f"ua-gpu{n}"  # a user alias: <qemu:override> finds the device by it


def _address_space(spec: DomainSpec, host: HostRoot, request: DomainRequest, kernel) -> None:
    """The MMIO window that fits the BARs, and the versions of QEMU, libvirt and the kernel the
    features it takes need."""
    groups, buses = bridge_groups(spec)
    spec.address = plan_address_space(groups, spec.memory_kib, host_phys_bits=physical_address_bits(host),
                                      virt_type=request.virt_type, firmware=spec.firmware, cpu_vendor=cpu_vendor(host),
                                      buses=buses)
    features = list(spec.address.features)
    if spec.cliques:
        features += ["nv-clique-turing", "qemu-override"]
    if spec.address.maxphysaddr:
        features.append("maxphysaddr")
    have = {"qemu": request.qemu_version, "libvirt": request.libvirt_version,
            "kernel": versions.kernel_version(kernel.release)}
    spec.versions = versions.check(have, sorted(set(features), key=features.index))


def _uefi(host: HostRoot, request: DomainRequest, warnings: list[str]) -> tuple[str | None, str | None, bool]:
    """(loader, nvram template, auto-select) for the guest's firmware. UEFI goes through libvirt's
    firmware auto-selection, as virt-install does, where QEMU's firmware descriptors are installed;
    by path where the user names the images, or on a host with OVMF but no descriptors."""
    if request.firmware != "efi":
        return None, None, False
    if request.loader is not None:
        _host_file(host, request.loader, "loader", warnings)
        _host_file(host, request.nvram_template, "nvram_template", warnings)
        return request.loader, request.nvram_template, False
    if uefi_descriptors(host):
        return None, None, True
    found = find_ovmf(host)
    if found is None:
        raise Refused("no UEFI firmware for guests on this host: no QEMU firmware descriptor for UEFI under "
                      "/usr/share/qemu/firmware or /etc/qemu/firmware, no OVMF image at the usual paths; install "
                      "ovmf (edk2-ovmf), or give --loader and --nvram-template, or use --firmware bios")
    warnings.append(f"no QEMU firmware descriptors here: UEFI by its path ({found[0]}), not libvirt's choice")
    return found[0], found[1], False


ROM_SIGNATURE = b"\x55\xaa"  # a PCI expansion ROM image starts so (PCI Firmware Specification)
ROM_MAX_BYTES = 16 << 20


def _host_file(host: HostRoot, path: str, option: str, warnings: list[str]) -> str | None:
    """``path`` (the value of the domain option named ``option``, as the host names the file) as
    a regular file under the host root, its links followed
    as the host would (HostRoot.config_path: absolute targets under the root, never out of it;
    a FIFO or a device would hang a read); bad input otherwise. In the plan of a remote testbed
    run (made from the hypervisor's recording, which does not hold such files) a file the
    recording lacks is unknown, not missing: None and a warning; the run there checks it."""
    try:
        candidate = host.config_path(*path.strip("/").split("/"))
    except UnsafePathError:
        raise OptionError(f"{{{option}}} {value_shown(path)} leads out of the host root") from None
    if host.files_checked_by_run and not host.exists(candidate):
        warnings.append(f"{cli_flag(option)} {path} not checked here: the hypervisor's recording does not hold it (the run "
                        "there checks it)")
        return None
    if not host.is_file(candidate):
        raise OptionError(f"{{{option}}} {value_shown(path)}: no such file on this host")
    return candidate


def _check_rom(host: HostRoot, path: str, warnings: list[str]) -> None:
    """--rom-file: a PCI option ROM image on this host (bad input otherwise)."""
    real = _host_file(host, path, "rom_file", warnings)
    if real is None:
        return
    try:
        data = read_regular(real, ROM_MAX_BYTES)
    except InputError:
        data = None  # larger than any option ROM, or no longer a regular file
    if data is None or len(data) < 512 or not data.startswith(ROM_SIGNATURE):
        raise OptionError(f"{{rom_file}} {value_shown(path)}: not a PCI option ROM (55 AA signature, 512 bytes to "
                          "16 MiB)")


def bridge_groups(spec: DomainSpec) -> tuple[list[list], list[int]]:
    """The 64-bit BARs behind each of the guest's root ports, as the address planner wants them
    (a device's BARs, or for an emulated switch one list per downstream port), and the bus each
    root port is on: the pxb-pcie's controller index, or 0 for pcie-root."""
    below: dict[int, list[GuestPort]] = {}
    for port in spec.ports:
        below.setdefault(port.index, []).append(port)
    children: dict[int, list[Controller]] = {}
    for controller in spec.controllers:
        children.setdefault(controller.parent, []).append(controller)

    def bars(index: int) -> list:
        own = [b for port in below.get(index, []) for f in port.functions for b in f.bars]
        nested = [bars(c.index) for c in children.get(index, [])
                  if c.model in ("pcie-switch-downstream-port", "pcie-switch-upstream-port")]
        if len(nested) == 1 and not own:  # an upstream port: its window is its downstream ports'
            return nested[0]
        return own + nested

    roots = [c for c in spec.controllers if c.model == "pcie-root-port"]
    return [bars(c.index) for c in roots], [c.parent for c in roots]


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


def _place(host: HostRoot, request: DomainRequest, cells: list[int], node_ids: dict[int, NumaNode],
           pinned: dict[int, list[str]]) -> list[CellPlacement]:
    if not cells:
        return []
    if request.vcpus % len(cells):
        raise OptionError(f"{{vcpus}} {request.vcpus} must be a multiple of the {len(cells)} NUMA cells "
                         f"(devices on nodes {cells})")
    if request.memory_kib % len(cells):
        raise OptionError("{memory} must divide evenly between the NUMA cells")
    per_cell, mem = request.vcpus // len(cells), request.memory_kib // len(cells)
    placements = []
    for i, node in enumerate(cells):
        node_cpus = node_ids[node].cpus
        cpus = read_cpus(host, node_cpus)
        vcpus = list(range(i * per_cell, (i + 1) * per_cell))
        placements.append(place_cell(node, node_cpus, cpus, vcpus, mem, force=request.force,
                                     avoid=frozenset(pinned), pinned_by=pinned))
    return placements


def _cell_distances(placements: list[CellPlacement],
                    node_ids: dict[int, NumaNode]) -> tuple[dict[int, dict[int, int]], str | None]:
    """(guest cell -> cell -> the host SLIT distance between their nodes, why not). Empty when
    the host's table is missing a pair, or breaks libvirt's rule for <sibling value> (10 to 255,
    exactly 10 for the cell itself and never 10 for another: src/conf/numa_conf.c
    virDomainNumaDefNodeDistanceParseXML). Linux drops an ACPI SLIT with a remote distance of
    10 or less (drivers/acpi/numa/srat.c slit_valid), but nodes numa=fake carves from one
    physical node show 10 between them: libvirt then keeps QEMU's defaults, 10 local / 20 remote."""
    table = {}
    for i, a in enumerate(placements):
        row = {}
        for j, b in enumerate(placements):
            value = node_ids[a.node].distances.get(b.node)
            if value is None:
                return {}, None
            if (value == 10) != (a.node == b.node):
                return {}, (f"host NUMA distance {a.node}->{b.node} is {value}, which libvirt refuses for "
                            f"{'a cell to itself' if a.node == b.node else 'two cells'}: the guest keeps "
                            "the default distances (10 local, 20 remote)")
            row[j] = value
        table[i] = row
    return table, None


def _p2p(request: DomainRequest, devices: list[list[PciFunction]], single_node: bool, *,
         acs_override: bool, cpu_vendor: str | None) -> CliquePlan:
    """Which GPUs get QEMU's x-nv-gpudirect-clique, or why none do: NCCL's default P2P level
    on this CPU decides how far apart they may be (gpuvfio.host.topology.p2p_rule) unless
    ``--p2p force`` lifts it, and then the plan warns of each clique only force gave."""
    functions = [fns[0] for fns in devices]
    if request.p2p == "off" or sum(1 for f in functions if f.is_nvidia_gpu) < 2:
        return CliquePlan([], [])
    if request.hide_kvm:
        # NVIDIA's driver ignores the clique capability when the hypervisor is hidden.
        return CliquePlan([], ["--hide-kvm: the guest driver does not honour P2P cliques with KVM hidden; none set"])
    plan = p2p_cliques(functions, acs_override=acs_override, single_node=single_node, cpu_vendor=cpu_vendor,
                       force=request.p2p == "force")
    if not plan.cliques:
        return plan
    version = request.qemu_version
    if version is None:
        # A libvirt version without a QEMU one: connected, but not to QEMU (test:///, ...).
        why, ask = (("no libvirt connection", "or --connect") if request.libvirt_version is None else
                    ("the libvirt connection is not to QEMU", "or --connect a qemu:// URI"))
        return CliquePlan([], plan.notes + [
            f"QEMU version unknown ({why}): P2P cliques left out, since QEMU before "
            f"{CLIQUE_QEMU[0]}.{CLIQUE_QEMU[1]} refuses to start Turing and newer GPUs with one; pass --qemu-version "
            + ask], plan.rule)
    if tuple(version[:2]) < CLIQUE_QEMU:
        return CliquePlan([], plan.notes + [
            f"QEMU {'.'.join(map(str, version))} is older than {CLIQUE_QEMU[0]}.{CLIQUE_QEMU[1]}: it puts the P2P "
            "clique capability where Turing and newer GPUs have MSI-X, and refuses to start the guest; cliques left out"],
            plan.rule)
    for clique in plan.cliques:
        plan.notes.append(f"P2P clique {clique.clique_id}: {', '.join(map(str, clique.members))} "
                          f"({clique.relation}: {clique.to_json()['why']})")
    return plan
