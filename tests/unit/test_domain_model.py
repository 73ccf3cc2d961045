"""One domain model (issue 36 item 2): gpuvfio.domain.model formats the documents gpuvfio
defines, reads libvirt's definitions back, and says what a difference compares; what gpuvfio
owns is declared there, not listed beside it."""

from __future__ import annotations

import dataclasses
import os
import xml.etree.ElementTree as ET

import pytest

from gpuvfio.domain import model
from gpuvfio.domain.elements import DOCUMENT_LIMIT, UnreadableXml
from gpuvfio.virt.define import difference
from gpuvfio.virt.defined import UnreadableDomain, read_defined

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "domain")
FILES = sorted(f for f in os.listdir(GOLDEN) if f.endswith(".xml"))


def _golden(name: str) -> str:
    with open(os.path.join(GOLDEN, name), encoding="utf-8") as handle:
        return handle.read()


@pytest.mark.parametrize("name", FILES)
def test_each_golden_domain_reads_into_the_model_and_writes_back_byte_for_byte(name):
    """The reader and the writer are one declaration: nothing gpuvfio writes is lost reading it."""
    xml = _golden(name)
    assert model.write_domain(model.read_domain(xml)) == xml


def test_values_that_need_escaping_survive_the_round_trip():
    """Quotes, ampersands and angle brackets in a path are escaped as jinja2's autoescape did
    (markupsafe's entities), and read back as they were."""
    base = model.read_domain(_golden("dgx-tcg-bios.xml"))
    odd = "/srv/a'b\"c&d<e>f.img"
    disks = (dataclasses.replace(base.devices.disks[0], source=dataclasses.replace(
        base.devices.disks[0].source, file=odd)),) if base.devices.disks else ()
    edited = dataclasses.replace(base, name="x&y", devices=dataclasses.replace(base.devices, disks=disks))
    text = model.write_domain(edited)
    assert "x&amp;y" in text and ET.fromstring(text).findtext("name") == "x&y"
    again = model.read_domain(text)
    assert again == edited
    if disks:
        assert "a&#39;b&#34;c&amp;d&lt;e&gt;f.img" in text


def _stored(name: str = "dgx-1gpu-local.xml") -> str:
    """A golden domain as libvirt stores it: a UUID, a controller and an input device of its own."""
    xml = _golden(name)
    return (xml.replace("</name>", "</name>\n  <uuid>4b1c9d0e-0000-4000-8000-000000000001</uuid>", 1)
            .replace("<memballoon", "<controller type='usb' index='0' model='none'/>\n    <input type='mouse' "
                     "bus='ps2'/>\n    <memballoon", 1))


def test_what_libvirt_adds_outside_gpuvfios_parts_is_no_difference():
    xml = _golden("dgx-1gpu-local.xml")
    assert difference(xml, _stored()) == []


@pytest.mark.parametrize("edit, line", [
    # a part the model declares owned whole: anything else in it is a difference
    (("</cputune>", "  <period>100000</period>\n  </cputune>"), "- " + "/".join(("", "cputune", "period=100000"))),
    (("</numatune>", "  <memnode cellid='1' mode='strict' nodeset='0'/>\n  </numatune>"),
     "- " + "/".join(("", "numatune", "memnode"))),
    # an attribute of a part compared part by part (on main container attributes were not compared)
    (("mode='host-passthrough'", "mode='host-model'"), "+ /cpu[mode=host-passthrough]"),
    (("<on_crash>destroy</on_crash>", "<on_crash>restart</on_crash>"), "+ /on_crash=destroy"),
])
def test_what_others_change_in_gpuvfios_parts_differs(edit, line):
    xml = _golden("dgx-1gpu-local.xml")
    assert edit[0] in xml
    changes = difference(xml, _stored().replace(*edit, 1))
    assert any(change.startswith(line) for change in changes), changes


def test_the_loader_and_nvram_are_libvirts_under_firmware_auto_selection():
    """<os firmware='efi'>: libvirt fills in the loader and nvram it chose, which is no difference;
    without auto-selection <os> is gpuvfio's whole, and the same two are extras."""
    filled = ("</os>", "  <loader readonly='yes' type='pflash'>/usr/share/OVMF/OVMF_CODE.fd</loader>\n"
              "    <nvram template='/usr/share/OVMF/OVMF_VARS.fd'>/var/lib/libvirt/qemu/nvram/g_VARS.fd</nvram>\n"
              "  </os>")
    auto = _golden("dgx-1gpu-local.xml")
    assert "<os firmware='efi'>" in auto
    assert difference(auto, auto.replace(*filled, 1)) == []
    plain = _golden("dgx-1gpu-remote-numa.xml")
    assert "<os>" in plain
    changes = difference(plain, plain.replace(*filled, 1))
    assert [c.split("[")[0] for c in changes] == ["- " + "/".join(("", "os", part)) for part in ("loader", "nvram")]


def test_owned_parts_come_from_the_models_declarations():
    """Each part a difference treats as gpuvfio's whole is a field declared owned in the model."""
    from gpuvfio.domain import device_elements as dev
    from gpuvfio.domain.elements import owned_fields

    assert set(owned_fields(model.Domain)) == {"memory_backing", "cputune", "numatune"}
    assert set(owned_fields(dev.Devices)) == {"hostdevs", "disks", "interfaces"}
    assert set(owned_fields(model.Cpu)) == {"topology", "maxphysaddr", "numa"}
    assert set(owned_fields(model.Features)) == {"hyperv", "kvm"}
    assert set(owned_fields(model.Cputune)) == {"vcpupins", "emulatorpin", "iothreadpins", "rest"}
    # With <os firmware> set, libvirt chooses the loader and nvram: they are owned unless it is.
    assert dict(owned_fields(model.Os)) == {"firmware_features": None, "loader": "firmware", "nvram": "firmware",
                                            "kernel": None, "initrd": None, "cmdline": None}
    assert set(owned_fields(model.Record)) == set()


def test_each_owned_unless_names_a_field_of_its_own_element():
    from gpuvfio.domain import device_elements as dev
    from gpuvfio.domain.elements import Element, owned_fields

    classes = [c for m in (model, dev) for c in vars(m).values()
               if isinstance(c, type) and issubclass(c, Element) and c is not Element]
    conditions = {(c.__name__, unless) for c in classes for unless in owned_fields(c).values() if unless}
    assert conditions == {("Os", "firmware")}
    assert all(unless in {f.name for f in dataclasses.fields(c)}
               for c in classes for unless in owned_fields(c).values() if unless)


def test_a_definition_over_the_limit_is_one_error_not_a_parse():
    huge = "<domain><name>h</name><description>" + "x" * DOCUMENT_LIMIT + "</description></domain>"
    with pytest.raises(UnreadableXml, match="at most"):
        model.read_domain(huge)
    with pytest.raises(UnreadableDomain):
        read_defined(huge)


def test_hostile_nesting_and_entities_are_bounded():
    deep = "<domain><name>h</name><cputune>" + "<x>" * 5000 + "</x>" * 5000 + "</cputune></domain>"
    domain = model.read_domain(deep)
    assert domain.name == "h" and len(domain.cputune.rest) == 1  # kept, cut below a few levels
    laughs = ("<?xml version='1.0'?><!DOCTYPE d [<!ENTITY a 'aaaaaaaaaa'>" +
              "".join(f"<!ENTITY {chr(98 + i)} '{('&' + chr(97 + i) + ';') * 10}'>" for i in range(8)) +
              "]><domain><name>&i;</name></domain>")
    with pytest.raises(UnreadableDomain):
        read_defined(laughs)


def test_another_element_is_not_read_as_a_domain():
    with pytest.raises(UnreadableXml, match="not <domain>"):
        model.read_domain("<network><name>default</name></network>")


def test_a_document_type_is_refused_before_its_entities_expand():
    """An internal entity can hold elements: 3 MB of definition expanded to 8 million <vcpupin>
    (31 s, 2 GB) under expat's amplification guard. libvirt writes no DOCTYPE."""
    entity = "<!DOCTYPE domain [<!ENTITY v \"" + "<vcpupin vcpu='0' cpuset='1'/>" * 10 + "\">]>"
    xml = entity + "<domain><name>h</name><cputune>" + "&v;" * 10 + "</cputune></domain>"
    with pytest.raises(UnreadableXml, match="DOCTYPE"):
        model.read_domain(xml)
    with pytest.raises(UnreadableDomain):
        read_defined(xml)


def test_an_element_with_more_children_than_libvirt_writes_is_refused():
    """More children than libvirt writes for one element is no definition of its own; one-to-one
    matching of so many was quadratic (5,000 hostdevs against 5,000 others took minutes)."""
    from gpuvfio.domain.elements import CHILDREN_LIMIT

    pins = "".join(f"<vcpupin vcpu='{n}' cpuset='1'/>" for n in range(CHILDREN_LIMIT + 1))
    with pytest.raises(UnreadableXml, match="children"):
        model.read_domain(f"<domain><name>h</name><cputune>{pins}</cputune></domain>")
    just = "".join(f"<vcpupin vcpu='{n}' cpuset='1'/>" for n in range(CHILDREN_LIMIT))
    assert len(model.read_domain(f"<domain><name>h</name><cputune>{just}</cputune></domain>").cputune.vcpupins) \
        == CHILDREN_LIMIT


def test_pairing_takes_for_each_the_first_left_that_holds_its_values():
    """pair() matches each of ours, in order, to the first of theirs not yet taken that holds every
    value it sets: reversed lists pair whole, all-different ones not at all, leftovers keep order."""
    from gpuvfio.domain import device_elements as dev
    from gpuvfio.domain.elements import CHILDREN_LIMIT, Foreign, pair

    pins = [model.Vcpupin(str(n), str(n % 64)) for n in range(CHILDREN_LIMIT)]
    assert pair(pins, pins[::-1]) == ([], [])
    others = [model.Vcpupin(str(n + CHILDREN_LIMIT), "1") for n in range(CHILDREN_LIMIT)]
    assert pair(pins, others) == (pins, others)
    assert pair(pins, others[:3] + pins[::-1] + others[3:5]) == ([], others[:5])
    kept = [Foreign("x", (("n", str(n)),)) for n in range(CHILDREN_LIMIT)]
    assert pair(kept, kept[::-1]) == ([], [])
    assert pair(kept, [Foreign("y")] + kept[:-1]) == ([kept[-1]], [Foreign("y")])
    # Host devices that differ only in their source address; libvirt adds a guest address.
    def hostdev(n, guest=None):
        source = dev.Source(address=dev.Address(domain=0, bus=n >> 5, slot=n & 31, function=0))
        return dev.Hostdev("subsystem", "pci", "yes", source=source, address=guest)

    wanted = [hostdev(n) for n in range(512)]
    held = [hostdev(n, dev.Address("pci", 0, 1 + (n >> 5), n & 31, 0)) for n in range(512)]
    assert pair(wanted, held[::-1]) == ([], [])
    assert pair(wanted[::-1], held[1:]) == ([wanted[0]], [])
    assert pair(held, wanted) == (held, wanted)  # a guest address gpuvfio sets is one to hold
    # First come, first served: a pin that leaves cpuset to libvirt takes the first vCPU 0 left,
    # even the one a later pin needs.
    loose, exact, other = model.Vcpupin("0"), model.Vcpupin("0", "3"), model.Vcpupin("0", "1")
    assert pair([loose, exact], [other, exact]) == ([], [])
    assert pair([loose, exact], [exact, other]) == ([exact], [other])
    # A codec's own comparison (libvirt's versioned machine for q35) still decides a match.
    q35, i440fx = model.OsType(machine="q35"), model.OsType(machine="pc-i440fx-7.2")
    assert pair([q35], [i440fx, model.OsType("x86_64", "pc-q35-7.2", "hvm")]) == ([], [i440fx])


def test_pairing_is_the_greedy_first_match_on_mixed_lists():
    """Against the plain greedy scan, on seeded random lists of elements that set some of their
    values, flags and child elements, with a codec's own comparison and kept foreign children."""
    import random

    from gpuvfio.domain import device_elements as dev
    from gpuvfio.domain.elements import Foreign, matches, pair

    def greedy(ours, theirs):
        left, missing = list(theirs), []
        for item in ours:
            found = next((t for t in left if matches(item, t)), None)
            if found is None:
                missing.append(item)
            else:
                left.remove(found)
        return missing, left

    rng = random.Random(36)

    def some(values):
        return rng.choice([None, *values])

    makers = [lambda: model.Vcpupin(some("012"), some("12")),
              lambda: model.OsType(some(["x86_64"]), some(["q35", "pc-q35-7.2", "pc-i440fx-7.2"])),
              lambda: model.Features(acpi=rng.random() < .5, ioapic=rng.choice([None, model.Ioapic("kvm")])),
              lambda: model.Hugepages(tuple(model.Page(some([1, 2])) for _ in range(rng.randrange(3)))),
              lambda: model.FirmwareFeature(some([True, False]), some(["secure-boot"])),
              lambda: dev.Hostdev(some(["subsystem"]), "pci", source=some([dev.Source(file="f"), dev.Source(
                  address=dev.Address(domain=some([0]), bus=rng.choice([1, 2]), function=some([0, 1])))])),
              lambda: dev.Disk(some(["file"]), readonly=rng.random() < .5, source=some([dev.Source(file="a")])),
              lambda: Foreign(rng.choice("ab"), (("n", rng.choice("12")),) if rng.random() < .5 else ())]
    for _ in range(2000):
        ours = [rng.choice(makers)() for _ in range(rng.randrange(7))]
        theirs = rng.choice([ours[::-1], ours, []]) + [rng.choice(makers)() for _ in range(rng.randrange(7))]
        if rng.random() < .3:
            rng.shuffle(theirs)
        assert pair(ours, theirs) == greedy(ours, theirs), (ours, theirs)


@pytest.mark.parametrize("value", ["/srv/evil\tname.qcow2", "/var/log/a\rb.log", "console=ttyS0\rinit=/bin/sh",
                                   "a\nb", "  lead and trail  "])
def test_whitespace_is_written_so_that_libvirt_reads_the_value_gpuvfio_wrote(value):
    """XML readers turn a CR into a newline and a tab or newline in an attribute into a space
    (XML 1.0 2.11, 3.3.3): unescaped, libvirt would define another file or command line."""
    from lxml import etree

    from gpuvfio.domain import device_elements as dev

    disk = dev.Disk("file", "disk", source=dev.Source(file=value))
    domain = model.Domain(type="kvm", name="n", os=model.Os(cmdline=value),
                          devices=dev.Devices(disks=(disk,)))
    text = model.write_domain(domain)
    libxml2 = etree.fromstring(text.encode())  # libvirt's own parser
    assert libxml2.find("devices/disk/source").get("file") == value
    assert libxml2.findtext("os/cmdline") == value
    again = model.read_domain(text)
    assert again.devices.disks[0].source.file == value and again.os.cmdline == value


def test_numbers_in_cpusets_and_forwards_are_bounded_ascii():
    """A 5,000-digit cpuset or port was a ValueError traceback (int() refuses over 4,300 digits);
    an Arabic-Indic port was read as 2222."""
    from gpuvfio.virt.pins import UnreadablePins, domain_pins

    for cpuset in ("0" * 5000, "0-" + "9" * 5000):
        with pytest.raises(UnreadablePins):
            domain_pins(f"<domain><name>h</name><vcpu>1</vcpu><cputune><vcpupin vcpu='0' cpuset='{cpuset}'/>"
                        "</cputune></domain>")
    for port in ("1" * 5000, "\u0662\u0662\u0662\u0662"):
        xml = (f"<domain xmlns:qemu='{model.QEMU_NS}'><name>h</name><qemu:commandline><qemu:arg "
               f"value='user,hostfwd=tcp::{port}-:22'/></qemu:commandline></domain>")
        assert read_defined(xml).ssh is None
