"""The architecture, checked on the source: one direction of imports between the layers, no
cycles, no private names across modules, the package's own modules imported at the top of a
module (not in functions), interfaces that only reach gpuvfio through its services."""

from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "gpuvfio")
FOUNDATION = {"gpuvfio", "gpuvfio.address", "gpuvfio.errors", "gpuvfio.sizes", "gpuvfio.files", "gpuvfio.strictjson",
              "gpuvfio.selector", "gpuvfio.numbers", "gpuvfio.text"}
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
    packages = {m for m, p in MODULES.items() if p.endswith("__init__.py")} | {"gpuvfio.domain.templates"}
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


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_modules_and_no_local_imports_of_our_own(module):
    tree = ast.parse(open(MODULES[module], encoding="utf-8").read())
    aliases = set()
    for imported, names, local in _imports(MODULES[module]):
        assert not local, f"{module} imports {imported} inside a function (import it at the top)"
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
    for directory in ("library", "module_utils"):
        base = os.path.join(REPO, "playbooks", directory)
        for name in sorted(os.listdir(base)):
            if name.endswith(".py"):
                for imported, _names, _local in _imports(os.path.join(base, name)):
                    assert imported in allowed, f"playbooks/{directory}/{name} imports {imported}"


def test_no_process_exit_that_skips_teardown():
    """Only a forked sysfs writer leaves with os._exit (it must not run the parent's cleanup)."""
    users = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Attribute) and node.attr == "_exit":
                users.append(module)
    assert users == ["gpuvfio.bind.sysfs_write"]
