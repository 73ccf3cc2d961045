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


def test_owned_parts_come_from_the_models_declarations():
    """Each part a difference treats as gpuvfio's whole is a field declared owned in the model."""
    from gpuvfio.domain import device_elements as dev
    from gpuvfio.domain.elements import _KEY  # noqa: the declaration key, to list what is owned

    def owned(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls) if _KEY in f.metadata and f.metadata[_KEY].owned}

    assert owned(model.Domain) == {"memory_backing", "cputune", "numatune"}
    assert owned(dev.Devices) == {"hostdevs", "disks", "interfaces"}
    assert owned(model.Os) == {"firmware_features", "loader", "nvram", "kernel", "initrd", "cmdline"}
    assert owned(model.Cpu) == {"topology", "maxphysaddr", "numa"}
    assert owned(model.Features) == {"hyperv", "kvm"}


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
