"""CPUs other domains pin: against libvirt's real test driver (test:///), and libvirt's cpuset syntax."""

import pytest

from gpuvfio.domain.placement import place_cell
from gpuvfio.host.numa import Cpu
from gpuvfio.virt.connection import LibvirtError, open_connection
from gpuvfio.virt.defined import read_all
from gpuvfio.virt.pins import (ALL_PINS, EMULATOR, VCPU_PINS, UnreadablePins, domain_pins, parse_cpuset,
                               pinned_elsewhere)

libvirt = pytest.importorskip("libvirt")

DOMAIN = """
<domain type='test'>
  <name>{name}</name>
  <memory unit='MiB'>512</memory>
  <vcpu{cpuset}>{vcpus}</vcpu>
  {iothreads}
  <cputune>{pins}</cputune>
  <os><type arch='x86_64'>hvm</type></os>
</domain>"""


def domain(name: str, pins: str = "", vcpus: int = 2, cpuset: str = "", iothreads: str = "") -> str:
    return DOMAIN.format(name=name, pins=pins, vcpus=vcpus, iothreads=iothreads,
                         cpuset=f" cpuset='{cpuset}'" if cpuset else "")


# Two guests as gpuvfio pins them today: vCPUs on whole cores, the emulator on the rest of the node.
GUEST_A = domain("guest-a", "<vcpupin vcpu='0' cpuset='8'/><vcpupin vcpu='1' cpuset='9'/>"
                            "<emulatorpin cpuset='10-15'/>")
GUEST_B = domain("guest-b", "<vcpupin vcpu='0' cpuset='4'/><vcpupin vcpu='1' cpuset='5'/>"
                            "<emulatorpin cpuset='6-7'/>")


@pytest.fixture
def conn(tmp_path):
    """guest-a and guest-b run (the test driver starts the domains of its file); guest-c is only
    defined; unpinned has no pins at all."""
    path = tmp_path / "testdriver.xml"
    path.write_text("<node>" + GUEST_A + GUEST_B + domain("unpinned") + "</node>")
    conn = open_connection(f"test://{path}")
    conn.defineXML(domain("guest-c", "<vcpupin vcpu='0' cpuset='2'/><vcpupin vcpu='1' cpuset='3'/>"
                                     "<emulatorpin cpuset='2-3'/>"))
    yield conn
    conn.close()


def test_running_and_defined_domains_pins_are_found(conn):
    assert conn.lookupByName("guest-a").isActive() and not conn.lookupByName("guest-c").isActive()
    pinned = pinned_elsewhere(read_all(conn), None)
    assert pinned == {2: ["guest-c"], 3: ["guest-c"], 4: ["guest-b"], 5: ["guest-b"], 6: ["guest-b"],
                      7: ["guest-b"], 8: ["guest-a"], 9: ["guest-a"], 10: ["guest-a"], 11: ["guest-a"],
                      12: ["guest-a"], 13: ["guest-a"], 14: ["guest-a"], 15: ["guest-a"]}


def test_the_domain_being_redefined_does_not_count(conn):
    pinned = pinned_elsewhere(read_all(conn), "guest-a")
    assert "guest-a" not in {n for names in pinned.values() for n in names}
    assert sorted(pinned) == [2, 3, 4, 5, 6, 7]


def test_vcpu_pins_only(conn):
    assert pinned_elsewhere(read_all(conn), None, kinds=VCPU_PINS) == {
        2: ["guest-c"], 3: ["guest-c"], 4: ["guest-b"], 5: ["guest-b"], 8: ["guest-a"], 9: ["guest-a"]}


def test_a_cpu_two_domains_pin_names_both(tmp_path):
    path = tmp_path / "testdriver.xml"
    path.write_text("<node>" + domain("one", "<emulatorpin cpuset='1-2'/>")
                    + domain("two", "<emulatorpin cpuset='2-3'/>") + "</node>")
    conn = open_connection(f"test://{path}")
    try:
        assert pinned_elsewhere(read_all(conn), None) == {1: ["one"], 2: ["one", "two"], 3: ["two"]}
    finally:
        conn.close()


def test_live_pins_and_next_boot_pins_both_count(conn):
    """Redefining a running guest changes what it gets on its next start, not the pins its threads
    use now: both count."""
    dom = conn.lookupByName("guest-a")
    conn.defineXML(GUEST_A.replace("cpuset='8'", "cpuset='12'").replace(
        "<name>guest-a</name>", f"<name>guest-a</name><uuid>{dom.UUIDString()}</uuid>"))
    assert dom.isActive() and "cpuset='8'" in dom.XMLDesc(0)
    assert "cpuset='12'" in dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
    vcpus = pinned_elsewhere(read_all(conn), "guest-b", kinds=VCPU_PINS)
    assert vcpus[8] == ["guest-a"] and vcpus[12] == ["guest-a"]


def test_placement_stays_off_the_neighbours(conn):
    """Two guests on one node no longer get identical pins: the second one's vCPUs and emulator
    go to cores the first does not hold, and the plan says so."""
    cpus = {c: Cpu(c, 0, c % 8, (c % 8, c % 8 + 8)) for c in range(16)}  # 8 cores x 2 threads
    alone = place_cell(0, list(range(16)), cpus, [0, 1], 1 << 20)
    assert alone.host_cpus == [1, 9]
    pinned = pinned_elsewhere(read_all(conn), None, kinds=VCPU_PINS)  # guest-a 8-9, guest-b 4-5, guest-c 2-3
    cell = place_cell(0, list(range(16)), cpus, [0, 1], 1 << 20, avoid=frozenset(pinned), pinned_by=pinned)
    held = {0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13}  # the cores of 2-5 and 8-9
    assert cell.host_cpus == [6, 14] and not held & set(cell.host_cpus + cell.emulator_cpus)
    assert cell.avoided == sorted(held) and cell.emulator_cpus == [7, 15] and cell.warnings == []
    assert cell.notes == ["node 0: vCPUs and emulator threads stayed off CPUs 0-5,8-13 (pinned by guest-a: 8-9, "
                          "guest-b: 4-5, guest-c: 2-3, and those cores' sibling threads)"]


def test_vcpu_cpuset_stands_in_for_missing_pins():
    """<vcpu cpuset> is where every thread without its own pin runs (qemuProcessSetupPid)."""
    only_default = domain("d", cpuset="0-3,^2")
    assert domain_pins(only_default) == {0, 1, 3}
    assert domain_pins(only_default, VCPU_PINS) == {0, 1, 3}
    all_pinned = domain("d", "<vcpupin vcpu='0' cpuset='8'/><vcpupin vcpu='1' cpuset='9'/>"
                             "<emulatorpin cpuset='10'/>", cpuset="0-3")
    assert domain_pins(all_pinned) == {8, 9, 10}  # nothing falls back to 0-3
    one_vcpu_free = domain("d", "<vcpupin vcpu='0' cpuset='8'/><emulatorpin cpuset='10'/>", cpuset="0-3")
    assert domain_pins(one_vcpu_free, VCPU_PINS) == {0, 1, 2, 3, 8}
    assert domain_pins(one_vcpu_free, frozenset({EMULATOR})) == {10}
    iothread = domain("d", "<vcpupin vcpu='0' cpuset='8'/><vcpupin vcpu='1' cpuset='9'/>"
                           "<emulatorpin cpuset='10'/><iothreadpin iothread='1' cpuset='11'/>",
                      cpuset="0-3", iothreads="<iothreads>2</iothreads>")
    assert domain_pins(iothread) == {0, 1, 2, 3, 8, 9, 10, 11}  # I/O thread 2 has no pin of its own
    assert domain_pins(iothread, VCPU_PINS) == {8, 9}
    assert domain_pins(domain("d", "<emulatorpin cpuset='4'/>")) == {4}
    assert ALL_PINS >= VCPU_PINS


def test_libvirt_cpuset_syntax():
    """src/util/virbitmap.c virBitmapParseSeparator: N, N-M, ^N, left to right."""
    assert parse_cpuset("0-7,^3") == {0, 1, 2, 4, 5, 6, 7}
    assert parse_cpuset("^3,0-4") == {0, 1, 2, 3, 4}  # an exclusion only removes what came before
    assert parse_cpuset(" 1 - 3 , 5") == {1, 2, 3, 5}
    assert parse_cpuset("8,") == {8}
    assert parse_cpuset("16383") == {16383}


@pytest.mark.parametrize("text", ["", " ", ",", "1-", "-1", "a", "1,,2", "3-1", "^1-3", "^ 1", "1 2", "0x1",
                                  "16384", "0-99999999", "\u0663", "1;2"])
def test_malformed_cpusets_are_refused(text):
    with pytest.raises(UnreadablePins):
        parse_cpuset(text)


def test_malformed_definition_is_a_typed_error_naming_the_domain():
    with pytest.raises(UnreadablePins, match="guest-x: vcpupin of vCPU 0: malformed cpuset '1-x'"):
        domain_pins(domain("d", "<vcpupin vcpu='0' cpuset='1-x'/>"), name="guest-x")
    with pytest.raises(UnreadablePins, match="guest-x: emulatorpin: empty cpuset"):
        domain_pins(domain("d", "<emulatorpin/>"), name="guest-x")
    with pytest.raises(UnreadablePins, match="guest-x: libvirt's definition is not XML"):
        domain_pins("<domain>", name="guest-x")
    with pytest.raises(UnreadablePins, match="not a count"):
        domain_pins(domain("d", vcpus="two", cpuset="1"), name="guest-x")


def test_a_closed_connection_is_a_libvirt_error(tmp_path):
    path = tmp_path / "testdriver.xml"
    path.write_text("<node>" + GUEST_A + "</node>")
    conn = open_connection(f"test://{path}")
    conn.close()
    with pytest.raises(LibvirtError, match="listing libvirt's domains"):
        read_all(conn)
