# Shared by the modules of the collection gpuvfio.gpuvfio (../modules): argument specs, the
# gpuvfio Context a task works in, turning gpuvfio's typed errors into module failures, and
# Ansible's diff format.
# Apache-2.0, like gpuvfio.
"""Common helpers for the gpuvfio Ansible modules.

The modules only parse their parameters, call gpuvfio's services (``gpuvfio.ops``: the same
functions the gpuvfio command calls) and map the results to ``changed`` and ``diff``.

Every module takes ``root`` (the host as a directory, default ``/``; the read-only modules
also take a host fixture file) and ``state_dir`` (gpuvfio's journal and lock directory,
default ``<root>/var/lib/gpuvfio``). gpuvfio reads the state directory from
``GPUVFIO_STATE_DIR``; a module is its own process, so setting the variable there affects that
one task only. What a task touches (the kernel's sysfs, modprobe and systemctl, libvirt) comes
through a gpuvfio Context made by ``context_factory(host)``: the live one unless a caller (the
tests) passes another to the module's ``main``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import traceback

from ansible_collections.gpuvfio.gpuvfio.plugins.module_utils.options import SETS


COMMON_ARGS = dict(
    root=dict(type="str", default="/"),
    state_dir=dict(type="path"),
)

# The devices a task acts on, as the gpuvfio command takes them: addresses, lspci slots
# (``01:00``: every function), libvirt node-device names, ``device_ids`` as lspci -d; a task
# that changes the host acts on more than one physical device from a slot or an id filter only
# with ``all_matched`` (the command's --yes).
DEVICE_ARGS = dict(
    devices=dict(type="list", elements="str", default=[]),
    device_ids=dict(type="list", elements="str", default=[]),
    all_matched=dict(type="bool", default=False),
)

try:  # gpuvfio is a normal Python package on the managed host (host-prep.yml installs it)
    from gpuvfio.errors import GpuvfioError, InputError
    from gpuvfio.ops import selection
    from gpuvfio.ops.context import host_context
    from gpuvfio.ops.uris import check_uri
    from gpuvfio.ops.inventory import open_host
    from gpuvfio.ops.targets import ssh_from_table
    from gpuvfio.options import SETS as OPTION_SETS, checked
    from gpuvfio.settings import Settings
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
                             "(the playbook gpuvfio.gpuvfio.host_prep does) or point ansible_python_interpreter "
                             "(gpuvfio_python) at the interpreter that has it",
                         exception=IMPORT_ERROR)


@contextlib.contextmanager
def task_context(module, context_factory=None, *, writable: bool = False, **options):
    """The gpuvfio Context of this task: ``root`` as a directory (or, for reading, a fixture
    file loaded into a temp dir), the state directory applied (in this task's settings, never in
    the environment of the process, which may run other tasks); connections closed at the end."""
    check_table_values(module.params)
    settings = Settings.from_environment()
    if module.params.get("state_dir"):
        settings = dataclasses.replace(settings, state_dir=module.params["state_dir"])
    root = module.params["root"]
    if writable and os.path.isfile(root):
        raise InputError(f"root {root} is a host fixture file: it can be read, not changed; load it into a "
                         "directory (gpuvfio.host.fixture.load_fixture) to simulate changes")
    factory = context_factory or (lambda host: host_context(host, writable=writable, **options))
    with open_host(root, settings) as (host, _label):
        ctx = factory(host)
        try:
            yield ctx
        finally:
            ctx.close()


def check_table_values(params: dict) -> None:
    """Each option gpuvfio.options declares, as the task gives it, within its declared kind,
    bounds, choices and pattern before anything runs, check mode as the run (the command checks
    at its edge the same way); OptionError names the option as the task does."""
    for option_set in OPTION_SETS:
        for option in option_set:
            if params.get(option.name) is not None and option.ansible:
                checked(option, params[option.name])


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


def table_values(params: dict, name: str) -> dict:
    """The task's values of one option set gpuvfio declares (gpuvfio.options: "domain", "ssh",
    "verify"), by their names, for the gpuvfio service that validates them."""
    return {key: params[key] for key in SETS[name] if key in params}


def guest_ssh(module, key_file, wait: str):
    """gpuvfio's SSH options for the guest from the task's SSH options (``key_file``: from
    private_key_file; ``wait``: the option whose wait applies, ssh_timeout or boot_timeout)."""
    return ssh_from_table(dict(table_values(module.params, "ssh"), ssh_key=key_file), wait=wait)


def finish(module, result: dict, selected: list) -> None:
    """exit_json with what selectors expanded to, and the diff only under --diff."""
    if selected:
        result["selected"] = selected
    if not module._diff:
        result.pop("diff", None)
    module.exit_json(**result)


def check_libvirt_uri(module, key: str, keywords=()) -> None:
    """The task's libvirt URI parameter by gpuvfio's URI policy (gpuvfio.virt.uri), before
    anything opens it: libvirt runs programs some URIs name, in check mode too. A URI let
    through by GPUVFIO_ALLOW_UNSAFE_URI=1 (the task's environment) is a task warning."""
    check_uri(module.params.get(key), source=key, keywords=keywords, warn=module.warn)


def check_devices(module, *, required: bool, key: str = "devices", ids_key: str | None = "device_ids") -> None:
    """The device parameters parsed before anything is read (bad input fails the task alone)."""
    try:
        selection.check_devices(_texts(module, key), _texts(module, ids_key), required=required,
                                missing=f"no device given: set {key}" + (f" or {ids_key}" if ids_key else ""))
    except InputError as exc:
        # YAML 1.1 reads an unquoted 18:00 as the sexagesimal number 1080 (and 18:00.0 as 1080.0)
        if any(_NUMBER.fullmatch(text) for text in _texts(module, key) + _texts(module, ids_key)):
            raise InputError(f"{exc}; an unquoted 18:00 is the number 1080 to YAML: quote device addresses") \
                from None
        raise


def resolve_devices(module, ctx, *, changes: bool, key: str = "devices", ids_key: str | None = "device_ids",
                    selected: list | None = None) -> list:
    """The addresses the task's device parameters mean on its host (gpuvfio.ops.selection, as
    the command); what a slot or an id filter expanded to is added to ``selected``."""
    told = selected if selected is not None else []
    return selection.resolve(ctx, _texts(module, key), _texts(module, ids_key), changes=changes,
                             yes=bool(module.params.get("all_matched")), yes_hint="all_matched: true",
                             tell=told.append)


_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?")


def _texts(module, key: str | None) -> list:
    values = module.params.get(key) if key else None
    return [str(v) for v in values or []]


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
    spelled = getattr(exc, "spelled", None)  # gpuvfio.options.OptionError: options by their names here
    module.fail_json(msg=spelled(str) if spelled is not None else str(exc), **result)


def driver_lines(drivers: dict) -> str:
    return "".join(f"{address}: {driver or '(no driver)'}\n" for address, driver in sorted(drivers.items()))


def driver_diff(before: dict, after: dict, header: str) -> dict:
    return {"before_header": f"{header} (drivers now)", "after_header": f"{header} (drivers after)",
            "before": driver_lines(before), "after": driver_lines(after)}
