"""Which libvirt domains use a device: against libvirt's real test driver (test:///)."""

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.virt.connection import open_connection
from gpuvfio.virt.defined import read_all, read_defined
from gpuvfio.virt.usage import domains_using

libvirt = pytest.importorskip("libvirt")

DOMAIN = """
<domain type='test'>
  <name>{name}</name>
  <memory unit='MiB'>512</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64'>hvm</type></os>
  <devices>
    <hostdev mode='subsystem' type='pci' managed='no'>
      <source><address domain='0x0000' bus='0x{bus}' slot='0x00' function='0x{fn}'/></source>
    </hostdev>
  </devices>
</domain>"""


@pytest.fixture
def uri(tmp_path):
    node = "<node>" + DOMAIN.format(name="running-vm", bus="01", fn="0") + "</node>"
    path = tmp_path / "testdriver.xml"
    path.write_text(node)
    return f"test://{path}"


def test_domain_using_a_device_is_found(uri):
    conn = open_connection(uri)
    try:
        used = domains_using(read_all(conn), [PciAddress.parse("0000:01:00.0"), PciAddress.parse("0000:02:00.0")])
        assert used[PciAddress.parse("0000:01:00.0")] == ["running-vm"]
        assert used[PciAddress.parse("0000:02:00.0")] == []
        # the domain an attach is about to redefine does not count against itself
        assert domains_using(read_all(conn), [PciAddress.parse("0000:01:00.0")], exclude="running-vm") == {
            PciAddress.parse("0000:01:00.0"): []}
    finally:
        conn.close()


def test_bind_refuses_a_device_a_domain_uses(uri, cli, tmp_path):
    from tests.conftest import gpu_workstation

    ws = gpu_workstation(tmp_path / "host")
    result = cli("--root", ws.root, "bind", "0000:01:00.1", "--connect", uri, "--json")
    assert result.code == 1 and "running-vm" in result.err
    other = cli("--root", ws.root, "bind", "0000:04:00.0", "--connect", uri, "--dry-run", "--json").json()
    assert [c["status"] for c in other["checks"] if c["id"] == "libvirt"] == ["ok"]


def test_unreachable_daemon_refuses_the_bind(cli, tmp_path):
    """Fail closed: on main a libvirt that did not answer made the check a skip and the bind went on."""
    from tests.conftest import gpu_workstation

    ws = gpu_workstation(tmp_path / "host")
    result = cli("--root", ws.root, "bind", "0000:01:00.0", "--connect",
                 "qemu+unix:///system?socket=/nonexistent/libvirt-sock", "--dry-run")
    assert result.code == 1 and "cannot ask libvirt" in result.err and "--connect none" in result.err


def test_hostdev_parsing_ignores_other_devices():
    xml = """<domain><devices>
      <hostdev mode='subsystem' type='usb'><source><vendor id='0x1'/></source></hostdev>
      <hostdev mode='subsystem' type='pci'><source><address domain='0x10000' bus='0xe1' slot='0x00'
        function='0x1'/></source></hostdev>
      <hostdev mode='subsystem' type='mdev' model='vfio-pci'><source><address uuid='x'/></source></hostdev>
    </devices></domain>"""
    defined = read_defined(xml)
    assert defined.hostdevs == {PciAddress.parse("10000:e1:00.1")}
    assert defined.mdevs == {"x"}  # the mdev is counted as one, not as a PCI function


def test_one_listing_leaves_the_domain_left_out_unread():
    """A plan's shared listing (virt.defined.listed) reads no more than read_all does: the domain
    being replaced, left out, is not read, so a definition of it gpuvfio cannot read (more
    children in one element than it takes) stops nothing, with or without the shared listing."""
    import libvirt

    from gpuvfio.virt.defined import listed

    conn = libvirt.open("test:///default")
    crowded = "".join("<x:i/>" for _ in range(4097))
    conn.defineXML("<domain type='test'><name>replaced</name><memory>1024</memory><vcpu>1</vcpu>"
                   "<os><type>hvm</type></os><metadata><x:m xmlns:x='http://example.com/x'>" + crowded +
                   "</x:m></metadata></domain>")
    try:
        assert [d.name for d in read_all(conn, exclude="replaced")] == ["test"]
        memo: dict = {}
        assert [d.name for d in listed(conn, memo, exclude="replaced")] == ["test"]
        assert [d.name for d in listed(conn, memo, exclude="replaced")] == ["test"] and len(memo) == 1
        with pytest.raises(Exception, match="more than 4096 children"):
            listed(conn, memo, exclude=None)
    finally:
        conn.close()
