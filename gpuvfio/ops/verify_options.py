"""How a guest is verified: the timeouts, the bandwidth gates and the verifier's measurement
options (gpuvfio verify and attach take them; the testbed's [run] sets them per variant)."""

from __future__ import annotations

from dataclasses import dataclass

from gpuvfio.errors import InputError
from gpuvfio.guest.expect import LINK_EFFICIENCY, Gates, gates
from gpuvfio.ops.context import checked_seconds

__all__ = ["PROBE_TIMEOUT", "VERIFY_TIMEOUT", "VerifyOptions", "verify_options"]

PROBE_TIMEOUT = 120.0  # the probe's forks: seconds on hardware, more under emulation
VERIFY_TIMEOUT = 600.0  # the verifier with its bandwidth runs




@dataclass(frozen=True)
class VerifyOptions:
    bandwidth: bool = True
    probe_timeout: float = PROBE_TIMEOUT
    timeout: float = VERIFY_TIMEOUT
    gates: Gates = Gates()
    size_mib: int | None = None  # None: the verifier's own defaults (nvbandwidth's)
    copies: int | None = None
    samples: int | None = None

    @property
    def verifier_args(self) -> tuple[str, ...]:
        out: list[str] = []
        for flag, value in (("--size-mib", self.size_mib), ("--copies", self.copies), ("--samples", self.samples)):
            if value is not None:
                out += [flag, str(value)]
        return tuple(out)


def verify_options(*, bandwidth: bool = True, probe_timeout: float = PROBE_TIMEOUT,
                   timeout: float = VERIFY_TIMEOUT, link_efficiency: float | None = None,
                   min_gbps: float | None = None, size_mib: int | None = None, copies: int | None = None,
                   samples: int | None = None) -> VerifyOptions:
    for name, value, top in (("--size-mib", size_mib, 64 * 1024), ("--copies", copies, 1000),
                             ("--samples", samples, 1000)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top):
            raise InputError(f"{name} must be a whole number from 1 to {top}")
    chosen = gates(link_efficiency=LINK_EFFICIENCY if link_efficiency is None else link_efficiency, min_gbps=min_gbps)
    return VerifyOptions(bool(bandwidth), checked_seconds(probe_timeout, "probe timeout", upper=24 * 3600),
                         checked_seconds(timeout, "verify timeout", upper=24 * 3600), chosen, size_mib, copies, samples)
