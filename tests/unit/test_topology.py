"""Host topology: nvidia-smi's path words from the sysfs tree, P2P cliques, NVLink (NVML and its
recording) and the ``gpuvfio topo`` command."""

import dataclasses
import json
import os

import pynvml
import pytest

from gpuvfio.ops.context import Context
from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError
from gpuvfio.host.fixture import load_fixture, open_host
from gpuvfio.host.recording import dump_host
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.nvlink import (RECORD, NvmlUnusable, parse_recording, read_from_nvml, read_nvlink,
                                 record_text)
from gpuvfio.host.root import HostRoot
from gpuvfio.host.numa import cpu_vendor
from gpuvfio.host.topology import NODE, PHB, PIX, PXB, SYS, p2p_cliques, p2p_rule, position, relation
from tests.conftest import REPO, BAR64_PREF, GiB
from tests.hostbuilder import HostBuilder

A = PciAddress.parse
DGX = os.path.join(REPO, "gpuvfio", "samples", "dgx-h100.host")
DGX_GPUS = ["0000:1b:00.0", "0000:43:00.0", "0000:52:00.0", "0000:61:00.0",
            "0000:9d:00.0", "0000:c3:00.0", "0000:d1:00.0", "0000:df:00.0"]
NVSWITCHES = ["0000:03:00.0", "0000:04:00.0", "0000:05:00.0", "0000:06:00.0"]
BROADCOM, SWITCH_PORT, INTEL, ROOT_PORT = "1000", "c030", "8086", "352a"
NVIDIA, H100, NVSWITCH = "10de", "2330", "22a3"
MELLANOX, CX7 = "15b3", "1021"


@pytest.fixture(scope="module")
def dgx_functions():
    with open_host(DGX) as (host, _label):
        return read_inventory(host).functions


def _pos(functions, address):
    return position(functions[A(address)])


# -- relation words ------------------------------------------------------------------------------
def test_dgx_words_gpu_nic_under_one_switch_pix_same_socket_node_across_sys(dgx_functions):
    gpu0, nic0 = _pos(dgx_functions, "0000:1b:00.0"), _pos(dgx_functions, "0000:18:00.0")
    assert gpu0.switch == A("0000:16:00.0") and nic0.switch == A("0000:16:00.0")
    assert relation(gpu0, nic0) == PIX
    assert relation(gpu0, _pos(dgx_functions, "0000:43:00.0")) == NODE  # both on socket 0
    assert relation(gpu0, _pos(dgx_functions, "0000:9d:00.0")) == SYS  # socket 0 and socket 1
    assert relation(gpu0, gpu0) == "X"
    # The two ports of a dual-port NIC: one device.
    assert relation(_pos(dgx_functions, "0000:29:00.0"), _pos(dgx_functions, "0000:29:00.1")) == PIX


def _root_port_and_switch(root):
    """One node, root bus 0, root port 00:01.0 -> a switch's upstream port 02:00.0: (builder, root bus, upstream)."""
    b = HostBuilder(str(root))
    b.iommu("intel", 1)
    b.numa_node(0, list(range(8)), 16)
    rb = b.root_bus(0, 0, numa=0)
    rp = b.bridge(rb, "0000:00:01.0", INTEL, ROOT_PORT, secondary_bus=0x02)
    return b, rb, b.bridge(rp, "0000:02:00.0", BROADCOM, SWITCH_PORT, secondary_bus=0x03)


def _switch_tree(root) -> HostBuilder:
    """Root bus 0: root port 00:01.0 -> switch (02) -> port 03:00.0 -> a second switch (04) -> GPU 06:00.0,
    and port 03:01.0 -> NIC 07:00.0; root port 00:02.0 -> GPU 08:00.0; root bus 80 -> GPU 81:00.0."""
    b, rb, up = _root_port_and_switch(root)
    ds_a = b.bridge(up, "0000:03:00.0", BROADCOM, SWITCH_PORT, secondary_bus=0x04)
    ds_b = b.bridge(up, "0000:03:01.0", BROADCOM, SWITCH_PORT, secondary_bus=0x07)
    up2 = b.bridge(ds_a, "0000:04:00.0", BROADCOM, SWITCH_PORT, secondary_bus=0x05)
    ds2 = b.bridge(up2, "0000:05:00.0", BROADCOM, SWITCH_PORT, secondary_bus=0x06)
    b.function(ds2, "0000:06:00.0", NVIDIA, H100, "030200", driver="nvidia", bars=[(1, 1 * GiB, BAR64_PREF)])
    b.function(ds_b, "0000:07:00.0", MELLANOX, CX7, "020700", driver="mlx5_core")
    rp2 = b.bridge(rb, "0000:00:02.0", INTEL, ROOT_PORT, secondary_bus=0x08)
    b.function(rp2, "0000:08:00.0", NVIDIA, H100, "030200", driver="nvidia")
    rb80 = b.root_bus(0, 0x80, numa=-1)
    rp80 = b.bridge(rb80, "0000:80:01.0", INTEL, ROOT_PORT, secondary_bus=0x81)
    b.function(rp80, "0000:81:00.0", NVIDIA, H100, "030200", driver="nvidia")
    return b


def test_pxb_through_two_switches_and_phb_through_one_root_complex(tmp_path):
    b = _switch_tree(tmp_path)
    functions = read_inventory(HostRoot(b.root)).functions
    gpu, nic, other = (_pos(functions, a) for a in ("0000:06:00.0", "0000:07:00.0", "0000:08:00.0"))
    assert gpu.switches == (A("0000:02:00.0"), A("0000:04:00.0")) and gpu.root_port == A("0000:00:01.0")
    assert relation(gpu, nic) == PXB
    assert relation(gpu, other) == PHB and relation(nic, other) == PHB
    assert str(gpu.root_complex) == "0000:00"


def test_functions_without_a_node_are_node_only_on_a_single_node_host(tmp_path):
    functions = read_inventory(HostRoot(_switch_tree(tmp_path).root)).functions
    nodeless, local = _pos(functions, "0000:81:00.0"), _pos(functions, "0000:08:00.0")
    assert nodeless.numa_node is None and local.numa_node == 0
    assert relation(nodeless, local) == SYS and relation(nodeless, local, single_node=True) == SYS
    bare = dataclasses.replace(local, numa_node=None)
    assert relation(nodeless, bare, single_node=True) == NODE and relation(nodeless, bare) == SYS


# -- P2P cliques ---------------------------------------------------------------------------------
def _two_gpus_under_a_switch(root, *, shared_group: bool, count: int = 2):
    b, _rb, up = _root_port_and_switch(root)
    group = b.new_group() if shared_group else "auto"
    for n in range(count):
        ds = b.bridge(up, f"0000:03:{n:02x}.0", BROADCOM, SWITCH_PORT, secondary_bus=0x04 + n, group=group)
        b.function(ds, f"0000:{0x04 + n:02x}:00.0", NVIDIA, H100, "030200", driver="nvidia", group=group)
    return list(read_inventory(HostRoot(b.root)).functions.values())


def test_two_gpus_under_one_switch_in_their_own_groups_make_one_clique(tmp_path):
    plan = p2p_cliques(_two_gpus_under_a_switch(tmp_path, shared_group=False), acs_override=False)
    assert [(c.clique_id, [str(m) for m in c.members], c.relation) for c in plan.cliques] == [
        (0, ["0000:04:00.0", "0000:05:00.0"], PIX)]
    # Only the rule it followed: the model comes from the device id (gpuvfio.host.nvidia_ids), pci.ids or not.
    assert [note.split(":")[0] for note in plan.notes] == ["P2P rule"]
    assert plan.forced == []


def test_gpus_sharing_a_group_get_no_clique_and_say_why(tmp_path):
    plan = p2p_cliques(_two_gpus_under_a_switch(tmp_path, shared_group=True), acs_override=False)
    assert plan.cliques == []
    assert len(plan.notes) == 2 and all("shares IOMMU group" in note for note in plan.notes)


def test_acs_override_and_a_single_gpu_give_no_clique(tmp_path):
    functions = _two_gpus_under_a_switch(tmp_path, shared_group=False)
    overridden = p2p_cliques(functions, acs_override=True)
    assert overridden.cliques == [] and "pcie_acs_override" in overridden.notes[0]
    single = p2p_cliques(_two_gpus_under_a_switch(tmp_path / "one", shared_group=False, count=1), acs_override=False)
    assert single.cliques == [] and single.notes == []


# -- P2P cliques: NCCL's default P2P level (NCCL 2.23.4 to 2.30.7, src/graph/paths.cc ncclTopoCheckP2p) ---
def _gpus_on_root_ports(root, *, vendor: str | None, sockets: int = 1, per_socket: int = 2,
                        switch_pair: bool = False):
    """GPUs each on a root port of its socket's one root complex (nvidia-smi PHB between them), a
    second socket's on its own (SYS); ``switch_pair``: two more under a switch on socket 0 (PIX).
    ``vendor``: the CPUID vendor /proc/cpuinfo shows (None: a recording without it)."""
    b = HostBuilder(str(root))
    b.iommu("amd" if vendor == AMD else "intel", 1)
    if vendor is not None:
        b.cpuinfo("a CPU", 48, vendor=vendor)
    for node in range(sockets):
        b.numa_node(node, list(range(8 * node, 8 * node + 8)), 16)
        rbus = 0x40 * (node + 1)
        rb = b.root_bus(0, rbus, numa=node)
        for n in range(per_socket):
            rp = b.bridge(rb, f"0000:{rbus:02x}:{n + 1:02x}.0", INTEL, ROOT_PORT, secondary_bus=rbus + 1 + n)
            b.function(rp, f"0000:{rbus + 1 + n:02x}:00.0", NVIDIA, H100, "030200", driver="vfio-pci")
    if switch_pair:
        rb = b.root_bus(0, 0x40, numa=0)
        rp = b.bridge(rb, "0000:40:10.0", INTEL, ROOT_PORT, secondary_bus=0x50)
        up = b.bridge(rp, "0000:50:00.0", BROADCOM, SWITCH_PORT, secondary_bus=0x51)
        for n in range(2):
            ds = b.bridge(up, f"0000:51:{n:02x}.0", BROADCOM, SWITCH_PORT, secondary_bus=0x52 + n)
            b.function(ds, f"0000:{0x52 + n:02x}:00.0", NVIDIA, H100, "030200", driver="vfio-pci")
    host = HostRoot(b.root)
    gpus = [f for f in read_inventory(host).functions.values() if f.is_nvidia_gpu]
    return gpus, cpu_vendor(host)


def _cliques(plan) -> list[tuple[list[str], str]]:
    return [([str(m) for m in c.members], c.relation) for c in plan.cliques]


AMD = "AuthenticAMD"


@pytest.mark.parametrize("vendor, gpus, farthest", [
    ("GenuineIntel", 2, PXB), ("AuthenticAMD", 2, SYS), ("AuthenticAMD", 3, PXB), ("HygonGenuine", 2, PXB),
    ("CentaurHauls", 2, PXB), (None, 2, PXB)])
def test_the_rule_is_nccls_default_p2p_level(vendor, gpus, farthest):
    """PATH_PXB everywhere but x86 AMD with at most two GPUs (PATH_SYS); an unknown vendor fails closed."""
    rule = p2p_rule(vendor, gpus)
    assert rule.farthest == farthest and "ncclTopoCheckP2p" in rule.why
    assert rule.allows(PIX) and rule.allows(PXB) and rule.allows(PHB) == (farthest == SYS)
    assert rule.allows(NODE) == rule.allows(SYS) == (farthest == SYS)


def test_gpus_on_root_ports_of_one_intel_host_bridge_get_no_clique(tmp_path):
    gpus, vendor = _gpus_on_root_ports(tmp_path, vendor="GenuineIntel", switch_pair=True)
    assert vendor == "GenuineIntel"
    plan = p2p_cliques(gpus, acs_override=False, cpu_vendor=vendor)
    assert _cliques(plan) == [(["0000:52:00.0", "0000:53:00.0"], PIX)]  # the pair under the switch only
    assert plan.rule.farthest == PXB and plan.notes[0].startswith("P2P rule: NCCL's default P2P level on a "
                                                                  "GenuineIntel CPU is PATH_PXB")
    assert any(note.startswith("0000:41:00.0, 0000:42:00.0: the nearest other GPU is PHB") and "(PATH_PXB)" in note
               for note in plan.notes), plan.notes
    # Export's call, without a vendor: the same (fails closed).
    assert _cliques(p2p_cliques(gpus, acs_override=False)) == _cliques(plan)


def test_amd_with_two_gpus_gets_cliques_through_the_host_bridge_and_across_sockets(tmp_path):
    gpus, vendor = _gpus_on_root_ports(tmp_path, vendor=AMD)
    assert vendor == AMD and len(gpus) == 2
    plan = p2p_cliques(gpus, acs_override=False, cpu_vendor=vendor)
    assert _cliques(plan) == [(["0000:41:00.0", "0000:42:00.0"], PHB)] and plan.forced == []
    assert plan.rule.farthest == SYS and "at most two GPUs is PATH_SYS" in plan.notes[0]
    across, _ = _gpus_on_root_ports(tmp_path / "two", vendor=AMD, sockets=2, per_socket=1)
    assert _cliques(p2p_cliques(across, acs_override=False, cpu_vendor=AMD)) == [
        (["0000:41:00.0", "0000:81:00.0"], SYS)]


def test_amd_with_three_gpus_is_back_to_pxb(tmp_path):
    gpus, vendor = _gpus_on_root_ports(tmp_path, vendor=AMD, per_socket=3)
    plan = p2p_cliques(gpus, acs_override=False, cpu_vendor=vendor)
    assert plan.cliques == [] and plan.rule.farthest == PXB
    assert "x86 AMD CPU with 3 GPUs (PATH_SYS only for two at most)" in plan.notes[0]
    assert any("0000:41:00.0, 0000:42:00.0, 0000:43:00.0: the nearest other GPU is PHB" in n for n in plan.notes)


def test_a_host_that_does_not_tell_its_cpu_vendor_fails_closed(tmp_path):
    gpus, vendor = _gpus_on_root_ports(tmp_path, vendor=None)
    assert vendor is None
    plan = p2p_cliques(gpus, acs_override=False, cpu_vendor=vendor)
    assert plan.cliques == [] and "CPU vendor is unknown" in plan.notes[0]


def test_force_lifts_the_level_and_says_so(tmp_path):
    gpus, vendor = _gpus_on_root_ports(tmp_path, vendor="GenuineIntel", sockets=2)
    plan = p2p_cliques(gpus, acs_override=False, cpu_vendor=vendor, force=True)
    assert _cliques(plan) == [(["0000:41:00.0", "0000:42:00.0", "0000:81:00.0", "0000:82:00.0"], SYS)]
    assert plan.forced == ["--p2p force: P2P clique 0 (0000:41:00.0, 0000:42:00.0, 0000:81:00.0, 0000:82:00.0) "
                           "spans SYS (PATH_SYS), beyond NCCL's default level PATH_PXB on this host"]
    # Never past the IOMMU: a shared group or pcie_acs_override still gives none.
    assert p2p_cliques(gpus, acs_override=True, force=True).cliques == []
    shared = p2p_cliques(_two_gpus_under_a_switch(tmp_path / "shared", shared_group=True), acs_override=False,
                         cpu_vendor=vendor, force=True)
    assert shared.cliques == [] and shared.forced == []
    # Where the rule already allowed everything, force changes nothing and the plan says that.
    same = p2p_cliques(_two_gpus_under_a_switch(tmp_path / "pix", shared_group=False), acs_override=False,
                       cpu_vendor=vendor, force=True)
    assert len(same.cliques) == 1 and same.forced == [] and any("force changed nothing" in n for n in same.notes)


def _as(functions, device_id):
    return [dataclasses.replace(f, device_id=device_id, device_name=None) if f.is_nvidia_gpu else f
            for f in functions]


@pytest.mark.parametrize("device_id, name", [("2684", "AD102_GEFORCE_RTX_4090"), ("1e02", "TU102_TITAN_RTX")])
def test_geforce_and_titan_cards_get_no_clique_even_under_one_switch(tmp_path, device_id, name):
    """By device id in the shipped table, not by the host's pci.ids: these have no names here."""
    gpus = _as(_two_gpus_under_a_switch(tmp_path, shared_group=False), device_id)
    plan = p2p_cliques(gpus, acs_override=False, cpu_vendor=AMD)
    assert plan.cliques == []
    assert plan.notes[1] == (f"0000:04:00.0 ({name}), 0000:05:00.0 ({name}): GeForce and TITAN cards have no PCIe "
                             "P2P in NVIDIA's driver (NVML reports it unsupported and NCCL then turns P2P off); "
                             "no clique")
    forced = p2p_cliques(gpus, acs_override=False, cpu_vendor=AMD, force=True)
    assert _cliques(forced) == [(["0000:04:00.0", "0000:05:00.0"], PIX)]
    assert len(forced.forced) == 1 and "GeForce" in forced.forced[0]
    # A data-center card of the same chip is no consumer one, whatever pci.ids would call it.
    named = p2p_cliques([dataclasses.replace(f, device_name="AD102 [GeForce RTX 4090]") for f in
                         _as(gpus, "26b9")], acs_override=False, cpu_vendor=AMD)
    assert len(named.cliques) == 1


def test_a_device_the_table_does_not_know_gets_no_clique_unless_forced(tmp_path):
    gpus = _as(_two_gpus_under_a_switch(tmp_path, shared_group=False), "fffe")
    plan = p2p_cliques(gpus, acs_override=False, cpu_vendor=AMD)
    assert plan.cliques == [] and "gpuvfio's NVIDIA id table does not know by architecture (pci.ids 2025.07.11)" \
        in plan.notes[1] and "10de:fffe" in plan.notes[1]
    forced = p2p_cliques(gpus, acs_override=False, cpu_vendor=AMD, force=True)
    assert len(forced.cliques) == 1 and "does not know" in forced.forced[0]


def test_architectures_never_share_a_clique(tmp_path):
    """An A100 and a T4 under one switch: two architectures, no clique, even forced."""
    gpus = _two_gpus_under_a_switch(tmp_path, shared_group=False)
    gpus = [dataclasses.replace(f, device_id="20b5" if str(f.address) == "0000:04:00.0" else "1eb8")
            if f.is_nvidia_gpu else f for f in gpus]
    for force in (False, True):
        plan = p2p_cliques(gpus, acs_override=False, cpu_vendor=AMD, force=force)
        assert plan.cliques == []
        assert any(n.startswith("GPUs of different architectures never share a P2P clique") and
                   "Ampere: 0000:04:00.0; Turing: 0000:05:00.0" in n for n in plan.notes)


def test_the_workstations_two_geforce_cards_by_their_pciids_names(tmp_path):
    """The issue's case: an RTX 4090 on the CPU's PEG port and an RTX 3060 on a chipset port of one
    Intel host bridge, each (here) in a group of its own; named from pci.ids as the plan names them."""
    from gpuvfio.host.pciids import PciIds

    b = HostBuilder(str(tmp_path))
    b.iommu("intel", 1)
    b.cpuinfo("12th Gen Intel(R) Core(TM) i9-12900KF", 39, vendor="GenuineIntel")
    b.numa_node(0, list(range(8)), 16)
    rb = b.root_bus(0, 0, numa=-1)
    peg = b.bridge(rb, "0000:00:01.0", INTEL, "460d", secondary_bus=1, link=(4, 16, 5, 16))
    b.function(peg, "0000:01:00.0", NVIDIA, "2684", "030000", driver="vfio-pci", link=(4, 16))
    pch = b.bridge(rb, "0000:00:1c.4", INTEL, "7a3c", secondary_bus=4, link=(4, 4))
    b.function(pch, "0000:04:00.0", NVIDIA, "2504", "030000", driver="vfio-pci", link=(4, 4, 4, 16))
    host = HostRoot(b.root)
    names = PciIds.load(host)
    if not names.available:
        pytest.skip("no pci.ids on this machine")
    gpus = [f for f in read_inventory(host, names=names).functions.values() if f.is_nvidia_gpu]
    assert all("GeForce" in (f.device_name or "") for f in gpus)
    plan = p2p_cliques(gpus, acs_override=False, cpu_vendor=cpu_vendor(host), single_node=True)
    assert plan.cliques == [] and "GeForce and TITAN cards have no PCIe P2P" in plan.notes[1]
    # Even forced past the GeForce rule: an Ada and an Ampere card never share a clique.
    forced = p2p_cliques(gpus, acs_override=False, cpu_vendor=cpu_vendor(host), single_node=True, force=True)
    assert forced.cliques == [] and any("Ada Lovelace: 0000:01:00.0; Ampere: 0000:04:00.0" in n for n in forced.notes)


# -- NVLink: the recording -----------------------------------------------------------------------
def _nvlink_host(root) -> HostBuilder:
    """Two socket-0 GPUs joined by 4 direct links, two more on 2 NVSwitches (6 and 4 links each),
    and a fifth GPU with no NVLink."""
    b = HostBuilder(str(root))
    b.iommu("intel", 1)
    b.numa_node(0, list(range(8)), 16)
    b.numa_node(1, list(range(8, 16)), 16)
    for n, (bus, numa) in enumerate(((0x10, 0), (0x20, 0), (0x30, 1), (0x40, 1), (0x50, 1))):
        rb = b.root_bus(0, bus, numa=numa)
        rp = b.bridge(rb, f"0000:{bus:02x}:01.0", INTEL, ROOT_PORT, secondary_bus=bus + 1)
        b.function(rp, f"0000:{bus + 1:02x}:00.0", NVIDIA, H100, "030200", driver="nvidia")
    rb = b.root_bus(0, 0x60, numa=1)
    for n in range(2):
        rp = b.bridge(rb, f"0000:60:0{n + 1}.0", INTEL, ROOT_PORT, secondary_bus=0x61 + n)
        b.function(rp, f"0000:{0x61 + n:02x}:00.0", NVIDIA, NVSWITCH, "068000", driver="nvidia")
    b.nvlink({"0000:11:00.0": {"0000:21:00.0": 4}, "0000:21:00.0": {"0000:11:00.0": 4},
              "0000:31:00.0": {"0000:61:00.0": 3, "0000:62:00.0": 3},
              "0000:41:00.0": {"0000:61:00.0": 2, "0000:62:00.0": 2},
              "0000:51:00.0": {}})
    return b


def test_recording_gives_direct_and_switch_link_counts(tmp_path):
    b = _nvlink_host(tmp_path)
    reading = read_nvlink(HostRoot(b.root))
    assert reading.source == "recording" and reading.read
    between = reading.links_between
    assert between(A("0000:11:00.0"), A("0000:21:00.0")) == 4
    assert between(A("0000:31:00.0"), A("0000:41:00.0")) == 4  # the smaller switch-link count
    assert between(A("0000:11:00.0"), A("0000:31:00.0")) == 0
    assert between(A("0000:51:00.0"), A("0000:11:00.0")) == 0
    assert [link.kind for link in reading.gpus[A("0000:31:00.0")]] == ["switch"] * 6


def test_topo_shows_nv_and_unknown_pairs_are_marked_not_hidden(tmp_path, cli):
    b = _nvlink_host(tmp_path)
    data = cli("--root", b.root, "topo", "--json").json()
    names = {d["address"]: d["name"] for d in data["devices"]}
    assert list(names.values()) == ["GPU0", "GPU1", "GPU2", "GPU3", "GPU4"]  # NVSwitches are neither
    assert data["matrix"]["GPU0"]["GPU1"] == "NV4" and data["pcie"]["GPU0"]["GPU1"] == NODE
    assert data["matrix"]["GPU2"]["GPU3"] == "NV4" and data["matrix"]["GPU0"]["GPU2"] == SYS
    assert data["nvlink_links"]["GPU4"]["GPU0"] == 0 and data["nvlink"]["read"] is True
    # Without the recording: every GPU pair is unknown, never "no NVLink".
    os.unlink(os.path.join(b.root, *RECORD))
    result = cli("--root", b.root, "topo", "--json")
    data = result.json()
    assert data["nvlink"]["read"] is False and "no NVLink recording" in data["nvlink"]["reason"]
    assert data["nvlink_links"]["GPU0"]["GPU1"] is None and data["matrix"]["GPU0"]["GPU1"] == NODE
    assert data["devices"][0]["nvlink"]["read"] is False
    text = cli("--root", b.root, "topo").out
    assert "NODE?" in text and "NVLink not read for this GPU pair" in text and "NVLink: not read" in text


def test_a_gpu_missing_from_the_recording_is_unknown(tmp_path, cli):
    b = _nvlink_host(tmp_path)
    b.nvlink({"0000:11:00.0": {"0000:21:00.0": 4}, "0000:21:00.0": {"0000:11:00.0": 4}})
    data = cli("--root", b.root, "topo", "--json").json()
    assert data["matrix"]["GPU0"]["GPU1"] == "NV4"
    assert data["nvlink_links"]["GPU0"]["GPU2"] is None
    assert "0000:31:00.0" in data["nvlink"]["unread"] and "no entry" in data["nvlink"]["unread"]["0000:31:00.0"]
    text = cli("--root", b.root, "topo").out
    assert "0000:31:00.0: not read: the recording has no entry" in text


def test_a_recording_of_a_host_that_could_not_be_read_says_why(tmp_path, cli):
    b = _nvlink_host(tmp_path)
    _write_record(b.root, {"format": "gpuvfio-nvlink", "version": 1, "not_read": "pynvml is not installed"})
    data = cli("--root", b.root, "topo", "--json").json()
    assert data["nvlink"]["read"] is False and "pynvml is not installed" in data["nvlink"]["summary"]
    assert data["nvlink_links"]["GPU0"]["GPU1"] is None


def test_dgx_with_its_nvswitch_recording_is_nv18_everywhere(tmp_path, cli):
    with open(DGX, encoding="utf-8") as handle:
        root = load_fixture(handle.read(), str(tmp_path / "dgx"))
    split = dict(zip(NVSWITCHES, (5, 4, 4, 5)))  # HGX H100: 18 NVLink4 links per GPU over 4 NVSwitches
    _write_record(root, {"format": "gpuvfio-nvlink", "version": 1, "gpus": {
        gpu: [{"link": n, "remote": sw, "type": "switch"}
              for n, sw in enumerate(s for s, count in split.items() for _ in range(count))] for gpu in DGX_GPUS}})
    data = cli("--root", root, "topo", "--json").json()
    gpus = [f"GPU{n}" for n in range(8)]
    assert {data["matrix"][a][b] for a in gpus for b in gpus if a != b} == {"NV18"}
    assert data["pcie"]["GPU0"]["GPU4"] == SYS and data["matrix"]["GPU0"]["NIC0"] == PIX
    # dump-host carries the recording, and the recorded fixture reads the same.
    fixture = tmp_path / "again.host"
    fixture.write_text(dump_host(HostRoot(root)))
    assert cli("--root", str(fixture), "topo", "--json").json()["matrix"] == data["matrix"]


def _write_record(root, record) -> str:
    path = os.path.join(root, *RECORD)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(record if isinstance(record, str) else json.dumps(record))
    return path


def _gpus_record(gpus: dict) -> str:
    return json.dumps({"format": "gpuvfio-nvlink", "version": 1, "gpus": gpus})


_LINK = {"link": 0, "remote": "0000:21:00.0", "type": "gpu"}
HOSTILE = {
    "not JSON": "{",
    "NaN": '{"format": "gpuvfio-nvlink", "version": NaN, "gpus": {}}',
    "Infinity link": _gpus_record({"0000:11:00.0": []}).replace("[]", '[{"link": Infinity, "remote": '
                                                                       '"0000:21:00.0", "type": "gpu"}]'),
    "duplicate key": '{"format": "gpuvfio-nvlink", "version": 1, "gpus": {}, "gpus": {}}',
    "a list": "[]",
    "bool version": '{"format": "gpuvfio-nvlink", "version": true, "gpus": {}}',
    "unknown key": '{"format": "gpuvfio-nvlink", "version": 1, "gpus": {}, "extra": 1}',
    "both gpus and not_read": '{"format": "gpuvfio-nvlink", "version": 1, "gpus": {}, "not_read": "x"}',
    "not_read with a newline": '{"format": "gpuvfio-nvlink", "version": 1, "not_read": "a\\nb"}',
    "gpus a list": '{"format": "gpuvfio-nvlink", "version": 1, "gpus": []}',
    "links an object": _gpus_record({"0000:11:00.0": {}}),
    "float link number": _gpus_record({"0000:11:00.0": [{**_LINK, "link": 1.0}]}),
    "link number too big": _gpus_record({"0000:11:00.0": [{**_LINK, "link": 36}]}),
    "repeated link number": _gpus_record({"0000:11:00.0": [_LINK, _LINK]}),
    "extra link key": _gpus_record({"0000:11:00.0": [{**_LINK, "speed": 1}]}),
    "unknown type": _gpus_record({"0000:11:00.0": [{**_LINK, "type": "cpu"}]}),
    "malformed address": _gpus_record({"0000:11:00": []}),
    "unknown GPU": _gpus_record({"0000:99:00.0": []}),
    "an NVSwitch as a GPU": _gpus_record({"0000:61:00.0": []}),
    "link to an unknown GPU": _gpus_record({"0000:11:00.0": [{**_LINK, "remote": "0000:99:00.0"}]}),
    "link to itself": _gpus_record({"0000:11:00.0": [{**_LINK, "remote": "0000:11:00.0"}]}),
    "a GPU called a switch": _gpus_record({"0000:11:00.0": [{**_LINK, "type": "switch"}]}),
    "same GPU twice": _gpus_record({"0000:11:00.0": [], "11:00.0": []}),
    "too deep": "[" * 100000 + "]" * 100000,
    "not UTF-8": b'{"format": "\xff"}',
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_recordings_fail_closed_in_one_line(case, tmp_path, cli):
    b = _nvlink_host(tmp_path)
    data = HOSTILE[case]
    path = os.path.join(b.root, *RECORD)
    with open(path, "wb") as handle:
        handle.write(data if isinstance(data, bytes) else data.encode())
    result = cli("--root", b.root, "topo")
    assert result.code == 2, (case, result.out, result.err)
    assert result.err.startswith("gpuvfio: error: NVLink recording var/lib/gpuvfio-fixture/nvlink.json: ")
    assert result.err.count("\n") == 1 and result.out == ""


def test_oversized_and_misplaced_recordings_fail_closed(tmp_path, cli):
    b = _nvlink_host(tmp_path)
    path = os.path.join(b.root, *RECORD)
    with open(path, "w") as handle:
        handle.write(" " * (1 << 20) + "{}")
    result = cli("--root", b.root, "topo")
    assert result.code == 2 and "larger than" in result.err
    os.unlink(path)
    os.symlink("../../../../../../../../etc/passwd", path)  # leads out of the root
    result = cli("--root", b.root, "topo")
    assert result.code == 2 and result.err.count("\n") == 1
    os.unlink(path)
    os.mkdir(path)
    result = cli("--root", b.root, "topo")
    assert result.code == 2 and "is a directory" in result.err


def test_parse_recording_checks_against_the_hosts_gpus():
    good = _gpus_record({"0000:11:00.0": [_LINK], "0000:21:00.0": [{**_LINK, "remote": "0000:11:00.0"}]})
    reading = parse_recording(good.encode(), {A("0000:11:00.0"), A("0000:21:00.0")})
    assert reading.links_between(A("0000:11:00.0"), A("0000:21:00.0")) == 1
    with pytest.raises(InputError, match="not an NVIDIA GPU of this host"):
        parse_recording(good.encode(), {A("0000:11:00.0")})
    # A link seen up from one end only (going down): counted where both ends say so.
    one_sided = _gpus_record({"0000:11:00.0": [_LINK, {**_LINK, "link": 1}],
                              "0000:21:00.0": [{**_LINK, "remote": "0000:11:00.0"}]})
    reading = parse_recording(one_sided.encode(), {A("0000:11:00.0"), A("0000:21:00.0")})
    assert reading.links_between(A("0000:21:00.0"), A("0000:11:00.0")) == 1


# -- NVLink: NVML ---------------------------------------------------------------------------------
class StandInNvml:
    """pynvml's interface (its constants and NVMLError) over a table of links, for the parts of
    NVML gpuvfio calls: gpus maps a bus id to {link: (remote bus id, NVML device type)}."""

    def __init__(self, gpus: dict, *, typed: bool = True, fail_at: str | None = None) -> None:
        for name in dir(pynvml):
            if name.startswith("NVML_"):
                setattr(self, name, getattr(pynvml, name))
        self.NVMLError = pynvml.NVMLError
        self.gpus, self.order, self.typed, self.fail_at = gpus, list(gpus), typed, fail_at

    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"

    def nvmlDeviceGetCount(self):
        return len(self.order)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.order[index]

    def nvmlDeviceGetPciInfo(self, handle):
        return type("PciInfo", (), {"busId": b"0000" + handle.upper().encode()})()

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if handle == self.fail_at:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if link not in self.gpus[handle]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED if link else pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED if self.gpus[handle][link][0] else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle, link):
        return type("PciInfo", (), {"busId": "0000" + self.gpus[handle][link][0]})()

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link):
        if not self.typed:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self.gpus[handle][link][1]


GPU_T, SWITCH_T = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU, pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH


def test_nvml_reading_counts_active_links_and_types_their_far_ends():
    nvml = StandInNvml({
        "0000:11:00.0": {0: ("0000:21:00.0", GPU_T), 1: ("0000:21:00.0", GPU_T), 2: (None, GPU_T)},  # 2 is down
        "0000:21:00.0": {0: ("0000:11:00.0", GPU_T), 1: ("0000:11:00.0", GPU_T)},
        "0000:31:00.0": {n: ("0000:61:00.0", SWITCH_T) for n in range(6)},
        "0000:41:00.0": {n: ("0000:62:00.0", SWITCH_T) for n in range(4)},
        "0000:51:00.0": {},
    })
    reading = read_from_nvml(nvml)
    assert reading.source == "nvml" and reading.driver == "550.54.15"
    assert reading.links_between(A("0000:11:00.0"), A("0000:21:00.0")) == 2
    assert reading.links_between(A("0000:31:00.0"), A("0000:41:00.0")) == 4
    assert reading.gpus[A("0000:51:00.0")] == ()
    # What dump-host records of it reads back the same.
    again = parse_recording(json.dumps(reading.to_record()).encode(), {A(g) for g in nvml.gpus})
    assert again.gpus == reading.gpus and again.driver == "550.54.15"


def test_nvml_without_remote_types_knows_gpus_and_leaves_the_rest_unknown():
    nvml = StandInNvml({"0000:11:00.0": {0: ("0000:21:00.0", GPU_T)}, "0000:21:00.0": {0: ("0000:11:00.0", GPU_T)},
                        "0000:31:00.0": {0: ("0000:61:00.0", SWITCH_T)}, "0000:41:00.0": {}},
                       typed=False)
    reading = read_from_nvml(nvml)
    assert reading.links_between(A("0000:11:00.0"), A("0000:21:00.0")) == 1
    assert [link.kind for link in reading.gpus[A("0000:31:00.0")]] == ["unknown"]
    assert reading.links_between(A("0000:31:00.0"), A("0000:41:00.0")) is None  # never "none"


def test_an_nvml_failure_is_one_line_not_a_partial_reading():
    nvml = StandInNvml({"0000:11:00.0": {}, "0000:21:00.0": {}}, fail_at="0000:21:00.0")
    with pytest.raises(NvmlUnusable, match=r"0000:21:00.0: GPU is lost"):
        read_from_nvml(nvml)


def test_dump_host_records_nvlink_only_where_something_is_known(tmp_path, workstation):
    assert record_text(HostRoot(workstation.root)) is None  # a tree without a recording: nothing
    assert "gpuvfio-fixture" not in dump_host(HostRoot(workstation.root))
    b = _nvlink_host(tmp_path / "nv")
    text = dump_host(HostRoot(b.root))
    line = next(line for line in text.splitlines() if "gpuvfio-fixture/nvlink.json" in line)
    assert line.startswith("F var/lib/gpuvfio-fixture/nvlink.json {")


# -- the command ---------------------------------------------------------------------------------
def test_topo_text_on_the_dgx_sample(cli):
    result = cli("--root", DGX, "topo")
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    header = lines[2].split()
    assert header[:9] == ["GPU0", "GPU1", "GPU2", "GPU3", "GPU4", "GPU5", "GPU6", "GPU7", "NIC0"]
    assert header[-4:] == ["CPU", "Affinity", "NUMA", "Affinity"] and "NIC11" in header
    gpu0 = next(line for line in lines if line.startswith("GPU0 ")).split()
    assert gpu0[1] == "X" and gpu0[9] == PIX and gpu0[-2:] == ["0-55,112-167", "0"]
    for part in ("Legend:", "  PIX  = at most one PCIe switch between them", "NUMA distances (ACPI SLIT",
                 "PCIe tree:", "0000:16:00.0 (PEX890xx", "NIC0:   0000:18:00.0", "NVLink: "):
        assert part in result.out, part
    distances = next(i for i, line in enumerate(lines) if line.startswith("NUMA distances"))
    assert lines[distances + 3].split() == ["node0", "10", "21"]


def test_topo_json_on_the_dgx_sample(cli):
    data = cli("--root", DGX, "topo", "--json").json()
    assert set(data) == {"devices", "matrix", "pcie", "nvlink_links", "nvlink", "numa", "legend", "fabric", "notes"}
    devices = {d["name"]: d for d in data["devices"]}
    assert [devices[f"GPU{n}"]["address"] for n in range(8)] == DGX_GPUS
    assert len(devices) == 20 and devices["NIC0"]["address"] == "0000:18:00.0"
    gpu0 = devices["GPU0"]
    assert (gpu0["root_complex"], gpu0["root_port"], [s["address"] for s in gpu0["switches"]]) == (
        "0000:15", "0000:15:01.0", ["0000:16:00.0"])
    assert gpu0["local_cpulist"] == "0-55,112-167" and gpu0["numa_node"] == 0
    assert data["pcie"]["GPU0"]["NIC0"] == PIX and data["pcie"]["GPU0"]["GPU1"] == NODE
    assert data["pcie"]["GPU0"]["GPU4"] == SYS and data["pcie"]["NIC1"]["NIC2"] == PIX
    assert data["numa"]["nodes"][1]["distances"] == {"0": 21, "1": 10} and data["numa"]["single_node"] is False
    assert list(data["legend"]) == ["X", "SYS", "NODE", "PHB", "PXB", "PIX", "NV#"]
    assert data["nvlink"]["record"] == "var/lib/gpuvfio-fixture/nvlink.json"


def test_topo_only_given_addresses_and_bad_ones(cli):
    data = cli("--root", DGX, "topo", "0000:9d:00.0", "0000:1b:00.0", "0000:18:00.0", "--json").json()
    assert [(d["name"], d["address"]) for d in data["devices"]] == [
        ("GPU0", "0000:1b:00.0"), ("GPU1", "0000:9d:00.0"), ("NIC0", "0000:18:00.0")]
    assert data["pcie"]["GPU1"]["NIC0"] == SYS
    # lspci's slot form and -d select as well: the slot 1b:00, and every NVIDIA display function
    slot = cli("--root", DGX, "topo", "1b:00", "--json").json()
    assert [d["address"] for d in slot["devices"]] == ["0000:1b:00.0"]
    by_id = cli("--root", DGX, "topo", "-d", "10de::03xx", "--json").json()
    assert len(by_id["devices"]) == 8 and all(d["name"].startswith("GPU") for d in by_id["devices"])
    for args, message in ((["0000:ee:00.0"], "no such PCI function on this host: 0000:ee:00.0"),
                          (["1b:0g"], "not a PCI address"),
                          (["0000:03:00.0"], "not an NVIDIA GPU (class 03xx) or a NIC (class 02xx)"),
                          (["0000:08:00.0"], "not an NVIDIA GPU")):  # the BMC's VGA is not NVIDIA's
        result = cli("--root", DGX, "topo", *args)
        assert result.code == 2 and message in result.err and result.err.count("\n") == 1, (args, result.err)


def test_topo_on_a_host_without_gpus_or_nics_and_with_vfs(tmp_path, cli):
    b = HostBuilder(str(tmp_path))
    b.iommu("intel", 1)
    b.numa_node(0, list(range(4)), 8)
    rb = b.root_bus(0, 0, numa=0)
    b.function(rb, "0000:00:00.0", INTEL, "a700", "060000")
    result = cli("--root", b.root, "topo")
    assert result.code == 0 and "No NVIDIA GPU or NIC" in result.out
    rp = b.bridge(rb, "0000:00:01.0", INTEL, ROOT_PORT, secondary_bus=1)
    pf = b.function(rp, "0000:01:00.0", MELLANOX, CX7, "020000", driver="mlx5_core")
    b.sriov(pf, 8, ["0000:01:00.1", "0000:01:00.2"], "101e", MELLANOX, "020000", driver="mlx5_core")
    data = cli("--root", b.root, "topo", "--json").json()
    assert [d["address"] for d in data["devices"]] == ["0000:01:00.0"]
    assert data["notes"] == ["2 SR-IOV VF(s) left out (name them to see them)"]
    named = cli("--root", b.root, "topo", "0000:01:00.1", "0000:01:00.0", "--json").json()
    assert named["matrix"]["NIC0"]["NIC1"] == PIX and named["numa"]["single_node"] is True


def test_topo_reports_the_nvswitch_fabric(cli):
    """NVSwitches recognised and their fabric reported (issue 14 item 5) beside the matrix."""
    result = cli("--root", DGX, "topo")
    assert result.code == 0, result.err
    assert ("NVSwitch fabric: 4 NVSwitches (" + ", ".join(NVSWITCHES) + "), 8 baseboard GPUs; "
            "FABRIC_MODE=unset (0) (bare metal / full passthrough); Fabric Manager running") in result.out
    fabric = cli("--root", DGX, "topo", "--json").json()["fabric"]
    assert fabric["nvswitches"] == NVSWITCHES and fabric["gpus"] == DGX_GPUS
    switch_host = os.path.join(REPO, "gpuvfio", "samples", "pcie-switch.host")
    out = cli("--root", switch_host, "topo")
    assert out.code == 0 and "NVSwitch fabric" not in out.out
    assert cli("--root", switch_host, "topo", "--json").json()["fabric"]["nvswitches"] == []


def test_nvml_module_ids_are_read_recorded_and_read_back():
    """HGX GPUs' module ids (nvmlDeviceGetModuleId): how the Fabric Manager names them."""
    class WithModules(StandInNvml):
        def nvmlDeviceGetModuleId(self, handle):
            if handle == "0000:51:00.0":  # a PCIe card: no module
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return {"0000:31:00.0": 2, "0000:41:00.0": 1}[handle]

    gpus = {"0000:31:00.0": {n: ("0000:61:00.0", SWITCH_T) for n in range(2)},
            "0000:41:00.0": {n: ("0000:61:00.0", SWITCH_T) for n in range(2)}, "0000:51:00.0": {}}
    reading = read_from_nvml(WithModules(gpus))
    assert reading.module_map() == {2: A("0000:31:00.0"), 1: A("0000:41:00.0")}
    record = reading.to_record()
    assert record["modules"] == {"0000:31:00.0": 2, "0000:41:00.0": 1}
    again = parse_recording(json.dumps(record).encode(), {A(g) for g in gpus})
    assert again.modules == reading.modules
    for bad in ({"0000:31:00.0": 2, "0000:41:00.0": 2}, {"0000:31:00.0": -1}, {"0000:31:00.0": 2.0},
                {"0000:99:00.0": 3}):
        with pytest.raises(InputError):
            parse_recording(json.dumps(dict(record, modules=bad)).encode(), {A(g) for g in gpus})


def test_topology_report_is_typed_on_the_dgx_sample():
    from gpuvfio.ops.topology import DeviceKind, topology_report

    with open_host(DGX) as (host, _label):
        report = topology_report(Context(host=host))
    gpus = [d for d in report.devices if d.kind is DeviceKind.GPU]
    nics = [d for d in report.devices if d.kind is DeviceKind.NIC]
    assert [str(d.function.address) for d in gpus] == DGX_GPUS and nics
    assert [d.name for d in gpus] == [f"GPU{i}" for i in range(8)] and nics[0].name == "NIC0"
    assert all(d.nvlink is None for d in nics)
    assert gpus[0].switches and gpus[0].switches[0].address == gpus[0].position.switches[0]
    assert not report.single_node and [n.node_id for n in report.nodes] == [0, 1]
    assert report.fabric.present and report.nvlink.reading.read  # the sample's NVLink recording
    links = gpus[0].nvlink
    assert links.read and (links.to_switch, links.to_gpu, links.other) == (18, 0, 0) and len(links.links) == 18
    data = report.to_json()
    assert data["devices"][0]["kind"] == "gpu" and data["numa"]["single_node"] is False
    assert data["nvlink"]["unread"] == {} and data["nvlink"]["summary"] == report.nvlink.summary
