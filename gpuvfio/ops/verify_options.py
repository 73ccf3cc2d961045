"""How a guest is verified: the timeouts, the bandwidth gates and the verifier's measurement
options (gpuvfio verify and attach take them; the testbed's [run] sets them per variant)."""

from __future__ import annotations

from dataclasses import dataclass

from gpuvfio.errors import InputError
from gpuvfio.guest.expect import Gates, gates
from gpuvfio.options import VERIFY, checked

__all__ = ["PROBE_TIMEOUT", "VERIFY_TIMEOUT", "VerifyOptions", "verify_options"]

PROBE_TIMEOUT = VERIFY["probe_timeout"].default  # the probe's forks: seconds on hardware, more under emulation
VERIFY_TIMEOUT = VERIFY["verify_timeout"].default  # the verifier with its bandwidth runs


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
                   verify_timeout: float = VERIFY_TIMEOUT, link_efficiency: float | None = None,
                   min_gbps: float | None = None, size_mib: int | None = None, copies: int | None = None,
                   samples: int | None = None) -> VerifyOptions:
    """The one validation of the verify options (gpuvfio.options.VERIFY names them and sets
    their bounds; bad input: InputError, exit 2)."""
    given = {"size_mib": size_mib, "copies": copies, "samples": samples, "link_efficiency": link_efficiency,
             "min_gbps": min_gbps}  # the timeouts below: always given, checked there
    for name, value in given.items():
        if value is not None:
            checked(VERIFY[name], value)
    chosen = gates(link_efficiency=link_efficiency, min_gbps=min_gbps)
    return VerifyOptions(bool(bandwidth),
                         float(checked(VERIFY["probe_timeout"], probe_timeout)),
                         float(checked(VERIFY["verify_timeout"], verify_timeout)),
                         chosen, size_mib, copies, samples)
