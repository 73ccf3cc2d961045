"""Guest PCIe layout (issue 14 items 1-2): host switches mirrored, one pxb per root complex,
P2P cliques through <qemu:override>, and the reasons a plan gives when it leaves them out.
Every document is checked against libvirt's RelaxNG schema and defined in the test driver."""

from __future__ import annotations

import pytest
from lxml import etree

from gpuvfio.address import PciAddress
from gpuvfio.domain.render import domain_xml
from gpuvfio.domain.request import domain_request
from gpuvfio.domain.spec import build_spec
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.numa import read_numa
from gpuvfio.errors import Refused
from gpuvfio.host.root import HostRoot
from tests.hostbuilder import BAR32, BAR64_PREF, GiB, HostBuilder, MiB

libvirt = pytest.importorskip("libvirt")

L40S = ("10de", "26b9", "030200")
CX7 = ("15b3", "1021", "020000")
GPU_BARS = [(0, 16 * MiB, BAR32), (1, 64 * GiB, BAR64_PREF), (3, 32 * MiB, BAR64_PREF)]


def switch_host(root, *, acs: bool = True, cmdline: str = "intel_iommu=on iommu=pt", nic: bool = True) -> HostBuilder:
    """Two sockets; on each a root port -> switch -> GPU, GPU, NIC. ``acs``: the downstream ports
    isolate their devices (one group each); without, everything below the switch shares one."""
    b = HostBuilder(str(root))
    b.iommu("intel", 2)
    b.cmdline(f"BOOT_IMAGE=/vmlinuz ro {cmdline}")
    b.cpuinfo("Intel(R) Xeon(R) Gold 6448Y", 46)
    b.firmware()
    cpus = b.cpu_topology(2, 8, 2)
    for node in (0, 1):
        b.numa_node(node, cpus[node], 64, {1048576: (32, 32)})
    for node, rbus in ((0, 0x15), (1, 0x97)):
        rb = b.root_bus(0, rbus, numa=node)
        shared = None if acs else b.new_group()
        group = "auto" if acs else shared
        rp = b.bridge(rb, f"0000:{rbus:02x}:01.0", "8086", "352a", secondary_bus=rbus + 1, link=(5, 16))
        up = b.bridge(rp, f"0000:{rbus + 1:02x}:00.0", "1000", "c030", secondary_bus=rbus + 2, link=(5, 16),
                      group=group)
        for n, (vendor, device, klass) in enumerate((L40S, L40S, CX7) if nic else (L40S, L40S)):
            dp = b.bridge(up, f"0000:{rbus + 2:02x}:{n:02x}.0", "1000", "c030", secondary_bus=rbus + 3 + n,
                          link=(5, 16), group=group)
            b.function(dp, f"0000:{rbus + 3 + n:02x}:00.0", vendor, device, klass,
                       driver="vfio-pci", link=(4, 16), group=group,
                       bars=GPU_BARS if vendor == "10de" else [(0, 32 * MiB, BAR64_PREF)])
    b.modules(["vfio_pci", "vfio_iommu_type1", "vfio"])
    return b


def spec_for(root, addresses, **options):
    host = HostRoot(str(root))
    request = domain_request("switchy", vcpus=4, memory="16G", **options)
    return build_spec(host, read_inventory(host), read_numa(host), [PciAddress.parse(a) for a in addresses],
                      request)


def checked(spec, tmp_path) -> etree._Element:
    xml = domain_xml(spec)  # RelaxNG-validated
    node = tmp_path / "testdriver.xml"
    node.write_text("<node/>")
    libvirt.registerErrorHandler(lambda *args: None, None)
    conn = libvirt.open(f"test://{node}")
    try:
        conn.defineXML(xml).undefine()
    finally:
        conn.close()
    return etree.fromstring(xml.encode())


def models(doc) -> dict[str, str]:
    return {c.get("index"): c.get("model") for c in doc.iter("controller")}


def parent_chain(doc, bus: str) -> list[str]:
    controllers = {c.get("index"): c for c in doc.iter("controller")}
    chain, index = [], str(int(bus, 16))
    while index != "0":
        controller = controllers[index]
        chain.append(controller.get("model"))
        address = controller.find("address")
        index = str(int(address.get("bus"), 16)) if address is not None else "0"
    return chain


def test_switch_mirrored_with_nic_and_a_clique(tmp_path):
    switch_host(tmp_path)
    spec = spec_for(tmp_path, ["0000:18:00.0", "0000:19:00.0", "0000:1a:00.0"], qemu_version="8.2")
    doc = checked(spec, tmp_path)
    assert spec.topology == "mirror"
    for hostdev in doc.iter("hostdev"):  # every device behind one emulated switch, on a pxb of its own
        assert parent_chain(doc, hostdev.find("address").get("bus")) == [
            "pcie-switch-downstream-port", "pcie-switch-upstream-port", "pcie-root-port", "pcie-expander-bus"]
    assert any("128 GiB of BARs (128 GiB or more)" in note for note in spec.notes)
    downstream = {hostdev.find("address").get("bus") for hostdev in doc.iter("hostdev")}
    assert len(downstream) == 3
    aliases = [a.get("name") for a in doc.iter("alias")]
    assert aliases == ["ua-gpu0", "ua-gpu1"]  # the NIC is no GPU: no alias, no clique
    ns = {"qemu": "http://libvirt.org/schemas/domain/qemu/1.0"}
    props = {d.get("alias"): d.find("qemu:frontend/qemu:property", ns).attrib
             for d in doc.iterfind("qemu:override/qemu:device", ns)}
    assert props == {f"ua-gpu{n}": {"name": "x-nv-gpudirect-clique", "type": "unsigned", "value": "0"}
                     for n in (0, 1)}
    assert any("P2P clique 0: 0000:18:00.0, 0000:19:00.0 (PIX" in note for note in spec.notes)


def test_two_sockets_two_pxbs_two_cliques(tmp_path):
    switch_host(tmp_path)
    gpus = ["0000:18:00.0", "0000:19:00.0", "0000:9a:00.0", "0000:9b:00.0"]
    spec = spec_for(tmp_path, gpus, qemu_version="9.2.0")
    doc = checked(spec, tmp_path)
    pxbs = [c for c in doc.iter("controller") if c.get("model") == "pcie-expander-bus"]
    assert [p.findtext("target/node") for p in pxbs] == ["0", "1"]
    for hostdev in doc.iter("hostdev"):
        assert parent_chain(doc, hostdev.find("address").get("bus"))[-1] == "pcie-expander-bus"
    assert [c.members for c in spec.p2p.cliques] == [[PciAddress.parse(a) for a in gpus[:2]],
                                                      [PciAddress.parse(a) for a in gpus[2:]]]
    assert {s.get("value") for s in doc.iter("sibling")} == {"10", "21"}


@pytest.mark.parametrize("options, why", [
    ({"qemu_version": "7.2"}, "older than 8.1"),
    ({}, "QEMU version unknown"),
    ({"qemu_version": "8.2", "hide_kvm": True}, "KVM hidden"),
])
def test_cliques_left_out_with_the_reason(tmp_path, options, why):
    switch_host(tmp_path)
    spec = spec_for(tmp_path, ["0000:18:00.0", "0000:19:00.0"], **options)
    doc = checked(spec, tmp_path)
    assert spec.cliques == [] and not list(doc.iter("alias"))
    assert any(why in note for note in spec.notes), spec.notes
    assert spec.topology == "mirror"  # the switch is mirrored either way


def test_p2p_off_and_flat(tmp_path):
    switch_host(tmp_path)
    spec = spec_for(tmp_path, ["0000:18:00.0", "0000:19:00.0"], qemu_version="8.2", p2p="off", topology="flat")
    doc = checked(spec, tmp_path)
    assert spec.cliques == [] and spec.notes == []
    assert set(models(doc).values()) == {"pcie-root", "pcie-root-port"}


def test_no_acs_no_clique(tmp_path):
    switch_host(tmp_path, acs=False, nic=False)
    spec = spec_for(tmp_path, ["0000:18:00.0", "0000:19:00.0"], qemu_version="8.2")
    checked(spec, tmp_path)
    assert spec.cliques == []
    assert any("shares IOMMU group" in note for note in spec.notes)


def test_acs_override_no_clique(tmp_path):
    switch_host(tmp_path, cmdline="intel_iommu=on pcie_acs_override=downstream,multifunction")
    spec = spec_for(tmp_path, ["0000:18:00.0", "0000:19:00.0"], qemu_version="8.2", force=True)
    assert spec.cliques == []
    assert any("pcie_acs_override" in note for note in spec.notes)


def test_across_sockets_no_clique(tmp_path):
    switch_host(tmp_path)
    spec = spec_for(tmp_path, ["0000:18:00.0", "0000:9a:00.0"], qemu_version="8.2")
    checked(spec, tmp_path)
    assert spec.cliques == []
    assert sum("0000:18:00.0, 0000:9a:00.0: the nearest other GPU is SYS" in note for note in spec.notes) == 1


def test_one_device_stays_flat(tmp_path):
    switch_host(tmp_path)
    spec = spec_for(tmp_path, ["0000:18:00.0"], qemu_version="8.2")
    doc = checked(spec, tmp_path)
    assert spec.topology == "flat"
    assert set(models(doc).values()) == {"pcie-root", "pcie-root-port"}


def test_bad_topology_words_are_input_errors():
    from gpuvfio.errors import InputError

    for options in ({"topology": "tree"}, {"p2p": "on"}, {"qemu_version": "8.x"}, {"qemu_version": ""},
                    {"qemu_version": "8.1 ; rm"}, {"qemu_version": "9.2.0.1"}, {"qemu_version": "-1"}):
        with pytest.raises(InputError):
            domain_request("x", **options)


@pytest.mark.parametrize("access, status", [
    ([[False, True], [True, False]], "pass"),
    ([[False, False], [False, False]], "fail"),  # the plan's clique, but no peer access in the guest
    (None, "fail"),  # no matrix at all: fail closed
])
def test_the_guest_peer_matrix_checks_the_plans_clique(access, status):
    from gpuvfio.guest.checks import evaluate
    from gpuvfio.guest.expect import Expected

    expected = [Expected(f"0000:{bus}:00.0", "10de", "26b9", "030200", 4, 16, clique=0) for bus in ("18", "19")]
    guest = [{"address": f"0000:{bus}:00.0", "vendor_id": "10de", "device_id": "26b9", "class_id": "030200",
              "driver": "nvidia", "upstream": None, "link": {}} for bus in ("83", "84")]
    verifier = {"p2p": None if access is None else {"bus_ids": ["00000000:83:00.0", "00000000:84:00.0"],
                                                    "access": access, "bandwidth": {}}, "errors": {}}
    probe = {"pci": guest, "modules": [], "dmesg": [], "nvidia_version": None}
    (row,) = [c for c in evaluate(probe, verifier, expected)["checks"] if c["id"] == "p2p_cliques"]
    assert row["status"] == status, row
    # --no-bandwidth: the verifier runs no peer stage, so there is nothing to hold the plan against
    assert not [c for c in evaluate(probe, verifier, expected, bandwidth=False)["checks"] if c["id"] == "p2p_cliques"]


def test_many_root_complexes_still_get_bus_ranges():
    """17 devices on 17 host root complexes: 17 pxbs of 2 buses each fit below bus 0x100."""
    from gpuvfio.domain.layout import plan_layout
    from gpuvfio.host.model import PciFunction

    devices = [[PciFunction(PciAddress(0, 0x10 + 8 * n + 1, 0, 0), "10de", "26b9", "030200",
                            parents=[PciAddress(0, 0x10 + 8 * n, 1, 0)])] for n in range(17)]
    layout = plan_layout(devices, "mirror", {}, False)
    numbers = [c.bus_nr for c in layout.expanders]
    assert len(numbers) == 17 and len(set(numbers)) == 17
    assert min(numbers) >= 0x20 and max(numbers) + 2 <= 0x100
    assert all(b - a >= 2 for a, b in zip(numbers, numbers[1:]))


def test_the_address_plan_follows_the_layouts_buses(tmp_path):
    """Devices on pxb-pcies stay out of pcie-root's <pcihole64>; with --topology flat the same
    devices sit on pcie-root and its hole holds them (the planner takes the buses from the layout)."""
    switch_host(tmp_path, nic=False)
    gpus = ["0000:18:00.0", "0000:9a:00.0"]  # one per socket: two root complexes, two pxbs
    mirrored = spec_for(tmp_path, gpus, numa="none")
    doc = checked(mirrored, tmp_path)
    assert mirrored.address.buses == [1, 3] and mirrored.address.pcihole64_kib is None
    assert doc.find("devices/controller[@model='pcie-root']/pcihole64") is None
    flat = spec_for(tmp_path, gpus, numa="none", topology="flat")
    doc = checked(flat, tmp_path)
    assert flat.address.buses == [0, 0]
    # 2 x (64 GiB + 32 MiB), aligned 64 GiB: 128 GiB + 32 MiB, with headroom 256 GiB.
    assert flat.address.pcihole64_kib == 256 * 1024 * 1024
    assert doc.findtext("devices/controller[@model='pcie-root']/pcihole64") == str(256 * 1024 * 1024)
    assert any("on pcie-root" in line for line in flat.address.lines)


def test_a_slit_libvirt_refuses_leaves_the_default_distances(tmp_path):
    """A distance of 10 between two nodes (numa=fake nodes of one physical node): libvirt refuses
    such a <sibling value>, so the guest keeps the defaults and the plan says why."""
    switch_host(tmp_path, nic=False)
    for node in (0, 1):
        (tmp_path / "sys/devices/system/node" / f"node{node}" / "distance").write_text("10 10\n")
    spec = spec_for(tmp_path, ["0000:18:00.0", "0000:9a:00.0"])
    doc = checked(spec, tmp_path)  # defines on the test driver: no refused <sibling>
    assert spec.guest_cells and spec.distances == {} and not list(doc.iter("sibling"))
    assert any("NUMA distance 0->1 is 10" in note for note in spec.notes), spec.notes


def test_more_than_32_ports_on_one_guest_bus_are_refused(tmp_path):
    """33 NICs on root ports of one host root complex (AMD-style root ports, eight functions per
    device number) and one on another: mirrored, the first complex's pxb-pcie would need 33 root
    ports on its bus, which has 32 device numbers: refused with the reason, not an XML libvirt
    rejects."""
    b = HostBuilder(str(tmp_path))
    b.iommu("amd", 1)
    b.cmdline("BOOT_IMAGE=/vmlinuz ro amd_iommu=on")
    b.cpuinfo("AMD EPYC", 48, vendor="AuthenticAMD")
    b.firmware()
    b.numa_node(0, b.cpu_topology(1, 4, 2)[0], 64)
    nics = []
    for rbus, count in ((0x00, 33), (0x80, 1)):
        rb = b.root_bus(0, rbus, numa=0)
        for n in range(count):
            port = b.bridge(rb, f"0000:{rbus:02x}:{1 + n // 8:02x}.{n % 8}", "1022", "14ab",
                            secondary_bus=rbus + 1 + n)
            nics.append(f"0000:{rbus + 1 + n:02x}:00.0")
            b.function(port, nics[-1], *CX7, driver="vfio-pci", bars=[(0, 32 * MiB, BAR64_PREF)])
    with pytest.raises(Refused, match="more than 32 ports on one guest bus"):
        spec_for(tmp_path, nics)
    spec = spec_for(tmp_path, nics[1:])  # 32 fit
    assert sum(c.model == "pcie-root-port" for c in spec.controllers) == 33


def test_a_group_that_goes_whole_is_viable_for_that_request(tmp_path):
    """Without ACS the switch's GPUs and NIC share one IOMMU group, which is not viable on its
    own (a NIC beside NVIDIA functions); asking for all of it gives the guest the whole group,
    for xml and bind alike; asking for part of it still names what would be taken."""
    from gpuvfio.ops import binding
    from gpuvfio.ops.binding import BindPolicy
    from gpuvfio.ops.context import Context

    switch_host(tmp_path, acs=False)
    everything = ["0000:18:00.0", "0000:19:00.0", "0000:1a:00.0"]
    spec = spec_for(tmp_path, everything, qemu_version="8.2")
    checked(spec, tmp_path)
    assert len(spec.ports) == 3 and spec.cliques == []  # one group: no clique, but a guest
    with pytest.raises(Refused, match=r"not viable: shares IOMMU group \d+ with 0000:1a:00.0") as info:
        spec_for(tmp_path, everything[:2])
    assert "0000:19:00.0 [" not in str(info.value)  # only what is not asked for is named
    ctx = Context(host=HostRoot(str(tmp_path)))
    _plan, report = binding.plan_report(ctx, [PciAddress.parse(a) for a in everything], BindPolicy(), uri="none")
    assert report.refused == []
    assert any(c.check_id == "group_viable" and "goes whole" in c.message for c in report.checks)
    _plan, report = binding.plan_report(ctx, [PciAddress.parse(a) for a in everything[:2]], BindPolicy(), uri="none")
    assert [c.check_id for c in report.refused] == ["group_viable"]
