"""IOMMU faults in the kernel log, each attributed to the PCI function that caused it.

The log is /dev/kmsg's records (Documentation/ABI/testing/dev-kmsg): ``prio,seq,usec,flags;text``,
then dictionary lines that start with a space (``DEVICE=+pci:0000:03:00.0``); the text escapes
non-printable bytes and ``\\`` as ``\\xNN``. On the live host it is the kernel's device, in a
tree the recording dump-host made (the fault records only). Two kinds of lines count, in the
forms of Linux 5.4 to 6.12:

* Intel VT-d, drivers/iommu/intel/dmar.c dmar_fault_do_one (pr_err, prefix ``DMAR: ``):
  ``[DMA Read NO_PASID] Request device [03:00.0] fault addr 0x... [fault reason 0x06] ...``,
  ``[DMA Write PASID 0x2] ...``, ``[INTR-REMAP] Request device [03:00.0] fault index 0x...``;
  5.4 wrote ``[DMA Read] ... PASID ffffffff fault addr ... [fault reason 06]``, 5.14
  ``[0x03:0x00.0]``. The line names no PCI segment: on a host with several, the fault is
  every segment's function at that bus, device and function, and says so.
* AMD-Vi, drivers/iommu/amd/iommu.c (prefix ``AMD-Vi: ``): a page fault of a known device is
  pci_err, so its text begins with the driver and the device (``vfio-pci 0000:03:00.0:
  AMD-Vi: Event logged [IO_PAGE_FAULT domain=0x000e address=0x... flags=0x0020]``); otherwise,
  and for every other event (``iommu ivhd0: AMD-Vi: Event logged [ILLEGAL_DEV_TABLE_ENTRY
  device=0000:03:00.0 ...``), the event names it in ``device=``, without the segment before
  6.1 (``device=03:00.0``).

ARM SMMUv3 names a stream ID, not a function (arm-smmu-v3.c, "event 0x10 received"): not
attributed. The kernel rate-limits these lines, and the ring buffer keeps only the newest
(log_buf_len): a count is a floor, of the faults the log still holds.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError
from gpuvfio.host.root import HostRoot

__all__ = ["IommuFault", "KernelLog", "read_kernel_log", "fault_records", "recorded_log", "KMSG"]

KMSG = "dev/kmsg"
DETAIL_LIMIT = 160  # what a finding quotes of a fault line
RECORD = re.compile(r"(\d{1,3}),(\d{1,20}),(\d{1,20}),[^;\n]{0,64};([^\n]{0,16384})")
KERNEL_FACILITY = 8  # prio = facility << 3 | level: below 8 is facility 0, the kernel's own (not /dev/kmsg writes)
RECORDED_LIMIT = 1 << 20  # what dump-host keeps of the log's fault records: the newest within a MiB
_BDF = r"(?:0x)?([0-9a-f]{2}):(?:0x)?([0-9a-f]{2})\.([0-7])"
DMAR = re.compile(r"^DMAR: \[(DMA Read|DMA Write|INTR-REMAP)(?: NO_PASID| PASID 0x[0-9a-f]{1,8})?\] "
                  rf"Request device \[{_BDF}\] (?:PASID [0-9a-f]{{1,8}} )?fault (?:addr|index) (?:0x)?[0-9a-f]{{1,16}} "
                  r"\[fault reason (?:0x)?([0-9a-f]{1,3})\] ?(.*)")
AMD = re.compile(r"^(?:\S{1,64} ([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]): |iommu ivhd[0-9]{1,3}: )?AMD-Vi: "
                 r"Event logged \[([A-Z_]{2,40})\b(.*)")
AMD_DEVICE = re.compile(r"device=(?:([0-9a-f]{4}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])\b")


@dataclass(frozen=True)
class IommuFault:
    unit: str  # "DMAR" or "AMD-Vi"
    kind: str  # DMA Read, DMA Write, INTR-REMAP; IO_PAGE_FAULT, ILLEGAL_DEV_TABLE_ENTRY, ...
    segment: int | None  # None: the line names no PCI segment (Intel; AMD before 6.1)
    bus: int
    slot: int
    function: int
    usec: int  # since boot
    text: str  # the line, cut to DETAIL_LIMIT, escapes as the kernel wrote them

    def names(self, address: PciAddress) -> bool:
        return (address.bus, address.slot, address.function) == (self.bus, self.slot, self.function) and \
            self.segment in (None, address.domain)


@dataclass(frozen=True)
class KernelLog:
    """The faults the kernel log holds (``faults``), or why there is no log to read (``missing``:
    the root has none, ``error``: it could not be read); one read per operation."""

    faults: tuple[IommuFault, ...] = ()
    missing: bool = False
    error: str | None = None

    def of(self, address: PciAddress) -> list[IommuFault]:
        at = self.by_bus_address.get((address.bus, address.slot, address.function), ())
        return [f for f in at if f.segment in (None, address.domain)]

    @functools.cached_property
    def by_bus_address(self) -> dict[tuple[int, int, int], list[IommuFault]]:
        out: dict[tuple[int, int, int], list[IommuFault]] = {}
        for fault in self.faults:
            out.setdefault((fault.bus, fault.slot, fault.function), []).append(fault)
        return out


def read_kernel_log(host: HostRoot) -> KernelLog:
    try:
        data = host.tree.read_kernel_log(KMSG)
    except GpuvfioError as exc:
        return KernelLog(error=str(exc))
    if data is None:
        return KernelLog(missing=True)
    return KernelLog(tuple(fault for _, fault in fault_records(data)))


def fault_records(data: bytes) -> list[tuple[tuple[int, str], IommuFault]]:
    """The kernel's own records (facility 0: what a process writes to /dev/kmsg is not) whose
    text is an IOMMU fault line of a function, as ((usec since boot, text), fault): what health
    reads, and all that dump-host records of the log. A line that is not of the record's form
    (a recording's hostile line) is passed over, as is a fault line inside other text."""
    out = []
    for line in data.decode("ascii", "replace").split("\n"):
        match = RECORD.fullmatch(line)
        if match is None or int(match.group(1)) >= KERNEL_FACILITY:
            continue
        record = (int(match.group(3)), match.group(4))
        fault = _fault(record) if "DMAR: " in record[1] or "AMD-Vi: " in record[1] else None
        if fault is not None:
            out.append((record, fault))
    return out


def recorded_log(data: bytes) -> str:
    """What dump-host records of a kernel log: its fault records, the newest within
    RECORDED_LIMIT, in /dev/kmsg's form again."""
    lines, size = [], 0
    for n, ((usec, text), _) in reversed(list(enumerate(fault_records(data)))):
        line = f"3,{n},{usec},-;{text}\n"
        size += len(line)
        if size > RECORDED_LIMIT:
            break
        lines.append(line)
    return "".join(reversed(lines))


def _fault(record: tuple[int, str]) -> IommuFault | None:
    usec, text = record
    shown = text[:DETAIL_LIMIT]
    dmar = DMAR.search(text)
    if dmar is not None:
        return IommuFault("DMAR", dmar.group(1), None, int(dmar.group(2), 16), int(dmar.group(3), 16),
                          int(dmar.group(4)), usec, shown)
    amd = AMD.search(text)
    if amd is None:
        return None
    named = PciAddress.try_parse(amd.group(1)) if amd.group(1) else None
    if named is not None:
        return IommuFault("AMD-Vi", amd.group(2), named.domain, named.bus, named.slot, named.function, usec, shown)
    device = AMD_DEVICE.search(amd.group(3))
    if device is None:  # a command or IOTLB error of the IOMMU itself: no function to blame
        return None
    segment = int(device.group(1), 16) if device.group(1) else None
    return IommuFault("AMD-Vi", amd.group(2), segment, int(device.group(2), 16), int(device.group(3), 16),
                      int(device.group(4)), usec, shown)
