"""Nested lane: real passthrough end to end, inside the kernel lane.

In the emulated GPU host (kernel lane: real kernel, emulated Intel IOMMU, two NUMA
nodes, QEMU edu devices 1234:11e8: one on node 0's expander, two behind an emulated
PCIe switch on node 1's, one behind a second switch cascaded below that one) a private
libvirtd runs, and ``gpuvfio attach 0000:41:00.0 0000:84:00.0 0000:85:00.0 0000:88:00.0
--topology mirror --vcpus 2 ...`` binds them to vfio-pci,
defines and starts a second-level guest (the tiny busybox+dropbear guest of
tests/lanes/guest.py under QEMU TCG inside QEMU TCG) with the devices passed through,
waits for its SSH and verifies them there.  The lane then reads the PCI tree the
second-level guest sees (issue 14: the switch edus under one emulated switch, on the
guest NUMA cell that mirrors host node 1; issue 37: every switch level between the root
port and a device mirrored, so each device has the host's switch depth and each pair
the host's shared switches); ``gpuvfio detach`` stops and undefines
the guest and gives the devices back.  One boot for the module, shared with
tests/nested/test_kernel_domain.py (see tests/lanes/nested.py); ~5-11 minutes on 2 cores.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from tests.lanes import kernel as kl
from tests.lanes import nested

pytestmark = [
    pytest.mark.skipif(nested.skip_reason() is not None, reason=str(nested.skip_reason())),
]

DEVICES = list(nested.ATTACH_DEVICES)
SINGLE = kl.NUMA0_EDU  # host node 0, on a root port alone
SWITCHED = [*kl.SWITCH_EDUS, kl.CASCADE_EDU]  # host node 1, behind one switch (the last behind two)
NAME = nested.NESTED_NAME
VENDOR, DEVICE = nested.EDU_IDS
SWITCH_UP_IDS, SWITCH_DOWN_IDS = ("104c", "8232"), ("104c", "8233")  # QEMU's x3130 / xio3130 ports


@pytest.fixture(scope="module")
def rec() -> nested.NestedResult:
    return nested.checked_shared_run()


@pytest.fixture(scope="module")
def attach(rec) -> dict:
    assert rec.rc("attach") == 0, rec.run("attach") + "\n" + rec.summary()
    return rec.json("attach")


@pytest.fixture(scope="module")
def domain(attach, rec) -> ET.Element:
    return ET.fromstring(rec.text("attached.xml"))


@pytest.fixture(scope="module")
def tree(attach, rec) -> dict[str, nested.PciNode]:
    nodes = rec.nested_tree()
    print("second-level guest's PCI tree (path numa_node vendor:device class):\n" + "\n".join(
        f"  {'/'.join(n.path)} {n.numa_node} {n.vendor}:{n.device} {n.class_id}" for n in nodes.values()))
    print("its lspci -t:\n" + rec.files.get("nested.lspci_t", "(not recorded)"))
    assert nodes, rec.files.get("nested.tree.raw", "(no nested.tree.raw)") + "\n" + rec.summary()
    return nodes


def _groups(rec) -> set[str]:
    # The group nodes are the ones attach created (absent before, present while attached).
    created = rec.vfio_nodes("attached") - rec.vfio_nodes("before") - {"vfio"}
    assert len(created) == len(DEVICES), (rec.vfio_nodes("before"), rec.vfio_nodes("attached"))
    return created


def _host_bus(address: str) -> dict:
    domain_, bus, rest = address.split(":")
    slot, function = rest.split(".")
    return {"domain": f"0x{domain_}", "bus": f"0x{bus}", "slot": f"0x{slot}", "function": f"0x{int(function, 16):x}"}


def _expander_of(domain: ET.Element, host: str) -> ET.Element:
    """The pcie-expander-bus controller above the hostdev of host address ``host``."""
    controllers = {c.get("index"): c for c in domain.iter("controller") if c.get("type") == "pci"}
    hostdev = next(h for h in domain.iter("hostdev") if h.find("source/address").attrib == _host_bus(host))
    index = str(int(hostdev.find("address").get("bus"), 16))
    while index != "0":
        controller = controllers[index]
        if controller.get("model") == "pcie-expander-bus":
            return controller
        index = str(int(controller.find("address").get("bus"), 16))
    raise AssertionError(f"{host} is not below a pcie-expander-bus in the domain")


def _edus(tree) -> list[nested.PciNode]:
    return [n for n in tree.values() if (n.vendor, n.device) == (VENDOR, DEVICE)]


def test_guest_script_finished(rec):
    assert "finished" in rec.files, rec.summary()
    errors = rec.files.get("errors", "")
    assert not errors, errors


def test_emulated_host_has_the_switch_and_both_nodes(rec):
    """The first-level guest's own tree (kernel lane topology), as lspci -t draws it."""
    text = rec.text("host.lspci_t")
    print(text)
    groups = kl.parse_groups(rec.text("host.groups"))
    group_of = {a: g for g, members in groups.items() for a in members}
    assert len({group_of[a] for a in DEVICES}) == len(DEVICES)  # one group each
    for edu, port in zip(kl.SWITCH_EDUS, kl.SWITCH_DOWNSTREAM):
        # QEMU 7.2's xio3130-downstream has no ACS: each edu shares its group with its
        # downstream port (a bridge: the group stays viable, the port stays on pcieport).
        assert groups[group_of[edu]] <= {edu, port}, groups[group_of[edu]]
    # The cascade's ports have no ACS either: its edu shares a group with them (bridges only).
    cascade = groups[group_of[kl.CASCADE_EDU]]
    assert cascade <= {kl.CASCADE_PORT, kl.CASCADE_UPSTREAM, kl.CASCADE_DOWNSTREAM, kl.CASCADE_EDU}, cascade
    host = rec.host_tree()
    assert [host[a].bridges[1:] for a in (kl.SWITCH_EDUS[0], kl.CASCADE_EDU)] == [
        (kl.SWITCH_UPSTREAM, kl.SWITCH_DOWNSTREAM[0]),
        (kl.SWITCH_UPSTREAM, kl.CASCADE_PORT, kl.CASCADE_UPSTREAM, kl.CASCADE_DOWNSTREAM)], host


def test_devices_start_without_driver(rec):
    for address in DEVICES:
        assert rec.driver("before", address) == (None, "(null)")


def test_attach_steps(attach, rec):
    assert attach["ok"] is True, rec.run("attach")
    # the address is discovered: the forward gpuvfio recorded in the domain
    assert [s["step"] for s in attach["steps"]] == ["bind", "define", "start", "find address", "wait for ssh",
                                                    "verify"]
    assert all(s["ok"] for s in attach["steps"])
    assert attach["rolled_back"] == []
    # the L1 guest's emulated switch, mirrored level for level in the L2 guest
    assert any(note.startswith(f"{', '.join(SWITCHED)} are below host root port {kl.SWITCH_ROOT_PORT} through "
                               "2 switch level(s)") for note in attach["notes"]), attach["notes"]


def test_verify_finds_every_device_in_the_second_level_guest(attach):
    present = [c for c in attach["verify"]["checks"] if c["id"] == "pci_present"]
    assert sorted(c["device"] for c in present) == sorted(DEVICES)
    assert all(c["status"] == "pass" and c["expected"] == f"{VENDOR}:{DEVICE}" for c in present), present
    guest_pci = {p["address"]: p for p in attach["verify"]["facts"]["pci"]}
    observed = [c["observed"].split()[0] for c in present]
    assert len(set(observed)) == len(DEVICES)  # three distinct guest functions
    for address in observed:
        assert (guest_pci[address]["vendor_id"], guest_pci[address]["device_id"]) == (VENDOR, DEVICE)
    assert attach["verify"]["ok"] is True
    assert attach["verify"]["expected"] == [
        {"address": a, "vendor_id": VENDOR, "device_id": DEVICE, "class_id": "00ff00", "link_gen": None,
         "link_width": None, "link_source": None, "vgpu_profile": None, "driver_version": None, "clique": None,
         "kind": "present"} for a in DEVICES]


def test_second_level_guest_is_the_tiny_guest(attach, rec):
    facts = attach["verify"]["facts"]
    assert facts["guest_kernel"] == rec.image.kernel_version
    assert facts["python3"] is None  # busybox guest: probe only, no verifier
    assert any(p["vendor_id"] == "1af4" for p in facts["pci"])  # its virtio NIC (user networking)
    assert attach["ssh"]["host"] == "127.0.0.1" and attach["ssh"]["notes"] == []  # pinned key, no TOFU


def test_devices_on_vfio_pci_while_attached(attach, rec):
    groups = _groups(rec)
    status = rec.json("attached_status")
    held = {d["address"]: d for d in status["devices"]}
    for address in DEVICES:
        assert rec.driver("attached", address) == ("vfio-pci", "vfio-pci")
        assert held[address]["original_driver"] is None and held[address]["driver"] == "vfio-pci"
    assert {str(held[a]["group"]) for a in DEVICES} == groups
    assert rec.driver("attached") == (None, "(null)")  # EDU, not attached, untouched


def test_qemu_runs_the_devices_through_vfio(attach, rec, domain):
    assert json.loads(rec.text("attached.json")) == {"active": True}
    argv = rec.text("attached.qemu_argv").splitlines()
    devices = [json.loads(a) for a in argv if a.startswith("{") and '"vfio-pci"' in a]
    assert sorted(d["host"] for d in devices) == DEVICES, argv
    assert domain.get("type") == "qemu"
    sources = [h.find("source/address").attrib for h in domain.iter("hostdev")]
    assert sources == [_host_bus(a) for a in DEVICES]


def test_domain_mirrors_the_switch_and_the_nodes(domain):
    """What gpuvfio asked for: two cells, one pxb per host root complex bound to its cell,
    the switch edus behind emulated switches as on the host: two upstream ports (the switch
    and the one cascaded below it), four downstream ports (three of the first, one of the
    second)."""
    cells = domain.findall("cpu/numa/cell")
    assert [c.get("id") for c in cells] == ["0", "1"]
    assert _expander_of(domain, SINGLE).findtext("target/node") == "0"
    for address in SWITCHED:
        assert _expander_of(domain, address).findtext("target/node") == "1"
    models = [c.get("model") for c in domain.iter("controller")]
    assert models.count("pcie-switch-upstream-port") == 2 and models.count("pcie-switch-downstream-port") == 4


def test_second_level_guest_sees_one_switch_on_the_mirrored_node(tree, domain, rec):
    """Issue 14: in the second-level guest the two switch edus hang from one upstream port (their
    grandparent bridge), each below its own downstream port, on the NUMA node of the cell
    that mirrors host node 1; the cascaded edu below a second switch on the same node; the
    node-0 edu on a root port of its own, on node 0."""
    edus = _edus(tree)
    assert len(edus) == 4, tree
    by_grandparent: dict[str, list[nested.PciNode]] = {}
    for edu in edus:
        assert len(edu.bridges) >= 1, edu
        by_grandparent.setdefault(edu.path[-3], []).append(edu)
    shared = [group for group in by_grandparent.values() if len(group) == 2]
    assert len(shared) == 1, by_grandparent
    (single,) = [e for e in edus if len(e.bridges) == 1]
    (cascaded,) = [e for e in edus if len(e.bridges) == 5]
    switched = shared[0] + [cascaded]
    upstream = tree[switched[0].path[-3]]
    assert (upstream.vendor, upstream.device) == SWITCH_UP_IDS, upstream
    downstream = {e.path[-2] for e in shared[0]}
    assert len(downstream) == 2 and all((tree[d].vendor, tree[d].device) == SWITCH_DOWN_IDS for d in downstream)
    assert len(switched[0].bridges) == 3  # root port -> upstream -> downstream
    assert cascaded.bridges[:2] == switched[0].bridges[:2]  # the cascade hangs from the same switch
    assert len(single.bridges) == 1 and single.path[-3].startswith("pci")  # a root port on a root bus
    assert tree[single.path[-2]].class_id.startswith("0604")
    # NUMA: the node the guest gives them is the cell gpuvfio bound their pxb to.
    switch_pxb, single_pxb = _expander_of(domain, SWITCHED[0]), _expander_of(domain, SINGLE)
    assert {e.numa_node for e in switched} == {int(switch_pxb.findtext("target/node"))} == {1}
    assert single.numa_node == int(single_pxb.findtext("target/node")) == 0
    # ... and each hangs from the root bus its pxb's busNr starts.
    assert {e.root_bus for e in switched} == {f"0000:{int(switch_pxb.find('target').get('busNr')):02x}"}
    assert single.root_bus == f"0000:{int(single_pxb.find('target').get('busNr')):02x}"
    nodes = dict(line.split("|", 1) for line in rec.text("nested.nodes").splitlines() if "|" in line)
    assert sorted(nodes) == ["node0", "node1"], nodes


def _shape(nodes: list[nested.PciNode], tree: dict[str, nested.PciNode]) -> tuple[list, list]:
    """Where devices sit, whatever their addresses: each one's chain of bridges as
    (vendor, device) ids from its root port down, and for each pair the bridges they share."""
    chains = sorted(tuple((tree[b].vendor, tree[b].device) for b in n.bridges) for n in nodes)
    shared = []
    for i, one in enumerate(nodes):
        for other in nodes[i + 1:]:
            common = 0
            if one.root_bus == other.root_bus:
                while common < min(len(one.bridges), len(other.bridges)) and \
                        one.bridges[common] == other.bridges[common]:
                    common += 1
            shared.append((min(len(one.bridges), len(other.bridges)), max(len(one.bridges), len(other.bridges)),
                           common))
    return chains, sorted(shared)


def test_second_level_guest_has_the_hosts_switch_depth(tree, rec):
    """Issue 37: the kernel of the second-level guest sees every passed-through device at the
    host's switch depth, below the same kinds of ports (QEMU's root port, x3130 upstream and
    xio3130 downstream ports on both levels), and each pair shares as many bridges as on the
    host: the cascaded edu two switch levels down, sharing the root port and the first
    switch's upstream port with the other two. (Read from sysfs: busybox's lspci has no -t.)"""
    host = rec.host_tree()
    assert _shape([host[a] for a in DEVICES], host) == _shape(_edus(tree), tree), (
        rec.text("host.lspci_t"), rec.files.get("nested.lspci_t"))
    chains, shared = _shape([host[a] for a in DEVICES], host)
    assert max(len(c) for c in chains) == 5 and (3, 5, 2) in shared  # the cascade is there to compare


def test_libvirt_gave_qemu_the_group_nodes(attach, rec):
    """libvirt's DAC driver hands the vfio group nodes to the user QEMU runs as (in QEMU's /dev)."""
    facts = json.loads(rec.text("attached.qemu_facts"))
    for group in _groups(rec):
        node = facts.get(f"qemu /dev/vfio/{group}", "missing")
        assert node.split()[0] == f"{facts['uid']}:{facts['gid']}", facts
    assert not facts["kernel"].startswith("error"), facts  # the 9p kernel was reachable


def test_detach_undefines_and_restores(attach, rec):
    assert rec.rc("detach") == 0, rec.run("detach")
    report = rec.json("detach")
    assert report["stopped"] in ("shut down", "destroyed")
    assert report["undefined"] is True
    assert sorted(report["devices"]) == DEVICES
    assert report["restored"]["restored"] == {a: "no driver" for a in DEVICES}
    assert report["restored"]["failed"] == {}
    assert NAME not in rec.text("detached.domains").split()


def test_devices_back_to_no_driver(attach, rec):
    groups = _groups(rec)
    for address in DEVICES:
        assert rec.driver("detached", address) == (None, "(null)")
    assert not groups & rec.vfio_nodes("detached")
    assert rec.json("detached_status")["devices"] == []
    assert rec.json("detached_status")["unfinished_operation"] is None


def test_libvirtd_in_the_guest_left_nothing_behind(rec):
    assert rec.text("libvirtd.problems") == ""
