"""Domain services: a validated request -> DomainSpec -> XML (checked against libvirt's schema),
and the idempotent define. gpuvfio xml, attach, the testbed and the Ansible domain module all
build their domains here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from xml.etree import ElementTree as ET

from gpuvfio.address import PciAddress
from gpuvfio.domain import nccl_topo
from gpuvfio.domain.nccl_topo import GUEST_FILE as NCCL_GUEST_FILE
from gpuvfio.domain.address_space import guest_cpu_vendor
from gpuvfio.domain.render import domain_xml
from gpuvfio.domain.request import DomainRequest, domain_request, parse_hugepages, parse_numa, parse_uuid
from gpuvfio.domain.spec import DomainSpec, build_spec, mdev_uuid
from gpuvfio.host.fabric import WARN as FABRIC_WARN
from gpuvfio.host.inventory import Inventory, read_inventory
from gpuvfio.host.numa import MAX_NODE, cpu_vendor, read_numa
from gpuvfio.host.pciids import PciIds
from gpuvfio.ops import fabric as fabric_ops
from gpuvfio.ops.context import Context
from gpuvfio.ops.nccl_paths import PathPair, gpu_pairs, virtual_links
from gpuvfio.ops.plans import Plan, StepKind
from gpuvfio.errors import GpuvfioError, Refused
from gpuvfio.numbers import uint
from gpuvfio.virt import lifecycle
from gpuvfio.virt.connection import call, connection_versions, default_uri, libvirt_module
from gpuvfio.virt.define import DefineResult, Definition, current_definition, define, difference
from gpuvfio.virt.defined import DefinedDomain, listed, read_defined
from gpuvfio.virt.pins import VCPU_PINS, pinned_elsewhere

# read_defined: the one reader of a domain's definition (gpuvfio.virt.defined), for the interfaces.
__all__ = ["Provisioned", "provision_xml", "read_defined", "DefinedDomain", "nccl_topology_file", "NCCL_GUEST_FILE",
           "pages_held", "plan_define", "run_define", "DefinePlan", "Existing", "existing_domain",
           "differences",
           "DomainRequest", "domain_request", "parse_hugepages", "parse_numa", "parse_uuid", "mdev_uuid"]


@dataclass
class Provisioned:
    """A domain as gpuvfio would define it, with what it was built from."""

    spec: DomainSpec
    xml: str
    inventory: Inventory
    paths: list[PathPair] = dataclasses.field(default_factory=list)  # NCCL's, between its GPUs

    @property
    def assigned(self) -> list[PciAddress]:
        """The host PCI functions the guest gets (the slot's functions, or the vGPU's VF)."""
        return self.spec.assignment.host_functions

    def layout_json(self) -> dict:
        """The guest PCIe tree, P2P cliques and what the plan noted, for --json and the plan."""
        spec = self.spec
        return {"topology": spec.topology,
                "controllers": [{"index": c.index, "model": c.model, "parent": c.parent, "bus_nr": c.bus_nr,
                                 "cell": c.cell, "mirrors": c.purpose} for c in spec.controllers],
                "devices": [{"address": str(slot.functions[0].address), "bus": slot.port, "alias": slot.alias}
                            for slot in spec.assignment.slots],
                "p2p": spec.p2p.to_json(), "nccl_paths": [pair.to_json() for pair in self.paths],
                "numa_distances": {str(k): {str(j): v for j, v in row.items()}
                                                              for k, row in spec.distances.items()}}

    @property
    def passthrough(self) -> list[PciAddress]:
        """The functions passed through whole: bound to vfio-pci for the guest (never a vGPU's VF,
        which the vGPU host driver keeps)."""
        return self.spec.assignment.passthrough


def provision_xml(ctx: Context, addresses: list[PciAddress], request: DomainRequest, *,
                  replacing: "Existing | None" = None, uri: str | None = None, ask_libvirt: bool = False,
                  seed_iso: str | None = None) -> Provisioned:
    """``replacing``: the domain of that name as it is; when it runs, the hugepages it holds count
    as free for its new definition (a re-run of the same request must come out the same).
    ``ask_libvirt``: a libvirt connection (``uri``) is in use, so the QEMU version comes from it
    when the request does not name one. ``seed_iso``: a cloud-init seed image the guest gets as
    a cdrom (gpuvfio.ops.cloud_init writes it)."""
    if ask_libvirt:
        qemu, lib = connection_versions(ctx.libvirt(uri))
        request = dataclasses.replace(request, qemu_version=request.qemu_version or qemu, libvirt_version=lib)
    inventory = read_inventory(ctx.host, names=PciIds.load(ctx.host))
    held = pages_held(replacing.xml) if replacing is not None and replacing.active else None
    fabric = None if request.mdev or request.vgpu else fabric_ops.decide(ctx, inventory, addresses).check()
    if fabric is not None and fabric.kind == "none":
        fabric = None
    if fabric is not None:
        addresses = list(addresses) + [a for a in fabric.add_devices if a not in addresses]
    # The other domains' vCPU pins, not their emulator pins: gpuvfio gives a guest's emulator the
    # rest of its node, which would leave a second guest nothing.
    pinned = pinned_elsewhere(listed(ctx.libvirt(uri), ctx.listing), request.name, kinds=VCPU_PINS) \
        if ask_libvirt else None
    spec = build_spec(ctx.host, inventory, read_numa(ctx.host), addresses, request, pages_held=held, pinned=pinned)
    spec.seed_iso = seed_iso
    if fabric is not None:
        spec.fabric = fabric
        spec.notes = [line.message for line in fabric.lines if line.status != FABRIC_WARN] + spec.notes
        spec.warnings += [line.message for line in fabric.lines if line.status == FABRIC_WARN]
    settings = ctx.host.settings
    provisioned = Provisioned(spec, domain_xml(spec, schemas=settings.schemas), inventory)
    _compare_paths(ctx, provisioned)
    return provisioned


def _nccl_ports(spec: DomainSpec) -> list:
    # NCCL's file holds GPUs and NICs (and the switches above them); other devices stay out.
    return [p for p in spec.ports if p.functions[0].class_id.startswith(("02", "03"))]


def guest_topology(ctx: Context, provisioned: Provisioned, guest_pci: list[dict] | None = None
                   ) -> tuple[list[nccl_topo.GuestDevice], ET.Element]:
    """The guest's devices as it names them and the NCCL topology of a provisioned guest: from
    the devices the guest shows (``guest_pci``, the probe's PCI facts) or, without them, from
    the predicted bus ids."""
    spec = provisioned.spec
    ports = _nccl_ports(spec)
    if guest_pci is None:
        devices = nccl_topo.predicted_addresses(spec.controllers, ports)
    else:
        devices = nccl_topo.map_guest(spec.controllers, ports, guest_pci)
    cells = ([(i, cell.vcpus) for i, cell in enumerate(spec.cells)] if spec.guest_cells
             else [(0, list(range(spec.vcpus)))])
    # Link attributes as NCCL's reader computes them on the host: each device and each host
    # switch's upstream port against the port above it (nccl_topo.link_attributes).
    tree = nccl_topo.topology_tree(devices, cells, {slot.port: slot.cell for slot in spec.assignment.slots},
                                   cpu_vendor=guest_cpu_vendor(spec.asked.virt_type, cpu_vendor(ctx.host)),
                                   host_functions=provisioned.inventory.functions)
    return devices, tree


def nccl_topology_file(ctx: Context, provisioned: Provisioned, guest_pci: list[dict] | None = None) -> str:
    """The NCCL topology file for a provisioned guest (``guest_topology``), as NCCL reads it."""
    return nccl_topo.render(guest_topology(ctx, provisioned, guest_pci)[1])


def _compare_paths(ctx: Context, provisioned: Provisioned) -> None:
    """NCCL's path between each pair of the guest's GPUs, on the host and in the guest's file:
    a note with the pairs, a warning for each pair that differs (NCCL in the guest would plan
    for another machine than the one its GPUs are in)."""
    spec = provisioned.spec
    if sum(p.functions[0].is_nvidia_gpu for p in _nccl_ports(spec)) < 2:
        return
    devices, tree = guest_topology(ctx, provisioned)
    host_vendor = cpu_vendor(ctx.host)
    provisioned.paths = gpu_pairs(devices, tree, provisioned.inventory.functions, host_vendor=host_vendor,
                                  guest_vendor=guest_cpu_vendor(spec.asked.virt_type, host_vendor))
    for same, words in ((True, "the same on the host and in the guest"),
                        (False, "NOT the same on the host and in the guest")):
        by_kind: dict[str, list[str]] = {}
        for pair in provisioned.paths:
            if pair.same == same:
                by_kind.setdefault(pair.kinds(), []).append(f"{pair.a}-{pair.b}")
        if by_kind:
            line = f"NCCL's path between GPUs, {words}: " + "; ".join(
                f"{kind}: {', '.join(pairs)}" for kind, pairs in by_kind.items())
            if same:
                spec.notes.append(line)
            else:
                spec.warnings.append(line + " (NCCL in the guest would plan its rings and P2P for another machine "
                                     "than the one its GPUs are in)" + _virtual_links_why(provisioned))


def _virtual_links_why(provisioned: Provisioned) -> str:
    """Why a guest differs where the host's switches are joined by Broadcom virtual links."""
    functions = provisioned.inventory.functions
    gpus = [functions[pair.a] for pair in provisioned.paths] + [functions[pair.b] for pair in provisioned.paths]
    links = virtual_links(gpus, functions)
    if not links:
        return ""
    return ("; on the host NCCL joins switches by Broadcom virtual switch links (" +
            ", ".join(f"{a} -> {b}" for a, b in links) + "), which no guest's emulated switches have")


def pages_held(xml: str) -> dict[int, dict[int, int]] | None:
    """node -> page KiB -> pages a running domain's definition holds (its memory in hugepages,
    split over its memnode nodes, else its numatune nodeset, else host node 0)."""
    domain = read_defined(xml)
    if not domain.hugepage_kib or not domain.memory_kib:
        return None
    nodes = [n for n in domain.memnodes if n <= MAX_NODE]
    if not nodes:
        nodes = [n for n in (uint(part, MAX_NODE) for part in (domain.numa_nodeset or "").split(","))
                 if n is not None] or [0]
    per_node = -(-domain.memory_kib // domain.hugepage_kib) // len(nodes)
    return {node: {domain.hugepage_kib: per_node} for node in nodes}


@dataclass
class DefinePlan(Plan):
    """``xml --define`` (and attach's define step) decided: what libvirt holds under the name
    (``held``), and whether the run defines new, redefines under the existing UUID, or leaves
    an unchanged definition; differences without ``update`` refuse (exit 1, nothing changed)."""

    uri: str | None = None
    update: bool = False
    held: Definition | None = None

    @property
    def outcome(self) -> str:
        """would_define | would_update | unchanged | differs | refused (the dry run's word)."""
        if self.held is None:
            return "refused"
        if self.held.current_xml is None:
            return "would_define"
        if not self.held.changes:
            return "unchanged"
        return "would_update" if self.update else "differs"

    def extra_json(self) -> dict:
        return {"define": {"name": self.target, "result": self.outcome,
                           "changes": list(self.held.changes) if self.held else []}}


def plan_define(ctx: Context, xml: str, *, uri: str | None = None, update: bool = False) -> DefinePlan:
    """What defining ``xml`` on libvirt at ``uri`` (default: libvirt's default) will do; reads
    only. A domain of that name gpuvfio did not define is refused, not taken over."""
    conn = ctx.libvirt(uri)
    name = read_defined(xml).name
    plan = DefinePlan("define", name, xml=xml, uri=uri, update=update)
    dom = lifecycle.lookup(conn, name)
    if dom is not None and not lifecycle.made_by_gpuvfio(dom):
        plan.refuse("domain", f"domain {name} exists and was not created by gpuvfio; pick another name")
        return plan
    plan.held = held = current_definition(conn, xml)
    plan.changes = list(held.changes)
    if held.current_xml is None:
        plan.step(StepKind.DEFINE, f"define {name} on {uri or default_uri(ctx.host.settings)}", name=name)
    elif not held.changes:
        plan.notes.append(f"{name} is defined so already (unchanged)")
    elif update:
        plan.step(StepKind.DEFINE, f"redefine {name} ({len(held.changes)} differences), keeping its UUID", name=name)
    else:
        plan.refuse("define", f"domain {name} exists and differs; nothing changed (--update to redefine)")
    return plan


def run_define(ctx: Context, plan: DefinePlan) -> DefineResult:
    """Carry out a define plan: defineXML as planned, or nothing for an unchanged definition."""
    plan.raise_if_refused()
    conn = ctx.libvirt(plan.uri)
    # libvirt's domains are not under gpuvfio's run lock: what the plan read must still hold, or
    # the run would act on a definition it never looked at (fail closed: plan again).
    if current_definition(conn, plan.xml) != plan.held:
        raise GpuvfioError(f"libvirt's definition of {plan.target} changed since the plan was made; nothing "
                           "defined (run it again)")
    if plan.nothing_to_do:
        return DefineResult(plan.target, "unchanged")
    return define(conn, plan.xml, plan.held)


@dataclass
class Existing:
    """A domain libvirt has under the name: its stored definition, whether it runs, and (when
    gpuvfio defined it) the host devices gpuvfio recorded in it."""

    xml: str
    active: bool
    ours: bool
    devices: list[PciAddress]


def existing_domain(ctx: Context, name: str, *, uri: str | None = None, ours_only: bool = True) -> Existing | None:
    """The domain called ``name``, or None; with ``ours_only`` one gpuvfio did not define is refused."""
    dom = lifecycle.lookup(ctx.libvirt(uri), name)
    if dom is None:
        return None
    ours = lifecycle.made_by_gpuvfio(dom)
    if ours_only and not ours:
        raise Refused(f"domain {name} exists and was not created by gpuvfio; pick another name")
    libvirt = libvirt_module()
    return Existing(call(f"reading {name}'s definition", dom.XMLDesc, libvirt.VIR_DOMAIN_XML_INACTIVE),
                    lifecycle.is_active(dom), ours, lifecycle.recorded_devices(dom) if ours else [])


def differences(wanted_xml: str, current_xml: str) -> list[str]:
    """What defining ``wanted_xml`` would change in ``current_xml`` (see gpuvfio.virt.define)."""
    return difference(wanted_xml, current_xml)
