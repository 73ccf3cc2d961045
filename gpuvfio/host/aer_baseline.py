"""The AER counts health saw last, and the ones an admin acknowledged, kept in the state dir.

The kernel's AER counters count since boot and no reset clears them (host.aer). So a count alone
cannot say whether errors are still coming, and a fatal error that a reset mended would fail the
device until the next reboot. Two records answer that:

* the last sample (``health --record``, as the health timer runs it every minute): correctable
  errors above it are *rising*, and degrade the device;
* an acknowledgement (``health --acknowledge DEVICE``): non-fatal and fatal counts at or below
  it are known and rate ok; only errors after it count.

Both hold for one boot: they carry the kernel's boot id (/proc/sys/kernel/random/boot_id,
drivers/char/random.c) and are ignored after a reboot, when the counters start again. A host whose
boot id cannot be read has no baseline. Counters are keyed by the function that counts them, or
``rootport:ADDR`` for a root port's totals of the messages it received.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from gpuvfio.errors import HostReadError
from gpuvfio.files import Tree
from gpuvfio.host.root import HostRoot
from gpuvfio.host.state import state_dir
from gpuvfio.numbers import U64_MAX
from gpuvfio.strictjson import JsonRejected, strict_loads

__all__ = ["AerBaseline", "Sample", "FILE_NAME", "boot_id", "read_baseline", "SEVERITIES"]

FORMAT = "gpuvfio-aer-baseline"
VERSION = 1
FILE_NAME = "aer-baseline.json"
LIMIT = 4 << 20
MAX_COUNTERS = 16384
SEVERITIES = ("correctable", "nonfatal", "fatal")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_KEY = re.compile(r"(rootport:)?[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")


class BaselineUnreadable(HostReadError):
    """The baseline file is there but is not one gpuvfio wrote."""


@dataclass(frozen=True)
class Sample:
    at: str  # UTC, ISO 8601
    totals: dict[str, int]  # severity -> the total then

    def to_json(self) -> dict:
        return {"at": self.at, "totals": dict(self.totals)}


@dataclass
class AerBaseline:
    boot: str | None = None  # the boot the records are of
    now: str | None = None  # the boot the host is in
    last: dict[str, Sample] = field(default_factory=dict)
    acknowledged: dict[str, Sample] = field(default_factory=dict)
    error: str | None = None

    @property
    def applies(self) -> bool:
        return self.boot is not None and self.boot == self.now

    def last_sample(self, key: str) -> Sample | None:
        return self.last.get(key) if self.applies else None

    def acknowledgement(self, key: str) -> Sample | None:
        return self.acknowledged.get(key) if self.applies else None

    def restart(self) -> None:
        """Records of another boot are dropped before this boot's are added."""
        if not self.applies:
            self.boot, self.last, self.acknowledged = self.now, {}, {}

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "boot_id": self.boot,
                "last": {k: s.to_json() for k, s in sorted(self.last.items())},
                "acknowledged": {k: s.to_json() for k, s in sorted(self.acknowledged.items())}}

    def render(self) -> str:
        return json.dumps(self.to_json(), indent=1) + "\n"


def boot_id(host: HostRoot) -> str | None:
    """This boot's id, as the kernel gives it; None when it cannot be read or is not a UUID."""
    text = (host.read(host.path("proc", "sys", "kernel", "random", "boot_id"), 64) or "").strip()
    return text if _UUID.fullmatch(text) else None


def read_baseline(host: HostRoot, state: Tree | None = None) -> AerBaseline:
    """The records as they are (``error`` set when the file does not read), with this boot's id."""
    tree = state if state is not None else state_dir(host)
    now = boot_id(host)
    try:
        data = tree.read(FILE_NAME, LIMIT)
        baseline = parse(data) if data is not None else AerBaseline()
    except (HostReadError, BaselineUnreadable) as exc:
        baseline = AerBaseline(error=f"{tree.path(FILE_NAME)}: {exc}")
    baseline.now = now
    return baseline


def parse(data: bytes) -> AerBaseline:
    try:
        top = strict_loads(data)
    except JsonRejected as exc:
        raise BaselineUnreadable(str(exc)) from None
    if not isinstance(top, dict) or set(top) != {"format", "version", "boot_id", "last", "acknowledged"} \
            or top["format"] != FORMAT or top["version"] != VERSION:
        raise BaselineUnreadable(f"not a {FORMAT} file of version {VERSION}")
    boot = top["boot_id"]
    if not (boot is None or (isinstance(boot, str) and _UUID.fullmatch(boot))):
        raise BaselineUnreadable("its boot id is not the kernel's form")
    return AerBaseline(boot, None, _samples(top["last"]), _samples(top["acknowledged"]))


def _samples(value) -> dict[str, Sample]:
    if not isinstance(value, dict) or len(value) > MAX_COUNTERS:
        raise BaselineUnreadable("its records are not an object of counters")
    out = {}
    for key, sample in value.items():
        if not _KEY.fullmatch(key) or not isinstance(sample, dict) or set(sample) != {"at", "totals"}:
            raise BaselineUnreadable("a counter's record is not one gpuvfio writes")
        at, totals = sample["at"], sample["totals"]
        if not (isinstance(at, str) and _TIME.fullmatch(at)) or not isinstance(totals, dict) \
                or not set(totals) <= set(SEVERITIES) or not all(_count(v) for v in totals.values()):
            raise BaselineUnreadable(f"{key}: its time or totals are malformed")
        out[key] = Sample(at, dict(totals))
    return out


def _count(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= U64_MAX
