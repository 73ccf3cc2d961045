"""gpuvfio_ncclpaths against NCCL's rules (v2.30.7-1, commit 73cf1122): src/graph/topo.cc
ncclTopoAddPci, ncclTopoAddPciLinks, ncclTopoFlattenBcmSwitches, ncclTopoConnectCpus and
src/graph/paths.cc ncclTopoSetPaths. Each topology is read by gpuvfio_ncclxml, as NCCL reads it."""

from __future__ import annotations

import pytest

from gpuvfio.guest.payload.gpuvfio_ncclpaths import bcm_gen, build_system, class_type, gpu_paths, link_bw
from gpuvfio.guest.payload.gpuvfio_ncclxml import load_topology

GPU = 'class="0x030200" link_speed="16.0 GT/s PCIe" link_width="16"'
BRIDGE = 'class="0x060400" link_speed="16.0 GT/s PCIe" link_width="16"'


def paths(xml: str) -> dict[tuple[str, str], str]:
    return gpu_paths(load_topology(xml))


def system(*cpus: str) -> str:
    return '<system version="1">\n' + "".join(cpus) + "</system>\n"


def cpu(numaid: int, *subs: str) -> str:
    return f'<cpu numaid="{numaid}" arch="x86_64" vendor="GenuineIntel">\n' + "".join(subs) + "</cpu>\n"


def pci(busid: str, attrs: str, *subs: str) -> str:
    if not subs:
        return f'<pci busid="{busid}" {attrs}/>\n'
    return f'<pci busid="{busid}" {attrs}>\n' + "".join(subs) + "</pci>\n"


def test_one_switch_is_pix_two_are_pxb_a_cpu_phb_two_cpus_sys():
    found = paths(system(
        cpu(0, pci("0000:01:00.0", BRIDGE,
                   pci("0000:02:00.0", BRIDGE, pci("0000:03:00.0", GPU), pci("0000:04:00.0", GPU)),
                   pci("0000:05:00.0", GPU)),
            pci("0000:10:00.0", GPU)),
        cpu(1, pci("0000:80:00.0", GPU))))
    assert found == {
        ("0000:03:00.0", "0000:04:00.0"): "PIX", ("0000:03:00.0", "0000:05:00.0"): "PXB",
        ("0000:04:00.0", "0000:05:00.0"): "PXB", ("0000:03:00.0", "0000:10:00.0"): "PHB",
        ("0000:04:00.0", "0000:10:00.0"): "PHB", ("0000:05:00.0", "0000:10:00.0"): "PHB",
        ("0000:03:00.0", "0000:80:00.0"): "SYS", ("0000:04:00.0", "0000:80:00.0"): "SYS",
        ("0000:05:00.0", "0000:80:00.0"): "SYS", ("0000:10:00.0", "0000:80:00.0"): "SYS"}


def test_classes_go_by_the_first_prefix_and_fall_back_to_pci():
    """kvConvertToInt compares strlen(key) bytes, first entry first; unknown is PCI."""
    assert class_type("0x060400") == "PCI" and class_type("0x030000") == "GPU" and class_type("0x0302") == "GPU"
    assert class_type("0x020700") == "NIC" and class_type("0x068000") == "NVS" and class_type("0x040300") == "PCI"
    assert class_type("") == "PCI"
    # an unknown class is a PCI level like a switch: two GPUs under it are PIX, and a GPU below a
    # second one is PXB from them
    found = paths(system(cpu(0, pci("0000:01:00.0", 'class="0x058000"', pci("0000:02:00.0", GPU),
                                    pci("0000:03:00.0", 'class="0x0c0330"', pci("0000:04:00.0", GPU))))))
    assert found[("0000:02:00.0", "0000:04:00.0")] == "PXB"


def test_what_is_no_pci_node_is_not_read_below():
    """A <pci> of a NIC's class without a <nic> makes no node, and NCCL reads nothing under it."""
    found = paths(system(cpu(0, pci("0000:01:00.0", 'class="0x020000"', pci("0000:02:00.0", GPU)),
                             pci("0000:03:00.0", GPU))))
    assert found == {}  # the GPU under the NIC-class node is never added


def test_a_gpu_without_a_rank_ends_its_node():
    """ncclTopoAddPci returns when a <gpu> has no rank: the GPU is not added."""
    found = paths(system(cpu(0, pci("0000:01:00.0", GPU, '<gpu dev="0" sm="90" rank="0"/>\n'),
                             pci("0000:02:00.0", GPU, '<gpu dev="1" sm="90"/>\n'),
                             pci("0000:03:00.0", GPU, '<gpu dev="2" sm="90" rank="2"/>\n'))))
    assert found == {("0000:01:00.0", "0000:03:00.0"): "PHB"}


def test_no_path_goes_through_another_gpu():
    """Only the base GPU's DEV node is passed through; a GPU-class node's subs are not read."""
    found = paths(system(cpu(0, pci("0000:01:00.0", GPU, pci("0000:02:00.0", GPU)), pci("0000:03:00.0", GPU))))
    assert found == {("0000:01:00.0", "0000:03:00.0"): "PHB"}


def test_a_pcilink_between_switches_is_pxb():
    """ncclTopoAddPciLinks links two switches with LINK_LOC; a hop between two PCI nodes is PXB
    whatever the link, so two GPUs under linked switches are PXB, not PHB through the CPU."""
    left = pci("0000:01:00.0", BRIDGE, pci("0000:02:00.0", GPU), '<pcilink target="0000:11:00.0"/>\n')
    right = pci("0000:11:00.0", BRIDGE, pci("0000:12:00.0", GPU))
    assert paths(system(cpu(0, left, right))) == {("0000:02:00.0", "0000:12:00.0"): "PXB"}
    assert paths(system(cpu(0, left.replace("<pcilink", "<other"), right))) == {("0000:02:00.0", "0000:12:00.0"): "PHB"}


@pytest.mark.parametrize("ids, folded", [
    ('vendor="0x1000" device="0xc010" subsystem_vendor="0x1000" subsystem_device="0xa064"', True),  # Gen4
    ('vendor="0x1000" device="0xc030" subsystem_vendor="0x1000" subsystem_device="0x0100"', True),  # Gen5
    ('vendor="0x10b5" device="0xc010" subsystem_vendor="0x10b5" subsystem_device="0xa064"', False),  # not BCM
])
def test_broadcom_switches_lose_their_second_level(ids, folded):
    lower = ids.replace('subsystem_device="0x0100"', 'subsystem_device="0x1100"')
    top = pci("0000:01:00.0", f"{BRIDGE} {ids}",
              pci("0000:02:00.0", f"{BRIDGE} {lower}", pci("0000:03:00.0", GPU)),
              pci("0000:04:00.0", f"{BRIDGE} {lower}", pci("0000:05:00.0", GPU)))
    assert paths(system(cpu(0, top))) == {("0000:03:00.0", "0000:05:00.0"): "PIX" if folded else "PXB"}
    assert bcm_gen(0x1000C0101000A064, 0) == 4 and bcm_gen(0x1000C03010001100, 1) == 5
    assert bcm_gen(0x1000C03010001100, 0) == 0


def test_link_bandwidth_follows_kv_dict_pci_gen():
    node = load_topology(system(cpu(0, pci("0000:01:00.0", 'class="0x030200" link_speed="16.0 GT/s PCIe" '
                                                            'link_width="8"'))))[0].subs[0].subs[0]
    assert link_bw(node) == 8 * 120 / 80.0
    node.attrs = [("link_speed", "bogus"), ("link_width", "0")]
    assert link_bw(node) == 16 * 60 / 80.0  # unknown speed: 60; width 0: 16
    node.attrs = [("link_speed", "2.5 GT/s PCIe")]
    assert link_bw(node) == 16 * 15 / 80.0


def test_a_missing_bus_id_is_refused_as_nccl_refuses_it():
    with pytest.raises(ValueError, match="Attribute busid of node pci not found"):
        build_system(load_topology(system(cpu(0, '<pci class="0x030200"/>\n'))))
    with pytest.raises(ValueError, match="system node not found"):
        build_system([])


def test_deep_nesting_is_bounded():
    xml = "".join(f'<pci busid="0000:{n:02x}:00.0" {BRIDGE}>\n' for n in range(70))
    xml += "</pci>\n" * 70
    with pytest.raises(ValueError, match="nested more than 64"):
        paths(system(cpu(0, xml)))


def test_bus_ids_are_numbers_to_nccl():
    """busIdToInt64 (src/misc/utils.cc) reads the hex digits as one number: a pcilink target
    spelled with an eight-digit domain is the same switch, and a GPU named twice is one."""
    left = pci("0000:01:00.0", BRIDGE, pci("0000:02:00.0", GPU), '<pcilink target="00000000:11:00.0"/>\n')
    right = pci("0000:11:00.0", BRIDGE, pci("0000:12:00.0", GPU))
    assert paths(system(cpu(0, left, right))) == {("0000:02:00.0", "0000:12:00.0"): "PXB"}
    twice = paths(system(cpu(0, pci("0000:02:00.0", GPU), pci("0000:03:00.0", GPU), pci("0000:02:00.0 ", GPU))))
    assert list(twice) == [("0000:02:00.0", "0000:03:00.0")]
