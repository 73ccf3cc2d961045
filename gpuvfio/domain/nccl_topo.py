"""An NCCL topology file (``NCCL_TOPO_FILE``) for a guest: its CPUs and NUMA cells, the PCIe
switches, GPUs and NICs, with the link speeds NCCL would read on the HOST (``link_attributes``).

Why: emulated ports report made-up links (QEMU 7.2 root ports 16 GT/s x32, switch ports
2.5 GT/s x1), and a guest without the file looks flat to NCCL (every device on its own root
port, no NUMA), so NCCL picks wrong rings and turns GPU Direct RDMA off. NCCL reads the file
before it looks at sysfs and keeps the attributes the file gives (src/graph/xml.cc,
ncclTopoGetXmlFromFile then ncclTopoGetXmlFromSys fills only what is missing); NVIDIA's KVM
guide for HGX systems and the large clouds ship such files in their VMs.

The file names devices by the bus ids the GUEST sees. Those are not libvirt's controller
indexes: each pxb-pcie starts at its busNr and firmware numbers the buses below depth-first
(hw/pci-bridge/pci_expander_bridge.c; OVMF's PciBusDxe and SeaBIOS pci_bios_init_bus number
bridges as they find them). ``predicted_addresses`` follows that numbering for ``gpuvfio xml
--nccl-topo`` (a prediction, and said to be one); ``attach`` maps the devices the guest really
shows onto the plan (``map_guest``) and writes the file from those.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from xml.etree import ElementTree as ET

from gpuvfio.address import PciAddress

from gpuvfio.domain.layout import Controller, GuestPort
from gpuvfio.errors import GpuvfioError
from gpuvfio.host.model import PciFunction

GUEST_FILE = "/etc/gpuvfio/nccl-topo.xml"


class TopologyMismatch(GpuvfioError):
    """The guest's PCI devices do not line up with the plan: no file is written from them."""


@dataclass(frozen=True)
class GuestSwitch:
    """An emulated switch above a device: the guest's bus id of its upstream port (the node NCCL
    hangs what is below from) and the host switch's upstream port it stands for."""

    busid: str
    host: PciAddress | None


@dataclass
class GuestDevice:
    """One planned device as the guest names it: its bus id and the switches above it."""

    port: GuestPort
    address: str  # the guest's DDDD:BB:SS.F of function 0
    switches: tuple[GuestSwitch, ...] = ()  # nearest the root first

    @property
    def switch(self) -> str | None:
        """The guest's bus id of the switch nearest the device (None: straight on a root port)."""
        return self.switches[-1].busid if self.switches else None


def _children(controllers: list[Controller]) -> dict[int, list[Controller]]:
    kids: dict[int, list[Controller]] = {}
    for c in controllers:
        kids.setdefault(c.parent, []).append(c)
    for parent, members in kids.items():
        # On pcie-root libvirt hands out slots in index order; elsewhere the slot is ours.
        members.sort(key=lambda c: (c.slot if c.slot is not None else 0, c.index))
    return kids


def guest_buses(controllers: list[Controller]) -> dict[int, int]:
    """Controller index -> the guest bus number of the bus it provides, numbered depth-first as
    firmware does: pcie-root's bridges from bus 1, each pxb-pcie's from its busNr + 1."""
    kids = _children(controllers)
    numbers: dict[int, int] = {}

    def walk(index: int, next_bus: int) -> int:
        for child in kids.get(index, []):
            if child.model == "pcie-expander-bus":
                continue  # a host bridge of its own, numbered from its busNr
            numbers[child.index] = next_bus
            next_bus = walk(child.index, next_bus + 1)
        return next_bus

    walk(0, 1)
    for expander in sorted((c for c in controllers if c.model == "pcie-expander-bus"), key=lambda c: c.bus_nr):
        numbers[expander.index] = expander.bus_nr
        walk(expander.index, expander.bus_nr + 1)
    return numbers


def port_order(controllers: list[Controller], ports: list[GuestPort]) -> list[GuestPort]:
    """The devices in the order the guest enumerates them (ascending guest bus number)."""
    buses = guest_buses(controllers)
    return sorted(ports, key=lambda p: buses[p.index])


def switch_chain(controllers: list[Controller], port: GuestPort) -> list[Controller]:
    """The emulated upstream ports above a device's port, nearest the root first."""
    by_index = {c.index: c for c in controllers}
    chain = []
    index = port.index
    while index in by_index:
        controller = by_index[index]
        if controller.model == "pcie-switch-upstream-port":
            chain.append(controller)
        index = controller.parent
    return chain[::-1]


def predicted_addresses(controllers: list[Controller], ports: list[GuestPort]) -> list[GuestDevice]:
    buses = guest_buses(controllers)
    out = []
    for port in port_order(controllers, ports):
        switches = tuple(GuestSwitch(f"0000:{buses[up.parent]:02x}:00.0", up.host)
                         for up in switch_chain(controllers, port))
        out.append(GuestDevice(port, f"0000:{buses[port.index]:02x}:00.0", switches))
    return out


def map_guest(controllers: list[Controller], ports: list[GuestPort], guest_pci: list[dict]) -> list[GuestDevice]:
    """Map the guest's PCI functions (the probe's PCI lines: address, vendor_id, device_id,
    upstream) onto the planned devices. Both are in enumeration order, so the n-th planned
    device is the n-th guest function of its kind on its own bus; each pairing is checked by
    vendor:device, and the switches are the guest's own bridges above the device's port."""
    by_address = {p["address"]: p for p in guest_pci}
    planned = port_order(controllers, ports)
    wanted = {(f.vendor_id, f.device_id) for port in planned for f in port.functions[:1]}
    seen = sorted((p for p in guest_pci if p["address"].endswith(".0")
                   and (p["vendor_id"], p["device_id"]) in wanted), key=lambda p: p["address"])
    if len(seen) != len(planned):
        raise TopologyMismatch(f"the guest shows {len(seen)} of the {len(planned)} planned devices")
    out = []
    for port, guest in zip(planned, seen):
        fn: PciFunction = port.functions[0]
        if (guest["vendor_id"], guest["device_id"]) != (fn.vendor_id, fn.device_id):
            raise TopologyMismatch(f"guest {guest['address']} is {guest['vendor_id']}:{guest['device_id']} where "
                                   f"the plan has {fn.address} ({fn.vendor_id}:{fn.device_id})")
        out.append(GuestDevice(port, guest["address"], _guest_switches(controllers, port, guest, by_address)))
    return out


def _guest_switches(controllers: list[Controller], port: GuestPort, guest: dict,
                    by_address: dict[str, dict]) -> tuple[GuestSwitch, ...]:
    """The guest's upstream ports above ``guest``, read up the probe's bridges: a downstream
    port, then its switch's upstream port, once per planned switch level."""
    chain = switch_chain(controllers, port)
    found = []
    at = guest
    for up in reversed(chain):
        down = by_address.get(at.get("upstream") or "") if at else None
        switch = down.get("upstream") if down else None
        if not switch:
            raise TopologyMismatch(f"guest {guest['address']}: the probe does not show the {len(chain)} switch "
                                   "level(s) planned above it")
        found.append(GuestSwitch(switch, up.host))
        at = by_address.get(switch)
    return tuple(found[::-1])


# The kernel's spelling of a PCIe speed (drivers/pci/pci.h PCIE_SPEED2STR, Linux 5.7 and later:
# "16.0 GT/s PCIe"). Linux 5.6 and earlier wrote "16 GT/s"; NCCL's kvDictPciGen (src/graph/topo.cc)
# has both forms and gives them the same bandwidth, so the current form stands for both.
def speed_string(gts: float) -> str:
    return f"{gts:.1f} GT/s PCIe"


def link_attributes(fn: PciFunction, functions: Mapping[PciAddress, PciFunction] | None = None
                    ) -> tuple[str, str] | None:
    """``link_speed`` and ``link_width`` of ``fn`` as NCCL's sysfs reader writes them on this host
    (src/graph/xml.cc ncclTopoGetXmlFromSys, NCCL 2.6 to 2.30.4; read at v2.30.4-1 and
    v2.30.7-1): the smaller of the device's own maximum and its sysfs parent's (``..``: the root
    port or switch downstream port above it), so an x16 Gen5 GPU in an x8 Gen4 slot is
    ``16.0 GT/s PCIe`` and ``8``.

    - speed: each ``max_link_speed`` parsed as ``%f GT/s``; the parent's string when its number
      is strictly smaller, else the device's. A file NCCL cannot read or parse counts as
      FLT_MAX, so it never wins; both unknown gives the device's string, "" here.
    - width: ``std::min`` of the two ``max_link_width`` numbers, written as a decimal; a missing
      file reads as 0 (strtol of ""), so a device straight on a root bus, whose parent is the
      host bridge's directory without link files, is ``0`` (which NCCL's ncclTopoAddPci then
      takes as 16).

    NCCL 2.30.7 takes a GPU's values from NVML instead (the current generation and width), but
    a value in the topology file wins over both in every version (an attribute already set is
    never filled). The file carries the sysfs rule: it is what NCCL computes on this host before
    2.30.7 and for every device but GPUs in 2.30.7, its width equals the trained width in a
    narrow slot, and it does not follow the link generation a GPU lowers while idle
    (``nvidia-smi -q``, "PCIe Generation Current").

    ``functions``: the host's functions by address, where the parent is found; without them
    (or where the parent is not among them) only the device's own maximum is known, and that is
    what is returned. None: the device has no PCIe link attributes at all."""
    link = fn.link
    if link is None or (link.max_speed_gts is None and link.max_width is None):
        return None
    own_speed, own_width = link.max_speed_gts, link.max_width
    if functions is None or (fn.parents and fn.parents[-1] not in functions):
        if own_speed is None or own_width is None:
            return None
        return speed_string(own_speed), str(own_width)
    port = functions[fn.parents[-1]].link if fn.parents else None
    port_speed = port.max_speed_gts if port is not None else None
    port_width = port.max_width if port is not None else None
    if port_speed is not None and (own_speed is None or port_speed < own_speed):
        speed = speed_string(port_speed)
    else:
        speed = speed_string(own_speed) if own_speed is not None else ""
    return speed, str(min(own_width or 0, port_width or 0))


def _mask(cpus: list[int]) -> str:
    """A cpumap like /sys/devices/system/node/nodeN/cpumap: 32-bit hex words, most significant first."""
    value = sum(1 << c for c in cpus)
    words = max(1, (max(cpus, default=0) // 32) + 1)
    return ",".join(f"{(value >> (32 * w)) & 0xFFFFFFFF:08x}" for w in reversed(range(words)))


def _switch_attributes(switch: GuestSwitch, functions: Mapping[PciAddress, PciFunction] | None) -> dict[str, str]:
    """What the file says of an emulated switch beyond its bus id and class: the link attributes
    of the host switch's upstream port, by NCCL's rule against the port above it, and its ids
    (vendor, device, subsystem), which NCCL keeps from the file (an attribute already set is
    never filled) and reads to fold a Broadcom PEX switch's two levels into one
    (src/graph/topo.cc ncclTopoFlattenBcmSwitches, v2.30.7-1), as it does on the host."""
    fn = functions.get(switch.host) if functions is not None and switch.host is not None else None
    if fn is None:
        return {}
    attrs = _id_attributes(fn)
    link = link_attributes(fn, functions)
    if link:
        attrs.update(link_speed=link[0], link_width=link[1])
    return attrs


def _id_attributes(fn: PciFunction) -> dict[str, str]:
    attrs = {"vendor": f"0x{fn.vendor_id}", "device": f"0x{fn.device_id}"}
    if fn.subsystem_vendor_id and fn.subsystem_device_id:
        attrs.update(subsystem_vendor=f"0x{fn.subsystem_vendor_id}", subsystem_device=f"0x{fn.subsystem_device_id}")
    return attrs


def topology_tree(devices: list[GuestDevice], cells: list[tuple[int, list[int]]], cell_of_port: dict[int, int], *,
                  cpu_vendor: str | None, switch_links: dict[str, tuple[str, str]] | None = None,
                  host_functions: Mapping[PciAddress, PciFunction] | None = None) -> ET.Element:
    """The tree the file means: <system>, a <cpu> per cell, under it the switches and devices.
    ``cells``: (guest cell id, its vCPUs); ``cell_of_port``: guest port index -> cell;
    ``host_functions``: the host's functions by address, for the link attributes NCCL's reader
    computes on the host (``link_attributes``) of each device and of the host switch's upstream
    port each emulated switch stands for; ``switch_links``: guest switch bus id -> link
    attributes given outright (they win)."""
    system = ET.Element("system", version="1")
    cpu_nodes = {}
    for cell, vcpus in cells:
        attrs = {"numaid": str(cell), "affinity": _mask(vcpus), "arch": "x86_64"}
        if len(attrs["affinity"]) > MAX_VALUE:
            # A cell with vCPU 896 or above has a cpumap of 29 words or more (260 bytes), and one
            # value too long makes NCCL refuse the whole file. Without the attribute NCCL reads
            # the cell's cpumap from the guest's sysfs (src/graph/xml.cc ncclTopoGetXmlFromCpu,
            # v2.30.7-1): the same vCPUs.
            del attrs["affinity"]
        if cpu_vendor:
            attrs["vendor"] = cpu_vendor
        cpu_nodes[cell] = ET.SubElement(system, "cpu", attrs)
    switches: dict[tuple[str, ...], ET.Element] = {}
    for device in devices:
        parent = cpu_nodes[cell_of_port.get(device.port.index, cells[0][0])]
        for depth, switch in enumerate(device.switches):
            key = tuple(s.busid for s in device.switches[:depth + 1])
            if key not in switches:
                attrs = {"busid": switch.busid, "class": "0x060400", **_switch_attributes(switch, host_functions)}
                link = (switch_links or {}).get(switch.busid)
                if link:
                    attrs.update(link_speed=link[0], link_width=link[1])
                switches[key] = ET.SubElement(parent, "pci", attrs)
            parent = switches[key]
        fn = device.port.functions[0]
        attrs = {"busid": device.address, "class": f"0x{fn.class_id}", **_id_attributes(fn)}
        speed = link_attributes(fn, host_functions)
        if speed:
            attrs.update(link_speed=speed[0], link_width=speed[1])
        ET.SubElement(parent, "pci", attrs)
    return system


def nccl_chain(fn: PciFunction) -> tuple[PciAddress, ...]:
    """The <pci> nodes NCCL's sysfs reader puts above ``fn`` on this host, nearest the root
    first (src/graph/xml.cc ncclTopoGetXmlFromSys, v2.30.7-1): from a device's sysfs path it
    rewinds two components and continues on the bridge it lands on, and stops at a CPU where
    either component it passes is no bus id (the root complex's ``pciDDDD:BB``, or one with a
    domain wider than four digits). So a switch is one
    node named by its upstream port, a device on a root port hangs from the CPU, and a
    PCIe-to-PCI bridge below a switch shifts what follows by one."""
    path = (*fn.parents, fn.address)
    chain = []
    at = len(path) - 1
    while at >= 2 and _bdf(path[at - 1]) and _bdf(path[at - 2]):
        at -= 2
        chain.append(path[at])
    return tuple(chain[::-1])


def _bdf(address: PciAddress) -> bool:
    """xml.cc checkBDFFormat: exactly "DDDD:BB:SS.F", 12 characters. A wider domain (a VMD
    domain such as 10000:e0:06.0) is no bus id to NCCL: it stops there and takes the CPU."""
    return len(str(address)) == 12


def host_topology_tree(gpus: list[PciFunction], functions: Mapping[PciAddress, PciFunction], *,
                       cpu_vendor: str | None) -> ET.Element:
    """The topology NCCL's sysfs reader builds on this host for ``gpus``: a <cpu> per NUMA node
    (the node of the top bridge, -1 where unknown), under it each bridge of ``nccl_chain`` with
    its class, ids and link attributes, the <pcilink> of each Broadcom virtual switch link it
    has (inventory.switch_links), and the GPUs. What NCCL would compute on bare metal,
    for comparison with the guest's file (both read by the same reference, gpuvfio_ncclpaths)."""
    system = ET.Element("system", version="1")
    cpus: dict[str, ET.Element] = {}
    nodes: dict[PciAddress, ET.Element] = {}
    for gpu in sorted(gpus, key=lambda f: f.address):
        chain = nccl_chain(gpu)
        top = functions.get(chain[0]) if chain else gpu
        node = (top or gpu).numa_node
        numaid = str(node if node is not None and node >= 0 else -1)
        if numaid not in cpus:
            attrs = {"numaid": numaid, "arch": "x86_64", **({"vendor": cpu_vendor} if cpu_vendor else {})}
            cpus[numaid] = ET.SubElement(system, "cpu", attrs)
        parent = cpus[numaid]
        for address in (*chain, gpu.address):
            if address not in nodes:
                nodes[address] = ET.SubElement(parent, "pci", _host_attributes(address, functions))
            parent = nodes[address]
    for address, node in nodes.items():
        for peer in getattr(functions.get(address), "switch_links", ()):
            ET.SubElement(node, "pcilink", {"target": str(peer)})
    return system


def _host_attributes(address: PciAddress, functions: Mapping[PciAddress, PciFunction]) -> dict[str, str]:
    fn = functions.get(address)
    attrs = {"busid": str(address)}
    if fn is None:  # a bridge the inventory does not hold: NCCL would read it as one
        return attrs | {"class": "0x060400"}
    attrs |= {"class": f"0x{fn.class_id}", **_id_attributes(fn)}
    link = link_attributes(fn, functions)
    if link:
        attrs.update(link_speed=link[0], link_width=link[1])
    return attrs


# NCCL reads the file with a tokenizer of its own, not an XML parser (src/graph/xml.cc
# xmlGetNode, xmlGetToken and xmlGetValue, v2.30.7-1; v2.6.4-1 reads alike, without single
# quotes and with MAX_STR_LEN 256):
# one space before each attribute and none before "/>" (a space there reads as one more
# attribute, with an empty key), no declaration, nothing but ' ', '\n' and '\r' between tags,
# values raw in double quotes (no entities decoded), at most MAX_ATTR_COUNT (16) attributes
# (src/graph/xml.h), and a name or value of at most 253 bytes (a char[MAX_STR_LEN + 1] that
# must not fill up to MAX_STR_LEN - 1). ncclTopoDumpXmlRec writes its dump in this same form.
MAX_ATTRS = 16
MAX_VALUE = 253
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


class UnreadableTopology(GpuvfioError):
    """The tree holds what NCCL's reader cannot read back: no file is written from it."""


def render(node: ET.Element, depth: int = 0) -> str:
    """``node`` and what it holds in the form NCCL's reader tokenizes as meant: two spaces of
    indent a level, `<name key="value" ...>` or `<name key="value"/>`, one tag a line."""
    _readable(node)
    head = "  " * depth + "<" + node.tag + "".join(f' {key}="{value}"' for key, value in node.attrib.items())
    if len(node) == 0:
        return head + "/>\n"
    return head + ">\n" + "".join(render(sub, depth + 1) for sub in node) + "  " * depth + f"</{node.tag}>\n"


def _readable(node: ET.Element) -> None:
    if len(node.attrib) > MAX_ATTRS:
        raise UnreadableTopology(f"<{node.tag}> has {len(node.attrib)} attributes: NCCL reads {MAX_ATTRS}")
    for name in (node.tag, *node.attrib):
        if not _NAME.fullmatch(name) or len(name) > MAX_VALUE:
            raise UnreadableTopology(f"NCCL cannot read the name {name!r} in its topology file")
    for key, value in node.attrib.items():
        if '"' in value or "\0" in value or len(value.encode()) > MAX_VALUE:
            raise UnreadableTopology(f"NCCL cannot read <{node.tag}> {key}={value[:40]!r}: a quote, a NUL "
                                     f"or over {MAX_VALUE} bytes")
