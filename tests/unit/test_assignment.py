"""Issue 36 item 4: what goes where is decided once (gpuvfio.domain.assignment) and the libvirt
domain, the NCCL topology file and the plan's --json are renderings of it. Each test holds a
rendering to the assignment the plan made, on a two-socket host with a switch of two GPUs and
a NIC on each socket (tests/unit/test_layout.py's host)."""

from __future__ import annotations

import dataclasses

import pytest
from lxml import etree

from gpuvfio.address import PciAddress
from gpuvfio.domain.assignment import Rom
from gpuvfio.domain.render import domain_xml
from tests.unit.test_layout import spec_for, switch_host

GPUS = ["0000:18:00.0", "0000:19:00.0", "0000:9a:00.0", "0000:9b:00.0"]


@pytest.fixture
def spec(tmp_path):
    switch_host(tmp_path)
    return spec_for(tmp_path, GPUS + ["0000:1a:00.0"], qemu_version="9.2.0", rom_bar="off")


def test_the_assignment_holds_each_devices_slot_cell_clique_and_rom(spec):
    slots = {str(slot.functions[0].address): slot for slot in spec.assignment.slots}
    assert sorted(slots) == sorted(GPUS + ["0000:1a:00.0"])
    assert [slots[g].cell for g in GPUS] == [0, 0, 1, 1]  # the pxb-pcie of each socket
    assert slots[GPUS[0]].clique == slots[GPUS[1]].clique != slots[GPUS[2]].clique == slots[GPUS[3]].clique
    assert slots["0000:1a:00.0"].clique is None and slots["0000:1a:00.0"].alias is None
    assert all(slot.rom == Rom("off", None) for slot in slots.values())
    assert spec.assignment.passthrough == [a for s in spec.assignment.slots for a in s.host_addresses]


def test_the_domain_is_a_rendering_of_the_assignment(spec):
    doc = etree.fromstring(domain_xml(spec).encode())
    rendered = {}
    for hostdev in doc.iter("hostdev"):
        source, guest = hostdev.find("source/address"), hostdev.find("address")
        host = PciAddress(int(source.get("domain"), 16), int(source.get("bus"), 16), int(source.get("slot"), 16),
                          int(source.get("function"), 16))
        alias, rom = hostdev.find("alias"), hostdev.find("rom")
        rendered[host] = (int(guest.get("bus"), 16), alias.get("name") if alias is not None else None,
                          rom.get("bar") if rom is not None else None)
    expected = {fn.address: (slot.port, slot.alias if index == 0 else None, "off" if fn.is_gpu else None)
                for slot in spec.assignment.slots for index, fn in enumerate(slot.functions)}
    assert rendered == expected
    qemu = {"q": "http://libvirt.org/schemas/domain/qemu/1.0"}
    override = {d.get("alias"): d.xpath("q:frontend/q:property/@value", namespaces=qemu)[0]
                for d in doc.xpath("//q:override/q:device", namespaces=qemu)}
    assert override
    assert override == {alias: str(clique) for alias, clique in spec.assignment.cliques}


def test_a_changed_assignment_changes_the_domain(spec):
    """The renderer reads the assignment, not the ports beside it: moving a device's clique or
    ROM in the assignment alone moves it in the XML."""
    first = spec.assignment.slots[0]
    moved = dataclasses.replace(first, rom=Rom("on", None))
    spec.assignment = dataclasses.replace(spec.assignment, slots=(moved,) + spec.assignment.slots[1:])
    doc = etree.fromstring(domain_xml(spec).encode())
    bars = [h.find("rom").get("bar") for h in doc.iter("hostdev") if h.find("rom") is not None]
    assert bars.count("on") == 1
