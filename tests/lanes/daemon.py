"""Daemon lane: a real, private libvirtd (+ virtlogd) for tests, as children of the test run.

What is private and what is not.  Debian 12 ships the monolithic ``libvirtd``
(libvirt 9.0).  Running as root it is always the *system-mode* daemon: its
sockets and pid file can be moved (``unix_sock_dir`` in the config we write,
``--pid-file``), but the QEMU driver's state stays where the build put it
(/etc/libvirt/qemu for persistent domains, /run/libvirt/* for running state and
the per-driver ``driver.pid`` locks, /var/lib/libvirt, /var/log/libvirt/qemu,
/var/cache/libvirt/qemu for the capabilities cache).  Consequences:

* Only ONE such daemon can run on the machine at a time (a second one fails
  "Failed to acquire pid file '/run/libvirt/network/driver.pid'").  Test runs
  therefore queue on a machine-wide lock (LOCK_PATH) instead of failing, and a
  system libvirtd that is already running makes start() fail with that reason.
* Domains a test defines are written to /etc/libvirt/qemu.  stop() destroys every
  running domain and undefines every domain that was not there at start; start()
  removes leftovers of crashed runs whose names start with DOMAIN_PREFIX.  Give
  test domains that prefix.

virtlogd.  The QEMU driver always talks to virtlogd at the compiled-in path
/run/libvirt/virtlogd-sock (QEMU's stdout/stderr and file chardevs go through
it); there is no setting for that path.  The alternative, ``stdio_handler =
"file"``, lives in /etc/libvirt/qemu.conf, whose path a system-mode libvirtd
cannot be told to change, so using it would mean editing the machine's
configuration.  So: if something already answers on that socket it is used as
is; otherwise we start our own ``virtlogd`` in the foreground (private config and
pid file; it binds the default socket and removes it when it exits).  Because of
the machine-wide lock no other test run's virtlogd can be there at the same time.

Processes.  Both daemons run under a small reaper (this file run as a script):
it is a child subreaper (prctl PR_SET_CHILD_SUBREAPER), so the QEMU processes that
libvirtd double-forks re-parent to it instead of to PID 1 (here not an init that
reaps: ``libvirtd -d`` left zombies); it reaps them, forwards SIGTERM to the
daemon, and when the daemon has exited kills and reports any child left behind
(an orphaned QEMU).  It also has PR_SET_PDEATHSIG, so if the test process dies
without cleaning up, the daemons and their QEMUs go too.  Each reaper runs in its
own session, so a terminal's Ctrl-C reaches only pytest, which then tears down in
order (destroy domains, stop libvirtd, stop virtlogd).

Start-up is ~0.1-0.3 s.  The first call that needs QEMU capabilities (defining
or starting a domain, domcapabilities) costs several seconds once per QEMU/libvirt
build: libvirt probes the binary and caches the result in /var/cache/libvirt/qemu.

Environment knobs: GPUVFIO_DL_KEEP=1 keeps the work directory (configs, logs,
console files) after stop().
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterator

LIBVIRTD = "/usr/sbin/libvirtd"
VIRTLOGD = "/usr/sbin/virtlogd"
LIBVIRTD_SHUTDOWN_S = 30.0  # libvirt's own limit on a daemon's shutdown (virnetdaemon.c)
QEMU = "/usr/bin/qemu-system-x86_64"
VIRTLOGD_SOCK = "/run/libvirt/virtlogd-sock"
QEMU_STATE_DIR = "/run/libvirt/qemu"
QEMU_LOG_DIR = "/var/log/libvirt/qemu"
LOCK_PATH = "/run/lock/gpuvfio-daemon-lane.lock"
DOMAIN_PREFIX = "gpuvfio-"
WORK_PARENT = "/tmp"

_active_lock = threading.Lock()
_active: "LibvirtDaemon | None" = None  # the daemon this process runs, if any


class DaemonError(RuntimeError):
    pass


def skip_reason() -> str | None:
    """Why the daemon lane cannot run here, or None."""
    missing = [p for p in (LIBVIRTD, VIRTLOGD, QEMU) if not os.access(p, os.X_OK)]
    if missing:
        return ("daemon lane needs " + ", ".join(missing)
                + " (apt-get install libvirt-daemon-system qemu-system-x86)")
    try:
        import libvirt  # noqa: F401
    except ImportError:
        return "daemon lane needs libvirt-python in this interpreter (pip install libvirt-python)"
    if os.geteuid() != 0:
        return "daemon lane needs root (a system-mode libvirtd)"
    return None


def _socket_answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _proc_state(pid: int) -> str | None:
    """The state letter of a process ('Z' for a zombie), None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def qemu_processes(names: set[str] | None = None) -> dict[int, str]:
    """Running QEMU processes started by libvirt (``-name guest=NAME``): pid -> NAME."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        argv = _cmdline(int(entry))
        if not argv or "qemu-system" not in os.path.basename(argv[0]):
            continue
        for i, arg in enumerate(argv[:-1]):
            if arg == "-name" and argv[i + 1].startswith("guest="):
                name = argv[i + 1][len("guest="):].split(",")[0]
                if names is None or name in names:
                    found[int(entry)] = name
    return found


class LibvirtDaemon:
    """A private libvirtd (+ virtlogd) for the life of a ``with`` block.

    >>> with LibvirtDaemon() as d:
    ...     conn = d.connect()          # libvirt.open(d.uri)
    ...     conn.defineXML(...)

    ``uri`` is ``qemu:///system?socket=<workdir>/libvirt-sock``.  ``workdir`` is
    world-traversable (0755) so the QEMU process (user libvirt-qemu) can write
    console files there (``console_path(name)``).
    """

    def __init__(self, *, start_timeout: float = 30.0, lock_timeout: float = 900.0,
                 keep_workdir: bool | None = None, work_parent: str = WORK_PARENT):
        self.start_timeout = start_timeout
        self.lock_timeout = lock_timeout
        self.keep_workdir = (os.environ.get("GPUVFIO_DL_KEEP") == "1"
                             if keep_workdir is None else keep_workdir)
        self.work_parent = work_parent
        self.workdir = ""
        self.socket = ""
        self.uri = ""
        self.libvirtd_log = ""
        self.virtlogd_log = ""
        self.virtlogd_external = False
        self.start_seconds = 0.0
        self.problems: list[str] = []   # filled by stop(): leftovers, orphans, zombies
        self._lock_fd: int | None = None
        self._libvirtd: subprocess.Popen | None = None
        self._virtlogd: subprocess.Popen | None = None
        self._conns: list = []
        self._initial_domains: set[str] = set()
        self._seen_domains: set[str] = set()
        self._created_domains: set[str] = set()
        self._started_at = time.time()
        self._running = False

    # -- context manager -----------------------------------------------------------

    def __enter__(self) -> "LibvirtDaemon":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()
        if self.problems and exc_type is None:
            raise DaemonError("daemon lane teardown: " + "; ".join(self.problems))

    # -- start -----------------------------------------------------------------------

    def start(self) -> "LibvirtDaemon":
        global _active
        reason = skip_reason()
        if reason:
            raise DaemonError(reason)
        with _active_lock:
            if _active is not None:
                raise DaemonError("a LibvirtDaemon is already running in this process "
                                  f"({_active.uri}); share it (libvirt_daemon() does)")
            _active = self
        t0 = time.monotonic()
        try:
            self._acquire_lock()
            self._started_at = time.time()
            self.workdir = tempfile.mkdtemp(prefix="gpuvfio-dl-", dir=self.work_parent)
            os.chmod(self.workdir, 0o755)
            self.socket = os.path.join(self.workdir, "libvirt-sock")
            self.uri = f"qemu:///system?socket={self.socket}"
            self.libvirtd_log = os.path.join(self.workdir, "libvirtd.log")
            self.virtlogd_log = os.path.join(self.workdir, "virtlogd.log")
            self._write_configs()
            self._start_virtlogd()
            self._start_libvirtd()
            self._running = True
            self._clean_stale_domains()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _acquire_lock(self) -> None:
        lock_dir = os.path.dirname(LOCK_PATH)
        path = LOCK_PATH if os.path.isdir(lock_dir) else os.path.join(WORK_PARENT,
                                                                       os.path.basename(LOCK_PATH))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + self.lock_timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    raise
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise DaemonError(f"another test run holds {path} (a daemon-lane libvirtd "
                                      f"is running) for more than {self.lock_timeout}s")
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _write_configs(self) -> None:
        sock_dir = self.workdir
        with open(os.path.join(self.workdir, "libvirtd.conf"), "w") as f:
            f.write(
                "# written by tests/lanes/daemon.py\n"
                f'unix_sock_dir = "{sock_dir}"\n'
                'unix_sock_group = "root"\n'
                'unix_sock_ro_perms = "0700"\n'
                'unix_sock_rw_perms = "0700"\n'
                'unix_sock_admin_perms = "0700"\n'
                'auth_unix_ro = "none"\n'
                'auth_unix_rw = "none"\n'
                "listen_tls = 0\n"
                "listen_tcp = 0\n"
                # no idle exit; -t is not used either
                'log_outputs = "3:stderr"\n'
            )
        with open(os.path.join(self.workdir, "virtlogd.conf"), "w") as f:
            f.write('# written by tests/lanes/daemon.py\nlog_outputs = "3:stderr"\n')

    def _spawn(self, argv: list[str], log: str, tag: str) -> subprocess.Popen:
        """Start ``argv`` under the reaper (this file as a script), in its own session."""
        report = os.path.join(self.workdir, f"{tag}.reaper.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--reap", "--report", report,
               "--parent", str(os.getpid()), "--", *argv]
        logf = open(log, "ab")
        try:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                    cwd=self.workdir, start_new_session=True, close_fds=True)
        finally:
            logf.close()

    def _wait_until(self, proc: subprocess.Popen, ready, what: str, log: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            if proc.poll() is not None:
                raise DaemonError(self._explain(f"{what} exited (rc={proc.returncode}) "
                                                "before it was ready", log))
            if ready():
                return
            if time.monotonic() > deadline:
                raise DaemonError(self._explain(f"{what} not ready within "
                                                f"{self.start_timeout}s", log))
            time.sleep(0.02)

    def _explain(self, message: str, log: str) -> str:
        text = _tail(log)
        hint = ""
        if "Failed to acquire pid file" in text:
            hint = ("\nhint: another system-mode libvirtd (e.g. the machine's own, or one "
                    "left by a crashed run) holds the driver locks in /run/libvirt; stop it "
                    "(see `pgrep -a libvirtd`)")
        return f"{message}{hint}\n--- {os.path.basename(log)} (tail) ---\n{text}"

    def _start_virtlogd(self) -> None:
        if _socket_answers(VIRTLOGD_SOCK):
            self.virtlogd_external = True  # a system virtlogd; libvirtd just uses it
            return
        os.makedirs(os.path.dirname(VIRTLOGD_SOCK), mode=0o755, exist_ok=True)
        self._virtlogd = self._spawn(
            [VIRTLOGD, "--config", os.path.join(self.workdir, "virtlogd.conf"),
             "--pid-file", os.path.join(self.workdir, "virtlogd.pid")],
            self.virtlogd_log, "virtlogd")
        self._wait_until(self._virtlogd, lambda: _socket_answers(VIRTLOGD_SOCK), "virtlogd",
                         self.virtlogd_log)

    def _start_libvirtd(self) -> None:
        import libvirt

        libvirt.registerErrorHandler(lambda *a: None, None)
        self._libvirtd = self._spawn(
            [LIBVIRTD, "--config", os.path.join(self.workdir, "libvirtd.conf"),
             "--pid-file", os.path.join(self.workdir, "libvirtd.pid")],
            self.libvirtd_log, "libvirtd")

        def answers() -> bool:
            if not _socket_answers(self.socket):
                return False
            try:
                conn = libvirt.open(self.uri)
            except libvirt.libvirtError:
                return False
            try:
                conn.listAllDomains(0)  # the QEMU driver is there (no capability probe)
                return True
            except libvirt.libvirtError:
                return False
            finally:
                conn.close()

        self._wait_until(self._libvirtd, answers, "libvirtd", self.libvirtd_log)
        # A libvirtd whose driver init failed may answer briefly before exiting.
        time.sleep(0.05)
        if self._libvirtd.poll() is not None:
            raise DaemonError(self._explain("libvirtd exited right after start",
                                            self.libvirtd_log))

    def _clean_stale_domains(self) -> None:
        import libvirt

        conn = libvirt.open(self.uri)
        try:
            for dom in conn.listAllDomains(0):
                name = dom.name()
                if name.startswith(DOMAIN_PREFIX):
                    print(f"daemon lane: removing stale domain {name!r} left by an earlier run",
                          file=sys.stderr)
                    self._remove_domain(dom)
            self._initial_domains = {d.name() for d in conn.listAllDomains(0)}
        finally:
            conn.close()

    # -- use ---------------------------------------------------------------------------

    def connect(self):
        """A new libvirt connection to this daemon (closed by stop())."""
        import libvirt

        if not self._running:
            raise DaemonError("daemon not running")
        conn = libvirt.open(self.uri)
        self._conns.append(conn)
        return conn

    def console_path(self, name: str) -> str:
        """A file path in the work directory for a domain's serial console."""
        return os.path.join(self.workdir, f"{name}.console.log")

    def qemu_log(self, name: str) -> str:
        """libvirt's per-domain QEMU log (command line, QEMU's stderr), via virtlogd."""
        return _tail(os.path.join(QEMU_LOG_DIR, f"{name}.log"), 8000)

    def log_tail(self, limit: int = 4000) -> str:
        return _tail(self.libvirtd_log, limit)

    @property
    def reaper_pid(self) -> int | None:
        """The process libvirtd's QEMUs are re-parented to (and reaped by)."""
        return self._libvirtd.pid if self._libvirtd is not None else None

    @property
    def pid(self) -> int | None:
        try:
            with open(os.path.join(self.workdir, "libvirtd.pid")) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    # -- stop ----------------------------------------------------------------------------

    @staticmethod
    def _remove_domain(dom) -> None:
        import libvirt

        with contextlib.suppress(libvirt.libvirtError):
            if dom.isActive():
                dom.destroy()
        if dom.isPersistent():
            flags = (libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
                     | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
                     | libvirt.VIR_DOMAIN_UNDEFINE_CHECKPOINTS_METADATA
                     | libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)
            try:
                dom.undefineFlags(flags)
            except libvirt.libvirtError:
                dom.undefine()

    def _cleanup_domains(self) -> None:
        import libvirt

        try:
            conn = libvirt.open(self.uri)
        except libvirt.libvirtError as exc:
            self.problems.append(f"could not connect to clean up domains: {exc}")
            return
        try:
            for dom in conn.listAllDomains(0):
                name = dom.name()
                self._seen_domains.add(name)
                if name not in self._initial_domains:
                    self._created_domains.add(name)
                active = dom.isActive()
                created = name not in self._initial_domains
                if active or created:
                    try:
                        if created:
                            self._remove_domain(dom)
                        else:
                            dom.destroy()
                    except libvirt.libvirtError as exc:
                        self.problems.append(f"cleaning up domain {name!r}: {exc}")
        finally:
            conn.close()

    @staticmethod
    def _terminate(proc: subprocess.Popen | None, timeout: float = 20.0) -> int | None:
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        return proc.returncode

    def _kill_reaped_child(self, pidfile: str) -> None:
        """If a reaper had to be SIGKILLed, its daemon may live on: kill it by pid file."""
        try:
            with open(pidfile) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return
        if _proc_state(pid) not in (None, "Z"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                self.problems.append(f"had to SIGKILL {pidfile} pid {pid}")

    def stop(self) -> list[str]:
        """Destroy domains, stop libvirtd and virtlogd, check for leftovers.

        Returns (and keeps in ``problems``) a list of what went wrong: QEMU
        processes that outlived the daemon, zombies, daemons that had to be killed.
        Idempotent.
        """
        global _active
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.close()
        self._conns.clear()
        if self._running and self._libvirtd is not None and self._libvirtd.poll() is None:
            self._cleanup_domains()
        self._running = False

        # libvirtd gives its own shutdown 30 s before it exits anyway (src/rpc/virnetdaemon.c
        # virNetDaemonRun's finish timer, libvirt 7.x to 11.x); libvirt 11.3 took more than 20.
        for proc, tag, grace in ((self._libvirtd, "libvirtd", LIBVIRTD_SHUTDOWN_S + 10.0),
                                 (self._virtlogd, "virtlogd", 20.0)):
            if proc is None:
                continue
            rc = self._terminate(proc, grace)
            if rc == -signal.SIGKILL:
                self.problems.append(f"{tag} reaper did not exit on SIGTERM and was killed")
                self._kill_reaped_child(os.path.join(self.workdir, f"{tag}.pid"))
            report = os.path.join(self.workdir, f"{tag}.reaper.json")
            with contextlib.suppress(OSError, ValueError):
                with open(report) as f:
                    data = json.load(f)
                for left in data.get("leftovers", []):
                    self.problems.append(f"{tag} left a child behind, killed by the reaper: "
                                         f"pid {left['pid']} {' '.join(left['argv'])[:200]}")
        self._libvirtd = self._virtlogd = None

        # libvirt's per-domain QEMU logs of the domains we created: into the work
        # directory (kept with GPUVFIO_DL_KEEP=1), not left in /var/log.
        # That includes domains the tests undefined themselves: any DOMAIN_PREFIX log
        # written since start; those names are also checked for leftover QEMUs below.
        names = set(self._created_domains)
        with contextlib.suppress(OSError):
            for entry in os.listdir(QEMU_LOG_DIR):
                if entry.startswith(DOMAIN_PREFIX) and entry.endswith(".log") and \
                        os.path.getmtime(os.path.join(QEMU_LOG_DIR, entry)) >= self._started_at - 1:
                    names.add(entry[:-len(".log")])
        self._seen_domains |= names
        for name in names:
            src = os.path.join(QEMU_LOG_DIR, f"{name}.log")
            if self.workdir and os.path.isdir(self.workdir) and os.path.exists(src):
                with contextlib.suppress(OSError):
                    shutil.move(src, os.path.join(self.workdir, f"{name}.qemu.log"))

        # Independent check: nothing of ours may still exist (or be a zombie).
        for pid, name in qemu_processes(self._seen_domains).items():
            state = _proc_state(pid)
            self.problems.append(f"QEMU of domain {name!r} (pid {pid}, state {state}) "
                                 "outlived the daemon")

        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None
        if self.workdir and not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        with _active_lock:
            if _active is self:
                _active = None
        return self.problems


# --- pytest glue -----------------------------------------------------------------------

def libvirt_daemon(**kwargs) -> Iterator[LibvirtDaemon]:
    """Generator for a pytest fixture: yields a running daemon, stops it afterwards.

    Skips (pytest.skip) when the lane's binaries are missing.  If this process
    already runs a daemon (e.g. a session fixture), that one is yielded and left
    running.  Teardown fails the test run if QEMU processes or zombies were left.

        # conftest.py
        from tests.lanes.daemon import libvirt_daemon
        @pytest.fixture(scope="session")
        def libvirtd():
            yield from libvirt_daemon()
    """
    import pytest

    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with _active_lock:
        existing = _active
    if existing is not None and existing._running:
        yield existing
        return
    daemon = LibvirtDaemon(**kwargs).start()
    try:
        yield daemon
    finally:
        problems = daemon.stop()
    if problems:
        pytest.fail("daemon lane teardown: " + "; ".join(problems), pytrace=False)


def make_fixture(scope: str = "session", **kwargs):
    """A pytest fixture (of ``scope``) running libvirt_daemon(**kwargs)."""
    import pytest

    @pytest.fixture(scope=scope)
    def _libvirt_daemon():
        yield from libvirt_daemon(**kwargs)

    return _libvirt_daemon


# --- The reaper (this file run as a script) ---------------------------------------------

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry))
    return kids


def _reap(argv: list[str], report: str, parent: int) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the test process died before PDEATHSIG was armed
        return 1
    child = os.posix_spawn(argv[0], argv, dict(os.environ))
    stopping = False

    def forward(signum, frame):
        nonlocal stopping
        stopping = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)

    status = 0
    while True:
        try:
            pid, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == child:
            status = os.waitstatus_to_exitcode(st)
            break
        # else: an adopted orphan (a QEMU whose domain was destroyed) - reaped.

    leftovers = [{"pid": p, "argv": _cmdline(p)} for p in _children(os.getpid())]
    for p in _children(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.05)
    for p in _children(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    with open(report + ".tmp", "w") as f:
        json.dump({"status": status, "stopping": stopping, "leftovers": leftovers}, f)
    os.replace(report + ".tmp", report)
    return status if status >= 0 else 128 - status


def _main(args: list[str]) -> int:
    if len(args) >= 6 and args[0] == "--reap" and args[1] == "--report" \
            and args[3] == "--parent" and args[5] == "--":
        return _reap(args[6:], args[2], int(args[4]))
    print("usage: daemon.py --reap --report FILE --parent PID -- COMMAND...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
