"""What a Tab offers (issue 25 item 3, issue 24 item 6): candidate devices only -- GPUs with the
other functions of their slots, NVSwitches, SR-IOV VFs -- one spelling each, from a light read;
libvirt's domains from a local socket only, and never longer than a person waits."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from gpuvfio.ops import domain_completion
from gpuvfio.ops.completion import device_candidates
from gpuvfio.ops.domain_completion import domain_candidates
from tests.conftest import gpu_workstation
from tests.hostbuilder import build_sriov_server


@pytest.fixture(scope="module")
def workstation(tmp_path_factory):
    return gpu_workstation(str(tmp_path_factory.mktemp("ws"))).root


@pytest.mark.parametrize("typed, offered", [
    ("", ["01:00.0", "01:00.1", "04:00.0", "04:00.1"]),  # no bridges, no chipset devices, no NIC
    ("04", ["04:00.0", "04:00.1"]),
    ("0000", ["0000:01:00.0", "0000:01:00.1", "0000:04:00.0", "0000:04:00.1"]),  # a domain typed: full
    ("0000:01:", ["0000:01:00.0", "0000:01:00.1"]),
    ("pci_0000_01", ["pci_0000_01_00_0", "pci_0000_01_00_1"]),
    ("PCI_0000_01", ["pci_0000_01_00_0", "pci_0000_01_00_1"]),
    ("03", []),  # the Intel NIC on the chipset
    ("00:1c", []),  # a root port
    ("zz", []),
])
def test_devices_are_offered_once_in_the_form_typed(workstation, typed, offered):
    assert device_candidates(workstation, typed) == offered


def test_vfs_are_candidates_and_their_nic_pfs_are_not(tmp_path):
    root = build_sriov_server(str(tmp_path / "sriov"), nic_vfs=2).root
    devices = os.path.join(root, "sys", "bus", "pci", "devices")
    offered = device_candidates(root, "")
    assert len(offered) == len(set(offered))
    vfs = {name for name in os.listdir(devices) if os.path.islink(os.path.join(devices, name, "physfn"))}
    pfs = {os.path.basename(os.readlink(os.path.join(devices, vf, "physfn"))) for vf in vfs}
    assert vfs and {vf[len("0000:"):] for vf in vfs} <= set(offered)
    assert not {pf[len("0000:"):] for pf in pfs} & set(offered)
    gpus = [n for n in os.listdir(devices) if open(os.path.join(devices, n, "vendor")).read().strip() == "0x10de"
            and open(os.path.join(devices, n, "class")).read().startswith("0x03")]
    assert gpus and {g[len("0000:"):] for g in gpus} <= set(offered)


def test_no_host_offers_nothing(tmp_path):
    assert device_candidates(str(tmp_path / "nowhere"), "0") == []


def test_domains_come_from_a_local_libvirt_only(tmp_path):
    node = tmp_path / "node.xml"
    node.write_text("<node><domain type='test'><name>train-7</name><memory>1024</memory><os><type>hvm</type>"
                    "</os></domain><domain type='test'><name>eval</name><memory>1024</memory><os><type>hvm</type>"
                    "</os></domain></node>")
    assert domain_candidates(f"test://{node}", "tr") == ["train-7"]
    assert domain_candidates(f"test://{node}", "") == ["eval", "train-7"]
    for remote in ("qemu+ssh://host/system", "qemu+tcp://host/system", "qemu://host/system"):
        assert domain_candidates(remote, "") == []


def test_a_daemon_that_never_answers_offers_nothing_in_time(tmp_path, monkeypatch):
    """A socket that accepts and never speaks: libvirt's client waits on it; the Tab does not."""
    path = str(tmp_path / "silent.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    started = time.monotonic()
    assert domain_candidates(f"qemu+unix:///system?socket={path}", "", wait=1.0) == []
    assert time.monotonic() - started < 30  # it came back (a hang would hold the Tab forever)
    assert domain_completion.COMPLETION_WAIT <= 5


@pytest.fixture(scope="module")
def large_host(tmp_path_factory):
    return build_sriov_server(str(tmp_path_factory.mktemp("large"))).root


def _reference(root: str, typed: str) -> list[str]:
    """The candidates from the inventory read whole: every function of a slot that holds an NVIDIA
    GPU or NVSwitch, and every VF, in address order, a Tab's worth."""
    from gpuvfio.host.inventory import read_inventory
    from gpuvfio.host.root import HostRoot

    functions = read_inventory(HostRoot(root)).functions
    slots = {a.device for a, f in functions.items()
             if f.vendor_id == "10de" and f.class_id[:2] == "03" or f.vendor_id == "10de" and f.class_id[:4] == "0680"}
    chosen = [a for a, f in sorted(functions.items()) if a.device in slots or f.physfn is not None]
    return [str(a)[len("0000:"):] for a in chosen if str(a)[len("0000:"):].startswith(typed)][:200]


@pytest.mark.parametrize("typed", ["", "1", "12:00", "13:", "7e", "b"])
def test_a_tab_on_the_large_host_offers_the_first_candidates_of_the_whole_read(large_host, typed):
    """2,119 functions (benchmarks/bench_inventory.py's host): the slots decided one by one in
    address order give what the whole inventory gives, cut at a Tab's worth."""
    assert device_candidates(large_host, typed) == _reference(large_host, typed)


def test_the_walk_stops_at_a_tabs_worth(large_host, monkeypatch):
    from gpuvfio.ops import completion

    calls = []
    real = completion.read_ids_and_physfn
    monkeypatch.setattr(completion, "read_ids_and_physfn", lambda *a: calls.append(a[1]) or real(*a))
    assert len(device_candidates(large_host, "")) == completion.MAX_COMPLETIONS
    assert completion.MAX_COMPLETIONS <= len(calls) < 400  # not the host's 2,119
