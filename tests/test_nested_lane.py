"""Nested lane: real passthrough end to end, inside the kernel lane.

In the emulated GPU host (kernel lane: real kernel, emulated Intel IOMMU, the QEMU
edu device 1234:11e8 alone in its IOMMU group) a private libvirtd runs, and
``gpuvfio attach 0000:02:00.0 ...`` binds edu to vfio-pci, defines and starts a
second-level guest (the tiny busybox+dropbear guest of tests/lanes/guest.py under
QEMU TCG inside QEMU TCG) with the device passed through, waits for its SSH and
verifies it there; ``gpuvfio detach`` stops and undefines the guest and gives edu
back.  One boot for the module, shared with tests/test_kernel_domain.py (see
tests/lanes/nested.py); ~4-6 minutes on 2 cores.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from tests.lanes import nested

pytestmark = [
    pytest.mark.kernel,
    pytest.mark.skipif(nested.skip_reason() is not None, reason=str(nested.skip_reason())),
]

EDU = nested.EDU
NAME = nested.NESTED_NAME
VENDOR, DEVICE = nested.EDU_IDS


@pytest.fixture(scope="module")
def rec() -> nested.NestedResult:
    return nested.checked_shared_run()


@pytest.fixture(scope="module")
def attach(rec) -> dict:
    assert rec.rc("attach") == 0, rec.run("attach") + "\n" + rec.summary()
    return rec.json("attach")


def _group(rec) -> str:
    # The group node is the one attach created (absent before, present while attached).
    created = rec.vfio_nodes("attached") - rec.vfio_nodes("before") - {"vfio"}
    assert len(created) == 1, (rec.vfio_nodes("before"), rec.vfio_nodes("attached"))
    return created.pop()


def test_guest_script_finished(rec):
    assert "finished" in rec.files, rec.summary()
    errors = rec.files.get("errors", "")
    assert not errors, errors


def test_edu_starts_without_driver(rec):
    assert rec.driver("before") == (None, "(null)")


def test_attach_steps(attach, rec):
    assert attach["ok"] is True, rec.run("attach")
    # the address is discovered: the forward gpuvfio recorded in the domain
    assert [s["step"] for s in attach["steps"]] == ["bind", "define", "start", "find address", "wait for ssh",
                                                    "verify"]
    assert all(s["ok"] for s in attach["steps"])
    assert attach["rolled_back"] == []


def test_verify_finds_the_device_in_the_second_level_guest(attach):
    checks = {c["id"]: c for c in attach["verify"]["checks"]}
    present = checks["pci_present"]
    assert present["status"] == "pass", present
    assert present["expected"] == f"{VENDOR}:{DEVICE}"
    guest_pci = {p["address"]: p for p in attach["verify"]["facts"]["pci"]}
    assert present["observed"] in guest_pci
    seen = guest_pci[present["observed"]]
    assert (seen["vendor_id"], seen["device_id"]) == (VENDOR, DEVICE)
    assert attach["verify"]["ok"] is True
    assert attach["verify"]["expected"] == [{"address": EDU, "vendor_id": VENDOR, "device_id": DEVICE,
                                             "class_id": "00ff00", "link_gen": None, "link_width": None,
                                             "link_source": None, "vgpu_profile": None, "kind": "present"}]


def test_second_level_guest_is_the_tiny_guest(attach, rec):
    facts = attach["verify"]["facts"]
    assert facts["guest_kernel"] == rec.image.kernel_version
    assert facts["python3"] is None  # busybox guest: probe only, no verifier
    assert any(p["vendor_id"] == "1af4" for p in facts["pci"])  # its virtio NIC (user networking)
    assert attach["ssh"]["host"] == "127.0.0.1" and attach["ssh"]["notes"] == []  # pinned key, no TOFU


def test_edu_on_vfio_pci_while_attached(attach, rec):
    assert rec.driver("attached") == ("vfio-pci", "vfio-pci")
    assert _group(rec)
    status = rec.json("attached_status")
    held = {d["address"]: d for d in status["devices"]}
    assert held[EDU]["original_driver"] is None and held[EDU]["driver"] == "vfio-pci"
    assert str(held[EDU]["group"]) == _group(rec)


def test_qemu_runs_the_device_through_vfio(attach, rec):
    assert json.loads(rec.text("attached.json")) == {"active": True}
    argv = rec.text("attached.qemu_argv").splitlines()
    devices = [json.loads(a) for a in argv if a.startswith("{") and '"vfio-pci"' in a]
    assert [d["host"] for d in devices] == [EDU], argv
    root = ET.fromstring(rec.text("attached.xml"))
    assert root.get("type") == "qemu"
    sources = [h.find("source/address").attrib for h in root.iter("hostdev")]
    assert sources == [{"domain": "0x0000", "bus": "0x02", "slot": "0x00", "function": "0x0"}]


def test_libvirt_gave_qemu_the_group_node(attach, rec):
    """libvirt's DAC driver hands the vfio group node to the user QEMU runs as (in QEMU's /dev)."""
    facts = json.loads(rec.text("attached.qemu_facts"))
    node = facts.get(f"qemu /dev/vfio/{_group(rec)}", "missing")
    assert node.split()[0] == f"{facts['uid']}:{facts['gid']}", facts
    assert not facts["kernel"].startswith("error"), facts  # the 9p kernel was reachable


def test_detach_undefines_and_restores(attach, rec):
    assert rec.rc("detach") == 0, rec.run("detach")
    report = rec.json("detach")
    assert report["stopped"] in ("shut down", "destroyed")
    assert report["undefined"] is True
    assert report["devices"] == [EDU]
    assert report["restored"]["restored"] == {EDU: "no driver"}
    assert report["restored"]["failed"] == {}
    assert NAME not in rec.text("detached.domains").split()


def test_edu_back_to_no_driver(attach, rec):
    group = _group(rec)
    assert rec.driver("detached") == (None, "(null)")
    assert group not in rec.vfio_nodes("detached")
    assert rec.json("detached_status")["devices"] == []
    assert rec.json("detached_status")["unfinished_operation"] is None


def test_libvirtd_in_the_guest_left_nothing_behind(rec):
    assert rec.text("libvirtd.problems") == ""
