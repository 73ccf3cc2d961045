"""IOMMU faults attributed to devices (issue 38 item 1): the kernel's fault lines as Linux 5.4 to
6.12 print them (drivers/iommu/intel/dmar.c dmar_fault_do_one, drivers/iommu/amd/iommu.c
amd_iommu_report_page_fault and iommu_print_event), in /dev/kmsg's records; the kernel's own
/dev/kmsg read through the file layer; health, doctor and a bind's plan agreeing."""

from __future__ import annotations

import os
import re
import stat

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.errors import UnsafePathError
from gpuvfio.files import Tree
from gpuvfio.host.iommu_faults import RECORD, KernelLog, fault_records, read_kernel_log
from gpuvfio.host.root import HostRoot
from tests.conftest import gpu_workstation

GPU, SMALL_GPU = "0000:01:00.0", "0000:04:00.0"


def faults_of(data: bytes) -> list[tuple]:
    log = read_log(data)
    return [(f.unit, f.kind, f.segment, f.bus, f.slot, f.function) for f in log.faults]


def read_log(data: bytes) -> KernelLog:
    return KernelLog(tuple(fault for _, fault in fault_records(data)))


@pytest.mark.parametrize("line, fault", [
    # Linux 5.15 .. 6.12 (intel/dmar.c)
    ("DMAR: [DMA Read NO_PASID] Request device [01:00.0] fault addr 0xfffff000 [fault reason 0x06] PTE Read access "
     "is not set", ("DMAR", "DMA Read", None, 1, 0, 0)),
    ("DMAR: [DMA Write PASID 0x2] Request device [04:00.1] fault addr 0x7ff000 [fault reason 0x05] PTE Write "
     "access is not set", ("DMAR", "DMA Write", None, 4, 0, 1)),
    ("DMAR: [INTR-REMAP] Request device [01:00.0] fault index 0x12 [fault reason 0x25] Blocked a compatibility "
     "format interrupt request", ("DMAR", "INTR-REMAP", None, 1, 0, 0)),
    # Linux 5.4 (dmar.c): no NO_PASID, PASID ffffffff, no 0x, a decimal reason
    ("DMAR: [DMA Read] Request device [01:00.0] PASID ffffffff fault addr 7ff000 [fault reason 06] PTE Read access "
     "is not set", ("DMAR", "DMA Read", None, 1, 0, 0)),
    # Linux 5.14: bus and device with 0x (fixed in 5.15 by 0b482d0c75bf)
    ("DMAR: [DMA Read NO_PASID] Request device [0x01:0x00.0] fault addr 0x1000 [fault reason 0x06] x",
     ("DMAR", "DMA Read", None, 1, 0, 0)),
    # AMD-Vi, a known device: pci_err names it first, with its segment
    ("vfio-pci 0000:04:00.0: AMD-Vi: Event logged [IO_PAGE_FAULT domain=0x000e address=0xfd000000 flags=0x0020]",
     ("AMD-Vi", "IO_PAGE_FAULT", 0, 4, 0, 0)),
    # AMD-Vi, no device found: device= with the segment (6.1+) or without (5.4, 5.15)
    ("AMD-Vi: Event logged [IO_PAGE_FAULT device=0001:04:00.0 domain=0x0000 address=0x0 flags=0x0000]",
     ("AMD-Vi", "IO_PAGE_FAULT", 1, 4, 0, 0)),
    ("AMD-Vi: Event logged [IO_PAGE_FAULT device=04:00.0 domain=0x0000 address=0x0 flags=0x0000]",
     ("AMD-Vi", "IO_PAGE_FAULT", None, 4, 0, 0)),
    # AMD-Vi events of the IOMMU's own device (iommu ivhd0) that name the function in device=
    ("iommu ivhd0: AMD-Vi: Event logged [ILLEGAL_DEV_TABLE_ENTRY device=0000:01:00.0 pasid=0x00000 address=0x0 "
     "flags=0x0000]", ("AMD-Vi", "ILLEGAL_DEV_TABLE_ENTRY", 0, 1, 0, 0)),
    ("iommu ivhd0: AMD-Vi: Event logged [INVALID_DEVICE_REQUEST device=0000:01:00.0 pasid=0x00000 address=0x0 "
     "flags=0x0000]", ("AMD-Vi", "INVALID_DEVICE_REQUEST", 0, 1, 0, 0)),
])
def test_each_kernels_fault_line_names_its_function(line, fault):
    assert faults_of(f"3,7,5000000,-;{line}\n".encode()) == [fault]


@pytest.mark.parametrize("line", [
    "iommu ivhd0: AMD-Vi: Event logged [COMMAND_HARDWARE_ERROR address=0x0 flags=0x0000]",  # the IOMMU's own
    "DMAR: DRHD: handling fault status reg 2",  # the line before a fault, no device
    "arm-smmu-v3 arm-smmu-v3.0.auto: event 0x10 received:",  # SMMUv3: a stream ID, not a function
    "nvidia 0000:01:00.0: Xid 79: GPU has fallen off the bus",  # not an IOMMU fault
])
def test_lines_that_name_no_function_are_not_faults_of_one(line):
    assert faults_of(f"3,7,5000000,-;{line}\n".encode()) == []


@pytest.mark.parametrize("record", [
    # Linux 5.8+ names an exec-stack binary in the log, a name anyone can choose (fs/exec.c)
    "4,9,5000000,-;process 'DMAR: [DMA Write NO_PASID] Request device [04:00.0] fault addr 0x0 [fault reason "
    "0x05] x' started with executable stack",
    # a process writing /dev/kmsg: facility 1 (user), not the kernel's
    "11,9,5000000,-;DMAR: [DMA Read NO_PASID] Request device [04:00.0] fault addr 0x1 [fault reason 0x06] x",
    "14,9,5000000,-;vfio-pci 0000:04:00.0: AMD-Vi: Event logged [IO_PAGE_FAULT domain=0x1 address=0x0 flags=0x0]",
    # a fault line inside another device's message
    "3,9,5000000,-;usb 1-1: Product: AMD-Vi: Event logged [IO_PAGE_FAULT device=0000:04:00.0 domain=0x0]",
])
def test_a_fault_line_that_is_not_the_kernels_own_is_no_fault(record):
    """Found by an attacker's review: any text in the log that held a fault line counted."""
    assert faults_of(f"{record}\n".encode()) == []


def test_what_is_not_a_record_is_passed_over():
    """A recording's hostile lines: a text without the record's header, a header too long, a
    dictionary line, a record over its bound; the record after them still counts."""
    good = "DMAR: [DMA Read NO_PASID] Request device [01:00.0] fault addr 0x1 [fault reason 0x06] x"
    data = (f"{good}\n"  # no header
            f"3,1,{'9' * 30},-;{good}\n"  # usec longer than any u64
            f" DEVICE=+pci:0000:01:00.0 {good}\n"  # a dictionary line
            f"3,2,1,-;{good}{'x' * 20000}\n"  # longer than a record
            f"3,3,1,-;{good}\n").encode()
    assert faults_of(data) == [("DMAR", "DMA Read", None, 1, 0, 0)]


def test_the_kernels_own_log_is_read_whole_and_every_record_has_its_form():
    """/dev/kmsg of the machine the tests run on, read through the file layer as health reads
    the live host's: every line is a record's header or a dictionary line (dev-kmsg's form),
    and the newest records are kept within a bound."""
    looked = os.stat("/dev/kmsg") if os.path.exists("/dev/kmsg") else None
    if looked is None or not stat.S_ISCHR(looked.st_mode) or not os.access("/dev/kmsg", os.R_OK):
        pytest.fail("/dev/kmsg is not a readable character device here: the check cannot run")
    data = Tree("/").read_kernel_log("dev/kmsg")
    lines = data.decode("ascii", "replace").splitlines()
    assert lines and all(RECORD.fullmatch(line) or line.startswith(" ") for line in lines), lines[:5]
    tail = Tree("/").read_kernel_log("dev/kmsg", limit=600)
    assert 0 < len(tail) <= 600 and RECORD.fullmatch(tail.decode("ascii", "replace").splitlines()[0])


def test_only_the_kernel_log_device_is_opened(tmp_path):
    """dev/kmsg may be the kernel's device (1:11) or a recording; another device there is never
    opened (/dev/watchdog arms on open), a FIFO never waited on, a link never followed."""
    tree = Tree(str(tmp_path))
    os.makedirs(tmp_path / "dev")
    assert tree.read_kernel_log("dev/kmsg") is None
    os.mknod(tmp_path / "dev" / "kmsg", 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    with pytest.raises(UnsafePathError, match=re.escape(f"{tmp_path}/dev/kmsg is the character device 1:3: only "
                                                       "the live root's")):
        tree.read_kernel_log("dev/kmsg")
    os.unlink(tmp_path / "dev" / "kmsg")
    os.mknod(tmp_path / "dev" / "kmsg", 0o600 | stat.S_IFCHR, os.makedev(1, 11))  # the log's numbers, in a tree
    with pytest.raises(UnsafePathError, match="character device 1:11: only the live root's"):
        tree.read_kernel_log("dev/kmsg")
    os.unlink(tmp_path / "dev" / "kmsg")
    os.mkfifo(tmp_path / "dev" / "kmsg")
    with pytest.raises(UnsafePathError, match="FIFO"):
        tree.read_kernel_log("dev/kmsg")
    os.unlink(tmp_path / "dev" / "kmsg")
    os.symlink("/dev/kmsg", tmp_path / "dev" / "kmsg")
    with pytest.raises(UnsafePathError, match="is a link"):  # refused as a link, never followed to 1:11
        tree.read_kernel_log("dev/kmsg")
    os.unlink(tmp_path / "dev" / "kmsg")
    (tmp_path / "dev" / "kmsg").write_bytes(b"x" * 100)
    with pytest.raises(UnsafePathError, match=re.escape(f"{tmp_path}/dev/kmsg is larger than 10 bytes")):
        tree.read_kernel_log("dev/kmsg", limit=10)
    assert tree.read_kernel_log("dev/kmsg", limit=100) == b"x" * 100
    with pytest.raises(UnsafePathError, match=rf"^{re.escape(str(tmp_path))}/dev/k+\.\.\.: name too long$"):
        tree.read_kernel_log("dev/" + "k" * 300)  # an error of the look itself names the path


# --- health, doctor and plans ----------------------------------------------------------------------

def _iommu(result, address: str) -> list[tuple[str, str]]:
    (device,) = [d for d in result.json()["devices"] if d["address"] == address]
    return [(f["status"], f["message"]) for f in device["findings"] if f["check"] == "iommu"]


def test_a_device_with_iommu_faults_is_degraded_and_the_others_are_not(cli, tmp_path):
    b = gpu_workstation(tmp_path / "host")
    b.kernel_log(["DMAR: [DMA Read NO_PASID] Request device [01:00.0] fault addr 0xfffff000 [fault reason 0x06] "
                  "PTE Read access is not set",
                  "DMAR: [INTR-REMAP] Request device [01:00.0] fault index 0x12 [fault reason 0x25] Blocked",
                  "DMAR: [DMA Read NO_PASID] Request device [01:00.0] fault addr 0xfffff000 [fault reason 0x06] "
                  "PTE Read access is not set"])
    result = cli("--root", b.root, "health", "--json")
    assert result.code == 1
    assert _iommu(result, GPU) == [("degraded", "3 IOMMU fault(s) in the kernel log (DMAR DMA Read 2, DMAR "
                                                "INTR-REMAP 1); the last, 7 s after boot: DMAR: [DMA Read NO_PASID] "
                                                "Request device [01:00.0] fault addr 0xfffff000 [fault reason 0x06] "
                                                "PTE Read access is not set")]
    assert _iommu(result, SMALL_GPU) == [("ok", "no IOMMU faults in the kernel log")]
    doctor = cli("--root", b.root, "doctor", "--json")
    (check,) = [c for c in doctor.json()["checks"] if c["id"] == "device_health"]
    assert check["status"] == "warn" and f"{GPU}: 3 IOMMU fault(s) in the kernel log" in check["summary"]
    b.driver("vfio-pci")
    plan = cli("--root", b.root, "bind", GPU, "--dry-run", "--json")
    assert plan.code == 0
    assert [c["status"] for c in plan.json()["checks"] if c["message"].startswith(f"{GPU}: 3 IOMMU")] == ["warn"]


def test_a_line_without_a_segment_says_so_where_the_host_has_two(cli, tmp_path):
    """Intel's line names bus, device and function only: on a host with a second PCI segment the
    fault counts for both functions at that bus address, and says it may be the other's."""
    b = gpu_workstation(tmp_path / "host")
    b.function(b.root_bus(domain=1, numa=0), "0001:01:00.0", "10de", "2684", "030000", driver="nvidia")
    b.kernel_log(["DMAR: [DMA Read NO_PASID] Request device [01:00.0] fault addr 0x1 [fault reason 0x06] x"])
    result = cli("--root", b.root, "health", "--json")
    for address in (GPU, "0001:01:00.0"):
        ((status, message),) = _iommu(result, address)
        assert status == "degraded" and "its line names no PCI segment" in message
    b.kernel_log(["vfio-pci 0001:01:00.0: AMD-Vi: Event logged [IO_PAGE_FAULT domain=0x0001 address=0x0 flags=0x0]"])
    result = cli("--root", b.root, "health", "--json")
    assert _iommu(result, GPU) == [("ok", "no IOMMU faults in the kernel log")]
    assert _iommu(result, "0001:01:00.0")[0][0] == "degraded"


def test_a_root_without_a_kernel_log_cannot_vouch_and_plans_go_on(cli, tmp_path):
    b = gpu_workstation(tmp_path / "host")
    os.unlink(os.path.join(b.root, "dev", "kmsg"))
    result = cli("--root", b.root, "health", "--json")
    assert _iommu(result, GPU) == [("unknown", "no kernel log to read for IOMMU faults (dev/kmsg)")]
    b.driver("vfio-pci")
    plan = cli("--root", b.root, "bind", GPU, "--dry-run", "--json")
    assert plan.code == 0 and not [c for c in plan.json()["checks"] if "kernel log" in c["message"]]


def test_a_recording_keeps_the_fault_records_only(cli, tmp_path):
    """dump-host records the kernel log's IOMMU fault records and nothing else of it (the rest is
    the host's own business), and health reads the recording as it read the host."""
    b = gpu_workstation(tmp_path / "host")
    b.kernel_log(["Command line: root=/dev/sda1 secret=hunter2", "DMAR: IOMMU enabled hunter2",
                  "vfio-pci 0000:01:00.0: AMD-Vi: Event logged [IO_PAGE_FAULT domain=0x0001 address=0x0 flags=0x0]"])
    dump = cli("--root", b.root, "dump-host", "-")
    assert dump.code == 0 and "hunter2" not in dump.out and "IO_PAGE_FAULT" in dump.out
    recording = tmp_path / "host.txt"
    recording.write_text(dump.out)
    again = cli("--root", str(recording), "health", "--json")
    assert _iommu(again, GPU)[0][0] == "degraded" and _iommu(again, GPU) == _iommu(
        cli("--root", b.root, "health", "--json"), GPU)


def test_read_kernel_log_reads_once_and_reports_what_it_could_not(tmp_path):
    b = gpu_workstation(tmp_path / "host")
    os.unlink(os.path.join(b.root, "dev", "kmsg"))
    os.mkfifo(os.path.join(b.root, "dev", "kmsg"))
    log = read_kernel_log(HostRoot(b.root))
    assert log.error is not None and "FIFO" in log.error and not log.missing
    assert log.of(PciAddress.parse(GPU)) == []


def test_the_textfile_counts_each_devices_faults_by_iommu_and_kind(cli, tmp_path):
    """The metrics, read by the Prometheus client library's own text parser."""
    from prometheus_client.parser import text_string_to_metric_families
    b = gpu_workstation(tmp_path / "host")
    b.kernel_log(["DMAR: [DMA Read NO_PASID] Request device [01:00.0] fault addr 0x1 [fault reason 0x06] x",
                  "DMAR: [DMA Write NO_PASID] Request device [01:00.0] fault addr 0x1 [fault reason 0x05] x",
                  "DMAR: [DMA Read NO_PASID] Request device [01:00.0] fault addr 0x1 [fault reason 0x06] x"])
    out = tmp_path / "gpuvfio.prom"
    assert cli("--root", b.root, "health", "--textfile", str(out)).code == 1
    (family,) = [f for f in text_string_to_metric_families(out.read_text()) if f.name == "gpuvfio_iommu_faults_logged"]
    assert family.type == "gauge"
    assert sorted((s.labels["device"], s.labels["iommu"], s.labels["kind"], s.value) for s in family.samples) == [
        (GPU, "DMAR", "DMA Read", 2.0), (GPU, "DMAR", "DMA Write", 1.0)]
    assert cli("--root", b.root, "health", "--json").json()["devices"][0]["iommu_faults"] == {
        "DMAR DMA Read": 2, "DMAR DMA Write": 1}


def test_a_recording_keeps_the_newest_fault_records_within_a_mib(tmp_path):
    """A fault storm of 40,000 lines made a recording the fixture loader refused (one record is
    at most 5 MiB): the newest that fit in a MiB are kept."""
    from gpuvfio.host.iommu_faults import RECORDED_LIMIT, recorded_log
    line = "DMAR: [DMA Read NO_PASID] Request device [01:00.0] fault addr 0x{:x} [fault reason 0x06] PTE Read"
    data = "".join(f"3,{n},{n},-;{line.format(n)}\n" for n in range(40000)).encode()
    kept = recorded_log(data)
    assert len(kept) <= RECORDED_LIMIT and kept.endswith(line.format(39999) + "\n")
    assert len(fault_records(kept.encode())) == kept.count("\n") > 5000


def test_a_kernel_log_the_recorder_cannot_read_leaves_it_out(cli, tmp_path):
    b = gpu_workstation(tmp_path / "host")
    os.unlink(os.path.join(b.root, "dev", "kmsg"))
    os.mkdir(os.path.join(b.root, "dev", "kmsg"))
    dump = cli("--root", b.root, "dump-host", "-")
    assert dump.code == 0 and "dev/kmsg" not in dump.out
