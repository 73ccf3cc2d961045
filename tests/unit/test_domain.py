"""Domain XML: golden files per sample host and option set, libvirt's RelaxNG schema, and
libvirt's real test driver (define + start)."""

import difflib
import os
import re

import pytest
from lxml import etree

from gpuvfio.domain.render import validate
from gpuvfio.errors import GpuvfioError
from tests.conftest import golden_text
from tests.make_samples import sample_path

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "domain")
libvirt = pytest.importorskip("libvirt")

CASES = {
    # name: (sample, arguments)
    "dgx-8gpu-two-cells": ("dgx-h100", ["0000:1b:00.0", "0000:43:00.0", "0000:52:00.0", "0000:61:00.0",
                                        "0000:9d:00.0", "0000:c3:00.0", "0000:d1:00.0", "0000:df:00.0",
                                        "--name", "dgx-8gpu", "--vcpus", "64", "--memory", "512G"]),
    "dgx-8gpu-flat": ("dgx-h100", ["0000:1b:00.0", "0000:43:00.0", "0000:52:00.0", "0000:61:00.0",
                                   "0000:9d:00.0", "0000:c3:00.0", "0000:d1:00.0", "0000:df:00.0",
                                   "--name", "dgx-8gpu", "--vcpus", "64", "--memory", "512G", "--topology", "flat"]),
    # HGX: all eight GPUs with their compute NICs; the NVSwitches join them (full passthrough).
    "dgx-8gpu-8nic": ("dgx-h100", ["0000:1b:00.0", "0000:18:00.0", "0000:43:00.0", "0000:40:00.0", "0000:52:00.0",
                                   "0000:4f:00.0", "0000:61:00.0", "0000:5e:00.0", "0000:9d:00.0", "0000:9a:00.0",
                                   "0000:c3:00.0", "0000:c0:00.0", "0000:d1:00.0", "0000:ce:00.0", "0000:df:00.0",
                                   "0000:dc:00.0", "--name", "hgx", "--vcpus", "64", "--memory", "512G"]),
    "switch-2gpu-nic-clique": ("pcie-switch", ["0000:18:00.0", "0000:19:00.0", "0000:1a:00.0", "--name", "l40s-pair",
                                               "--vcpus", "16", "--memory", "64G", "--qemu-version", "8.2"]),
    # AMD EPYC, two GPUs on one root complex (PHB): NCCL's default P2P level there is SYS, so a clique.
    "epyc-2gpu-two-architectures": ("epyc-mixed", ["0000:81:00.0", "0000:82:00.0", "--name", "epyc-pair", "--vcpus", "8",
                                            "--memory", "32G", "--qemu-version", "9.2"]),
    "switch-2gpu-qemu72": ("pcie-switch", ["0000:18:00.0", "0000:19:00.0", "--name", "l40s-old-qemu",
                                           "--vcpus", "8", "--memory", "32G", "--qemu-version", "7.2"]),
    "dgx-1gpu-local": ("dgx-h100", ["0000:9d:00.0", "--name", "h100-node1", "--vcpus", "16", "--memory", "64GiB",
                                    "--disk", "/var/lib/libvirt/images/h100.qcow2", "--network", "default"]),
    "dgx-1gpu-remote-numa": ("dgx-h100", ["0000:1b:00.0", "--name", "h100-remote", "--vcpus", "8",
                                          "--memory", "32768M", "--numa", "1", "--hugepages", "none",
                                          "--firmware", "bios"]),
    "workstation-4090": ("workstation", ["0000:01:00.0", "--name", "win<11>&gaming", "--vcpus", "8",
                                         "--memory", "16G", "--hide-kvm", "--kernel", "/boot/vmlinuz",
                                         "--initrd", "/boot/initrd.img", "--cmdline", "console=ttyS0 quiet"]),
    "epyc-a100-vfio": ("epyc-mixed", ["0000:81:00.0", "--name", "a100", "--vcpus", "16", "--memory", "64G"]),
    "epyc-t4-mdev": ("epyc-mixed", ["0000:82:00.0", "--name", "t4-vgpu", "--mdev", "GRID T4-2Q",
                                    "--vcpus", "4", "--memory", "8G"]),
    "epyc-a10-sriov-vgpu": ("epyc-mixed", ["0000:41:00.0", "--name", "a10-vgpu", "--vgpu", "NVIDIA A10-4Q",
                                           "--vcpus", "4", "--memory", "8G", "--hugepages", "2M"]),
    # A stock cloud image's guest: the cloud-init seed as a read-only SATA cdrom (a dry run: the
    # seed itself, with its fresh host key, is tests/unit/test_cloud_init.py's).
    "dgx-1gpu-cloud-init": ("dgx-h100", ["0000:9d:00.0", "--name", "h100-cloud", "--vcpus", "8", "--memory", "16G",
                                         "--disk", "/var/lib/libvirt/images/debian-12-genericcloud-amd64.qcow2",
                                         "--user-net-ssh-port", "2222", "--cloud-init",
                                         "/var/lib/libvirt/boot/h100-cloud-seed.iso", "--ssh-key", "{ssh_key}",
                                         "--dry-run"]),
    "dgx-tcg-bios": ("dgx-h100", ["0000:1b:00.0", "--name", "tcg", "--vcpus", "2", "--memory", "2G",
                                  "--virt-type", "qemu", "--firmware", "bios", "--numa", "none"]),
}


def canonical(xml: str) -> str:
    parser = etree.XMLParser(remove_blank_text=True)
    return etree.tostring(etree.fromstring(xml.encode(), parser), method="c14n").decode()


def pretty(xml: str) -> list[str]:
    parser = etree.XMLParser(remove_blank_text=True)
    return etree.tostring(etree.fromstring(xml.encode(), parser), pretty_print=True).decode().splitlines(True)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Every case rendered once, through the real CLI entry point."""
    import contextlib
    import io

    from gpuvfio.cli import main

    from gpuvfio.domain.cloud_init import generate_host_key

    key = tmp_path_factory.mktemp("key") / "id_ed25519"
    key.write_text(generate_host_key().private)
    out = {}
    for case, (sample, args) in CASES.items():
        buffer = io.StringIO()
        args = [str(key) if arg == "{ssh_key}" else arg for arg in args]
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(io.StringIO()):
            assert main(["--root", sample_path(sample), "xml", *args]) == 0, case
        out[case] = buffer.getvalue()
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case, generated, regenerate):
    path = os.path.join(GOLDEN, f"{case}.xml")
    expected = golden_text(path, generated[case], regenerate)
    if canonical(generated[case]) != canonical(expected):
        diff = "".join(difflib.unified_diff(pretty(expected), pretty(generated[case]), "golden", "generated"))
        pytest.fail(f"{case} differs from {path} (pytest --regenerate to accept):\n{diff}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_schema_and_test_driver(case, generated, tmp_path):
    validate(generated[case])
    node = tmp_path / "testdriver.xml"
    node.write_text("<node/>")
    libvirt.registerErrorHandler(lambda *args: None, None)
    conn = libvirt.open(f"test://{node}")
    try:
        dom = conn.defineXML(generated[case])
        dom.create()
        assert dom.isActive()
        dom.destroy()
        dom.undefine()
    finally:
        conn.close()


def expander_of(doc, bus: str) -> etree._Element:
    """The pcie-expander-bus a guest bus (controller index, hex) hangs from."""
    controllers = {c.get("index"): c for c in doc.iter("controller")}
    index = str(int(bus, 16))
    while controllers[index].get("model") != "pcie-expander-bus":
        index = str(int(controllers[index].find("address").get("bus"), 16))
    return controllers[index]


@pytest.mark.parametrize("case", ["dgx-8gpu-two-cells", "dgx-8gpu-flat"])
def test_dgx_two_cells_keep_host_locality(generated, case):
    doc = etree.fromstring(generated[case].encode())
    cell_of_gpu = {h.find("source/address").get("bus"): expander_of(doc, h.find("address").get("bus")).findtext(
        "target/node") for h in doc.iter("hostdev")}
    # All eight baseboard GPUs: full passthrough takes the four NVSwitches (buses 03-06, node 0) along.
    assert cell_of_gpu == {"0x1b": "0", "0x43": "0", "0x52": "0", "0x61": "0",
                           "0x9d": "1", "0xc3": "1", "0xd1": "1", "0xdf": "1",
                           "0x03": "0", "0x04": "0", "0x05": "0", "0x06": "0"}
    pxbs = [c for c in doc.iter("controller") if c.get("model") == "pcie-expander-bus"]
    # mirror: one pxb per host root complex (each GPU has its own, the NVSwitches share one);
    # flat: one per guest cell
    assert len(pxbs) == (9 if case == "dgx-8gpu-two-cells" else 2)
    bus_nrs = sorted(int(c.find("target").get("busNr")) for c in pxbs)
    assert len(set(bus_nrs)) == len(bus_nrs) and bus_nrs[-1] < 256
    distances = {(c.get("id"), s.get("id")): s.get("value") for c in doc.iter("cell") for s in c.iter("sibling")}
    assert distances == {("0", "0"): "10", ("0", "1"): "21", ("1", "0"): "21", ("1", "1"): "10"}  # the host SLIT
    pins = [int(p.get("cpuset")) for p in doc.iter("vcpupin")]
    node0 = set(range(0, 56)) | set(range(112, 168))
    assert all(p in node0 for p in pins[:32]) and all(p not in node0 for p in pins[32:])
    assert len(set(pins)) == 64
    # 46 phys-bits passed through: OVMF's own window (1/8 of 2^46 = 8 TiB) holds eight 128 GiB BAR1s,
    # so no X-PciMmio64Mb fallback and no pcihole64 on pcie.0 (no devices there).
    assert "X-PciMmio64Mb" not in generated[case] and "pcihole64" not in generated[case]
    assert doc.find("cpu/maxphysaddr").get("mode") == "passthrough"
    assert doc.find("memoryBacking/hugepages/page").get("size") == "1048576"


def test_clique_golden_shape(generated):
    """The switch sample's socket-0 pair: one emulated switch (with the NIC) and one clique;
    the same pair for QEMU 7.2: mirrored, but no clique (and no qemu namespace at all)."""
    doc = etree.fromstring(generated["switch-2gpu-nic-clique"].encode())
    ns = {"qemu": "http://libvirt.org/schemas/domain/qemu/1.0"}
    cliques = {d.get("alias"): d.find(".//qemu:property", ns).get("value")
               for d in doc.iterfind("qemu:override/qemu:device", ns)}
    assert cliques == {"ua-gpu0": "0", "ua-gpu1": "0"}
    assert len([c for c in doc.iter("controller") if c.get("model") == "pcie-switch-downstream-port"]) == 3
    old = generated["switch-2gpu-qemu72"]
    assert "x-nv-gpudirect-clique" not in old and "qemu:override" not in old
    assert "pcie-switch-upstream-port" in old


def _cliques(xml: str) -> dict[str, str]:
    ns = {"qemu": "http://libvirt.org/schemas/domain/qemu/1.0"}
    doc = etree.fromstring(xml.encode())
    aliases = {h.find("alias").get("name"): h.find("source/address").get("bus") for h in doc.iter("hostdev")
               if h.find("alias") is not None}
    return {aliases[d.get("alias")]: d.find(".//qemu:property", ns).get("value")
            for d in doc.iterfind("qemu:override/qemu:device", ns)}


def test_an_a100_and_a_t4_get_no_clique_though_nccl_would_reach(generated, cli):
    """NCCL's default P2P level (NCCL 2.23.4 to 2.30.7, src/graph/paths.cc ncclTopoCheckP2p) is SYS on
    x86 AMD with at most two GPUs, so the EPYC's A100 and T4 on one root complex are within it; but
    an Ampere and a Turing card have no peer access between them: no clique, even forced."""
    assert _cliques(generated["epyc-2gpu-two-architectures"]) == {}
    data = cli("--root", sample_path("epyc-mixed"), "xml", *CASES["epyc-2gpu-two-architectures"][1], "--json").json()
    assert any(n.startswith("P2P rule: NCCL's default P2P level on an x86 AMD CPU with at most two GPUs is "
                            "PATH_SYS") for n in data["notes"]), data["notes"]
    assert "GPUs of different architectures never share a P2P clique (NVIDIA's driver gives no peer access " \
           "across them): Ampere: 0000:81:00.0; Turing: 0000:82:00.0" in data["notes"]
    forced = cli("--root", sample_path("epyc-mixed"), "xml", *CASES["epyc-2gpu-two-architectures"][1], "--p2p", "force",
                 "--json").json()
    assert forced["topology"]["p2p"]["cliques"] == []


def test_intel_pair_across_sockets_gets_none_unless_forced_and_force_is_flagged(cli, tmp_path):
    """One GPU of each socket of an Intel host with ACS below its switches (SYS, NCCL's PATH_SYS):
    no clique at NCCL's default PATH_PXB; --p2p force gives one, and the plan warns that only force did."""
    from tests.unit.test_layout import switch_host

    switch_host(tmp_path)
    args = ["--root", str(tmp_path), "xml", "0000:18:00.0", "0000:9a:00.0", "--name", "pair",
            "--vcpus", "8", "--memory", "32G", "--qemu-version", "9.2"]
    auto = cli(*args, "--json").json()
    assert "x-nv-gpudirect-clique" not in auto["xml"]
    assert any("GenuineIntel CPU is PATH_PXB" in n for n in auto["notes"])
    assert any(n.startswith("0000:18:00.0, 0000:9a:00.0: the nearest other GPU is SYS") for n in auto["notes"])
    forced = cli(*args, "--p2p", "force", "--json").json()
    assert _cliques(forced["xml"]) == {"0x18": "0", "0x9a": "0"}
    assert [w for w in forced["warnings"] if "--p2p force" in w] == [
        "--p2p force: P2P clique 0 (0000:18:00.0, 0000:9a:00.0) spans SYS (PATH_SYS), beyond NCCL's default "
        "level PATH_PXB on this host"]
    assert cli(*args, "--p2p", "sometimes").code == 2


def test_names_are_escaped(generated):
    assert "<name>win&lt;11&gt;&amp;gaming</name>" in generated["workstation-4090"]
    assert "<hidden state='on'/>" in generated["workstation-4090"]


def test_mdev_uuid_is_deterministic(generated):
    uuids = re.findall(r"uuid='([0-9a-f-]+)'", generated["epyc-t4-mdev"])
    assert len(uuids) == 1
    assert uuids == re.findall(r"uuid='([0-9a-f-]+)'", generated["epyc-t4-mdev"])


def test_sriov_vgpu_uses_the_vf_already_set(generated):
    doc = etree.fromstring(generated["epyc-a10-sriov-vgpu"].encode())
    sources = [h.find("source/address").attrib for h in doc.iter("hostdev")]
    assert [(s["bus"], s["function"]) for s in sources] == [("0x41", "0x4")]


@pytest.mark.parametrize("args, fragment", [
    (["0000:01:00.0", "--name", "a/b"], "domain name"),
    (["0000:01:00.0", "--name", "bad\x07"], "domain name"),
    (["0000:01:00.0", "--name", "x", "--memory", "lots"], "not a size"),
    (["0000:00:01.0", "--name", "x"], "PCI bridge"),
    (["0000:01:00.0", "--name", "x", "--numa", "7"], "NUMA node 7 does not exist"),
    (["0000:01:00.0", "--name", "x", "--numa", "far"], "numa must be"),
    (["0000:01:00.0", "--name", "x", "--hugepages", "3G"], "hugepages must be"),
    (["0000:01:00.0", "--name", "x", "--uuid", "nope"], "not a UUID"),
    (["0000:01:00.0", "--name", "x", "--kernel", "relative/vmlinuz"], "absolute path"),
    (["0000:01:00.0", "--name", "x", "--console-log", "relative.log"], "absolute path"),
])
def test_bad_input(cli, args, fragment):
    result = cli("--root", sample_path("workstation"), "xml", *args)
    assert result.code == 2, result.err
    assert fragment in result.err and len(result.err.strip().splitlines()) == 1
    assert result.out == ""


@pytest.mark.parametrize("args, fragment", [
    (["0000:04:00.0", "--name", "x"], "not viable"),
    (["0000:01:00.0", "--name", "x", "--vcpus", "64"], "vCPUs do not fit"),
    (["0000:01:00.0", "--name", "x", "--mdev", "nvidia-1"], "offers no mdev types"),
    (["0000:01:00.0", "--name", "x", "--hugepages", "1G"], "not enough free 1G hugepages"),
    (["0000:01:00.0", "--name", "x", "--numa", "remote"], "numa 'remote' needs"),
])
def test_refused_by_the_host_exits_1(cli, args, fragment):
    """Well-formed requests this host cannot satisfy are refusals (exit 1), not bad input."""
    result = cli("--root", sample_path("workstation"), "xml", *args)
    assert result.code == 1, result.err
    assert fragment in result.err and len(result.err.strip().splitlines()) == 1
    assert result.out == ""


def test_mdev_type_not_offered(cli):
    result = cli("--root", sample_path("epyc-mixed"), "xml", "0000:82:00.0", "--name", "x", "--mdev", "nvidia-9999")
    assert result.code == 1 and "does not offer mdev type" in result.err and "GRID T4" in result.err


@pytest.mark.parametrize("spelling, size", [("4K", None), ("4k", None), ("none", None), ("2M", "2048"),
                                            ("2m", "2048"), ("2MiB", "2048"), ("2048K", "2048"),
                                            ("1G", "1048576"), ("1g", "1048576"), ("1GiB", "1048576")])
def test_hugepage_spellings_the_testbed_takes(cli, spelling, size):
    """One parser for xml, attach, Ansible and the testbed spec (on main xml refused 4K and 1g)."""
    # The DGX sample reserves 1 GiB pages, the EPYC one 2 MiB pages.
    sample, gpu = ("epyc-mixed", "0000:81:00.0") if size == "2048" else ("dgx-h100", "0000:9d:00.0")
    result = cli("--root", sample_path(sample), "xml", gpu, "--name", "p", "--vcpus", "4",
                 "--memory", "8G", "--hugepages", spelling, "--json")
    assert result.code == 0, result.err
    page = etree.fromstring(result.json()["xml"].encode()).find("memoryBacking/hugepages/page")
    assert (page.get("size") if page is not None else None) == size


def test_numa_remote_places_the_guest_away_from_its_gpu(cli):
    result = cli("--root", sample_path("dgx-h100"), "xml", "0000:9d:00.0", "--name", "r", "--vcpus", "4",
                 "--memory", "8G", "--numa", "remote", "--json")
    assert result.code == 0, result.err
    doc = etree.fromstring(result.json()["xml"].encode())
    assert doc.find("numatune/memory").get("nodeset") == "0"  # 0000:9d:00.0 sits on node 1
    assert any("DMA crosses sockets" in w for w in result.json()["warnings"])


def test_numa_none_keeps_hugepages(cli):
    """--numa none pins nothing; the pages still come from the host's pools (any node). On main
    hugepages silently became 4K pages whenever NUMA placement was off."""
    auto = cli("--root", sample_path("dgx-h100"), "xml", "0000:9d:00.0", "--name", "n", "--vcpus", "4",
               "--memory", "8G", "--numa", "none", "--json")
    assert auto.code == 0, auto.err
    doc = etree.fromstring(auto.json()["xml"].encode())
    assert doc.find("memoryBacking/hugepages/page").get("size") == "1048576"
    assert doc.find("numatune") is None and doc.find("cputune") is None
    short = cli("--root", sample_path("workstation"), "xml", "0000:01:00.0", "--name", "n", "--memory", "8G",
                "--numa", "none", "--hugepages", "1G")
    assert short.code == 1 and "all nodes: 0 free x 1G" in short.err


def test_sriov_pf_with_vfs_is_refused_like_bind(cli):
    """On main xml of an SR-IOV physical function passed its VFs too (one of them with a vGPU in
    use), with exit 0, while bind refused the same device."""
    result = cli("--root", sample_path("epyc-mixed"), "xml", "0000:41:00.0", "--name", "pf")
    assert result.code == 1 and "SR-IOV VFs enabled" in result.err  # bind: test_binding.test_sriov_enabled_refused


def test_a_vf_alone_is_passed_alone(cli):
    result = cli("--root", sample_path("epyc-mixed"), "xml", "0000:41:00.5", "--name", "vf", "--json")
    assert result.code == 0, result.err
    sources = [h.find("source/address").attrib["function"]
               for h in etree.fromstring(result.json()["xml"].encode()).iter("hostdev")]
    assert sources == ["0x5"]  # not the other VFs in its slot


def test_console_log_goes_into_the_serial_device(cli, tmp_path):
    log = str(tmp_path / "console.log")
    result = cli("--root", sample_path("dgx-h100"), "xml", "0000:9d:00.0", "--name", "c", "--vcpus", "4",
                 "--memory", "8G", "--console-log", log, "--json")
    assert result.code == 0, result.err
    serial = etree.fromstring(result.json()["xml"].encode()).find("devices/serial")
    assert serial.find("log").get("file") == log


def test_digest_follows_every_input(cli):
    def digest(*extra):
        out = cli("--root", sample_path("dgx-h100"), "xml", "0000:9d:00.0", "--name", "d", "--vcpus", "4",
                  "--memory", "8G", "--json", *extra).json()["xml"]
        return re.search(r"digest='(sha256:[0-9a-f]{64})'", out).group(1)

    first = digest()
    assert digest() == first  # deterministic
    assert len({first, digest("--hugepages", "none"), digest("--numa", "none"), digest("--firmware", "bios")}) == 4


def test_define_is_idempotent(cli, tmp_path):
    node = tmp_path / "testdriver.xml"
    node.write_text("<node/>")
    uri = f"test://{node}"
    args = ["--root", sample_path("epyc-mixed"), "xml", "0000:81:00.0", "--name", "a100", "--vcpus", "8",
            "--memory", "16G", "--define", "--connect", uri, "--json"]
    # The test driver keeps state per connection: define and re-check within one process
    # by opening the same URI; each call opens its own connection, so define twice and
    # compare through a persistent connection.
    libvirt.registerErrorHandler(lambda *a: None, None)
    keep = libvirt.open(uri)
    try:
        out = cli(*args).json()
        assert out["define"]["result"] == "defined"
    finally:
        keep.close()
    # The test driver is libvirt itself: its version is the library's; it has no QEMU behind it.
    rows = {row["feature"]: row for row in out["versions"]}
    assert rows["maxphysaddr"]["have"].startswith(f"libvirt {libvirt.getVersion() // 1000000}.") and rows["maxphysaddr"]["status"] != "unknown"
    assert rows["phys-bits-check"]["have"] is None and rows["phys-bits-check"]["status"] == "unknown"


def test_define_compares_before_changing():
    from gpuvfio.virt.define import difference

    wanted = "<domain type='kvm'><name>a</name><vcpu>4</vcpu></domain>"
    current = "<domain type='kvm'><name>a</name><uuid>x</uuid><vcpu placement='static'>4</vcpu></domain>"
    assert difference(wanted, current) == []  # libvirt's added attributes are not a difference
    assert difference(wanted.replace(">4<", ">8<"), current) == ["+ /vcpu=8"]
    q35 = "<domain><os><type arch='x86_64' machine='q35'>hvm</type></os></domain>"
    assert difference(q35, q35.replace("'q35'", "'pc-q35-7.2'")) == []
    assert difference(q35, q35.replace("'q35'", "'pc-i440fx-7.2'")) != []


def _hostdev(bus: str, guest_bus: str) -> str:
    return (f"<hostdev mode='subsystem' type='pci' managed='no'><source><address domain='0x0000' bus='{bus}' "
            f"slot='0x00' function='0x0'/></source><address type='pci' domain='0x0000' bus='{guest_bus}' "
            "slot='0x00' function='0x0'/></hostdev>")


def test_define_sees_removals_and_moves():
    """What others added to gpuvfio's parts, and devices swapped between guest buses, differ (on
    main each element was only looked for somewhere at its path, and extras were ignored)."""
    from gpuvfio.virt.define import difference

    def domain(devices: str, memory: str = "") -> str:
        return f"<domain><name>a</name>{memory}<devices>{devices}</devices></domain>"

    one = domain(_hostdev("0x1b", "0x01"))
    two = domain(_hostdev("0x1b", "0x01") + _hostdev("0x43", "0x02"))
    assert difference(one, one) == []
    assert [c[:18] for c in difference(one, two)] == ["- /devices/hostdev"]  # an extra GPU
    swapped = domain(_hostdev("0x1b", "0x02") + _hostdev("0x43", "0x01"))
    assert len(difference(two, swapped)) == 4  # both moved: two missing, two extra
    pages = domain(_hostdev("0x1b", "0x01"), "<memoryBacking><hugepages/></memoryBacking>")
    assert difference(one, pages) == ["- /memoryBacking hugepages[]"]


def test_define_sees_a_changed_digest():
    from gpuvfio.virt.define import difference

    def domain(digest: str) -> str:
        return ("<domain><name>a</name><metadata><gpuvfio:domain xmlns:gpuvfio='https://gpuvfio.invalid/xmlns/"
                f"domain/1' digest='{digest}'/></metadata></domain>")

    assert difference(domain("sha256:1"), domain("sha256:1")) == []
    assert difference(domain("sha256:2"), domain("sha256:1")) == ["~ gpuvfio's definition: sha256:1 -> sha256:2"]


FOREIGN_NODE = """<node><domain type='test'><name>someone-else</name><memory>1048576</memory>
<os><type>hvm</type></os></domain></node>"""


def test_a_domain_gpuvfio_did_not_define_is_not_taken_over(cli, tmp_path):
    """xml --define --update and detach refuse a domain of that name gpuvfio did not define (on main
    --update redefined it with gpuvfio's metadata; a later detach would have undefined it)."""
    node = tmp_path / "testdriver.xml"
    node.write_text(FOREIGN_NODE)
    uri = f"test://{node}"
    define = cli("--root", sample_path("epyc-mixed"), "xml", "0000:81:00.0", "--name", "someone-else",
                 "--firmware", "bios", "--define", "--update", "--connect", uri)
    assert define.code == 1 and "not created by gpuvfio" in define.err
    detach = cli("detach", "someone-else", "--connect", uri)
    assert detach.code == 1 and "not created by gpuvfio" in detach.err


def test_a_running_domain_keeps_its_own_hugepages():
    """Re-provisioning a running guest: the pages it holds count as free for its definition (on a
    host with no other free 1 GiB pages the same request still comes out the same)."""
    import contextlib

    from gpuvfio.address import PciAddress
    from gpuvfio.ops.context import Context
    from gpuvfio.ops.domains import Existing, domain_request, pages_held, provision_xml
    from gpuvfio.ops.inventory import open_host

    request = domain_request("keep", vcpus=4, memory="8G", hugepages="1G")
    with open_host(sample_path("workstation")) as (host, _label), contextlib.closing(Context(host=host)) as ctx:
        with pytest.raises(GpuvfioError, match="not enough free 1G hugepages"):
            provision_xml(ctx, [PciAddress.parse("0000:01:00.0")], request)
        held = ("<domain><memory unit='KiB'>8388608</memory><memoryBacking><hugepages><page size='1048576' "
                "unit='KiB'/></hugepages></memoryBacking><numatune><memory mode='strict' nodeset='0'/></numatune>"
                "</domain>")
        assert pages_held(held) == {0: {1048576: 8}}
        built = provision_xml(ctx, [PciAddress.parse("0000:01:00.0")], request,
                              replacing=Existing(held, True, True, []))
        assert built.spec.hugepage_kib == 1048576
        with pytest.raises(GpuvfioError):  # a domain that is not running holds nothing
            provision_xml(ctx, [PciAddress.parse("0000:01:00.0")], request, replacing=Existing(held, False, True, []))
