"""The architecture, checked on the source: one direction of imports between the layers, no
cycles, no private names across modules, the package's own modules imported at the top of a
module (not in functions), interfaces that only reach gpuvfio through its services."""

from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "gpuvfio")
FOUNDATION = {"gpuvfio", "gpuvfio.address", "gpuvfio.errors", "gpuvfio.sizes", "gpuvfio.files", "gpuvfio.tree_filler",
              "gpuvfio.kmsg", "gpuvfio.read_only_tree",
              "gpuvfio.strictjson",
              "gpuvfio.selector", "gpuvfio.numbers", "gpuvfio.text", "gpuvfio.names", "gpuvfio.user_files", "gpuvfio.options", "gpuvfio.settings",
              "gpuvfio.commands", "gpuvfio.planning", "gpuvfio.clock"}
# What each layer may import besides itself and the foundation (README "Layout").
ALLOWED = {
    "host": set(),
    "bind": {"host"},
    "vgpu": {"host", "bind"},
    "domain": {"host", "vgpu"},
    "virt": {"domain"},
    "guest": {"host"},
    "ops": {"host", "bind", "vgpu", "domain", "virt", "guest"},
    "testbed": {"ops", "guest"},  # guest: the SSH transport to a remote hypervisor
    "cli": {"ops", "testbed"},
}


def _modules() -> dict[str, str]:
    found = {}
    for directory, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or module in (f"gpuvfio.{k}" for k in ALLOWED) else None


def _imports(path: str) -> list[tuple[str, list[str], bool]]:
    """(module imported, names taken from it, inside a function) for every gpuvfio import."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, [], in_function) for a in child.names if a.name.split(".")[0] == "gpuvfio")
            elif isinstance(child, ast.ImportFrom) and child.module and child.module.split(".")[0] == "gpuvfio":
                names = [a.name for a in child.names]
                submodules = [f"{child.module}.{n}" for n in names if f"{child.module}.{n}" in MODULES]
                found.append((child.module, [n for n in names if f"{child.module}.{n}" not in MODULES], in_function))
                found.extend((m, [], in_function) for m in submodules)
            visit(child, nested)

    visit(tree, False)
    return found


def test_every_package_is_in_pyproject():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        listed = set(tomllib.load(handle)["tool"]["setuptools"]["packages"])
    packages = {m for m, p in MODULES.items() if p.endswith("__init__.py")} | {"gpuvfio.testbed.templates"}
    assert listed == packages


@pytest.mark.parametrize("module", sorted(MODULES))
def test_layers_import_one_way(module):
    layer = _layer(module)
    if layer is None:
        return
    for imported, _names, _local in _imports(MODULES[module]):
        if imported in FOUNDATION:
            continue
        other = _layer(imported)
        assert other == layer or other in ALLOWED[layer], f"{module} (layer {layer}) imports {imported}"


# The one place a module of ours is imported where it is first used: the Context's boundaries
# with the world beyond the host's files (a sysfs write, an SSH session, NVML, the Fabric
# Manager, the journal and its lock, libvirt). A listing or a plan meets none of them, and loading them
# at the top cost ``gpuvfio list`` about 26 ms (medians of 31 runs: 106 ms without, 134 ms with).
LAZY_BOUNDARIES = {"gpuvfio.ops.context": {"gpuvfio.bind.sysfs_write", "gpuvfio.guest.ssh", "gpuvfio.bind.journal",
                                           "gpuvfio.bind.fabric_manager", "gpuvfio.vgpu.scheduler",
                                           "gpuvfio.virt.connection"}}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_modules_and_no_local_imports_of_our_own(module):
    tree = ast.parse(open(MODULES[module], encoding="utf-8").read())
    aliases = set()
    for imported, names, local in _imports(MODULES[module]):
        assert not local or imported in LAZY_BOUNDARIES.get(module, ()), \
            f"{module} imports {imported} inside a function (import it at the top)"
        private = [n for n in names if n.startswith("_") and n != "__version__"]
        assert not private, f"{module} takes private name(s) {private} from {imported}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name.startswith("gpuvfio")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpuvfio"):
            aliases |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            assert False, f"{module} uses {node.value.id}.{node.attr}, another module's private name"


def test_no_import_cycles():
    graph = {m: {i for i, _n, _l in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}
    # A module imports its package's __init__ implicitly: that edge is the language's, not a cycle.
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_modules_stay_small():
    sizes = {m: sum(1 for _ in open(p, encoding="utf-8")) for m, p in MODULES.items()}
    assert {m: n for m, n in sizes.items() if n > 600} == {}


def test_interfaces_reach_gpuvfio_only_through_its_services():
    """The Ansible modules (and their module_utils) parse, call gpuvfio.ops and map results."""
    allowed = FOUNDATION | {m for m in MODULES if m.startswith("gpuvfio.ops")}
    collection = os.path.join("playbooks", "collections", "ansible_collections", "gpuvfio", "gpuvfio")
    seen = []
    for directory in ("modules", "module_utils"):
        base = os.path.join(collection, "plugins", directory)
        for name in sorted(os.listdir(os.path.join(REPO, base))):
            if name.endswith(".py"):
                seen.append(name)
                for imported, _names, _local in _imports(os.path.join(REPO, base, name)):
                    assert imported in allowed, f"{base}/{name} imports {imported}"
    assert "device.py" in seen and "common.py" in seen, seen


def test_no_process_exit_that_skips_teardown():
    """Only a forked sysfs writer leaves with os._exit (it must not run the parent's cleanup)."""
    users = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Attribute) and node.attr == "_exit":
                users.append(module)
    assert users == ["gpuvfio.bind.sysfs_write"]


# Every read and write of a file goes through gpuvfio.files (issue 22): a new raw open elsewhere
# would step around its rules (no link followed beneath a root, regular files only, bounded reads,
# atomic writes). The in-guest payload runs in the guest, stdlib only, and is not held to it.
FILE_CALLS = {"open", "io.open", "os.open", "os.fdopen", "os.listdir", "os.scandir", "os.walk", "os.makedirs",
              "os.mkdir", "os.unlink", "os.remove", "os.rmdir", "os.replace", "os.rename", "os.symlink", "os.link",
              "os.readlink", "os.truncate", "os.mkfifo", "os.mknod", "tempfile.*", "shutil.*", "glob.*",
              "tarfile.open", "*.read_text", "*.write_text", "*.read_bytes", "*.write_bytes", "*.load_host_keys"}
FILE_CALL_ALLOWED = {
    "gpuvfio.files": {"*"},
    "gpuvfio.tree_filler": {"*"},  # the file layer's bulk writer, under its rules (a recording loaded)
    # sysfs's own links, resolved inside <root>/sys (and a host's /etc links inside the root):
    # read by the one walk (readlinkat on its held directory fd), and named where never followed.
    "gpuvfio.host.walk": {"os.readlink"},
    "gpuvfio.host.root": {"os.readlink"},
    # SSH: which ssh binary runs (a lookup on PATH, no file read); tarfile and the TOML/JSON
    # readers work on bytes already read through the layer.
    "gpuvfio.guest.ssh_config": {"shutil.*"},
    "gpuvfio.testbed.remote": {"tarfile.open"},  # tarfile.open(fileobj=...) over bytes in memory
}


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        base = func.value
        if isinstance(base, ast.Name):
            return f"{base.id}.{func.attr}"
        return f"*.{func.attr}"
    return None


def _forbidden(name: str) -> bool:
    module = name.split(".")[0]
    return name in FILE_CALLS or f"{module}.*" in FILE_CALLS or f"*.{name.rsplit('.', 1)[-1]}" in FILE_CALLS \
        and "." in name


@pytest.mark.parametrize("module", sorted(m for m in MODULES if ".payload" not in m))
def test_files_are_reached_only_through_the_file_layer(module):
    allowed = FILE_CALL_ALLOWED.get(module, set())
    if "*" in allowed:
        return
    tree = ast.parse(open(MODULES[module], encoding="utf-8").read())
    raw = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _call_name(node)
            if name is None or not _forbidden(name):
                continue
            general = f"{name.split('.')[0]}.*" if not name.startswith("*.") else name
            wildcard = f"*.{name.rsplit('.', 1)[-1]}"
            if name in allowed or general in allowed or wildcard in allowed:
                continue
            raw.append(f"line {node.lineno}: {name}(...)")
    assert not raw, f"{module} opens files itself; use gpuvfio.files: {raw}"


def test_the_file_layer_check_sees_raw_opens(tmp_path):
    """The check above is not vacuous: each form it forbids is found in a sample."""
    sample = ("import os, shutil, tempfile\nopen('x')\nos.open('x', 0)\nos.listdir('.')\n"
              "shutil.copy('a', 'b')\ntempfile.mkdtemp()\npath.read_text()\n")
    found = [(_call_name(n), _forbidden(_call_name(n))) for n in ast.walk(ast.parse(sample))
             if isinstance(n, ast.Call)]
    assert [name for name, bad in found if bad] == ["open", "os.open", "os.listdir", "shutil.copy", "tempfile.mkdtemp",
                                                    "path.read_text"]


# Every local process starts in gpuvfio.commands (issue 23 item 6): a Context holds its Runner
# and hands it to what runs a command (ssh -G, fmpm, modprobe/systemctl, the probe), so a test's
# recording runner sees every command. The in-guest payload runs inside guests, stdlib only.
PROCESS_STARTERS = {"subprocess", "pty", "multiprocessing", "concurrent.futures.process"}
PROCESS_CALLS = {"os.system", "os.popen", "os.posix_spawn", "os.posix_spawnp", "asyncio.create_subprocess_exec",
                 "asyncio.create_subprocess_shell"}
PROCESS_CALL_PREFIXES = ("os.exec", "os.spawn")


def _starts_processes(path: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name in PROCESS_STARTERS or a.name.split(".")[0] in PROCESS_STARTERS]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level \
                and (node.module in PROCESS_STARTERS or node.module.split(".")[0] in PROCESS_STARTERS
                     or (node.module in ("os", "asyncio")
                         and any(f"{node.module}.{a.name}" in PROCESS_CALLS
                                 or f"{node.module}.{a.name}".startswith(PROCESS_CALL_PREFIXES) for a in node.names))):
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call) and (name := _call_name(node)) is not None \
                and (name in PROCESS_CALLS or name.startswith(PROCESS_CALL_PREFIXES)):
            found.append(f"line {node.lineno}: {name}(...)")
    return found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if ".payload" not in m))
def test_processes_start_in_gpuvfio_commands_only(module):
    if module == "gpuvfio.commands":
        assert _starts_processes(MODULES[module]), "gpuvfio.commands no longer starts processes: move the rule"
        return
    found = _starts_processes(MODULES[module])
    assert not found, f"{module} starts processes itself; take the Context's runner (gpuvfio.commands): {found}"


def test_the_process_check_sees_each_way_to_start_one(tmp_path):
    """The check above is not vacuous: each form it forbids is found in a sample."""
    sample = tmp_path / "sample.py"
    sample.write_text("import subprocess\nfrom subprocess import run\nimport multiprocessing.pool\n"
                      "from os import execvp\nos.system('x')\nos.spawnlp(0, 'x')\nos.popen('x')\n"
                      "import os\nos.fork()\nos.getpid()\n")
    assert [line.split(":")[0] for line in _starts_processes(str(sample))] == [
        f"line {n}" for n in (1, 2, 3, 4, 5, 6, 7)]


# gpuvfio.settings reads the environment, every variable gpuvfio follows (its own and other
# programs' conventions), once where a run starts (issue 36 item 1); nothing else reads it.
def test_the_environment_is_read_in_gpuvfio_settings_only():
    import re

    found = set()
    for module, path in MODULES.items():
        if ".payload" in module:  # the in-guest programs run inside the guest, with its environment
            continue
        if re.search(r"os\.environ|os\.getenv|environ\.get|os\.environb|os\.putenv|os\.unsetenv",
                     open(path, encoding="utf-8").read()):
            found.add(module)
    assert found == {"gpuvfio.settings"}, sorted(found)


# Issue 25: the boundaries where gpuvfio loads lazily. The root command (gpuvfio.cli.app and its
# index, gpuvfio.cli.lazy) imports no command module and no service: a command's module loads
# when it runs. The heavy libraries are imported inside the functions that use them.
ROOT_COMMAND = {"gpuvfio.cli", "gpuvfio.cli.app", "gpuvfio.cli.lazy", "gpuvfio.cli.output"}
HEAVY_LIBRARIES = {"jinja2", "lxml", "libvirt", "paramiko", "matplotlib", "numpy", "pynvml", "yaml"}


def test_the_root_command_imports_no_command_module_and_no_service():
    for module in sorted(ROOT_COMMAND):
        imported = {i for i, _n, _l in _imports(MODULES[module])}
        assert imported <= FOUNDATION | ROOT_COMMAND, (module, sorted(imported - FOUNDATION - ROOT_COMMAND))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_heavy_libraries_are_imported_where_they_are_used(module):
    tree = ast.parse(open(MODULES[module], encoding="utf-8").read())
    top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert not names & HEAVY_LIBRARIES, f"{module} imports {sorted(names & HEAVY_LIBRARIES)} at the top"


def test_services_return_typed_results_not_plain_dicts():
    """Issue 23 item 5: gpuvfio.ops returns dataclasses (statuses as enums), turned into JSON at
    the edges. A module-level service annotated to return a bare dict (or a list of them) is
    refused; a mapping of typed values (``dict[str, HeldDevice]``) and a ``*_json`` serialiser
    are what the edges use."""
    bare = {"dict", "dict | None", "list[dict]", "Optional[dict]"}
    found = []
    for module, path in MODULES.items():
        if not module.startswith("gpuvfio.ops"):
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.returns is not None and not node.name.startswith("_") \
                    and not node.name.endswith("_json") and ast.unparse(node.returns).strip("'\"") in bare:
                found.append(f"{module}.{node.name} -> {ast.unparse(node.returns)}")
    assert found == []


# Issue 36 item 1: the Context owns the run lock (its timeout, its progress, refused on a
# read-only Context); a RunLock built anywhere else would step around all three.
def _constructs(path: str, name: str) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(open(path, encoding="utf-8").read()))
            if isinstance(node, ast.Call) and _call_name(node) in (name, f"*.{name}")]


def test_the_run_lock_is_taken_through_the_context_only():
    found = {module: lines for module, path in MODULES.items() if (lines := _constructs(path, "RunLock"))}
    assert found == {"gpuvfio.ops.context": found.get("gpuvfio.ops.context")} and found["gpuvfio.ops.context"], found


# Issue 36 item 1: a service takes the Context, which owns the host (and its settings, state
# dir, clock and the rest): none takes a bare HostRoot beside it.
def _takes_host_root(function: ast.FunctionDef) -> bool:
    arguments = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
    return any(a.annotation is not None and "HostRoot" in ast.unparse(a.annotation) for a in arguments)


def test_services_take_a_context_not_a_host_root():
    found = []
    for module, path in MODULES.items():
        if not module.startswith("gpuvfio.ops.") or module == "gpuvfio.ops.context":
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        found += [f"{module}.{node.name}" for node in ast.walk(tree)
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _takes_host_root(node)]
    assert found == [], found


# Issue 36 item 1: a Context only reads unless a command that changes the host asks for a
# writable one. Each place that asks is listed (module, function); nothing else may.
CONTEXT_MAKERS = {"Context", "host_context", "live_context", "open_context", "task_context"}  # the last: Ansible's
WRITABLE_CONTEXTS = {
    ("gpuvfio.cli.binding", "unbind_cmd"), ("gpuvfio.cli.binding", "restore_cmd"),
    ("gpuvfio.cli.binding", "reset_cmd"), ("gpuvfio.cli.health", "qualify_cmd"),
    ("gpuvfio.cli.health", "health_cmd"), ("gpuvfio.cli.plans", "command_context"),
    ("gpuvfio.cli.guest", "verify_cmd"), ("gpuvfio.cli.guest", "attach_cmd"), ("gpuvfio.cli.guest", "detach_cmd"),
    ("gpuvfio.cli.testbed", "run_cmd"), ("gpuvfio.cli.testbed", "_this_machine"), ("gpuvfio.cli.domain", "xml_cmd"),
    ("gpuvfio.cli.vgpu", "create_cmd"), ("gpuvfio.cli.vgpu", "remove_cmd"),
    ("gpuvfio.cli.vgpu", "scheduler_cmd"), ("gpuvfio.ops.context", "host_context"),
    ("module_utils.common", "task_context"), ("modules.device", "main"), ("modules.domain", "main"),
    ("modules.verify", "main"),  # as verify_cmd: the guest agent (libvirt read-write), a TOFU host key
}


def _writable_contexts(path: str, module: str) -> set[tuple[str, str]]:
    found = set()
    tree = ast.parse(open(path, encoding="utf-8").read())
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and (_call_name(node) or "").split(".")[-1] in CONTEXT_MAKERS \
                    and any(k.arg == "writable" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                            for k in node.keywords):
                found.add((module, function.name))
    return found


def test_a_writable_context_is_asked_for_only_where_a_command_changes_the_host():
    utils = os.path.join(REPO, "playbooks", "collections", "ansible_collections", "gpuvfio", "gpuvfio", "plugins")
    found = set()
    for module, path in MODULES.items():
        found |= _writable_contexts(path, module)
    for directory in ("modules", "module_utils"):
        for name in sorted(os.listdir(os.path.join(utils, directory))):
            if name.endswith(".py"):
                found |= _writable_contexts(os.path.join(utils, directory, name), f"{directory}.{name[:-3]}")
    assert found == WRITABLE_CONTEXTS, (sorted(found - WRITABLE_CONTEXTS), sorted(WRITABLE_CONTEXTS - found))
    from gpuvfio.ops.context import Context

    assert Context.__dataclass_fields__["writable"].default is False


# Issue 36 item 1: the time is read, and waited on, in gpuvfio.clock only; the Context owns one
# Clock and hands it to each part that measures, waits or stamps, which the services build with it.
CLOCK_TAKERS = {"RunLock", "SysfsWriter", "Session", "Journal.load", "verify_guest", "run_probe", "lifecycle.stop"}


def _uses_time(path: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import) and any(a.name in ("time", "datetime") for a in node.names):
            found.append(f"line {node.lineno}: import")
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "datetime"):
            found.append(f"line {node.lineno}: from {node.module} import")
    return found


def test_the_time_is_read_in_gpuvfio_clock_only():
    found = {module: lines for module, path in MODULES.items() if ".payload" not in module
             and (lines := _uses_time(path))}
    assert set(found) == {"gpuvfio.clock"}, found


def test_the_services_hand_their_contexts_clock_on():
    missing = []
    for module, path in MODULES.items():
        if not module.startswith(("gpuvfio.ops", "gpuvfio.testbed")):
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            name = _call_name(node) if isinstance(node, ast.Call) else None
            if name in CLOCK_TAKERS and not any(k.arg == "clock" for k in node.keywords):
                missing.append(f"{module} line {node.lineno}: {name}(...)")
    assert not missing, missing


def test_ssh_sessions_are_made_by_the_context_only():
    """Context.ssh makes every session (its known_hosts, its clock); a session's own jump host is
    the one other place a session is made."""
    found = {module: lines for module, path in MODULES.items() if (lines := _constructs(path, "Session"))}
    assert set(found) == {"gpuvfio.ops.context", "gpuvfio.guest.ssh"}, found


def test_the_missing_function_refusal_is_written_once():
    """Issue 36 item 6: host.inventory.require_present (behind Inventory.require) is the one
    "no such PCI function" refusal; a copy elsewhere would drift from it."""
    import re

    found = {module: len(re.findall(r"no such PCI function on this host", open(path, encoding="utf-8").read()))
             for module, path in MODULES.items()}
    assert {module: n for module, n in found.items() if n} == {"gpuvfio.host.inventory": 1}


def test_inventory_require_names_every_missing_function_in_order():
    from gpuvfio.address import PciAddress
    from gpuvfio.errors import InputError
    from gpuvfio.host.inventory import Inventory
    from gpuvfio.host.model import PciFunction

    a, b, c = (PciAddress.parse(t) for t in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"))
    here = PciFunction.__new__(PciFunction)
    inventory = Inventory({b: here}, None)
    assert inventory.require(b) == [here] and inventory.require() == []
    with pytest.raises(InputError) as info:
        inventory.require(c, b, a)
    assert str(info.value) == "no such PCI function on this host: 0000:03:00.0, 0000:01:00.0"


# Issue 36 item 5: a stat-like check follows links the file layer refuses. Host paths go
# through HostRoot (exists, is_dir, is_file, is_link), paths a user names for another program
# through user_files.for_another_program; the root itself is told apart (a directory or a
# recording) by its owners.
STAT_CHECKS = {"os.path.exists", "os.path.lexists", "os.path.isfile", "os.path.isdir", "os.path.islink"}
STAT_CHECK_OWNERS = {"gpuvfio.files", "gpuvfio.user_files", "gpuvfio.host.root", "gpuvfio.host.fixture"}


def _stat_checks(path: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and isinstance(node.value.value, ast.Name) \
                and f"{node.value.value.id}.{node.value.attr}.{node.attr}" in STAT_CHECKS:
            found.append(f"line {node.lineno}: {node.value.value.id}.{node.value.attr}.{node.attr}")
    return found


def test_stat_like_checks_go_through_the_file_layer():
    found = {module: lines for module, path in MODULES.items()
             if ".payload" not in module and module not in STAT_CHECK_OWNERS and (lines := _stat_checks(path))}
    assert not found, found
    assert _stat_checks(MODULES["gpuvfio.user_files"])  # the check sees them where they are allowed


def test_the_file_layers_open_flags_are_declared_once():
    """Issue 36 item 5: gpuvfio.files declares the layer's open flags; tree_filler (its bulk
    writer) uses them rather than a copy that could lose O_NOFOLLOW."""
    from gpuvfio import files

    tree = ast.parse(open(MODULES["gpuvfio.tree_filler"], encoding="utf-8").read())
    flags = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute)
             and isinstance(node.value, ast.Name) and node.value.id == "os" and node.attr.startswith("O_")]
    assert flags == [], f"gpuvfio.tree_filler spells open flags itself (lines {flags}): use gpuvfio.files'"
    assert files.NEW_FILE_FLAGS & os.O_EXCL and files.NEW_FILE_FLAGS & os.O_NOFOLLOW
    assert files.DIR_FLAGS & os.O_NOFOLLOW and files.READ_FLAGS & os.O_NONBLOCK


def test_functions_stay_short():
    """Issue 36 item 6: functions within about 60 lines (62 at most, docstring included)."""
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 62:
                long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


# Issue 36 item 2: one model of a domain's definition. gpuvfio.domain.elements parses every
# domain document (libvirt's and gpuvfio's own) into gpuvfio.domain.model; the other parsers
# read what is not a domain: the renderer's own output for libvirt's RelaxNG schema, and a
# libvirt network's XML (ops.reach).
XML_PARSERS = {"gpuvfio.domain.elements": "the domain model", "gpuvfio.domain.render": "RelaxNG validation",
               "gpuvfio.ops.reach": "a libvirt network's XML"}
XML_PARSE_CALLS = {"fromstring", "XML", "parse", "iterparse", "XMLParser", "XMLPullParser", "fromstringlist",
                   "parseString"}


def _parses_xml(path: str) -> list[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    xml_names = {(a.asname or a.name) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                 for a in node.names
                 if "xml" in (getattr(node, "module", None) or a.name) or a.name in ("etree", "ElementTree")}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in XML_PARSE_CALLS and isinstance(node.value, ast.Name) \
                and node.value.id in xml_names:
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in XML_PARSE_CALLS and node.id in xml_names:
            found.append(f"line {node.lineno}: {node.id}")
    return found


def test_domain_xml_is_parsed_by_the_model_only(tmp_path):
    found = {module: lines for module, path in MODULES.items() if (lines := _parses_xml(path))}
    assert set(found) == set(XML_PARSERS), found
    sample = tmp_path / "sample.py"
    sample.write_text("import xml.etree.ElementTree as ET\nfrom lxml import etree\nfrom xml.dom.minidom import "
                      "parseString\nET.fromstring('x')\netree.XML('x')\nparseString('x')\nET.tostring(None)\n")
    assert _parses_xml(str(sample)) == ["line 4: ET.fromstring", "line 5: etree.XML", "line 6: parseString"]


def test_what_gpuvfio_owns_in_a_domain_is_declared_by_the_model_only():
    """No list of owned elements beside the model (the OWNED table of gpuvfio.virt.define is gone):
    a name in the package spelling an element gpuvfio owns whole would drift from the model."""
    import re

    found = {module for module, path in MODULES.items()
             if re.search(r"\bOWNED\b", open(path, encoding="utf-8").read())}
    assert found == set(), found


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try)):  # names bound under a guard at the top level
            names |= _top_level_names(ast.Module(body=[n for n in ast.walk(node) if isinstance(n, ast.stmt)
                                                       and n is not node], type_ignores=[]))
    return names


def _exported(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [e.value for e in node.value.elts]
    return []


def test_every_name_a_module_exports_exists():
    """``from M import *`` takes __all__: a name there that M lacks breaks it (gpuvfio.domain.
    elements listed a to_etree it never had, gpuvfio.ops.binding an unbind)."""
    missing = []
    for module, path in MODULES.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        missing += [f"{module}.{name}" for name in _exported(tree) if name not in _top_level_names(tree)]
    assert missing == []
