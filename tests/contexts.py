"""gpuvfio Contexts for the tests: a host tree whose sysfs writes a simulated kernel answers,
modprobe/systemctl recorded, libvirt's real test driver. What the services touch comes in
through the Context, so no test patches gpuvfio's internals."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from gpuvfio.commands import Actions
from gpuvfio.host.root import HostRoot
from gpuvfio.ops.context import Context
from tests.simkernel import SimKernel

# A libvirt test-driver node with nothing defined (test:///ABSOLUTE/PATH: a private
# state per connection, unlike test:///default which lives as long as the process).
EMPTY_NODE = """<node>
  <cpu><mhz>2000</mhz><model>x86_64</model><nodes>1</nodes><sockets>1</sockets><cores>4</cores>
    <threads>2</threads></cpu>
  <memory>33554432</memory>
</node>
"""


def libvirt_test_uri(directory: str) -> str:
    path = os.path.join(directory, "testdriver.xml")
    with open(path, "w") as handle:
        handle.write(EMPTY_NODE)
    return f"test://{os.path.abspath(path)}"


class Services:
    """systemctl start/stop, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def stop(self, unit: str) -> None:
        self.calls.append(("stop", unit))

    def start(self, unit: str) -> None:
        self.calls.append(("start", unit))


def sim_context(root: str | HostRoot, kernel: SimKernel | None = None, *, services: Services | None = None,
                write_timeout: float = 5.0, lock_timeout: float = 30.0, **kwargs) -> Context:
    """``root``: a host tree's path, or a HostRoot with its own settings (an Ansible task's)."""
    host = root if isinstance(root, HostRoot) else HostRoot(root)
    kernel = kernel or SimKernel(host.root)
    services = services or Services()
    return Context(host=host, backend=kernel,
                   actions=Actions(modprobe=kernel.modprobe, stop_service=services.stop,
                                   start_service=services.start),
                   write_timeout=write_timeout, lock_timeout=lock_timeout, **{"writable": True, **kwargs})


class SharedConnection:
    """One libvirt test:///default connection for every open in a test (each open of
    test:///default is a new, empty driver), with close() as a no-op; ``conn.close()`` ends it."""

    def __init__(self):
        import libvirt

        self.conn = libvirt.open("test:///default")

    def __getattr__(self, name):
        return getattr(self.conn, name)

    def close(self):
        return 0


@contextlib.contextmanager
def lock_held_elsewhere(state, command: str):
    """The run lock in ``state`` held by another process, as a concurrent gpuvfio run holds it
    (``command`` is what it says it runs); yields that process's pid."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys, time\nfrom gpuvfio.bind.journal import RunLock\n"
            "with RunLock(sys.argv[1], command=sys.argv[2]):\n"
            "    print('held', flush=True)\n    time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(state), command], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": repo})
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()
