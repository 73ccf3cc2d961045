"""An NCCL topology file (``NCCL_TOPO_FILE``) for a guest: its CPUs and NUMA cells, the PCIe
switches, GPUs and NICs, with the HOST's link speeds.

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

from dataclasses import dataclass
from xml.etree import ElementTree as ET

from gpuvfio.domain.layout import Controller, GuestPort
from gpuvfio.errors import GpuvfioError
from gpuvfio.host.model import PciFunction

GUEST_FILE = "/etc/gpuvfio/nccl-topo.xml"


class TopologyMismatch(GpuvfioError):
    """The guest's PCI devices do not line up with the plan: no file is written from them."""


@dataclass
class GuestDevice:
    """One planned device as the guest names it: its bus id and the switch it sits under."""

    port: GuestPort
    address: str  # the guest's DDDD:BB:SS.F of function 0
    switch: str | None  # the guest's bus id of the emulated switch's upstream port


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


def _switch_of(controllers: list[Controller], port: GuestPort) -> Controller | None:
    """The emulated upstream port above a device's downstream port, if it sits in a switch."""
    by_index = {c.index: c for c in controllers}
    down = by_index.get(port.index)
    if down is None or down.model != "pcie-switch-downstream-port":
        return None
    return by_index[down.parent]


def predicted_addresses(controllers: list[Controller], ports: list[GuestPort]) -> list[GuestDevice]:
    buses = guest_buses(controllers)
    out = []
    for port in port_order(controllers, ports):
        up = _switch_of(controllers, port)
        out.append(GuestDevice(port, f"0000:{buses[port.index]:02x}:00.0",
                               f"0000:{buses[up.parent]:02x}:00.0" if up is not None else None))
    return out


def map_guest(controllers: list[Controller], ports: list[GuestPort], guest_pci: list[dict]) -> list[GuestDevice]:
    """Map the guest's PCI functions (the probe's PCI lines: address, vendor_id, device_id,
    upstream) onto the planned devices. Both are in enumeration order, so the n-th planned
    device is the n-th guest function of its kind on its own bus; each pairing is checked by
    vendor:device, and the switch is the guest's own bridge above the device's port."""
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
        switch = None
        if _switch_of(controllers, port) is not None:
            down = by_address.get(guest.get("upstream") or "")
            switch = down.get("upstream") if down else None
            if not switch:
                raise TopologyMismatch(f"guest {guest['address']}: the probe does not show the switch above it")
        out.append(GuestDevice(port, guest["address"], switch))
    return out


def link_attributes(fn: PciFunction) -> tuple[str, str] | None:
    """The host link as sysfs spells it ('16.0 GT/s PCIe', '16'): what NCCL would read on bare metal."""
    link = fn.link
    if link is None or link.max_speed_gts is None or link.max_width is None:
        return None
    return f"{link.max_speed_gts:.1f} GT/s PCIe", str(link.max_width)


def _mask(cpus: list[int]) -> str:
    """A cpumap like /sys/devices/system/node/nodeN/cpumap: 32-bit hex words, most significant first."""
    value = sum(1 << c for c in cpus)
    words = max(1, (max(cpus, default=0) // 32) + 1)
    return ",".join(f"{(value >> (32 * w)) & 0xFFFFFFFF:08x}" for w in reversed(range(words)))


def nccl_topology(devices: list[GuestDevice], cells: list[tuple[int, list[int]]], cell_of_port: dict[int, int], *,
                  cpu_vendor: str | None, switch_links: dict[str, tuple[str, str]] | None = None) -> str:
    """The XML (NCCL's <system version="1"> format). ``cells``: (guest cell id, its vCPUs);
    ``cell_of_port``: guest port index -> cell; ``switch_links``: guest switch bus id -> the
    host link of the switch's uplink."""
    system = ET.Element("system", version="1")
    cpu_nodes = {}
    for cell, vcpus in cells:
        attrs = {"numaid": str(cell), "affinity": _mask(vcpus), "arch": "x86_64"}
        if cpu_vendor:
            attrs["vendor"] = cpu_vendor
        cpu_nodes[cell] = ET.SubElement(system, "cpu", attrs)
    switches: dict[str, ET.Element] = {}
    for device in devices:
        parent = cpu_nodes[cell_of_port.get(device.port.index, cells[0][0])]
        if device.switch:
            if device.switch not in switches:
                attrs = {"busid": device.switch, "class": "0x060400"}
                link = (switch_links or {}).get(device.switch)
                if link:
                    attrs.update(link_speed=link[0], link_width=link[1])
                switches[device.switch] = ET.SubElement(parent, "pci", attrs)
            parent = switches[device.switch]
        fn = device.port.functions[0]
        attrs = {"busid": device.address, "class": f"0x{fn.class_id}", "vendor": f"0x{fn.vendor_id}",
                 "device": f"0x{fn.device_id}"}
        if fn.subsystem_vendor_id and fn.subsystem_device_id:
            attrs.update(subsystem_vendor=f"0x{fn.subsystem_vendor_id}", subsystem_device=f"0x{fn.subsystem_device_id}")
        speed = link_attributes(fn)
        if speed:
            attrs.update(link_speed=speed[0], link_width=speed[1])
        ET.SubElement(parent, "pci", attrs)
    ET.indent(system)
    return ET.tostring(system, encoding="unicode") + "\n"
