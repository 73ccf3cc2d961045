"""Edges of the host topology: where a function hangs when nothing is above it, bridges that are not
switches, the farthest word of a clique, the 16-clique limit of QEMU's x-nv-gpudirect-clique, the
notes a plan prints when GPUs are left out, and IOMMU groups shared by non-NVIDIA devices."""

from gpuvfio.address import PciAddress
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.root import HostRoot
from gpuvfio.host.topology import (LEGEND, MAX_CLIQUES, NODE, PHB, PIX, PXB, SYS, p2p_cliques, position,
                                   relation)
from tests.hostbuilder import HostBuilder

A = PciAddress.parse
INTEL, ROOT_PORT, I210 = "8086", "352a", "1533"
BROADCOM, SWITCH_PORT = "1000", "c030"
PLX, PCI_BRIDGE = "10b5", "8112"  # PEX 8112: a PCIe-to-PCI bridge, no switch
NVIDIA, H100 = "10de", "2330"
AMD = "AuthenticAMD"


def _host(root, *, nodes: int = 1) -> HostBuilder:
    b = HostBuilder(str(root))
    b.iommu("intel", 1)
    for node in range(nodes):
        b.numa_node(node, list(range(8 * node, 8 * node + 8)), 16)
    return b


def _gpu(b: HostBuilder, parent, address: str, **kw):
    return b.function(parent, address, NVIDIA, H100, "030200", driver="vfio-pci", **kw)


def _switch_pair(b: HostBuilder, rb, root_port: str, bus: int) -> list[str]:
    """Root port ``root_port`` -> switch upstream port on ``bus`` -> two downstream ports, a GPU on each."""
    rp = b.bridge(rb, root_port, INTEL, ROOT_PORT, secondary_bus=bus)
    up = b.bridge(rp, f"0000:{bus:02x}:00.0", BROADCOM, SWITCH_PORT, secondary_bus=bus + 1)
    gpus = []
    for n in range(2):
        ds = b.bridge(up, f"0000:{bus + 1:02x}:{n:02x}.0", BROADCOM, SWITCH_PORT, secondary_bus=bus + 2 + n)
        gpus.append(f"0000:{bus + 2 + n:02x}:00.0")
        _gpu(b, ds, gpus[-1])
    return gpus


def _functions(b: HostBuilder):
    return read_inventory(HostRoot(b.root)).functions


def _gpus(b: HostBuilder, order: list[str] | None = None):
    functions = _functions(b)
    if order is not None:
        return [functions[A(a)] for a in order]
    return [f for f in functions.values() if f.is_nvidia_gpu]


def _cliques(plan) -> list[tuple[list[str], str]]:
    return [([str(m) for m in c.members], c.relation) for c in plan.cliques]


# -- positions and words -------------------------------------------------------------------------
def test_a_gpu_on_the_root_bus_hangs_from_its_own_root_complex(tmp_path):
    """A GPU with no bridge above it (a root-complex-integrated slot, a VM's root bus) must still
    be placed, on the root complex its own address names, not make the topology fail."""
    b = _host(tmp_path)
    rb = b.root_bus(0, 0x20, numa=0)
    _gpu(b, rb, "0000:20:05.0")
    pos = position(_functions(b)[A("0000:20:05.0")])
    assert pos.path == () and pos.root_port is None and pos.switch is None and pos.switches == ()
    assert str(pos.root_complex) == "0000:20" and pos.numa_node == 0


def test_a_bridge_with_no_bridge_below_is_no_switch_and_counts_as_one_more_hop(tmp_path):
    """A GPU behind a PCIe-to-PCI bridge under a switch's port crosses more than one switch to reach
    the switch's other ports: nvidia-smi's PXB from either end, never PIX (which would claim a
    closer path than the hardware has)."""
    b = _host(tmp_path)
    rb = b.root_bus(0, 0, numa=0)
    rp = b.bridge(rb, "0000:00:01.0", INTEL, ROOT_PORT, secondary_bus=0x10)
    up = b.bridge(rp, "0000:10:00.0", BROADCOM, SWITCH_PORT, secondary_bus=0x11)
    ds1 = b.bridge(up, "0000:11:00.0", BROADCOM, SWITCH_PORT, secondary_bus=0x12)
    pci = b.bridge(ds1, "0000:12:00.0", PLX, PCI_BRIDGE, secondary_bus=0x13)
    _gpu(b, pci, "0000:13:00.0")
    for n, bus in ((1, 0x14), (2, 0x15)):
        ds = b.bridge(up, f"0000:11:{n:02x}.0", BROADCOM, SWITCH_PORT, secondary_bus=bus)
        _gpu(b, ds, f"0000:{bus:02x}:00.0")
    functions = _functions(b)
    behind, near, other = (position(functions[A(a)]) for a in ("0000:13:00.0", "0000:14:00.0", "0000:15:00.0"))
    assert behind.switches == (A("0000:10:00.0"),) and behind.switch == A("0000:10:00.0")
    assert len(behind.path) == 4 and behind.root_port == A("0000:00:01.0")
    assert relation(behind, near) == PXB and relation(near, behind) == PXB
    assert relation(near, other) == PIX and relation(other, near) == PIX


# -- P2P cliques: which GPUs, and the word each clique and each lonely GPU is given ------------------
def test_gpus_without_a_numa_node_are_sys_apart_unless_the_host_has_one_node(tmp_path):
    """Two root complexes whose devices report no NUMA node: on a multi-node host nothing shows
    they share a socket (SYS); only a caller that knows the host has one node may call it NODE."""
    b = _host(tmp_path)
    for bus in (0x40, 0x80):
        rb = b.root_bus(0, bus, numa=-1)
        rp = b.bridge(rb, f"0000:{bus:02x}:01.0", INTEL, ROOT_PORT, secondary_bus=bus + 1)
        _gpu(b, rp, f"0000:{bus + 1:02x}:00.0")
    gpus = _gpus(b)
    pair = ["0000:41:00.0", "0000:81:00.0"]
    assert _cliques(p2p_cliques(gpus, acs_override=False, cpu_vendor=AMD)) == [(pair, SYS)]
    assert _cliques(p2p_cliques(gpus, acs_override=False, cpu_vendor=AMD, single_node=True)) == [(pair, NODE)]


def test_a_forced_clique_is_named_for_its_farthest_pair_and_serialised_whole(tmp_path):
    """A clique's word is its farthest pair (PHB here, though two members are PIX apart): the forced
    warning and the exported plan must not understate how far peer traffic travels."""
    b = _host(tmp_path)
    rb = b.root_bus(0, 0, numa=0)
    near = _switch_pair(b, rb, "0000:00:01.0", 0x10)
    rp = b.bridge(rb, "0000:00:02.0", INTEL, ROOT_PORT, secondary_bus=0x20)
    _gpu(b, rp, "0000:20:00.0")
    plan = p2p_cliques(_gpus(b), acs_override=False, cpu_vendor="GenuineIntel", force=True)
    members = near + ["0000:20:00.0"]
    assert _cliques(plan) == [(members, PHB)]
    assert plan.forced == [f"--p2p force: P2P clique 0 ({', '.join(members)}) spans PHB (PATH_PHB), beyond "
                           "NCCL's default level PATH_PXB on this host"]
    assert plan.to_json() == {
        "cliques": [{"id": 0, "members": members, "relation": PHB,
                     "why": f"{LEGEND[PHB]}, each in its own IOMMU group (ACS sends peer traffic through the IOMMU)"}],
        "notes": plan.notes}
    assert plan.clique_of(A("0000:20:00.0")) == 0


def test_cliques_do_not_depend_on_the_order_the_gpus_are_named(tmp_path):
    """GPUs named interleaved across two switches, with a GPU on a root port of its own among them (as a
    user may list them), still make one clique per switch, and each GPU is told the clique it is in."""
    b = _host(tmp_path)
    rb = b.root_bus(0, 0, numa=0)
    a0, a1 = _switch_pair(b, rb, "0000:00:01.0", 0x10)
    b0, b1 = _switch_pair(b, rb, "0000:00:02.0", 0x20)
    _gpu(b, b.bridge(rb, "0000:00:03.0", INTEL, ROOT_PORT, secondary_bus=0x30), "0000:30:00.0")
    alone = "0000:30:00.0"
    plan = p2p_cliques(_gpus(b, [a0, alone, b0, a1, b1]), acs_override=False, cpu_vendor="GenuineIntel")
    assert _cliques(plan) == [([a0, a1], PIX), ([b0, b1], PIX)]
    assert [plan.clique_of(A(a)) for a in (alone, a0, a1, b0, b1)] == [None, 0, 0, 1, 1]


def test_a_clique_word_is_its_farthest_pair_whatever_the_order(tmp_path):
    """One GPU whose firmware gives no NUMA node is SYS from a GPU on another root complex, though
    each is within NODE of the rest: the forced clique must still say SYS, wherever that GPU is named."""
    b = _host(tmp_path, nodes=2)
    rb = b.root_bus(0, 0x10, numa=0)
    nodeless = b.bridge(rb, "0000:10:01.0", INTEL, ROOT_PORT, secondary_bus=0x11, numa=-1)
    _gpu(b, nodeless, "0000:11:00.0")
    for n in (2, 3):
        rp = b.bridge(rb, f"0000:10:{n:02x}.0", INTEL, ROOT_PORT, secondary_bus=0x10 + n)
        _gpu(b, rp, f"0000:{0x10 + n:02x}:00.0")
    _gpu(b, b.bridge(b.root_bus(0, 0x20, numa=0), "0000:20:01.0", INTEL, ROOT_PORT, secondary_bus=0x21),
         "0000:21:00.0")
    order = ["0000:11:00.0", "0000:12:00.0", "0000:21:00.0", "0000:13:00.0"]
    gpus = _gpus(b, order)
    pos = [position(f) for f in gpus]
    words = {(i, j): relation(pos[i], pos[j]) for i in range(4) for j in range(4) if i != j}
    assert words.pop((0, 2)) == words.pop((2, 0)) == SYS and set(words.values()) == {PHB, NODE}
    plan = p2p_cliques(gpus, acs_override=False, cpu_vendor="GenuineIntel", force=True)
    assert _cliques(plan) == [(order, SYS)]


def test_past_sixteen_cliques_each_further_one_is_left_out_with_a_note(tmp_path):
    """QEMU takes clique ids 0-15: the 17th and 18th switch pairs get no clique, and every pair
    left out is named, so an admin knows which GPUs lost P2P."""
    b = _host(tmp_path)
    rb = b.root_bus(0, 0, numa=0)
    pairs = [_switch_pair(b, rb, f"0000:00:{n + 1:02x}.0", 4 * n + 1) for n in range(MAX_CLIQUES + 2)]
    plan = p2p_cliques(_gpus(b), acs_override=False, cpu_vendor="GenuineIntel")
    assert _cliques(plan) == [(pair, PIX) for pair in pairs[:MAX_CLIQUES]]
    assert [n for n in plan.notes if "cliques; left out" in n] == [
        f"{', '.join(pair)}: more than {MAX_CLIQUES} cliques; left out" for pair in pairs[MAX_CLIQUES:]]
    assert plan.clique_of(A(pairs[MAX_CLIQUES - 1][1])) == MAX_CLIQUES - 1
    assert plan.clique_of(A(pairs[MAX_CLIQUES][0])) is None


def _root_port_gpus(root, buses: dict[int, int]) -> HostBuilder:
    """One node; per root bus (bus -> GPUs), GPUs each on a root port of it."""
    b = _host(root)
    for bus, count in buses.items():
        rb = b.root_bus(0, bus, numa=0)
        for n in range(count):
            rp = b.bridge(rb, f"0000:{bus:02x}:{n + 1:02x}.0", INTEL, ROOT_PORT, secondary_bus=bus + 1 + n)
            _gpu(b, rp, f"0000:{bus + 1 + n:02x}:00.0")
    return b


def test_a_lonely_gpu_is_told_its_nearest_other_gpu(tmp_path):
    """Under NCCL's PXB level each GPU left alone is told the nearest word to another GPU (PHB beside
    a root-port neighbour, NODE for the one on another root complex), even when only two GPUs."""
    three = p2p_cliques(_gpus(_root_port_gpus(tmp_path / "three", {0x40: 2, 0x80: 1})), acs_override=False,
                        cpu_vendor="GenuineIntel")
    assert three.cliques == []
    nearest = [n.split(" (")[0] for n in three.notes if "the nearest other GPU" in n]
    assert nearest == ["0000:41:00.0, 0000:42:00.0: the nearest other GPU is PHB",
                       "0000:81:00.0: the nearest other GPU is NODE"]
    two = p2p_cliques(_gpus(_root_port_gpus(tmp_path / "two", {0x40: 2})), acs_override=False,
                      cpu_vendor="GenuineIntel")
    assert [n.split(" (")[0] for n in two.notes if "the nearest other GPU" in n] == [
        "0000:41:00.0, 0000:42:00.0: the nearest other GPU is PHB"]


def test_one_gpu_left_after_the_iommu_check_gets_only_the_reason(tmp_path):
    """With one of two GPUs out for want of an IOMMU group there is no pair: the plan says why that
    GPU is out and nothing about rules, names or neighbours that apply to no pair."""
    b = _host(tmp_path)
    rb = b.root_bus(0, 0x40, numa=0)
    for n, group in ((0, None), (1, "auto")):
        rp = b.bridge(rb, f"0000:40:{n + 1:02x}.0", INTEL, ROOT_PORT, secondary_bus=0x41 + n)
        _gpu(b, rp, f"0000:{0x41 + n:02x}:00.0", group=group)
    plan = p2p_cliques(_gpus(b), acs_override=False, cpu_vendor="GenuineIntel")
    assert plan.cliques == [] and plan.forced == []
    assert plan.notes == ["0000:41:00.0: no IOMMU group, so nothing shows its peer traffic is translated; no clique"]


def test_a_gpu_sharing_its_group_names_every_other_member(tmp_path):
    """Three GPUs in one IOMMU group: each note names both others, the devices an admin must
    separate (ACS) before P2P is safe."""
    b = _host(tmp_path)
    rb = b.root_bus(0, 0, numa=0)
    rp = b.bridge(rb, "0000:00:01.0", INTEL, ROOT_PORT, secondary_bus=0x10)
    up = b.bridge(rp, "0000:10:00.0", BROADCOM, SWITCH_PORT, secondary_bus=0x11)
    group = b.new_group()
    for n in range(3):
        ds = b.bridge(up, f"0000:11:{n:02x}.0", BROADCOM, SWITCH_PORT, secondary_bus=0x12 + n, group=group)
        _gpu(b, ds, f"0000:{0x12 + n:02x}:00.0", group=group)
    plan = p2p_cliques(_gpus(b), acs_override=False)
    assert plan.cliques == []
    assert [n.split(" (")[0] for n in plan.notes] == [
        f"0000:12:00.0: shares IOMMU group {group} with 0000:13:00.0, 0000:14:00.0",
        f"0000:13:00.0: shares IOMMU group {group} with 0000:12:00.0, 0000:14:00.0",
        f"0000:14:00.0: shares IOMMU group {group} with 0000:12:00.0, 0000:13:00.0"]


# -- IOMMU group viability -----------------------------------------------------------------------
def test_a_group_of_two_non_nvidia_devices_names_the_second_as_foreign(tmp_path):
    """A group holding two NICs of different slots is not viable, and the problem names the device
    that would go along with the first (the lowest address)."""
    b = _host(tmp_path)
    rb = b.root_bus(0, 0, numa=0)
    group = b.new_group()
    for slot in ("1e", "1f"):
        b.function(rb, f"0000:00:{slot}.0", INTEL, I210, "020000", driver="igb", group=group)
    inventory = read_inventory(HostRoot(b.root))
    second = inventory.functions[A("0000:00:1f.0")]
    assert inventory.groups[group].viable is False
    assert inventory.groups[group].problems == [f"shares IOMMU group {group} with {second.label()}"]


def test_the_word_between_two_functions_does_not_depend_on_their_order(tmp_path):
    """A function on a switch's internal bus (below its upstream port, beside the downstream
    ports) and one below a downstream port cross that one switch: the same word whichever is
    named first, so a clique's word never depends on the order of --device."""
    b = _host(tmp_path)
    rb = b.root_bus(0, 0, numa=0)
    rp = b.bridge(rb, "0000:00:01.0", INTEL, ROOT_PORT, secondary_bus=0x10)
    up = b.bridge(rp, "0000:10:00.0", BROADCOM, SWITCH_PORT, secondary_bus=0x11)
    ds = b.bridge(up, "0000:11:00.0", BROADCOM, SWITCH_PORT, secondary_bus=0x12)
    _gpu(b, up, "0000:11:08.0")
    _gpu(b, ds, "0000:12:00.0")
    internal, below = (position(fn) for fn in _gpus(b, ["0000:11:08.0", "0000:12:00.0"]))
    assert relation(internal, below) == relation(below, internal) == PIX
