"""The journal and the run lock, in the state directory.

State directory: ``GPUVFIO_STATE_DIR``, else ``<root>/var/lib/gpuvfio``.

* ``journal.json``: for each device gpuvfio moved, the driver and driver_override it
  had, the services stopped for it, and the steps of the last operation with their
  state (pending, running, done, failed, uncertain, rolled_back). Written with
  write-temp, fsync, rename, fsync(dir) *before* each step, so after a crash at any
  point ``restore`` knows what the host looked like and what may have happened.
* ``lock``: ``flock`` held for the whole run; the file names the holder's PID.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time

from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.files import atomic_write
from gpuvfio.host.root import HostRoot

STATE_ENV = "GPUVFIO_STATE_DIR"
JOURNAL_VERSION = 1


class LockTimeout(GpuvfioError):
    pass


class CorruptJournal(InputError):
    """The journal cannot be trusted: refuse to act, keep the file for a human."""


def state_dir(host: HostRoot) -> str:
    return os.environ.get(STATE_ENV) or host.path("var", "lib", "gpuvfio")


def known_hosts_file(host: HostRoot) -> str:
    """Where SSH host keys trusted on first use are recorded (guests, remote hypervisors)."""
    return os.path.join(state_dir(host), "known_hosts")


class Journal:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, "journal.json")
        self.data = {"version": JOURNAL_VERSION, "devices": {}, "services_stopped": [], "operation": None,
                     "mdevs": {}, "vgpus": {}, "schedulers": {}}

    @classmethod
    def load(cls, directory: str) -> "Journal":
        journal = cls(directory)
        try:
            with open(journal.path, encoding="utf-8") as handle:
                text = handle.read()
        except FileNotFoundError:
            return journal
        except OSError as exc:
            raise CorruptJournal(f"cannot read journal {journal.path}: {exc.strerror}") from None
        try:
            data = json.loads(text)
        except ValueError:
            raise CorruptJournal(f"journal {journal.path} is corrupt (not JSON); "
                                 "it is kept as is: inspect it, then move it away") from None
        if not isinstance(data, dict) or not isinstance(data.get("version"), int):
            raise CorruptJournal(f"journal {journal.path} is corrupt (no version); it is kept as is")
        if data["version"] > JOURNAL_VERSION:
            raise CorruptJournal(f"journal {journal.path} is from a newer gpuvfio (version {data['version']}); "
                                 "use that version to restore")
        if not isinstance(data.get("devices"), dict) or not isinstance(data.get("services_stopped", []), list):
            raise CorruptJournal(f"journal {journal.path} is corrupt (bad devices/services); it is kept as is")
        journal.data = {"version": JOURNAL_VERSION, "devices": data["devices"],
                        "services_stopped": data.get("services_stopped", []),
                        "operation": data.get("operation"),
                        "mdevs": data.get("mdevs", {}), "vgpus": data.get("vgpus", {}),
                        "schedulers": data.get("schedulers", {})}
        return journal

    @property
    def devices(self) -> dict:
        return self.data["devices"]

    def save(self) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        atomic_write(self.path, json.dumps(self.data, indent=2, sort_keys=True) + "\n", 0o600)

    def set_step(self, index: int, state: str, detail: str | None = None) -> None:
        step = self.data["operation"]["steps"][index]
        step["state"] = state
        if detail is not None:
            step["detail"] = detail
        self.save()


class RunLock:
    """``flock`` on ``<state>/lock``; waits up to ``timeout`` seconds, then names the holder."""

    def __init__(self, directory: str, timeout: float = 30.0) -> None:
        self.directory = directory
        self.path = os.path.join(directory, "lock")
        self.timeout = timeout
        self.fd: int | None = None

    def __enter__(self) -> "RunLock":
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    raise
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
                os.close(fd)
                raise LockTimeout(f"another gpuvfio run holds {self.path} (pid {holder}); "
                                  f"waited {self.timeout:g}s")
            time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
