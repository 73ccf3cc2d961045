"""Kernel lane: ``gpuvfio xml --define`` against a libvirtd running INSIDE the emulated GPU host.

The kernel-lane guest (real kernel, emulated IOMMU, the edu device alone in its
group) starts its own libvirtd; ``gpuvfio xml 0000:02:00.0 --virt-type qemu
--firmware bios ...`` reads the guest's real sysfs, and the XML is defined in that
libvirtd (twice: the second time it is unchanged), read back and undefined.
The boot is shared with tests/nested/test_nested_lane.py (tests/lanes/nested.py runs
both parts in one guest), so this module alone costs that whole run.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from tests.lanes import nested

pytestmark = [
    pytest.mark.skipif(nested.skip_reason() is not None, reason=str(nested.skip_reason())),
]

EDU = nested.EDU
NAME = nested.DOMAIN_NAME
META = "{https://gpuvfio.invalid/xmlns/domain/1}"


@pytest.fixture(scope="module")
def rec() -> nested.NestedResult:
    return nested.checked_shared_run()


def _errors_of(rec, part: str) -> str:
    errors = rec.files.get("errors", "")
    return "\n".join(block for block in errors.split("--- ") if block.startswith(part))


def test_libvirtd_runs_in_the_guest(rec):
    info = json.loads(rec.text("libvirtd.json"))
    assert info["uri"].startswith("qemu:///system?socket="), info
    assert not _errors_of(rec, "libvirtd"), rec.summary()


def test_xml_for_the_guests_edu_device(rec):
    assert rec.rc("xml") == 0, rec.run("xml")
    root = ET.fromstring(rec.text("xml.out"))
    assert root.get("type") == "qemu"
    assert root.findtext("name") == NAME
    assert root.find("os/loader") is None  # --firmware bios
    assert root.find("cpu").get("mode") == "maximum"
    sources = [h.find("source/address").attrib for h in root.iter("hostdev")]
    assert sources == [{"domain": "0x0000", "bus": "0x02", "slot": "0x00", "function": "0x0"}], sources
    assert [d.get("address") for d in root.iter(f"{META}device")] == [EDU]
    assert root.findtext("os/kernel") == rec.image.kernel
    assert root.findtext("os/cmdline") == nested.NESTED_CMDLINE


def test_define_in_the_guests_libvirtd(rec):
    assert rec.rc("define") == 0, rec.run("define")
    assert rec.json("define")["define"]["result"] == "defined", rec.run("define")
    assert rec.rc("define_again") == 0, rec.run("define_again")
    assert rec.json("define_again")["define"]["result"] == "unchanged", rec.run("define_again")
    assert not _errors_of(rec, "domain"), rec.summary()


def test_libvirt_kept_what_gpuvfio_defined(rec):
    state = json.loads(rec.text("defined.json"))
    assert state == {"persistent": True, "active": False}
    root = ET.fromstring(rec.text("defined.xml"))
    assert root.get("type") == "qemu"
    hostdevs = list(root.iter("hostdev"))
    assert len(hostdevs) == 1 and hostdevs[0].get("managed") == "no"
    assert hostdevs[0].find("source/address").attrib == {"domain": "0x0000", "bus": "0x02", "slot": "0x00",
                                                         "function": "0x0"}
    assert [d.get("address") for d in root.iter(f"{META}device")] == [EDU]
    assert NAME not in rec.text("undefined.domains").split()


def test_defining_changed_no_driver(rec):
    assert rec.driver("initial") == (None, "(null)")
    assert rec.driver("domain") == (None, "(null)")
