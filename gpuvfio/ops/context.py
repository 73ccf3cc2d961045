"""What the services need from the world, passed in: the host and its settings (read from the
environment once, gpuvfio.settings), the state dir, the kernel side of sysfs writes,
modprobe/systemctl, local commands, libvirt connections, SSH sessions, NVML, the Fabric
Manager, the run lock, the clock and a progress sink.

The CLI, the Ansible modules and the testbed build one with ``live_context`` or, for a host
that may be a recording, ``open_context`` (the real kernel, the real libvirt); the tests build
one around a simulated kernel and libvirt's test driver, and give their doubles (a fake clock, a
pause after a bind step) to it. Every service takes the Context, never a bare host. A Context
only reads unless the command that builds it changes the host. Its boundaries with the world
beyond the host's files (libvirt, sysfs writes, SSH, NVML, the Fabric Manager, the journal) are
loaded when first used. tests/unit/test_structure.py holds the rules: no environment read,
clock, lock or process start outside their owners, no service taking a HostRoot, no writable
Context beyond the commands listed there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from gpuvfio.clock import Clock
from gpuvfio.commands import Actions, Runner
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.files import ReadOnly, Tree
from gpuvfio.read_only_tree import ReadOnlyTree
from gpuvfio.host.fixture import open_host
from gpuvfio.host.root import HostRoot
from gpuvfio.options import RUN, checked
from gpuvfio.settings import ROOT_ENV
from gpuvfio.host.state import KNOWN_HOSTS, make_state_dir, state_dir

if TYPE_CHECKING:
    from gpuvfio.bind.fabric_manager import FabricManagerClient
    from gpuvfio.bind.journal import Journal, RunLock
    from gpuvfio.bind.sysfs_write import SysfsWriter
    from gpuvfio.guest.ssh import Session, SshTarget
    from gpuvfio.vgpu.scheduler import Nvml

__all__ = ["Context", "Clock", "live_context", "host_context", "open_context", "ROOT_ENV",
           "DEFAULT_LOCK_TIMEOUT", "DEFAULT_WRITE_TIMEOUT"]
DEFAULT_LOCK_TIMEOUT = RUN["lock_timeout"].default  # gpuvfio.options declares them and their bounds
DEFAULT_WRITE_TIMEOUT = RUN["write_timeout"].default


def _no_progress(line: str) -> None:
    pass


def _no_step(number: int) -> None:
    pass


# What a command meets beyond the host's files (libvirt, sysfs writes, SSH, NVML, the Fabric
# Manager, the journal and its lock) is imported when first used: a listing or a plan that never
# connects, writes, logs in or asks NVML does not load their modules (their import was most of a
# Context's cost; tests/unit/test_structure.py LAZY_BOUNDARIES lists them).
def open_connection(uri: str, *, read_only: bool = False):
    """A libvirt connection by gpuvfio's URI policy (gpuvfio.virt.connection.open_connection)."""
    from gpuvfio.virt.connection import open_connection as connect
    return connect(uri, read_only=read_only)


def _read_only_connection(uri: str):
    return open_connection(uri, read_only=True)


def kernel_write(path: str, data: bytes, fd: int) -> None:
    """One sysfs write through write(2) (gpuvfio.bind.sysfs_write.kernel_write)."""
    from gpuvfio.bind.sysfs_write import kernel_write as write_once
    write_once(path, data, fd)


def open_nvml() -> "Nvml":
    from gpuvfio.vgpu.scheduler import Nvml
    return Nvml()


def fabric_manager_client() -> "FabricManagerClient":
    from gpuvfio.bind.fabric_manager import FabricManagerClient
    return FabricManagerClient()


@dataclass
class Context:
    host: HostRoot
    backend: Callable[[str, bytes, int], None] = kernel_write  # one sysfs write: real write(2), or a simulated kernel
    actions: Actions | None = None  # modprobe / systemctl; None: refused (not the live host)
    connect: Callable[[str], object] = open_connection  # libvirt URI -> connection
    nvml: Callable[[], Nvml] = open_nvml  # NVML, opened for the vGPU scheduler
    # The host's Fabric Manager (HGX shared-NVSwitch partitions); None: not reachable from here.
    # The clients it makes run fmpm through ``run`` below, whoever made them.
    fabric_manager: Callable[[], FabricManagerClient] | None = None
    clock: Clock = field(default_factory=Clock)  # every wait, interval and time stamp of the run
    progress: Callable[[str], None] = _no_progress
    # Called with N once a bind's step N is done and journaled: nothing for a user; a test stops
    # a bind half-way here (the kernel lane kills it there) instead of through a variable the
    # package would read.
    after_step: Callable[[int], None] = _no_step
    write_timeout: float = DEFAULT_WRITE_TIMEOUT
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    connections: dict = field(default_factory=dict)
    # gpuvfio's state dir (journal, lock, known hosts): decided once, when the Context is built
    # (GPUVFIO_STATE_DIR, else <root>/var/lib/gpuvfio); nothing below reads the environment for it.
    state: Tree | None = None
    # Local commands (argument lists, no shell): the one way gpuvfio starts a process, handed
    # down to what starts one (ssh -G for the SSH config, fmpm, modprobe/systemctl).
    run: Runner = field(default_factory=Runner)
    # Only a command that changes the host asks for a writable Context. Any other (a listing, a
    # dry run, a recording, a plan) only reads: its state dir refuses every write, its sysfs
    # writer and modprobe/systemctl refuse, it takes no lock. By construction, not by care.
    writable: bool = False
    # While a plan is made (one_listing), libvirt's domains listed once per connection for every
    # question it asks; None: each question lists them afresh.
    listing: dict | None = None

    def __post_init__(self) -> None:
        if self.state is None:
            self.state = state_dir(self.host)
        if self.fabric_manager is not None:
            self.fabric_manager = _through(self.fabric_manager, self.run)
        if not self.writable:
            if self.connect is open_connection:  # libvirt's read-only socket: no define, start or destroy
                self.connect = _read_only_connection
            self.host = self.host.read_only()
            self.state = ReadOnlyTree(self.state.top, "/".join(self.state.base))
            self.actions = None
            self.fabric_manager = None

    def journal(self) -> Journal:
        """The journal as it is now (reading writes nothing; a damaged one raises)."""
        from gpuvfio.bind.journal import Journal
        return Journal.load(self.state, clock=self.clock)

    def lock(self, directory: Tree | None = None) -> RunLock:
        """The run lock, held for an operation (re-entrant within this process); ``directory``:
        the lock of another directory gpuvfio keeps a file in (one hosts of a fleet share)."""
        where = self.state if directory is None else directory
        if not self.writable:
            raise ReadOnly(f"the run lock under {where.path()} refused: this context only reads")
        from gpuvfio.bind.journal import RunLock
        return RunLock(where, self.lock_timeout, progress=self.progress, clock=self.clock)

    def libvirt(self, uri: str | None = None):
        """One connection per URI for the whole command (default: libvirt's default URI), so a
        check, a define and a start see the same daemon state; closed by close()."""
        if not uri:
            from gpuvfio.virt.connection import default_uri
            uri = default_uri(self.host.settings)
        if uri not in self.connections:
            self.connections[uri] = self.connect(uri)
        return self.connections[uri]

    @contextlib.contextmanager
    def one_listing(self):
        """Within, the questions about libvirt's domains (which use the devices, whose vCPUs are
        pinned where) share one listing of them; what follows the scope lists afresh."""
        outer = self.listing
        self.listing = {} if outer is None else outer
        try:
            yield self
        finally:
            self.listing = outer

    def close(self) -> None:
        while self.connections:
            _uri, conn = self.connections.popitem()
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing a broken connection must not hide the real error
                pass

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def writer(self) -> SysfsWriter:
        if not self.writable:
            raise ReadOnly(f"sysfs writes under {self.host.root} refused: this context only reads (a dry run, a "
                           "recording)")
        from gpuvfio.bind.sysfs_write import SysfsWriter
        return SysfsWriter(self.host, timeout=self.write_timeout, backend=self.backend, clock=self.clock)

    def ssh(self, target: SshTarget) -> Session:
        """An SSH session to ``target`` (not yet connected), on this run's clock; keys trusted on
        first use go to the target's known_hosts, else to the state dir's (record_host_key)."""
        from gpuvfio.guest.ssh import KNOWN_HOSTS_LIMIT, Session
        return Session(target, self.state.path(KNOWN_HOSTS), clock=self.clock, record=self.record_host_key,
                       recorded=lambda: self.state.read(KNOWN_HOSTS, KNOWN_HOSTS_LIMIT) or b"")

    def record_host_key(self, line: str) -> None:
        """Add a known_hosts line to the state dir's known_hosts: the state dir made private when
        it is made, the file 0600; refused by a Context that only reads."""
        from gpuvfio.guest.ssh import KNOWN_HOSTS_LIMIT
        make_state_dir(self.state)
        earlier = self.state.text(KNOWN_HOSTS, KNOWN_HOSTS_LIMIT) or ""
        self.state.write(KNOWN_HOSTS, earlier + ("\n" if earlier and not earlier.endswith("\n") else "") + line + "\n",
                         0o600)

    def host_actions(self) -> Actions:
        if self.actions is None:
            return refusing_actions(self.host)
        return self.actions

    @property
    def live(self) -> bool:
        """Is the root this machine itself (so its libvirt, modprobe and systemctl belong to it)?"""
        return self.host.root == "/"


def _through(make: Callable[[], FabricManagerClient], run: Runner) -> Callable[[], FabricManagerClient]:
    def client() -> FabricManagerClient:
        return make().with_runner(run)

    return client


def live_actions(run: Runner, timeout: float = 60.0) -> Actions:
    """modprobe and systemctl on this machine (argument lists: nothing goes through a shell)."""
    return Actions(modprobe=lambda name: run(["modprobe", "--", name], timeout),
                   stop_service=lambda unit: run(["systemctl", "stop", "--", unit], timeout),
                   start_service=lambda unit: run(["systemctl", "start", "--", unit], timeout))


def refusing_actions(host: HostRoot) -> Actions:
    """For a root that is not this machine: its modules and services are not ours to touch."""
    def refuse(what: str) -> Callable[[str], None]:
        def action(name: str) -> None:
            raise GpuvfioError(f"'{what} {name}' is needed, but {host.root} is not the live host")
        return action

    return Actions(modprobe=refuse("modprobe"), stop_service=refuse("systemctl stop"),
                   start_service=refuse("systemctl start"))


def refusing_nvml(host: HostRoot) -> Callable[[], Nvml]:
    """NVML talks to the GPUs of the machine it runs on, whatever the root: refused elsewhere."""
    def refuse() -> Nvml:
        raise Refused(f"NVML reaches this machine's GPUs only; {host.root} is not this machine")

    return refuse


def host_context(host: HostRoot, *, progress: Callable[[str], None] = _no_progress,
                 write_timeout: float = DEFAULT_WRITE_TIMEOUT, lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
                 writable: bool = False) -> Context:
    """The real thing around a host root: write(2), libvirt, and modprobe/systemctl and NVML when
    the root is this machine (``/``). ``writable``: for a command that changes the host only
    (see Context)."""
    live = host.root == "/"
    run = Runner()
    return Context(host=host, actions=live_actions(run) if live else None, progress=progress, writable=writable,
                   run=run, nvml=open_nvml if live else refusing_nvml(host),
                   fabric_manager=fabric_manager_client if live else None,
                   write_timeout=float(checked(RUN["write_timeout"], write_timeout)),
                   lock_timeout=float(checked(RUN["lock_timeout"], lock_timeout)))


def live_context(root: str | None = None, **kwargs) -> Context:
    """host_context for a root directory (None: $GPUVFIO_ROOT or /)."""
    return host_context(HostRoot(root), **kwargs)


@contextlib.contextmanager
def open_context(root: str | None, **kwargs) -> Iterator[tuple[Context, str]]:
    """host_context around the host behind ``--root`` (a directory, or a recording loaded into a
    temporary directory: gpuvfio.host.fixture.open_host; None: $GPUVFIO_ROOT or /), with the
    host's label for titles. Read-only unless ``writable`` is given."""
    with open_host(root) as (host, label), host_context(host, **kwargs) as ctx:
        yield ctx, label
