"""The journal and the run lock, in the state directory.

State directory: ``GPUVFIO_STATE_DIR``, else ``<root>/var/lib/gpuvfio``.

* ``journal.json``: for each device gpuvfio moved, the driver and driver_override it
  had, the services stopped for it, and the steps of the last operation with their
  state (pending, running, done, failed, uncertain, rolled_back). Written with
  write-temp, fsync, rename, fsync(dir) *before* each step, so after a crash at any
  point ``restore`` knows what the host looked like and what may have happened. Fabric
  Manager partitions gpuvfio activates are recorded (``activating``) before the call that
  activates them, so one a crash left active is found and deactivated.
* ``lock``: ``flock`` held for the whole run; the file names the holder's PID.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import sys

from gpuvfio.address import PciAddress
from gpuvfio.clock import SYSTEM_CLOCK, Clock
from gpuvfio.errors import GpuvfioError, InputError, UnsafePathError
from gpuvfio.files import Tree
from gpuvfio.host.checks import FAIL, OK, SKIP, WARN, Check
from gpuvfio.host.nvidia import NVIDIA_SERVICES
from gpuvfio.host.root import HostRoot
from gpuvfio.names import DRIVER_NAME
from gpuvfio.host.state import make_state_dir, state_dir, state_tree
from gpuvfio.strictjson import JsonRejected, strict_loads

JOURNAL_VERSION = 1


class LockTimeout(GpuvfioError):
    pass


class CorruptJournal(InputError):
    """The journal cannot be trusted: refuse to act, keep the file for a human."""


class UnreadableJournal(CorruptJournal):
    """The journal is there but cannot be read (permissions: gpuvfio's state is root's)."""


JOURNAL_LIMIT = 16 << 20  # thousands of functions and steps fit; /dev/zero linked in does not


# What a journal may hold, checked on every load: a journal that does not fit is not acted on
# (a bogus original driver would have restore reprobe a device gpuvfio never held).
_NAME = DRIVER_NAME  # the one rule for the names a bind writes back (gpuvfio.names; plan_bind refuses others)
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_UNITS = set(NVIDIA_SERVICES.values())
_POLICIES = {"best-effort", "equal-share", "fixed-share"}
_KEYS = {"version", "devices", "services_stopped", "operation", "mdevs", "vgpus", "schedulers", "broken", "partitions"}
_PARTITION_STATES = ("activating", "active", "deactivating")  # Fabric Manager partitions (bind.fabric_manager)


def _address(text) -> bool:
    parsed = PciAddress.try_parse(text) if isinstance(text, str) else None
    return parsed is not None and str(parsed) == text


def _integer(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _optional_name(value) -> bool:
    return value is None or (isinstance(value, str) and bool(_NAME.fullmatch(value)))


def _record(where: str, record, allowed: dict) -> str | None:
    if not isinstance(record, dict):
        return f"{where} is not an object"
    for key, value in record.items():
        if key not in allowed:
            return f"{where} has an unknown field {key!r}"
        if not allowed[key](value):
            return f"{where}.{key} is {value!r}"
    return None


def journal_problem(data: dict) -> str | None:
    """What is wrong with a journal's content, or None."""
    unknown = set(data) - _KEYS
    if unknown:
        return f"unknown field(s) {', '.join(sorted(map(str, unknown)))}"
    if "devices" not in data:  # every journal gpuvfio writes has it
        return "devices missing"
    for key in ("devices", "mdevs", "vgpus", "schedulers", "broken", "partitions"):
        if not isinstance(data.get(key, {}), dict):
            return f"{key} is not an object"
    device = {"original_driver": _optional_name, "original_override": _optional_name,
              "group": lambda v: v is None or _integer(v)}
    for address, record in data["devices"].items():  # present: checked above
        problem = (f"device {address!r} is not a PCI address" if not _address(address)
                   else _record(f"device {address}", record, device))
        if problem:
            return problem
    services = data.get("services_stopped", [])
    if not isinstance(services, list) or not all(s in _UNITS for s in services):
        return f"services_stopped is {services!r}"
    problem = _tables_problem(data)
    if problem:
        return problem
    operation = data.get("operation")
    if operation is not None:
        if not isinstance(operation, dict) or not isinstance(operation.get("steps", []), list) \
                or not all(isinstance(step, dict) and isinstance(step.get("state", ""), str)
                           for step in operation.get("steps", [])):
            return "operation is malformed"
    return None


def _tables_problem(data: dict) -> str | None:
    """What is wrong with the journal's tables beside its devices (mdevs, vGPUs, schedulers, broken
    devices, Fabric Manager partitions), the first found, or None: each key must be what its table
    is keyed by, and each record hold only that table's fields, each valid. journal_problem has
    checked that each table present is an object."""
    mdev = {"parent": _address, "type": lambda v: isinstance(v, str) and bool(_NAME.fullmatch(v)),
            "state": lambda v: v in ("creating", "created"), "persisted": lambda v: v is None or isinstance(v, str)}
    for uuid, record in data.get("mdevs", {}).items():
        problem = f"mdev {uuid!r} is not a UUID" if not _UUID.fullmatch(str(uuid)) else _record(
            f"mdev {uuid}", record, mdev)
        if problem:
            return problem
    vgpu = {"parent": _address, "type": _integer, "previous": _integer}
    for vf, record in data.get("vgpus", {}).items():
        problem = f"vGPU {vf!r} is not a PCI address" if not _address(vf) else _record(f"vGPU {vf}", record, vgpu)
        if problem:
            return problem
    scheduler = {"policy": lambda v: v in _POLICIES, "arr_mode": lambda v: isinstance(v, str),
                 "arr": lambda v: isinstance(v, bool), "timeslice": _integer, "avg_factor": _integer}
    for gpu, record in data.get("schedulers", {}).items():
        problem = (f"scheduler {gpu!r} is not a PCI address" if not _address(gpu)
                   else _record(f"scheduler {gpu}", record, scheduler))
        if problem:
            return problem
    broken = {"reason": lambda v: isinstance(v, str), "since": lambda v: isinstance(v, (int, float))
              and not isinstance(v, bool)}
    for address, record in data.get("broken", {}).items():
        problem = (f"broken {address!r} is not a PCI address" if not _address(address)
                   else _record(f"broken {address}", record, broken))
        if problem:
            return problem
    partition = {"state": lambda v: v in _PARTITION_STATES, "since": lambda v: isinstance(v, (int, float))
                 and not isinstance(v, bool), "modules": lambda v: isinstance(v, list) and all(_integer(m) for m in v),
                 "devices": lambda v: isinstance(v, list) and all(_address(d) for d in v)}
    for pid, record in data.get("partitions", {}).items():
        known = re.fullmatch(r"[0-9]{1,2}", pid) and int(pid) < 64  # FM_MAX_FABRIC_PARTITIONS
        problem = f"partition {pid!r} is not a partition id" if not known else _record(f"partition {pid}", record,
                                                                                        partition)
        if problem:
            return problem
    return None


class Journal:
    def __init__(self, directory: str | Tree, clock: Clock = SYSTEM_CLOCK) -> None:
        self.directory = state_tree(directory)
        self.clock = clock  # the Context's: the times the journal records (started, finished, since)
        self.path = self.directory.path("journal.json")
        self.data = {"version": JOURNAL_VERSION, "devices": {}, "services_stopped": [], "operation": None,
                     "mdevs": {}, "vgpus": {}, "schedulers": {}, "broken": {}, "partitions": {}}

    @classmethod
    def load(cls, directory: str | Tree, clock: Clock = SYSTEM_CLOCK) -> "Journal":
        """The journal as written, or an empty one when there is none. Read as strict JSON (a key
        twice, NaN, lone surrogates, non-UTF-8, deep nesting refused) and checked field by field:
        a journal that does not fit is CorruptJournal, kept in place, never acted on or rewritten."""
        journal = cls(directory, clock)
        try:
            text = journal.directory.read("journal.json", JOURNAL_LIMIT)
        except UnsafePathError as exc:
            raise CorruptJournal(f"journal {journal.path} cannot be trusted ({exc}); it is kept as is: "
                                 "inspect it, then move it away") from None
        except GpuvfioError as exc:
            raise UnreadableJournal(f"cannot read journal {journal.path}: {exc}") from None
        if text is None:
            return journal
        try:
            data = strict_loads(text)
        except JsonRejected as exc:
            raise CorruptJournal(f"journal {journal.path} is corrupt ({exc}); "
                                 "it is kept as is: inspect it, then move it away") from None
        if not isinstance(data, dict) or not isinstance(data.get("version"), int):
            raise CorruptJournal(f"journal {journal.path} is corrupt (no version); it is kept as is")
        if data["version"] > JOURNAL_VERSION:
            raise CorruptJournal(f"journal {journal.path} is from a newer gpuvfio (version {data['version']}); "
                                 "use that version to restore")
        problem = journal_problem(data)
        if problem:
            raise CorruptJournal(f"journal {journal.path} is corrupt ({problem}); it is kept as is: inspect it, "
                                 "then move it away")
        journal.data = {"version": JOURNAL_VERSION, "devices": data["devices"],
                        "services_stopped": data.get("services_stopped", []),
                        "operation": data.get("operation"),
                        "mdevs": data.get("mdevs", {}), "vgpus": data.get("vgpus", {}),
                        "schedulers": data.get("schedulers", {}), "broken": data.get("broken", {}),
                        "partitions": data.get("partitions", {})}
        return journal

    @property
    def devices(self) -> dict:
        return self.data["devices"]

    def unfinished_operation(self) -> dict | None:
        """The last operation when it did not finish (a crash or a kill mid-run, or running now)."""
        operation = self.data.get("operation")
        return operation if operation and not operation.get("finished") else None

    def save(self) -> None:
        make_state_dir(self.directory)
        try:
            self.directory.write("journal.json", json.dumps(self.data, indent=2, sort_keys=True) + "\n", 0o600,
                                 dir_mode=0o700)
        except UnsafePathError as exc:
            raise GpuvfioError(f"cannot write the journal {self.path}: {exc}") from None

    def set_step(self, index: int, state: str, detail: str | None = None) -> None:
        step = self.data["operation"]["steps"][index]
        step["state"] = state
        if detail is not None:
            step["detail"] = detail
        self.save()


_HELD: dict[str, list] = {}  # lock path -> [fd, depth]: the locks this process holds


def _holder_line(command: str | None, clock: Clock) -> str:
    """What the lock file says of its holder: pid, when it took the lock, the command."""
    words = command if command is not None else " ".join(os.path.basename(a) if i == 0 else a
                                                        for i, a in enumerate(sys.argv))
    words = "".join(c if c.isprintable() else "?" for c in words)[:200]
    return f"{os.getpid()} {clock.stamp()} {words}\n"


def _holder(text: str) -> tuple[int | None, str]:
    """(pid, description) of what a lock file says; pid None when it says nothing usable."""
    pid_text, _, rest = text.strip().partition(" ")
    pid = int(pid_text) if pid_text.isascii() and pid_text.isdigit() and len(pid_text) <= 8 else None
    since, _, command = rest.partition(" ")
    words = "".join(c if c.isprintable() else "?" for c in command)[:200]
    return pid, (f"pid {pid if pid is not None else 'unknown'}" + (f", {words}" if words else "")
                 + (f", since {since}" if since else ""))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """``flock`` on ``<state>/lock``, held for a whole operation: an attach from its first change
    to its verdict (or the end of its undo), a testbed variant from provision to teardown.
    Waits up to ``timeout`` seconds, then refuses, naming the holder (pid, command, since).

    Re-entrant within one process: attach's bind takes the lock attach already holds. A lock
    file naming a process that is gone (killed mid-run: flock went with it) is taken over, and
    ``progress`` says so; the journal tells what that run did."""

    def __init__(self, directory: str | Tree, timeout: float = 30.0, *, progress=None,
                 command: str | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.directory = state_tree(directory)
        self.path = self.directory.path("lock")
        self.timeout = timeout
        self.progress = progress
        self.command = command
        self.clock = clock  # the Context's: the wait for another run and the time the lock file names
        self.fd: int | None = None
        self.taken_over: str | None = None

    def __enter__(self) -> "RunLock":
        held = _HELD.get(self.path)
        if held is not None:
            held[1] += 1
            self.fd = held[0]
            return self
        make_state_dir(self.directory)
        try:
            fd = self.directory.open_lock("lock")
        except UnsafePathError as exc:
            raise InputError(f"cannot use the lock {self.path}: {exc}") from None
        deadline = self.clock.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    raise
            if self.clock.monotonic() >= deadline:
                _pid, holder = _holder(os.pread(fd, 512, 0).decode("utf-8", "replace"))
                os.close(fd)
                raise LockTimeout(f"another gpuvfio run holds {self.path} ({holder}); waited {self.timeout:g}s")
            self.clock.sleep(0.05)
        pid, earlier = _holder(os.pread(fd, 512, 0).decode("utf-8", "replace"))
        if pid is not None and pid != os.getpid() and not _alive(pid):
            self.taken_over = f"took over the lock {self.path} left by {earlier}, which is gone (gpuvfio status " \
                              "shows what it did)"
            if self.progress is not None:
                self.progress(self.taken_over)
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder_line(self.command, self.clock).encode(), 0)
        self.fd = fd
        _HELD[self.path] = [fd, 1]
        return self

    def __exit__(self, *exc) -> None:
        held = _HELD.get(self.path)
        if held is None or self.fd is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _HELD[self.path]
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
        self.fd = None


def journal_check(host: HostRoot) -> Check:
    """What the journal says about readiness, for doctor: devices that came back broken from a
    guest (binds refuse them until ``gpuvfio reset`` clears the mark), an operation that did not
    finish (a crash or a kill mid-run: restore knows what it did), or a journal gpuvfio cannot
    read or trust (every command that changes the host refuses it). Read only: nothing is created."""
    if host.recorded:
        return Check("journal", SKIP, "a host recording holds no gpuvfio state (status and doctor on the host "
                                      "itself read it)")
    directory = state_dir(host)
    path = directory.path("journal.json")
    try:
        journal = Journal.load(directory)
    except UnreadableJournal as exc:
        return Check("journal", FAIL, str(exc), "run gpuvfio doctor as root (gpuvfio's state is root's)")
    except CorruptJournal as exc:
        return Check("journal", FAIL, str(exc), f"inspect {path}; gpuvfio restore cannot use it until it is mended or "
                                                "moved away (then restore the devices by hand)")
    problems, fixes, status = [], [], OK
    broken = journal.data["broken"]
    if broken:
        marks = "; ".join(f"{address}: {_shown(record.get('reason'))}" for address, record in sorted(broken.items()))
        problems.append(f"marked broken (binds refuse them): {marks}")
        fixes.append("gpuvfio reset " + " ".join(sorted(broken)) + " (the kernel's reset; --forget once a device "
                     "answers again without one)")
        status = FAIL
    operation = journal.unfinished_operation()
    if operation is not None:
        kind, pid = operation.get("kind"), operation.get("pid")
        problems.append(f"a {kind if kind in ('bind', 'fabric') else 'gpuvfio'} operation "
                        f"(pid {pid if isinstance(pid, int) and not isinstance(pid, bool) else '?'}) did not finish, "
                        "or is running now")
        fixes.append("gpuvfio status; gpuvfio restore puts back what it did")
        status = status if status == FAIL else WARN
    if problems:
        return Check("journal", status, "; ".join(problems), "; ".join(fixes))
    held = len(journal.devices)
    return Check("journal", OK, f"gpuvfio holds {held} function(s); no broken device, no unfinished operation"
                 if held else "gpuvfio holds nothing; no broken device, no unfinished operation")


def _shown(reason, limit: int = 200) -> str:
    """A journal's reason as doctor shows it: text, and not more than a line's worth."""
    text = reason if isinstance(reason, str) else repr(reason)
    return text if len(text) <= limit else text[:limit] + "..."
