"""NCCL's reader of topology XML (issue 37 item 1), held to NCCL's own rules, and the verifier's
reading of NCCL's dump with it.

gpuvfio_ncclxml follows NCCL v2.30.7-1 (commit 73cf1122) src/graph/xml.cc xmlGetValue,
xmlGetToken, xmlSkipComment, xmlGetNode and xmlLoadSub; each case below is one of their rules.
The dumps are written here as ncclTopoDumpXmlRec writes them (the same file and version).
"""

from __future__ import annotations

import os
import re

import pytest

from gpuvfio.domain.request import domain_request
from gpuvfio.guest.payload.gpuvfio_ncclxml import Node, XmlError, load_topology
from gpuvfio.host.fixture import open_host
from gpuvfio.host.inventory import read_inventory
from gpuvfio.ops.context import Context
from gpuvfio.ops.domains import nccl_topology_file, provision_xml
from tests.make_samples import sample_path
from tests.unit.test_verifier_fakecuda import the_program


def pcis(text: str) -> list[tuple]:
    """The attributes of each <pci> NCCL keeps, depth first."""
    out = []

    def walk(node):
        for sub in node.subs:
            if sub.name == "pci":
                out.append(tuple(sub.attrs))
            walk(sub)
    for system in load_topology(text):
        walk(system)
    return out


def wrap(inner: str) -> str:
    return f'<system version="1">\n  <cpu numaid="0">\n    {inner}\n  </cpu>\n</system>\n'


# -- xmlGetNode and xmlGetToken: one ' ' starts an attribute, whatever follows it ----------------

@pytest.mark.parametrize("tag, attrs", [
    ('<pci a="1" />', (("a", "1"), ("", ""))),  # the form gpuvfio wrote before: a key ending at '/'
    ('<pci a="1"/>', (("a", "1"),)),
    ('<pci a="1"  b="2"/>', (("a", "1"), ("", ""), ("b", "2"))),  # the second space: another key
    ('<pci a="1" ></pci>', (("a", "1"), ("", ""))),  # a key ending at '>'
    ('<pci a="x &amp; <y>"/>', (("a", "x &amp; <y>"),)),  # raw up to the quote: no entities
    ("<pci a='1' b=\"'\"/>", (("a", "1"), ("b", "'"))),  # either quote, up to the same one
    ('<pci a="1" b/>', (("a", "1"), ("b", ""))),  # a key without '=' has an empty value
    ('<pci a="1"/junk>', (("a", "1"),)),  # after '/', a token up to '>' is read and dropped
])
def test_attributes_are_tokens_split_at_each_space(tag, attrs):
    assert pcis(wrap(tag)) == [attrs]


@pytest.mark.parametrize("text, why", [
    ('<?xml version="1.0"?>\n' + wrap("<pci/>"), "expected >, got '?'"),  # the declaration
    (wrap("<pci/>").replace("  <cpu", "\t<cpu"), "expecting '<', got '\t'"),  # a tab between tags
    (wrap('<pci\n a="1"/>'), "expected >, got '\n'"),  # a newline inside a tag
    (wrap('<pci a="1"\n/>'), "expected >, got '\n'"),
    (wrap("<pci a=1/>"), "Expected (double) quote."),  # INT_OK is never defined
    (wrap('<pci a="1"/ >'), "expected >, got ' '"),
    (wrap('<pci a="1"/b="2">'), "Unexpected value with name b"),
    (wrap("<pci></pci >"), "unexpected trailing   in closing tag pci"),
    (wrap("<pci></gpu>"), "XML Mismatch : pci / gpu"),
    ('<system version="1"><cpu>', "unterminated cpu"),
    ('<system version="1"><cpu a="1', "Unexpected EOF"),
    ("<!-- open", "unterminated comment"),
    ("text", "expecting '<', got 't'"),
    ("<system/>", "Attribute version of node system not found"),
    ('<system version="2"/>', "wrong version 2, 1 needed"),
    ("</system>", "Attribute version of node system not found"),  # at the top a closing tag is a node
])
def test_what_nccl_refuses(text, why):
    with pytest.raises(XmlError, match=re.escape(why)):
        load_topology(text)


def test_the_version_is_read_as_strtol_reads_it():
    for version in ("1", "01", "0x1", " 1.0", "+1", "4294967297"):
        assert [s.name for s in load_topology(f'<system version="{version}"/>')] == ["system"]
    for version in ("08", "-1", "0x", "99999999999999999999"):  # "08" is octal 0; overflow is LONG_MAX
        with pytest.raises(XmlError, match="wrong version"):
            load_topology(f'<system version="{version}"/>')


# -- the limits of src/graph/xml.h and topo.h ------------------------------------------------------

def test_names_and_values_fit_in_nccls_buffers():
    assert pcis(wrap(f'<pci {"k" * 254}="{"v" * 253}"/>')) == [(("k" * 254, "v" * 253),)]  # '=' is not stored
    for tag in (f'<pci a="{"v" * 254}"/>', f'<pci {"k" * 255}="1"/>', f'<{"p" * 254}/>', f'<pci {"k" * 254}/>'):
        with pytest.raises(XmlError, match="too long"):
            load_topology(wrap(tag))
    assert pcis(wrap(f'<{"p" * 253}/>')) == []  # read, and skipped: no handler has the name


def test_attributes_past_the_sixteenth_are_read_and_dropped():
    attrs = " ".join(f'k{i}="{i}"' for i in range(20))
    assert pcis(wrap(f"<pci {attrs}/>")) == [tuple((f"k{i}", str(i)) for i in range(16))]


def test_nodes_and_subnodes_are_bounded():
    text = wrap("<pci/>")  # system, cpu, pci: the check before reading </cpu> finds 3 nodes
    assert len(pcis(text)) == 1 and load_topology(text, max_nodes=4)
    with pytest.raises(XmlError, match="limited to 3 nodes"):
        load_topology(text, max_nodes=3)
    with pytest.raises(XmlError, match="limited to 640 subnodes"):
        load_topology(wrap("<pci/>" * 641), max_nodes=1000)
    with pytest.raises(XmlError, match="limited to 256 nodes"):
        load_topology(wrap("<pci/>" * 254))


# -- comments and the elements NCCL has no handler for ---------------------------------------------

def test_comments_and_unknown_elements_are_skipped():
    text = wrap('<!-- a comment --><!----><pci a="1"><gpu dev="0"><nvlink count="2"/><x/></gpu>'
                '<foo><bar></baz><qux/></zzz></pci><gpu dev="9"/>')
    (system,) = load_topology(text)
    (cpu,) = system.subs
    (pci,) = cpu.subs  # a <gpu> right under a <cpu> is no node of NCCL's
    assert pci.tree() == ("pci", (("a", "1"),), (("gpu", (("dev", "0"),), (("nvlink", (("count", "2"),), ()),)),))
    assert pci.parent is cpu and cpu.parent is system and system.parent is None
    assert load_topology("<other/>\n<other></x>\n") == []  # at the top only <system> is kept


# -- the verifier reads NCCL's dump with the same rules ---------------------------------------------

def nccl_dump(node, indent: int = 0) -> str:
    """src/graph/xml.cc ncclTopoDumpXmlRec (v2.30.7-1): indent spaces, '<name', ' key="value"' for
    each attribute as it is (an empty key too), then '/>' without subnodes, else '>', the
    subnodes two spaces deeper and '</name>'; a newline after each."""
    head = " " * indent + "<" + node.name + "".join(f' {k}="{v}"' for k, v in node.attrs)
    if not node.subs:
        return head + "/>\n"
    return head + ">\n" + "".join(nccl_dump(s, indent + 2) for s in node.subs) + " " * indent + f"</{node.name}>\n"


def detected(text: str) -> str:
    """NCCL's dump after it loaded ``text``: what it read, a <gpu> added under each GPU's <pci>
    (ncclTopoFillGpu's xmlAddNode, as the last subnode), then ncclTopoDumpXmlToFile."""
    (system,) = load_topology(text)

    def add_gpus(node, rank=[0]):
        for sub in node.subs:
            add_gpus(sub)
            if sub.name == "pci" and (sub.get("class") or "").startswith("0x03"):
                gpu = Node()
                gpu.name, gpu.attrs = "gpu", [("dev", str(rank[0])), ("sm", "90"), ("rank", str(rank[0])), ("gdr", "1")]
                sub.subs.append(gpu)
                rank[0] += 1
    add_gpus(system)
    return nccl_dump(system)


def sample_file(name: str) -> str:
    """The file gpuvfio writes for a guest with every GPU and NIC of sample host ``name``."""
    with open_host(sample_path(name)) as (host, _label):
        ctx = Context(host=host)
        addresses = [fn.address for fn in read_inventory(host).functions.values()
                     if fn.class_id.startswith(("02", "03")) and fn.address.function == 0 and fn.physfn is None]
        return nccl_topology_file(ctx, provision_xml(ctx, addresses, domain_request(
            "nccl", vcpus=8, memory="16G", qemu_version="8.2", topology="mirror")))


@pytest.mark.parametrize("sample", ["pcie-switch", "dgx-h100"])
@pytest.mark.parametrize("spaced", [False, True], ids=["as written", "space before slash"])
def test_the_verifier_finds_every_gpu_of_the_file_in_nccls_dump(sample, spaced, monkeypatch):
    """The dump of a file NCCL loaded, written as NCCL writes dumps. A file with a space before
    "/>" (gpuvfio's before) leaves ' =""' on each of its leaf lines: the GPUs are still there,
    and the verifier, reading as NCCL does, finds them and their links."""
    gpu_links = the_program(monkeypatch).gpu_links
    text = sample_file(sample)
    if spaced:
        text = text.replace('"/>', '" />')
    dump = detected(text)
    assert (' =""' in dump) is spaced
    gpus = gpu_links(dump)
    assert gpus and gpus == gpu_links(text)
    assert gpus == {a["busid"]: {"link_speed": a.get("link_speed"), "link_width": a.get("link_width")}
                    for a in map(dict, pcis(text)) if a["class"].startswith("0x03")}


def test_a_file_or_dump_nccl_would_refuse_is_a_problem_of_the_view(monkeypatch, tmp_path):
    program = the_program(monkeypatch)
    for name in ("NCCL_TOPO_FILE", "NCCL_TOPO_DUMP_FILE", "NCCL_TOPO_DUMP_FILE_RANK"):
        monkeypatch.setenv(name, "")  # the view sets them: put back after the test
    topo = tmp_path / "topo.xml"
    topo.write_text('<system version="1">\n\t<cpu numaid="0"/>\n</system>\n')
    view = program.TopologyView(type("Opts", (), {"nccl_topo_file": str(topo), "root": str(tmp_path)})())
    try:
        with open(view.dump, "w") as handle:
            handle.write('<?xml version="1.0"?>\n<system version="1"/>\n')
        report = view.report()
    finally:
        view.close()
    assert report["planned"] is None and report["nccl"] is None
    assert report["error"] == ("the topology file could not be read: XML Parse error : expecting '<', got '\t'; "
                               "NCCL's topology dump could not be read: XML Parse : expected >, got '?'")
    assert not os.path.exists(view.directory)


def test_nesting_is_bounded_before_pythons_own_limit():
    """NCCL recurses once per element with no limit; the reader refuses past MAX_DEPTH (a
    RecursionError would lose the whole verifier stage)."""
    from gpuvfio.guest.payload.gpuvfio_ncclxml import MAX_DEPTH

    deep = '<system version="1">' + "<x>" * 3000 + "</x>" * 3000 + "</system>"
    with pytest.raises(XmlError, match=f"nested deeper than {MAX_DEPTH}"):
        load_topology(deep)
    fine = '<system version="1">' + "<x>" * 150 + "</x>" * 150 + "</system>"
    assert load_topology(fine)[0].name == "system"
