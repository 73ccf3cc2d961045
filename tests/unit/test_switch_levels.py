"""The whole switch hierarchy mirrored and NCCL's paths compared (issue 37 items 2 and 3).

Generated hosts with two and three levels of PCIe switches below one root port, a GPU on another
root port of the same socket and one on the other socket. What NCCL would compute between two
GPUs is computed on both sides by one reference of NCCL's rules (gpuvfio_ncclpaths, NCCL
v2.30.7-1): on the host from the tree NCCL's sysfs reader builds, in the guest from gpuvfio's
topology file as NCCL's tokenizer reads it. Every domain is RelaxNG-validated and defined in
libvirt's test driver."""

from __future__ import annotations

import dataclasses

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.domain import nccl_topo
from gpuvfio.domain.layout import switch_levels
from gpuvfio.guest.payload.gpuvfio_ncclpaths import gpu_paths
from gpuvfio.guest.payload.gpuvfio_ncclxml import load_topology
from gpuvfio.host.topology import position
from gpuvfio.ops.context import Context
from gpuvfio.ops.domains import nccl_topology_file, provision_xml
from gpuvfio.domain.request import domain_request
from gpuvfio.host.root import HostRoot
from tests.hostbuilder import BAR32, BAR64_PREF, GiB, HostBuilder, MiB
from tests.unit.test_layout import checked

A = PciAddress.parse
L40S = ("10de", "26b9", "030200")
CX7 = ("15b3", "1021", "020000")
GPU_BARS = [(0, 16 * MiB, BAR32), (1, 32 * GiB, BAR64_PREF), (3, 32 * MiB, BAR64_PREF)]
PLX = ("10b5", "c010")  # a Broadcom/PLX PEX switch that is not one NCCL folds
BCM_GEN5 = ("1000", "c030")  # Broadcom PEX89xxx: NCCL folds its second level by subsystem id


def _device(b, port, address, kind):
    vendor, device, klass = kind
    b.function(port, address, vendor, device, klass, driver="vfio-pci", link=(4, 16),
               bars=GPU_BARS if vendor == "10de" else [(0, 32 * MiB, BAR64_PREF)])


def cascade_host(root, *, switch=PLX, subsystems=None) -> HostBuilder:
    """Socket 0, root complex 0x10: root port 10:01.0 -> switch P (11:00.0) ->
    - P's port 12:00.0 -> leaf switch L1 (13:00.0) -> GPUs 15:00.0 and 16:00.0;
    - P's port 12:01.0 -> leaf switch L2 (17:00.0) -> GPU 19:00.0 and a NIC 1a:00.0;
    - P's port 12:02.0 -> switch M (1b:00.0) -> switch N (1d:00.0) -> GPUs 1f:00.0 and 20:00.0;
    root port 10:02.0 -> GPU 21:00.0. Socket 1, root complex 0x80: root port 80:01.0 -> GPU 81:00.0.
    ``subsystems``: (upper, lower) subsystem ids of the switches' bridges (P and M are upper)."""
    b = HostBuilder(str(root))
    b.iommu("intel", 2)
    b.cmdline("BOOT_IMAGE=/vmlinuz ro intel_iommu=on iommu=pt")
    b.cpuinfo("Intel(R) Xeon(R) Gold 6448Y", 46)
    b.firmware()
    cpus = b.cpu_topology(2, 8, 2)
    for node in (0, 1):
        b.numa_node(node, cpus[node], 64, {1048576: (32, 32)})
    upper, lower = subsystems or (None, None)

    def sw(parent, up, bus, ports, sub):
        upstream = b.bridge(parent, up, *switch, secondary_bus=bus, link=(5, 16), subsystem=sub)
        return [b.bridge(upstream, f"0000:{bus:02x}:{n:02x}.0", *switch, secondary_bus=first, link=(5, 16),
                         subsystem=sub) for n, first in enumerate(ports)]

    rb = b.root_bus(0, 0x10, numa=0)
    rp = b.bridge(rb, "0000:10:01.0", "8086", "352a", secondary_bus=0x11, link=(5, 16))
    p_to_l1, p_to_l2, p_to_m = sw(rp, "0000:11:00.0", 0x12, (0x13, 0x17, 0x1b), upper)
    for port, address in zip(sw(p_to_l1, "0000:13:00.0", 0x14, (0x15, 0x16), lower), ("15", "16")):
        _device(b, port, f"0000:{address}:00.0", L40S)
    gpu_port, nic_port = sw(p_to_l2, "0000:17:00.0", 0x18, (0x19, 0x1a), lower)
    _device(b, gpu_port, "0000:19:00.0", L40S)
    _device(b, nic_port, "0000:1a:00.0", CX7)
    (m_to_n,) = sw(p_to_m, "0000:1b:00.0", 0x1c, (0x1d,), upper)
    for port, address in zip(sw(m_to_n, "0000:1d:00.0", 0x1e, (0x1f, 0x20), lower), ("1f", "20")):
        _device(b, port, f"0000:{address}:00.0", L40S)
    other = b.bridge(rb, "0000:10:02.0", "8086", "352b", secondary_bus=0x21, link=(5, 16))
    _device(b, other, "0000:21:00.0", L40S)
    rb1 = b.root_bus(0, 0x80, numa=1)
    _device(b, b.bridge(rb1, "0000:80:01.0", "8086", "352a", secondary_bus=0x81, link=(5, 16)),
            "0000:81:00.0", L40S)
    b.modules(["vfio_pci", "vfio_iommu_type1", "vfio"])
    return b


ALL = ["0000:15:00.0", "0000:16:00.0", "0000:19:00.0", "0000:1a:00.0", "0000:1f:00.0", "0000:20:00.0",
       "0000:21:00.0", "0000:81:00.0"]


def provisioned(root, addresses, **options):
    ctx = Context(host=HostRoot(str(root)))
    request = domain_request("cascade", vcpus=8, memory="16G", qemu_version="9.2.0", **options)
    return ctx, provision_xml(ctx, [A(a) for a in addresses], request)


def guest_depths(spec) -> dict[PciAddress, int]:
    """Each device's count of emulated switches above it in the guest."""
    return {port.functions[0].address: len(nccl_topo.switch_chain(spec.controllers, port)) for port in spec.ports}


def file_paths(ctx, p) -> dict[tuple[PciAddress, PciAddress], str]:
    """The path types NCCL's rules give between the GPUs of the guest's file, by host address."""
    devices = nccl_topo.predicted_addresses(p.spec.controllers, p.spec.ports)
    host_of = {d.address: d.port.functions[0].address for d in devices}
    found = gpu_paths(load_topology(nccl_topology_file(ctx, p)))
    return {tuple(sorted((host_of[a], host_of[b]))): kind for (a, b), kind in found.items()}


def test_every_switch_level_is_mirrored_and_the_paths_are_the_hosts(tmp_path):
    cascade_host(tmp_path)
    ctx, p = provisioned(tmp_path, ALL)
    checked(p.spec, tmp_path)  # libvirt's schema and test driver take it
    inventory = p.inventory.functions
    want = {A(a): len(switch_levels(position(inventory[A(a)]))) for a in ALL}
    assert want[A("0000:15:00.0")] == 2 and want[A("0000:1f:00.0")] == 3 and want[A("0000:21:00.0")] == 0
    assert guest_depths(p.spec) == want
    kinds = {(str(pair.a), str(pair.b)): (pair.host, pair.guest) for pair in p.paths}
    assert kinds[("0000:15:00.0", "0000:16:00.0")] == ("PIX", "PIX")  # one leaf switch
    assert kinds[("0000:15:00.0", "0000:19:00.0")] == ("PXB", "PXB")  # across leaves of one parent
    assert kinds[("0000:15:00.0", "0000:1f:00.0")] == ("PXB", "PXB")  # two levels against three
    assert kinds[("0000:1f:00.0", "0000:20:00.0")] == ("PIX", "PIX")
    assert kinds[("0000:15:00.0", "0000:21:00.0")] == ("PHB", "PHB")  # another root port, same socket
    assert kinds[("0000:15:00.0", "0000:81:00.0")] == ("SYS", "SYS")  # the other socket
    assert len(p.paths) == 21 and all(pair.same for pair in p.paths)  # 7 GPUs
    assert file_paths(ctx, p) == {(pair.a, pair.b): pair.host for pair in p.paths}
    assert not [w for w in p.spec.warnings if "NCCL's path" in w]
    assert any(n.startswith("NCCL's path between GPUs, the same") for n in p.spec.notes)


def test_the_file_nests_a_pci_node_per_host_switch(tmp_path):
    """NCCL's sysfs reader makes one <pci> of each switch (its upstream port), rewinding two
    path components at a time; the guest's file has the same nesting, with the host switch's ids."""
    cascade_host(tmp_path)
    ctx, p = provisioned(tmp_path, ["0000:1f:00.0", "0000:20:00.0", "0000:15:00.0"])
    (system,) = load_topology(nccl_topology_file(ctx, p))

    def depth_of(node, depth=0, out=None):
        out = {} if out is None else out
        for sub in node.subs:
            if sub.name == "pci":
                if sub.get("class") != "0x060400":
                    out[sub.get("busid")] = depth
                depth_of(sub, depth + 1, out)
        return out

    depths = sorted(depth_of(system.subs[0]).values())
    assert depths == [2, 3, 3]  # below P and L1; below P, M and N
    bridges = [sub for sub in system.subs[0].subs if sub.name == "pci"]
    assert [(n.get("vendor"), n.get("device")) for n in bridges] == [("0x10b5", "0xc010")]
    host = p.inventory.functions
    assert nccl_topo.nccl_chain(host[A("0000:1f:00.0")]) == (A("0000:11:00.0"), A("0000:1b:00.0"), A("0000:1d:00.0"))


def test_a_flat_guest_says_which_paths_differ(tmp_path):
    cascade_host(tmp_path)
    _ctx, p = provisioned(tmp_path, ["0000:15:00.0", "0000:16:00.0", "0000:19:00.0"], topology="flat")
    differ = [pair for pair in p.paths if not pair.same]
    assert {(pair.host, pair.guest) for pair in differ} == {("PIX", "PHB"), ("PXB", "PHB")}
    assert not any(pair.guest_p2p for pair in differ) and all(pair.host_p2p for pair in differ)
    (warning,) = [w for w in p.spec.warnings if "NCCL's path" in w]
    assert "host PIX (P2P), guest PHB (no P2P): 0000:15:00.0-0000:16:00.0" in warning
    json_pairs = p.layout_json()["nccl_paths"]
    assert len(json_pairs) == 3 and sum(not pair["same"] for pair in json_pairs) == 3


def test_a_broadcom_switch_is_folded_on_both_sides(tmp_path):
    """A Broadcom PEX89xxx shows two levels of bridges that NCCL folds into one
    (ncclTopoFlattenBcmSwitches, by subsystem id 0x0xxx above 0x1xxx): GPUs under two of its
    lower switches are PIX to NCCL on the host, and the guest's file carries the host switch's
    ids so that NCCL folds it there too."""
    cascade_host(tmp_path, switch=BCM_GEN5, subsystems=(("1000", "0100"), ("1000", "1100")))
    ctx, p = provisioned(tmp_path, ["0000:15:00.0", "0000:16:00.0", "0000:19:00.0"])
    kinds = {(str(pair.a), str(pair.b)): (pair.host, pair.guest) for pair in p.paths}
    assert kinds[("0000:15:00.0", "0000:19:00.0")] == ("PIX", "PIX")
    assert all(pair.same for pair in p.paths)


def linked_broadcom_host(root, *, linked: bool) -> HostBuilder:
    """The Broadcom cascade, and a second Broadcom PEX89xxx on root port 10:03.0 (upstream port
    30:00.0 -> 31:00.0 -> GPU 32:00.0), joined to the first (11:00.0) by a virtual switch link
    in both directions where ``linked``, as Broadcom's pci_switch_link module lists it."""
    b = cascade_host(root, switch=BCM_GEN5, subsystems=(("1000", "0100"), ("1000", "1100")))
    rp = b.bridge(b.root_bus(0, 0x10, numa=0), "0000:10:03.0", "8086", "352c", secondary_bus=0x30, link=(5, 16))
    up = b.bridge(rp, "0000:30:00.0", *BCM_GEN5, secondary_bus=0x31, link=(5, 16), subsystem=("1000", "0100"))
    down = b.bridge(up, "0000:31:00.0", *BCM_GEN5, secondary_bus=0x32, link=(5, 16), subsystem=("1000", "0100"))
    _device(b, down, "0000:32:00.0", L40S)
    if linked:
        b.switch_link("0000:11:00.0", "0000:30:00.0")
        b.switch_link("0000:30:00.0", "0000:11:00.0")
    return b


@pytest.mark.parametrize("linked", [True, False])
def test_broadcom_virtual_switch_links_are_the_hosts_and_no_guests(tmp_path, linked):
    """NCCL joins two Broadcom switches a virtual switch link connects (src/os/linux.cc
    ncclOsGetBcmLinks, v2.30.7-1): GPUs below them are PXB on the host, not PHB. No guest has
    the link, so the plan says the pair differs, and why, rather than that it is the same."""
    linked_broadcom_host(tmp_path, linked=linked)
    functions = read_functions(tmp_path)
    assert functions[A("0000:11:00.0")].switch_links == ([A("0000:30:00.0")] if linked else [])
    assert functions[A("0000:11:00.0")].to_json()["switch_links"] == (["0000:30:00.0"] if linked else [])
    _ctx, p = provisioned(tmp_path, ["0000:15:00.0", "0000:32:00.0"])
    (pair,) = p.paths
    assert (pair.host, pair.guest, pair.host_p2p, pair.guest_p2p) == (
        ("PXB", "PHB", True, False) if linked else ("PHB", "PHB", False, False))
    warnings = [w for w in p.spec.warnings if "NCCL's path" in w]
    if linked:
        (warning,) = warnings
        assert "host PXB (P2P), guest PHB (no P2P): 0000:15:00.0-0000:32:00.0" in warning
        assert ("Broadcom virtual switch links (0000:11:00.0 -> 0000:30:00.0, 0000:30:00.0 -> 0000:11:00.0)"
                in warning)
    else:
        assert not warnings


def test_a_virtual_link_to_a_switch_no_gpu_is_under_changes_nothing(tmp_path):
    """A link whose far end holds none of the guest's GPUs is not in NCCL's system (the target
    is no node of it), and the plan does not name it."""
    from gpuvfio.ops.nccl_paths import virtual_links

    b = linked_broadcom_host(tmp_path, linked=True)
    b.switch_link("0000:11:00.0", "0000:99:00.0")  # no such device: NCCL skips it
    b.switch_link("0000:11:00.0", "not-a-bus-id")
    for n in range(300):  # names NCCL skips, sorted before the real link: they hide nothing
        b.switch_link("0000:11:00.0", f"0000:00:00.0-{n:03d}")
    b.switch_link("0000:11:00.0", "0000:11:00.0")  # itself
    functions = read_functions(tmp_path)
    assert functions[A("0000:11:00.0")].switch_links == [A("0000:30:00.0"), A("0000:99:00.0")]
    gpus = [functions[A("0000:15:00.0")], functions[A("0000:16:00.0")]]
    assert virtual_links(gpus, functions) == []
    assert virtual_links([*gpus, functions[A("0000:32:00.0")]], functions) == [
        (A("0000:11:00.0"), A("0000:30:00.0")), (A("0000:30:00.0"), A("0000:11:00.0"))]
    tree = nccl_topo.host_topology_tree(gpus, functions, cpu_vendor=None)
    assert [n.get("target") for n in tree.iter("pcilink")] == ["0000:30:00.0", "0000:99:00.0"]
    _ctx, p = provisioned(tmp_path, ["0000:15:00.0", "0000:16:00.0"])
    assert all(pair.same and pair.host == "PIX" for pair in p.paths)


def test_bridges_that_are_no_switch_tree_get_root_ports(tmp_path):
    """Below a PCIe-to-PCI bridge NCCL's rewind-by-two lands elsewhere than on the switch (the
    GPU under it hangs from the downstream port and the root port, the other from the switch):
    to NCCL they meet only at the CPU. Emulated switches would make them PIX; root ports of their
    own keep NCCL's PHB, and the plan says why."""
    b = cascade_host(tmp_path)
    port = b.bridge(b.root_bus(0, 0x40, numa=0), "0000:40:01.0", "8086", "352a", secondary_bus=0x41, link=(5, 16))
    up = b.bridge(port, "0000:41:00.0", *PLX, secondary_bus=0x42, link=(5, 16))
    down = [b.bridge(up, f"0000:42:0{n}.0", *PLX, secondary_bus=0x43 + 2 * n, link=(5, 16)) for n in range(2)]
    pci_bridge = b.bridge(down[0], "0000:43:00.0", "12d8", "e113", secondary_bus=0x44, link=(1, 1))
    _device(b, pci_bridge, "0000:44:00.0", L40S)
    _device(b, down[1], "0000:45:00.0", L40S)
    _ctx, p = provisioned(tmp_path, ["0000:44:00.0", "0000:45:00.0"])
    (pair,) = p.paths
    assert pair.host == "PHB"  # 44:00.0 hangs from 42:00.0 and 40:01.0 to NCCL, 45:00.0 from 41:00.0
    assert pair.same and set(guest_depths(p.spec).values()) == {0}
    assert any("not a tree of PCIe switches" in note for note in p.spec.notes)
    assert not any("NOT the same" in w for w in p.spec.warnings)


@pytest.mark.parametrize("addresses", [["0000:15:00.0", "0000:81:00.0"], ["0000:15:00.0", "0000:21:00.0"]])
def test_gpus_on_other_root_ports_stay_apart(tmp_path, addresses):
    cascade_host(tmp_path)
    _ctx, p = provisioned(tmp_path, addresses)
    assert set(guest_depths(p.spec).values()) == {0}
    assert [c.model for c in p.spec.controllers].count("pcie-switch-upstream-port") == 0
    assert all(pair.same for pair in p.paths) and p.paths[0].host in ("PHB", "SYS")


def test_verify_holds_the_guest_to_the_pairs_the_plan_showed(tmp_path):
    """What verify hands the guest's checks (ops.nccl_paths.expected_paths, from the expected
    functions: GPUs only, each pair once) is what the plan showed for the host."""
    from gpuvfio.ops.nccl_paths import expected_paths

    cascade_host(tmp_path)
    _ctx, p = provisioned(tmp_path, ALL)
    functions = p.inventory.functions
    want = expected_paths(functions, [A(a) for a in ALL] + [A("0000:15:00.0")], "GenuineIntel")
    assert want == {(str(pair.a), str(pair.b)): pair.host for pair in p.paths}
    assert ("0000:15:00.0", "0000:1a:00.0") not in want  # the NIC is no GPU
    assert expected_paths(functions, [A("0000:15:00.0"), A("0000:1a:00.0")], None) == {}


def test_nccl_stops_at_a_bus_id_of_another_shape():
    """checkBDFFormat (src/graph/xml.cc, v2.30.7-1) takes only "DDDD:BB:SS.F": a bridge with a
    wider domain, as behind Intel VMD, ends NCCL's walk at the CPU."""
    from gpuvfio.host.model import PciFunction

    def fn(address, parents):
        return PciFunction(A(address), "10de", "26b9", "030200", parents=[A(p) for p in parents])

    cascade = fn("0000:05:00.0", ["0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"])
    assert nccl_topo.nccl_chain(cascade) == (A("0000:01:00.0"), A("0000:03:00.0"))
    vmd = fn("10000:e2:00.0", ["10000:e0:06.0", "10000:e1:00.0"])
    assert nccl_topo.nccl_chain(vmd) == ()
    assert nccl_topo.nccl_chain(fn("0000:00:1f.0", [])) == () and nccl_topo.nccl_chain(
        fn("0000:01:00.0", ["0000:00:01.0"])) == ()


def test_the_host_tree_is_what_nccls_sysfs_reader_builds(tmp_path):
    """Every attribute of the host's tree: a <cpu> per NUMA node of the top bridge (-1 without
    one), the CPU vendor where known, each <pci> with class, ids and NCCL's link attributes."""
    cascade_host(tmp_path)
    functions = read_functions(tmp_path)
    gpus = [functions[A(a)] for a in ("0000:15:00.0", "0000:81:00.0")]
    tree = nccl_topo.host_topology_tree(gpus, functions, cpu_vendor="GenuineIntel")
    cpus = tree.findall("cpu")
    assert [c.attrib for c in cpus] == [{"numaid": "0", "arch": "x86_64", "vendor": "GenuineIntel"},
                                        {"numaid": "1", "arch": "x86_64", "vendor": "GenuineIntel"}]
    chain = [n.attrib for n in cpus[0].iter("pci")]
    assert [n["busid"] for n in chain] == ["0000:11:00.0", "0000:13:00.0", "0000:15:00.0"]
    assert chain[0] == {"busid": "0000:11:00.0", "class": "0x060400", "vendor": "0x10b5", "device": "0xc010",
                        "subsystem_vendor": "0x0000", "subsystem_device": "0x0000",
                        "link_speed": "32.0 GT/s PCIe", "link_width": "16"}
    assert (chain[2]["class"], chain[2]["link_speed"], chain[2]["link_width"]) == ("0x030200", "16.0 GT/s PCIe", "16")
    assert [n.get("busid") for n in cpus[1].iter("pci")] == ["0000:81:00.0"]  # on a root port: from the CPU
    bare = nccl_topo.host_topology_tree(gpus[:1], functions, cpu_vendor=None)
    assert bare.find("cpu").attrib == {"numaid": "0", "arch": "x86_64"}
    # A bridge the inventory does not hold is one to NCCL; a node without one is NUMA -1.
    partial = {a: f for a, f in functions.items() if a != A("0000:13:00.0")}
    leaf = [n.attrib for n in nccl_topo.host_topology_tree(gpus[:1], partial, cpu_vendor=None).iter("pci")][1]
    assert leaf == {"busid": "0000:13:00.0", "class": "0x060400"}
    lost = dataclasses.replace(functions[A("0000:11:00.0")], numa_node=None)
    assert nccl_topo.host_topology_tree(gpus[:1], {**functions, lost.address: lost},
                                        cpu_vendor=None).find("cpu").get("numaid") == "-1"


def read_functions(root):
    from gpuvfio.host.inventory import read_inventory

    return read_inventory(HostRoot(str(root))).functions


@pytest.mark.parametrize("parents, device, chain", [
    (["0000:00:01.0", "0000:01:00.0"], "0000:02:00.0", ["0000:00:01.0"]),  # below a root port's bridge
    (["0000:00:01.0", "10000:01:00.0"], "0000:02:00.0", []),  # the next one up is no bus id to NCCL
    (["0000:00:01.0", "0000:01:00.0"], "10000:e2:00.0", ["0000:00:01.0"]),  # only the bridges are read
])
def test_nccls_rewind_by_two_in_each_shape(parents, device, chain):
    from gpuvfio.host.model import PciFunction

    fn = PciFunction(A(device), "10de", "26b9", "030200", parents=[A(p) for p in parents])
    assert nccl_topo.nccl_chain(fn) == tuple(A(c) for c in chain)


def probe_of(spec) -> list[dict]:
    """The PCI lines a guest built as planned shows: each controller and device with the bridge above it."""
    buses = nccl_topo.guest_buses(spec.controllers)
    by_index = {c.index: c for c in spec.controllers}

    def address(c):
        return f"0000:{buses[c.parent] if c.parent else 0:02x}:{c.slot or 0:02x}.0"

    lines = [{"address": address(c), "vendor_id": "1b36", "device_id": "000c",
              "upstream": address(by_index[c.parent]) if c.parent in by_index else None}
             for c in spec.controllers if c.model != "pcie-expander-bus"]
    for port in spec.ports:
        fn = port.functions[0]
        lines.append({"address": f"0000:{buses[port.index]:02x}:00.0", "vendor_id": fn.vendor_id,
                      "device_id": fn.device_id, "upstream": address(by_index[port.index])})
    return lines


def test_the_guests_own_switches_are_found_level_by_level(tmp_path):
    """map_guest reads each switch level up the guest's own bridges, with the host switch each
    stands for; a level the guest does not show is a mismatch, not a crash."""
    cascade_host(tmp_path)
    _ctx, p = provisioned(tmp_path, ["0000:15:00.0", "0000:16:00.0", "0000:1f:00.0", "0000:20:00.0"])
    probe = probe_of(p.spec)
    mapped = nccl_topo.map_guest(p.spec.controllers, p.spec.ports, probe)
    predicted = nccl_topo.predicted_addresses(p.spec.controllers, p.spec.ports)
    assert [(d.address, d.switches) for d in mapped] == [(d.address, d.switches) for d in predicted]
    deepest = next(d for d in mapped if d.port.functions[0].address == A("0000:1f:00.0"))
    assert [s.host for s in deepest.switches] == [A("0000:11:00.0"), A("0000:1b:00.0"), A("0000:1d:00.0")]
    middle = deepest.switches[1].busid
    cut = [line for line in probe if line["address"] != middle]
    with pytest.raises(nccl_topo.TopologyMismatch, match="does not show the 3 switch level"):
        nccl_topo.map_guest(p.spec.controllers, p.spec.ports, cut)


def test_a_switch_node_without_the_hosts_functions_says_only_what_it_is(tmp_path):
    cascade_host(tmp_path)
    functions = read_functions(tmp_path)
    from gpuvfio.domain.layout import GuestPort

    device = nccl_topo.GuestDevice(GuestPort(3, [functions[A("0000:15:00.0")]]), "0000:04:00.0",
                                   (nccl_topo.GuestSwitch("0000:02:00.0", A("0000:11:00.0")),))
    tree = nccl_topo.topology_tree([device], [(0, [0])], {}, cpu_vendor=None)
    assert tree.find("cpu/pci").attrib == {"busid": "0000:02:00.0", "class": "0x060400"}


def test_the_host_tree_takes_the_narrower_of_each_device_and_its_port(tmp_path):
    """NCCL's sysfs reader writes the smaller of a device's and its parent port's maximum
    (nccl_topo.link_attributes): a GPU in a slot of eight lanes is x8 in the host's tree."""
    cascade_host(tmp_path)
    functions = read_functions(tmp_path)
    port = functions[A("0000:14:00.0")]
    narrow = {**functions, port.address: dataclasses.replace(port, link=dataclasses.replace(port.link, max_width=8))}
    tree = nccl_topo.host_topology_tree([narrow[A("0000:15:00.0")]], narrow, cpu_vendor=None)
    gpu = [n for n in tree.iter("pci") if n.get("busid") == "0000:15:00.0"][0]
    assert (gpu.get("link_speed"), gpu.get("link_width")) == ("16.0 GT/s PCIe", "8")


def test_a_recording_carries_the_virtual_switch_links(tmp_path):
    """dump-host records each link's names (a directory per switch, one per peer), and the
    host loaded from the recording has the same links and the same NCCL paths."""
    from gpuvfio.host.fixture import load_fixture
    from gpuvfio.host.recording import dump_host

    linked_broadcom_host(tmp_path / "live", linked=True)
    text = dump_host(HostRoot(str(tmp_path / "live")))
    assert "D sys/kernel/pci_switch_link/virtual_switch_links/0000:11:00.0/0000:30:00.0" in text.splitlines()
    replayed = load_fixture(text, str(tmp_path / "replayed"))
    functions = read_functions(replayed)
    assert functions[A("0000:30:00.0")].switch_links == [A("0000:11:00.0")]
    _ctx, p = provisioned(replayed, ["0000:15:00.0", "0000:32:00.0"])
    assert [(pair.host, pair.guest) for pair in p.paths] == [("PXB", "PHB")]
