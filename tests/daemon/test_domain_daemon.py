"""Daemon lane for domain XML: every golden domain defines in a real libvirtd's qemu driver;
passthrough cannot start on this machine (no VFIO), the same spec without hostdevs boots."""

from __future__ import annotations

import dataclasses
import glob
import os
import time
import xml.etree.ElementTree as ET

import pytest

from tests.lanes import daemon as dl
from tests.lanes import guest as gl

_REASON = dl.skip_reason() or gl.skip_reason()
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)

import libvirt  # noqa: E402

from gpuvfio.address import PciAddress  # noqa: E402
from gpuvfio.ops.inventory import open_host  # noqa: E402
from gpuvfio.domain.request import domain_request  # noqa: E402
from gpuvfio.domain.spec import build_spec  # noqa: E402
from gpuvfio.domain.render import domain_xml  # noqa: E402
from gpuvfio.host.inventory import read_inventory  # noqa: E402
from gpuvfio.host.numa import read_numa  # noqa: E402
from tests.make_samples import sample_path  # noqa: E402

libvirt.registerErrorHandler(lambda *a: None, None)
GOLDEN = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "domain", "*.xml")))


@pytest.fixture(scope="module")
def conn(daemon):
    connection = daemon.connect()
    try:
        yield connection
    finally:
        connection.close()


@pytest.mark.parametrize("path", GOLDEN, ids=[os.path.basename(p)[:-4] for p in GOLDEN])
def test_golden_defines_in_qemu_driver(conn, path):
    with open(path) as handle:
        xml = handle.read().replace("<name>", "<name>gpuvfio-", 1)
    dom = conn.defineXML(xml)
    try:
        assert dom.name().startswith("gpuvfio-")
        stored = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        assert stored.count("<hostdev ") == xml.count("<hostdev ")
        # What the schema allows and only the driver could refuse: switches, pxbs on cells, cliques.
        for model in ("pcie-switch-upstream-port", "pcie-switch-downstream-port", "pcie-expander-bus"):
            assert stored.count(f"model='{model}'") == xml.count(f"model='{model}'"), model
        assert stored.count("x-nv-gpudirect-clique") == xml.count("x-nv-gpudirect-clique")
        assert stored.count("<sibling ") == xml.count("<sibling ")
    finally:
        dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)


def _tcg_spec(image=None, firmware="bios"):
    with open_host(sample_path("dgx-h100")) as (host, _):
        options = domain_request("gpuvfio-tcg", vcpus=1, memory="256M", virt_type="qemu", firmware=firmware,
                                 numa="none", hugepages="none", kernel=image.kernel if image else None,
                                 initrd=image.initrd if image else None,
                                 cmdline=gl.KERNEL_CMDLINE if image else None)
        return build_spec(host, read_inventory(host), read_numa(host), [PciAddress.parse("0000:1b:00.0")],
                          options)


def test_passthrough_cannot_start_here(conn):
    dom = conn.defineXML(domain_xml(_tcg_spec()))
    try:
        with pytest.raises(libvirt.libvirtError) as info:
            dom.create()
        assert info.value.get_error_code() == libvirt.VIR_ERR_CONFIG_UNSUPPORTED
        assert "host doesn't support passthrough of host PCI devices" in info.value.get_error_message()
    finally:
        dom.undefine()


def test_same_spec_without_hostdevs_boots(conn):
    image = gl.build_guest()
    spec = _tcg_spec(image)
    spec.ports = []  # everything else as gpuvfio decided it
    spec.assignment = dataclasses.replace(spec.assignment, slots=())  # what the hostdevs are rendered from
    spec.address = None
    dom = conn.defineXML(domain_xml(spec))
    try:
        dom.create()
        time.sleep(1.0)
        state, _reason = dom.state()
        assert state == libvirt.VIR_DOMAIN_RUNNING
        dom.destroy()
    finally:
        dom.undefine()


def test_uefi_chosen_by_libvirt_boots_and_stays_gpuvfios(conn):
    """<os firmware='efi'> with secure boot off: this libvirtd picks the firmware from QEMU's
    descriptors and QEMU starts with it; the loader and nvram it filled in are libvirt's, so a
    second define of the same spec is no difference."""
    from gpuvfio.virt.define import difference

    image = gl.build_guest()
    spec = _tcg_spec(image, firmware="efi")
    spec.ports = []
    spec.assignment = dataclasses.replace(spec.assignment, slots=())
    spec.address = None
    assert spec.firmware_auto and spec.loader is None
    xml = domain_xml(spec)
    dom = conn.defineXML(xml)
    try:
        dom.create()
        time.sleep(1.0)
        assert dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING
        live = ET.fromstring(dom.XMLDesc(0))
        loader = live.findtext("os/loader") or ""
        assert loader.endswith(".fd") and "secboot" not in loader.lower(), loader  # a non-secure-boot image
        assert live.find("os/nvram") is not None  # libvirt made the guest its own variables store
        dom.destroy()
        assert difference(xml, dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)) == []
    finally:
        dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)


def test_define_is_idempotent_in_the_real_driver(conn, cli):
    """--define: defined, then unchanged; a changed request shows the difference and changes
    nothing until --update."""
    uri = conn.getURI()
    base = ["--root", sample_path("epyc-mixed"), "xml", "0000:81:00.0", "--name", "gpuvfio-idem", "--vcpus", "8",
            "--memory", "16G", "--firmware", "bios", "--virt-type", "qemu", "--define", "--connect", uri, "--json"]
    try:
        out = cli(*base).json()
        assert out["define"]["result"] == "defined"
        # QEMU's version comes from the connection: no row stays unknown.
        assert [row["feature"] for row in out["versions"] if row["status"] == "unknown"] == []
        assert any(row["have"].startswith("QEMU ") for row in out["versions"])
        assert cli(*base).json()["define"]["result"] == "unchanged"
        changed = [a if a != "8" else "4" for a in base]
        result = cli(*changed)
        assert result.code == 1  # a define that was not done: the difference is shown, nothing changes
        differs = result.json()["define"]
        assert differs["result"] == "differs" and any("vcpu" in line for line in differs["changes"])
        stored = conn.lookupByName("gpuvfio-idem").XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        assert "<vcpu placement='static'>8</vcpu>" in stored  # nothing changed yet
        uuid = conn.lookupByName("gpuvfio-idem").UUIDString()
        assert cli(*changed, "--update").json()["define"]["result"] == "updated"
        dom = conn.lookupByName("gpuvfio-idem")
        assert "<vcpu placement='static'>4</vcpu>" in dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        assert dom.UUIDString() == uuid  # redefined under the same identity
    finally:
        try:
            conn.lookupByName("gpuvfio-idem").undefine()
        except libvirt.libvirtError:
            pass


def test_define_sees_what_others_added_to_gpuvfios_parts(conn, cli):
    """On main an extra GPU (added with virsh edit), hugepages, or a device moved to another guest
    bus compared as "unchanged": only additions were looked for."""
    uri = conn.getURI()
    base = ["--root", sample_path("epyc-mixed"), "xml", "0000:81:00.0", "--name", "gpuvfio-owned", "--vcpus", "8",
            "--memory", "16G", "--hugepages", "none", "--firmware", "bios", "--virt-type", "qemu", "--define",
            "--connect", uri, "--json"]
    extra_gpu = ("<hostdev mode='subsystem' type='pci' managed='no'><source><address domain='0x0000' bus='0xc1' "
                 "slot='0x00' function='0x0'/></source></hostdev>")
    try:
        assert cli(*base).json()["define"]["result"] == "defined"
        stored = conn.lookupByName("gpuvfio-owned").XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        for edited, fragment in (
                (stored.replace("</devices>", extra_gpu + "</devices>"), "- /devices/hostdev"),
                (stored.replace("<vcpu", "<memoryBacking><hugepages/></memoryBacking><vcpu", 1),
                 "- /memoryBacking"),
                (stored.replace("type='pci' domain='0x0000' bus='0x01' slot='0x00'",
                                "type='pci' domain='0x0000' bus='0x00' slot='0x1e'", 1), "+ /devices/hostdev")):
            assert edited != stored
            conn.defineXML(edited)
            result = cli(*base)
            assert result.code == 1, (fragment, result.err)
            changes = result.json()["define"]["changes"]
            assert any(line.startswith(fragment) for line in changes), (fragment, changes)
            conn.defineXML(stored)
            assert cli(*base).json()["define"]["result"] == "unchanged"
    finally:
        try:
            conn.lookupByName("gpuvfio-owned").undefine()
        except libvirt.libvirtError:
            pass


def test_the_cliques_gpuvfio_gave_are_read_back_from_the_real_driver(conn, cli):
    """verify on a running gpuvfio guest checks its peer matrix against the P2P cliques of its
    definition: the qemu driver keeps <qemu:override> and the hostdevs' user aliases, and gpuvfio
    reads the clique of each host GPU back from them (as attach has them from its plan)."""
    from gpuvfio.guest.expect import Expected
    from gpuvfio.ops.guests import with_cliques
    from gpuvfio.virt.lifecycle import recorded

    uri = conn.getURI()
    args = ["--root", sample_path("pcie-switch"), "xml", "0000:18:00.0", "0000:19:00.0", "--name", "gpuvfio-p2p",
            "--memory", "4G", "--hugepages", "none", "--firmware", "bios", "--virt-type", "qemu", "--define",
            "--qemu-version", "9.2", "--connect", uri, "--json"]  # cliques need QEMU 8.1; this machine's is older
    try:
        result = cli(*args)
        assert result.code == 0 and result.json()["define"]["result"] == "defined", result.err
        _devices, cliques = recorded(conn.lookupByName("gpuvfio-p2p"))
        assert cliques == {PciAddress.parse("0000:18:00.0"): 0, PciAddress.parse("0000:19:00.0"): 0}
        gpu = Expected("0000:18:00.0", "10de", "26b9", "030200", 4, 16)
        audio = Expected("0000:18:00.1", "10de", "22ba", "040300", 4, 16)
        other = Expected("0000:9a:00.0", "10de", "26b9", "030200", 4, 16)
        assert [e.clique for e in with_cliques([gpu, audio, other], cliques)] == [0, None, None]
    finally:
        try:
            conn.lookupByName("gpuvfio-p2p").undefine()
        except libvirt.libvirtError:
            pass
