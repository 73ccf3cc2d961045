"""What ``gpuvfio qualify`` found of each device model's reset methods, kept for a fleet.

A GPU that a reset does not bring back hands its last tenant's state, or a hung device, to the
next one. ``qualify`` cycles each method the kernel offers (gpuvfio.ops.qualify) and records,
per model (vendor:device) and method, how many runs passed and failed, and the last failure.
One failed run marks the method for the model: resets that fail now and then are the ones that
matter, and a later pass does not clear it (the admin removes the entry once the cause is
mended: firmware, a BIOS setting, a kernel quirk).

The file is ``GPUVFIO_RESET_VERDICTS`` where a fleet shares one, else ``reset-verdicts.json`` in
the state directory. It may come from other hosts, so it is read as hostile: strict JSON, at
most ``LIMIT`` bytes, every name and number checked; one that does not read is an error that
health reports, never believed in part.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from enum import Enum

from gpuvfio.errors import HostReadError, InputError
from gpuvfio.files import Tree
from gpuvfio.host.root import HostRoot
from gpuvfio.host.state import state_dir
from gpuvfio.numbers import U64_MAX
from gpuvfio.settings import RESET_VERDICTS_ENV
from gpuvfio.strictjson import JsonRejected, strict_loads
from gpuvfio.user_files import user_file

__all__ = ["FORMAT", "FILE_NAME", "LIMIT", "METHODS", "Outcome", "MethodRecord", "ResetVerdicts", "Run",
           "VerdictsUnreadable", "location", "model_of", "parse", "read_verdicts", "valid_host"]

FORMAT = "gpuvfio-reset-verdicts"
VERSION = 1
FILE_NAME = "reset-verdicts.json"
LIMIT = 1 << 20
MAX_MODELS = 4096
# The kernel's reset method names (drivers/pci/pci.c pci_reset_fn_methods, Linux 5.15 to 6.12;
# cxl_bus from 6.7): what ``reset_method`` lists and takes.
METHODS = ("device_specific", "acpi", "flr", "af_flr", "pm", "bus", "cxl_bus")
_MODEL = re.compile(r"[0-9a-f]{4}:[0-9a-f]{4}")
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}")  # a host name (RFC 1123), or "" when unknown
_ADDRESS = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")
MAX_MESSAGE = 300


class VerdictsUnreadable(HostReadError):
    """The verdicts file is there but is not one gpuvfio wrote: nothing in it is believed."""


class Outcome(str, Enum):
    PASSED = "passed"
    FAILED = "failed"


@dataclass(frozen=True)
class Run:
    """One qualification of one method on one device: ``cycles`` resets passed their checks,
    and ``failure`` says what the next one broke (None: every cycle passed)."""

    outcome: Outcome
    device: str
    host: str
    at: str
    cycles: int
    failure: str | None = None

    def to_json(self) -> dict:
        return {"outcome": self.outcome.value, "device": self.device, "host": self.host, "at": self.at,
                "cycles": self.cycles, "failure": self.failure}


@dataclass
class MethodRecord:
    passed: int = 0
    failed: int = 0
    last: Run | None = None
    last_failure: Run | None = None

    @property
    def outcome(self) -> Outcome:
        return Outcome.FAILED if self.failed else Outcome.PASSED

    def add(self, run: Run) -> None:
        if run.outcome is Outcome.FAILED:  # counts stop at the largest the reader takes
            self.failed = min(self.failed + 1, U64_MAX)
            self.last_failure = run
        else:
            self.passed = min(self.passed + 1, U64_MAX)
        self.last = run

    def to_json(self) -> dict:
        return {"verdict": self.outcome.value, "passed": self.passed, "failed": self.failed,
                "last": self.last.to_json() if self.last else None,
                "last_failure": self.last_failure.to_json() if self.last_failure else None}


@dataclass
class ResetVerdicts:
    models: dict[str, dict[str, MethodRecord]] = field(default_factory=dict)
    error: str | None = None  # the file is there and does not read: why

    def record(self, model: str, method: str) -> MethodRecord | None:
        return self.models.get(model, {}).get(method)

    def first_method(self, vendor_id: str, device_id: str, reset_method: list[str] | None
                     ) -> tuple[str, str, MethodRecord | None] | None:
        """(model, method, its record) of the method the kernel resets a function by: the first
        of its ``reset_method`` (drivers/pci/pci.c __pci_reset_function_locked tries them in
        order and the list holds only methods the device supports, Linux 5.15 to 6.12). None
        when it lists none."""
        if not reset_method:
            return None
        model = model_of(vendor_id, device_id)
        return model, reset_method[0], self.record(model, reset_method[0])

    def add(self, model: str, method: str, run: Run) -> None:
        self.models.setdefault(model, {}).setdefault(method, MethodRecord()).add(run)

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION,
                "models": {model: {method: record.to_json() for method, record in sorted(methods.items())}
                           for model, methods in sorted(self.models.items())}}

    def render(self) -> str:
        """The file's text, refused (VerdictsUnreadable) where gpuvfio's own reader would refuse
        it: a file no host can read again must never be written over one that reads."""
        text = json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n"
        if len(text.encode()) > LIMIT:
            raise VerdictsUnreadable(f"the verdicts would pass {LIMIT} bytes: remove the models no longer in use")
        parse(text.encode())
        return text


def model_of(vendor_id: str, device_id: str) -> str:
    return f"{vendor_id}:{device_id}"


def location(host: HostRoot, state: Tree | None = None) -> tuple[Tree, str]:
    """Where the verdicts are: the file GPUVFIO_RESET_VERDICTS names (its directory followed,
    the file itself never), else reset-verdicts.json in the state directory."""
    named = host.settings.reset_verdicts
    if named is not None:
        if not os.path.isabs(named):  # a timer's unit and an admin's shell would name two files
            raise InputError(f"{RESET_VERDICTS_ENV} must be an absolute path, not {ascii(named[:200])}")
        return user_file(named)
    return (state if state is not None else state_dir(host)), FILE_NAME


def read_verdicts(host: HostRoot, state: Tree | None = None) -> ResetVerdicts:
    """The verdicts as they are; none when there is no file, ``error`` set when it does not read."""
    tree, name = location(host, state)
    try:
        data = tree.read(name, LIMIT)
    except HostReadError as exc:
        return ResetVerdicts(error=str(exc))
    if data is None:
        return ResetVerdicts()
    try:
        return parse(data)
    except VerdictsUnreadable as exc:
        return ResetVerdicts(error=f"{tree.path(name)}: {exc}")


def parse(data: bytes) -> ResetVerdicts:
    try:
        top = strict_loads(data)
    except JsonRejected as exc:
        raise VerdictsUnreadable(str(exc)) from None
    if not isinstance(top, dict) or top.get("format") != FORMAT or top.get("version") != VERSION:
        raise VerdictsUnreadable(f"not a {FORMAT} file of version {VERSION}")
    models = top.get("models")
    if not isinstance(models, dict) or len(models) > MAX_MODELS or set(top) != {"format", "version", "models"}:
        raise VerdictsUnreadable("its models are not an object of at most 4096 vendor:device keys")
    verdicts = ResetVerdicts()
    for model, methods in models.items():
        if not _MODEL.fullmatch(model) or not isinstance(methods, dict):
            raise VerdictsUnreadable("a model is not a lower-case vendor:device of hex digits")
        for method, record in methods.items():
            if method not in METHODS:
                raise VerdictsUnreadable(f"{model}: a reset method the kernel does not have")
            verdicts.models.setdefault(model, {})[method] = _method_record(model, method, record)
    return verdicts


def _method_record(model: str, method: str, record) -> MethodRecord:
    where = f"{model} {method}"
    if not isinstance(record, dict) or set(record) != {"verdict", "passed", "failed", "last", "last_failure"}:
        raise VerdictsUnreadable(f"{where}: not a record gpuvfio writes")
    passed, failed = _count(record["passed"], where), _count(record["failed"], where)
    last, last_failure = _run(record["last"], where), _run(record["last_failure"], where)
    out = MethodRecord(passed, failed, last, last_failure)
    if record["verdict"] != out.outcome.value or (failed > 0) != (last_failure is not None) \
            or (passed + failed > 0) != (last is not None):
        raise VerdictsUnreadable(f"{where}: its verdict does not follow from its counts")
    return out


def _count(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U64_MAX:
        raise VerdictsUnreadable(f"{where}: a count is not a whole number")
    return value


def _run(value, where: str) -> Run | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"outcome", "device", "host", "at", "cycles", "failure"}:
        raise VerdictsUnreadable(f"{where}: a run is not one gpuvfio writes")
    failure = value["failure"]
    checks = (value["outcome"] in ("passed", "failed"), _text(value["device"], _ADDRESS),
              valid_host(value["host"]) or value["host"] == "", _text(value["at"], _TIME),
              failure is None or (isinstance(failure, str) and 0 < len(failure) <= MAX_MESSAGE
                                  and failure.isprintable()),
              (failure is None) == (value["outcome"] == "passed"))
    if not all(checks):
        raise VerdictsUnreadable(f"{where}: a run's outcome, device, host, time or failure is malformed")
    return Run(Outcome(value["outcome"]), value["device"], value["host"], value["at"],
               _count(value["cycles"], where), failure)


def valid_host(name: str) -> bool:
    """A host name as a run records it (RFC 1123 letters, digits, dots and hyphens)."""
    return _text(name, _HOST)


def _text(value, pattern: re.Pattern) -> bool:
    return isinstance(value, str) and pattern.fullmatch(value) is not None
