"""A PCIe function's AER counters, as the kernel counts them.

drivers/pci/pcie/aer.c (since Linux 4.19, ``aer_stats_dev_attr``) shows three attributes on
every function with an AER capability (Documentation/ABI/testing/sysfs-bus-pci-devices-aer-stats):
``aer_dev_correctable``, ``aer_dev_nonfatal`` and ``aer_dev_fatal``. Each is one
``NAME COUNT`` line per error bit (the bit's name from ``aer_correctable_error_string`` or
``aer_uncorrectable_error_string``, or ``dev_cor_errs_bit[N]``-style for a nameless bit that
counted), then ``TOTAL_ERR_COR``, ``TOTAL_ERR_NONFATAL`` or ``TOTAL_ERR_FATAL``. Counts are u64
since boot; a reset does not clear them. The counters are "as seen by the device": a link
error an endpoint causes may count at its link partner, the port above it, so a device's
health reads the ports above it too.

Absent files: the function has no AER capability, or the kernel counts nothing (built without
CONFIG_PCIEAER, booted with ``pci=noaer``). The files are kernel output but a tree may be a
recording: every line is checked and a file that is not of this form is refused, never half read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from enum import Enum

from gpuvfio.address import PciAddress
from gpuvfio.host.root import HostRoot

__all__ = ["Severity", "AerCounts", "AerError", "parse_counts", "read_aer", "read_rootport_totals", "AER_FILE_LIMIT"]

AER_FILE_LIMIT = 4096  # 32 bits a file at most, ~30 bytes a line: well under a page
_LINE = re.compile(r"([A-Za-z][A-Za-z0-9_]{0,31}(?:\[[0-9]{1,2}\])?) ([0-9]{1,20})")
U64_MAX = (1 << 64) - 1


class AerError(ValueError):
    """An AER attribute that is not of the kernel's form."""


class Severity(str, Enum):
    """The three AER severities, each with its sysfs file and the name of its total line."""

    CORRECTABLE = "correctable"
    NONFATAL = "nonfatal"
    FATAL = "fatal"

    @property
    def file(self) -> str:
        return f"aer_dev_{self.value}"

    @property
    def rootport_file(self) -> str:
        return {"correctable": "aer_rootport_total_err_cor", "nonfatal": "aer_rootport_total_err_nonfatal",
                "fatal": "aer_rootport_total_err_fatal"}[self.value]

    @property
    def total_key(self) -> str:
        return {"correctable": "TOTAL_ERR_COR", "nonfatal": "TOTAL_ERR_NONFATAL", "fatal": "TOTAL_ERR_FATAL"}[self.value]


@dataclass(frozen=True)
class AerCounts:
    """One severity's counters: the total and each error kind that counted (zeros left out)."""

    severity: Severity
    total: int
    kinds: tuple[tuple[str, int], ...]

    def describe(self) -> str:
        kinds = ", ".join(f"{name} {count}" for name, count in self.kinds)
        return f"{self.total} {self.severity.value} error(s)" + (f" ({kinds})" if kinds else "")

    def to_json(self) -> dict:
        return {"total": self.total, "kinds": dict(self.kinds)}


def parse_counts(severity: Severity, text: str) -> AerCounts:
    """One ``aer_dev_*`` attribute: every line ``NAME COUNT``, each name once, the total line
    last. AerError when it is not of that form."""
    counts: dict[str, int] = {}
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) > 40:
        raise AerError(f"{severity.file}: {len(lines)} lines, more than the kernel writes")
    for number, line in enumerate(lines, 1):
        match = _LINE.fullmatch(line)
        if not match:
            raise AerError(f"{severity.file}: line {number} is not NAME COUNT")
        name, count = match.group(1), int(match.group(2))
        if count > U64_MAX or name in counts:
            raise AerError(f"{severity.file}: line {number}: " + ("a count over 64 bits" if count > U64_MAX
                                                                  else f"{name} twice"))
        counts[name] = count
    if not lines or lines[-1].split(" ")[0] != severity.total_key:
        raise AerError(f"{severity.file}: no {severity.total_key} line at its end")
    total = counts.pop(severity.total_key)
    # Each error report adds one to the total and one to each bit it set (aer.c
    # pci_dev_aer_stats_incr), so no kind counts more than the total.
    over = [name for name, count in counts.items() if count > total]
    if over:
        raise AerError(f"{severity.file}: {over[0]} counts more than {severity.total_key}")
    return AerCounts(severity, total, tuple((name, count) for name, count in counts.items() if count))


def read_aer(host: HostRoot, address: PciAddress) -> dict[Severity, AerCounts] | None:
    """The AER counters of one function (None: it has none, or the kernel counts nothing).
    AerError when a file is not of the kernel's form or only some of the three exist; the file
    layer's errors (a link or a FIFO in a file's place) as they come."""
    directory = host.resolve_in_sys(host.sys_path("bus", "pci", "devices", str(address)))
    texts = {s: host.read(os.path.join(directory, s.file), AER_FILE_LIMIT) for s in Severity}
    present = [s for s, text in texts.items() if text is not None]
    if not present:
        return None
    if len(present) != len(texts):
        raise AerError(f"only {', '.join(s.file for s in present)} of the three AER files")
    return {s: parse_counts(s, text) for s, text in texts.items()}


def read_rootport_totals(host: HostRoot, address: PciAddress) -> dict[Severity, int] | None:
    """The error messages a root port received from the functions below it, by severity
    (``aer_rootport_total_err_cor``, ``_nonfatal``, ``_fatal``: aer.c aer_stats_rootport_attr,
    shown on root ports only). They count what no function below may have counted: for a fatal
    error whose link went down the kernel cannot read the sender's status ("type=Inaccessible")
    and its own ``aer_dev_fatal`` stays 0 (seen on Linux 6.1). None: not a root port, or no AER."""
    directory = host.resolve_in_sys(host.sys_path("bus", "pci", "devices", str(address)))
    texts = {s: host.read(os.path.join(directory, s.rootport_file), AER_FILE_LIMIT) for s in Severity}
    if all(text is None for text in texts.values()):
        return None
    totals = {}
    for severity, text in texts.items():
        if text is None or not re.fullmatch(r"[0-9]{1,20}", text) or int(text) > U64_MAX:
            raise AerError(f"{severity.rootport_file}: not one count")
        totals[severity] = int(text)
    return totals
