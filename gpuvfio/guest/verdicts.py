"""A verify check's verdict and the words both the guest's checks and NCCL's use: the status,
the result, a PCI address in one spelling, and the bounds of what hardware can report."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from gpuvfio.guest.expect import LANE_GBPS
from gpuvfio.numbers import finite

__all__ = ["CheckStatus", "Outcome", "CheckResult", "check", "bus_key", "shown", "PASS", "FAIL", "WARN", "SKIP",
           "EXPECTED", "WIDTHS", "MOST_GBPS", "MOST_MS"]

_BUS_ID = re.compile(r"([0-9a-f]{1,8}):([0-9a-f]{2}):([0-1][0-9a-f])\.([0-7])", re.ASCII)


def bus_key(bus_id: object) -> str | None:
    """One spelling of a PCI address, to compare what the kernel, NVML and CUDA print: the kernel
    writes the domain with %04x (drivers/pci/probe.c, pci_setup_device), NVML with eight upper-case
    digits (nvmlPciInfo_t.busId), CUDA with four or eight. The domain read as a number keeps
    0000:01:00.0 and 10000:01:00.0 (a VMD domain) apart, which their last 12 characters do not.
    None for anything that is not an address."""
    found = _BUS_ID.fullmatch(bus_id.lower()) if isinstance(bus_id, str) else None
    if found is None:
        return None
    domain, bus, slot, function = found.groups()
    return f"{int(domain, 16):04x}:{bus}:{slot}.{function}"


class CheckStatus(str, Enum):
    """One check's verdict; only FAIL fails the guest."""

    PASS = "pass"
    FAIL = "fail"
    WARN = "warn"  # below what the slot allows, but read idle (links train down when idle)
    SKIP = "skip"  # not expected here, or not asked for
    EXPECTED = "expected"  # looks like a failure, is right for the setup (no CUDA on a vGPU profile, MIG)


PASS, FAIL, WARN, SKIP, EXPECTED = (CheckStatus.PASS, CheckStatus.FAIL, CheckStatus.WARN, CheckStatus.SKIP,
                                    CheckStatus.EXPECTED)


class Outcome(str, Enum):
    """verify's verdict on the whole guest: it fails when one check fails."""

    PASS = "pass"
    FAIL = "fail"


@dataclass(frozen=True)
class CheckResult:
    """One check: what the host assigned (``expected``), what the guest showed (``observed``, in
    the guest's words), why it is not a pass, and the host device it is about (None: the guest)."""

    check_id: str
    status: CheckStatus
    expected: str | int | bool | None = None
    observed: str | int | float | bool | None = None
    reason: str | None = None
    device: str | None = None

    def to_json(self) -> dict:
        return {"id": self.check_id, "status": self.status.value, "expected": self.expected,
                "observed": self.observed, "reason": self.reason, "device": self.device}


def check(check_id: str, status: CheckStatus, expected=None, observed=None, reason=None, device=None) -> CheckResult:
    return CheckResult(check_id, status, expected, observed, reason, device)


# What hardware can report (issue 34 item 5): a guest that reports more is lying or broken, and
# fails, with the figure shown in a bounded form. PCIe widths: the base spec's x1 to x32.
WIDTHS = (1, 2, 4, 8, 12, 16, 32)
MOST_GBPS = LANE_GBPS[max(LANE_GBPS)] * max(WIDTHS)  # one direction of the widest, fastest link
MOST_MS = 3600e3  # a SAXPY launch that took more than an hour was not measured


def shown(value) -> str:
    """A number from a guest, printed in a bounded form (never 300 digits)."""
    return f"{value:.4g}" if finite(value) else repr(value)[:40]


def shown(value) -> str:
    """A number from a guest, printed in a bounded form (never 300 digits)."""
    return f"{value:.4g}" if finite(value) else repr(value)[:40]
