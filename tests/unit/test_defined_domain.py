"""One reader of a defined domain (gpuvfio.virt.defined, issue 23 item 5): every golden domain
gpuvfio writes, read back, agrees with an independent reading (lxml XPath over the same file)
on what verify, usage, detach, pins and the testbed ask of it; hostile definitions give one
error or no value, never a traceback or an endless count."""

from __future__ import annotations

import os

import pytest
from lxml import etree

from gpuvfio.address import PciAddress
from gpuvfio.virt.defined import UnreadableDomain, read_defined

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "domain")
FILES = sorted(f for f in os.listdir(GOLDEN) if f.endswith(".xml"))
# gpuvfio's metadata namespace, written out here rather than imported: an independent reading.
NS = {"m": "https://gpuvfio.invalid/xmlns/domain/1", "q": "http://libvirt.org/schemas/domain/qemu/1.0"}


def _hex(text: str | None) -> int:
    return int(text or "0", 16)


@pytest.mark.parametrize("name", FILES)
def test_each_golden_domain_reads_back_as_lxml_reads_it(name):
    with open(os.path.join(GOLDEN, name), encoding="utf-8") as handle:
        xml = handle.read()
    doc = etree.fromstring(xml.encode())
    domain = read_defined(xml)
    assert domain.name == doc.findtext("name") and domain.by_gpuvfio
    sources = doc.xpath("//devices/hostdev[@type='pci']/source/address")
    assert domain.hostdevs == {PciAddress(_hex(a.get("domain")), _hex(a.get("bus")), _hex(a.get("slot")),
                                          _hex(a.get("function"))) for a in sources}
    assert domain.mdevs == set(doc.xpath("//devices/hostdev[@type='mdev']/source/address/@uuid"))
    assert {str(a) for a in domain.recorded} == set(doc.xpath("//m:device/@address", namespaces=NS))
    assert domain.recorded or domain.mdevs  # whole functions are recorded; a vGPU is its mdev
    cliques = doc.xpath("//q:property[@name='x-nv-gpudirect-clique']/@value", namespaces=NS)
    assert sorted(domain.cliques.values()) == sorted(int(v) for v in cliques)
    assert domain.vcpus == int(doc.findtext("vcpu")) and domain.memory_kib == int(doc.findtext("memory"))
    page = doc.find("memoryBacking/hugepages/page")
    assert domain.hugepage_kib == (int(page.get("size")) if page is not None else None)
    assert domain.machine == doc.find("os/type").get("machine")
    pins = {c for p in doc.xpath("//cputune/vcpupin/@cpuset") for c in p.split(",")}
    assert set((domain.vcpu_pins or "").split(",")) - {""} == pins


def test_a_definition_that_is_not_xml_is_one_error():
    with pytest.raises(UnreadableDomain, match="not XML"):
        read_defined("<domain><name>x</name>")


@pytest.mark.parametrize("hostile", [
    "<domain><name>h</name><vcpu>99999999999999999999999</vcpu><memory>-5</memory></domain>",
    "<domain><name>h</name><vcpu> 4</vcpu><memory>NaN</memory><memoryBacking><hugepages><page size='x'/>"
    "</hugepages></memoryBacking></domain>",
    "<domain><name>h</name><devices><hostdev type='pci'><source><address bus='zz' slot='1' function='9'/>"
    "</source></hostdev></devices></domain>",
    "<domain><name>h</name><cputune><vcpupin vcpu='0' cpuset='a-b,,'/></cputune></domain>",
])
def test_hostile_definitions_give_no_value_not_a_traceback(hostile):
    domain = read_defined(hostile)
    assert domain.name == "h" and domain.vcpus == 0 and domain.hostdevs == frozenset()
    assert domain.memory_kib == 0 and domain.hugepage_kib is None and not domain.by_gpuvfio
