# Shared by the gpuvfio_* modules in ../library: argument specs, opening the host root,
# turning gpuvfio's typed errors into module failures, and Ansible's diff format.
# Apache-2.0, like gpuvfio.
"""Common helpers for the gpuvfio Ansible modules.

Every module takes ``root`` (the host as a directory, default ``/``; the read-only
modules also take a host fixture file) and ``state_dir`` (gpuvfio's journal and lock
directory, default ``<root>/var/lib/gpuvfio``). gpuvfio itself reads the state
directory from ``GPUVFIO_STATE_DIR``; a module is its own process, so setting the
variable there affects that one task only.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback

STATE_ENV = "GPUVFIO_STATE_DIR"

COMMON_ARGS = dict(
    root=dict(type="str", default="/"),
    state_dir=dict(type="path"),
)

try:  # gpuvfio is a normal Python package on the managed host (host-prep.yml installs it)
    import gpuvfio  # noqa: F401
    from gpuvfio.errors import GpuvfioError
    HAS_GPUVFIO = True
    IMPORT_ERROR = None
except ImportError:  # pragma: no cover - reported through require_gpuvfio()
    HAS_GPUVFIO = False
    IMPORT_ERROR = traceback.format_exc()

    class GpuvfioError(Exception):  # type: ignore[no-redef]
        exit_code = 1


def require_gpuvfio(module) -> None:
    if not HAS_GPUVFIO:
        module.fail_json(msg=f"the Python package gpuvfio is not importable by {sys.executable}: install it "
                             "(playbooks/host-prep.yml does) or point ansible_python_interpreter "
                             "(gpuvfio_python) at the interpreter that has it",
                         exception=IMPORT_ERROR)


def apply_state_dir(module) -> None:
    if module.params.get("state_dir"):
        os.environ[STATE_ENV] = module.params["state_dir"]


@contextlib.contextmanager
def read_host(module):
    """The host for reading: a root directory or a fixture file (loaded into a temp dir)."""
    from gpuvfio.commands import open_host

    apply_state_dir(module)
    with open_host(module.params["root"]) as (host, _label):
        yield host


def write_host(module):
    """The host for changing: a root directory only (a fixture file is read-only)."""
    from gpuvfio.hostroot import HostRoot

    apply_state_dir(module)
    root = module.params["root"]
    if os.path.isfile(root):
        raise _input_error(f"root {root} is a host fixture file: it can be read, not changed; "
                           "load it into a directory (gpuvfio.fixture.load_fixture) to simulate changes")
    return HostRoot(root)


def _input_error(message):
    from gpuvfio.errors import InputError

    return InputError(message)


def state_dir(host) -> str:
    from gpuvfio.journal import state_dir as gpuvfio_state_dir

    return gpuvfio_state_dir(host)


def known_hosts_file(host) -> str:
    from gpuvfio.journal import known_hosts_file as gpuvfio_known_hosts_file

    return gpuvfio_known_hosts_file(host)


@contextlib.contextmanager
def private_key_file(module):
    """ssh_private_key (no_log) as a mode-0600 temporary file for the task, else ssh_key;
    the file is removed afterwards."""
    import tempfile

    content = module.params.get("ssh_private_key")
    if not content:
        yield module.params.get("ssh_key")
        return
    handle = tempfile.NamedTemporaryFile("w", prefix="gpuvfio-key-", delete=False)
    try:
        os.chmod(handle.name, 0o600)
        with handle:
            handle.write(content.rstrip("\n") + "\n")
        yield handle.name
    finally:
        os.unlink(handle.name)


def parse_addresses(values) -> list:
    from gpuvfio.address import PciAddress

    return [PciAddress.parse(str(v)) for v in values or []]


def writer_for(host, timeout: float):
    from gpuvfio.sysfs_write import SysfsWriter

    return SysfsWriter(host, timeout=timeout)


def actions_for(host):
    """modprobe/systemctl on the live host. Looked up through the module attribute at call
    time, so a test can substitute a simulated kernel for gpuvfio.bindapply.live_actions."""
    from gpuvfio import bindapply

    return bindapply.live_actions(host)


def fail_gpuvfio(module, exc, **extra) -> None:
    """gpuvfio's own message as the module's msg; its exit status and any report alongside."""
    result = dict(extra)
    result["exit_code"] = getattr(exc, "exit_code", 1)
    result["error"] = type(exc).__name__
    report = getattr(exc, "report", None)
    if report is not None:
        result["report"] = report
    attach_result = getattr(exc, "result", None)
    if attach_result is not None and hasattr(attach_result, "to_json"):
        result["attach"] = attach_result.to_json()
    module.fail_json(msg=str(exc), **result)


def driver_lines(drivers: dict) -> str:
    return "".join(f"{address}: {driver or '(no driver)'}\n" for address, driver in sorted(drivers.items()))


def driver_diff(before: dict, after: dict, header: str) -> dict:
    return {"before_header": f"{header} (drivers now)", "after_header": f"{header} (drivers after)",
            "before": driver_lines(before), "after": driver_lines(after)}


def current_drivers(host, addresses) -> dict:
    """Driver of each device, read through the device's resolved directory as the inventory
    reads it (the ``driver`` link is relative to the real device directory)."""
    from gpuvfio.address import PciAddress
    from gpuvfio.inventory import read_function

    return {str(a): read_function(host, PciAddress.parse(str(a))).driver for a in addresses}
