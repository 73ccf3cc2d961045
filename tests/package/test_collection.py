"""The Ansible collection gpuvfio.gpuvfio (playbooks/collections/ansible_collections/gpuvfio/gpuvfio)
as a user gets it: ``ansible-galaxy collection build`` into a temp dir, ``ansible-galaxy
collection install`` of that tarball into a temp collections path, ``ansible-doc`` of every
module by its FQCN from there, and ``ansible-test sanity`` on the collection with the tests that
need no container.

ansible-test runs each sanity test in a virtual environment of its own with the requirement
versions it pins (ansible_test/_data/requirements/sanity.<test>.txt), which it installs with pip
after bootstrapping pip through a get-pip script it downloads. Both are fetched here first, with
this environment's pip and its configuration (an ordinary ``pip download``): the wheels into a
wheelhouse, and, for the bootstrap, a stand-in get-pip that installs pip from the interpreter's
own ensurepip and then what ansible-test asks for. ansible-test then runs against a temp HOME
whose pip configuration reads the wheelhouse only, so the run needs no network and touches
nothing of the user's ~/.ansible.

Fail closed: a sanity test ansible-test skips (a requirement it could not install, a Python it
could not find) fails here. The modules are Apache-2.0, like gpuvfio, not GPLv3:
tests/sanity/ignore-<version>.txt waives validate-modules' GPLv3 header check and nothing else.

Needs ansible-core (ansible-galaxy, ansible-doc, ansible-test) in the venv. Without it the tests
skip, except under ``make test`` (GPUVFIO_REQUIRE_LANES=1), where a missing tool fails them.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from tests.conftest import ANSIBLE_COLLECTIONS, need_tool, venv_which  # noqa: E402

COLLECTION = os.path.join(ANSIBLE_COLLECTIONS, "ansible_collections", "gpuvfio", "gpuvfio")
FQCN = "gpuvfio.gpuvfio"
MODULES = ("facts", "device", "domain", "verify", "host_info")
VENV_BIN = os.path.dirname(sys.executable)
# The sanity tests that run without a container, each required to pass. Not run: pylint (its own
# style rules, beyond what the project's lint holds the modules to), changelog (no changelogs/
# fragments: CHANGELOG.md instead), shellcheck and pslint (no shell or PowerShell files).
SANITY_TESTS = ("action-plugin-docs", "ansible-doc", "compile", "empty-init", "ignores", "import", "line-endings",
                "no-assert", "no-get-exception", "no-illegal-filenames", "no-smart-quotes", "pep8", "replace-urlopen",
                "runtime-metadata", "shebang", "symlinks", "use-argspec-type-path", "use-compat-six",
                "validate-modules", "yamllint")
# The pinned requirements of the tests above that install any (sanity.<name>.txt).
SANITY_REQUIREMENTS = ("ansible-doc", "import", "import.plugin", "pep8", "runtime-metadata", "validate-modules",
                       "yamllint")

# Stand-in for pypa's get-pip.py, which ansible-test runs (as a module, with the packages to
# install as arguments) inside a new virtual environment that has no pip.
GET_PIP = '''
"""get-pip stand-in: pip from this interpreter's ensurepip, then the packages asked for."""
import ensurepip
import os
import runpy
import sys

ensurepip.bootstrap()
os.environ.pop("PIP_CONFIG_FILE", None)  # ensurepip turns pip's configuration off for its own run
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
sys.argv = ["pip", "install", "--quiet", *args]
runpy.run_module("pip", run_name="__main__", alter_sys=True)
'''


def _tool(name: str) -> str:
    path = venv_which(name)
    need_tool(importlib.util.find_spec("ansible") is not None and path is not None, "ansible-core")
    return path


def _env(home) -> dict:
    """Ansible's environment with no configuration of the user's or the checkout's."""
    (home / "ansible.cfg").write_text("[defaults]\n")
    return {**os.environ, "PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", ""), "ANSIBLE_HOME": str(home),
            "ANSIBLE_CONFIG": str(home / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0",
            "ANSIBLE_LOCAL_TEMP": str(home / "tmp")}


def _version() -> str:
    with open(os.path.join(COLLECTION, "galaxy.yml"), encoding="utf-8") as handle:
        return re.search(r"^version: ([0-9.]+)", handle.read(), re.M).group(1)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The collection built from the checkout and installed: (collections path, env, tarball)."""
    galaxy = _tool("ansible-galaxy")
    home = tmp_path_factory.mktemp("ansible-home")
    env = _env(home)
    dist = tmp_path_factory.mktemp("collection-dist")
    proc = subprocess.run([galaxy, "collection", "build", COLLECTION, "--output-path", str(dist)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tarball = dist / f"gpuvfio-gpuvfio-{_version()}.tar.gz"
    assert tarball.is_file(), os.listdir(dist)
    path = tmp_path_factory.mktemp("collections")
    proc = subprocess.run([galaxy, "collection", "install", str(tarball), "-p", str(path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(path), {**env, "ANSIBLE_COLLECTIONS_PATH": str(path)}, str(tarball)


def test_the_built_collection_carries_modules_role_and_playbooks(installed):
    path, env, _tarball = installed
    root = os.path.join(path, "ansible_collections", "gpuvfio", "gpuvfio")
    for module in MODULES:
        assert os.path.isfile(os.path.join(root, "plugins", "modules", f"{module}.py")), module
    for name in ("common.py", "options.py"):
        assert os.path.isfile(os.path.join(root, "plugins", "module_utils", name))
    for playbook in ("host_prep", "inventory", "attach", "verify", "testbed"):
        assert os.path.isfile(os.path.join(root, "playbooks", f"{playbook}.yml")), playbook
    assert os.path.isfile(os.path.join(root, "roles", "gpuvfio", "tasks", "host_prep.yml"))
    assert os.path.isfile(os.path.join(root, "MANIFEST.json"))
    assert not glob.glob(os.path.join(root, "**", "__pycache__"), recursive=True)
    proc = subprocess.run([_tool("ansible-galaxy"), "collection", "list", FQCN, "-p", path], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0 and re.search(rf"^{re.escape(FQCN)}\s+{re.escape(_version())}\s*$", proc.stdout,
                                              re.M), proc.stdout + proc.stderr


@pytest.mark.parametrize("module", MODULES)
def test_ansible_doc_shows_each_module_by_its_fqcn(installed, module):
    _path, env, _tarball = installed
    proc = subprocess.run([_tool("ansible-doc"), "--json", f"{FQCN}.{module}"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=str(installed[0]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)[f"{FQCN}.{module}"]["doc"]
    assert doc["module"] == module and doc["collection"] == FQCN
    assert "root" in doc["options"]
    assert {"check_mode", "diff_mode", "platform"} <= set(doc["attributes"]), doc["attributes"]
    text = subprocess.run([_tool("ansible-doc"), f"{FQCN}.{module}"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=str(installed[0]))
    assert text.returncode == 0 and "OPTIONS" in text.stdout and "root" in text.stdout, text.stderr


def test_ansible_doc_lists_the_collections_modules_and_role(installed):
    _path, env, _tarball = installed
    proc = subprocess.run([_tool("ansible-doc"), "-l", FQCN], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(re.findall(rf"^{re.escape(FQCN)}\.(\w+)", proc.stdout, re.M)) == sorted(MODULES)
    roles = subprocess.run([_tool("ansible-doc"), "-t", "role", "-l", FQCN], capture_output=True, text=True,
                           env=env, timeout=120)
    assert roles.returncode == 0 and f"{FQCN}.gpuvfio" in roles.stdout, roles.stdout + roles.stderr


def _wheelhouse(path) -> str:
    """ansible-test's pinned sanity requirements and its pip, as wheels (this environment's pip)."""
    import ansible_test

    data = os.path.join(os.path.dirname(ansible_test.__file__), "_data", "requirements")
    from ansible_test._internal.python_requirements import get_venv_packages

    class Python:  # what get_venv_packages reads of ansible-test's PythonConfig
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"

    pins = [f"{name}=={version}" for name, version in get_venv_packages(Python()).items()]
    args = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary", ":all:", "--dest", str(path), *pins]
    for name in SANITY_REQUIREMENTS:
        args += ["-r", os.path.join(data, f"sanity.{name}.txt")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    need_tool(proc.returncode == 0, f"ansible-test's sanity requirements from pip ({proc.stderr.strip()[-300:]})")
    return pins[0].split("==")[1]


def test_ansible_test_sanity_passes(tmp_path):
    ansible_test = _tool("ansible-test")
    wheels = tmp_path / "wheels"
    pip_version = _wheelhouse(wheels)
    home = tmp_path / "home"
    (home / ".config" / "pip").mkdir(parents=True)  # pip reads ~/.config/pip/pip.conf
    (home / ".config" / "pip" / "pip.conf").write_text(f"[global]\nno-index = true\nfind-links = {wheels}\n")
    cache = home / ".ansible" / "test" / "cache"
    cache.mkdir(parents=True)
    (cache / f"get_pip_{pip_version.replace('.', '_')}.py").write_text(GET_PIP)
    # ansible-test writes tests/output into the collection it tests: a copy of it, so the checkout
    # is left as it is (ansible-test takes the collection at ansible_collections/NS/NAME only).
    copy = tmp_path / "ansible_collections" / "gpuvfio" / "gpuvfio"
    shutil.copytree(COLLECTION, copy, ignore=shutil.ignore_patterns("__pycache__", "output"))
    version = ".".join(map(str, sys.version_info[:2]))
    tests = [arg for name in SANITY_TESTS for arg in ("--test", name)]
    proc = subprocess.run([ansible_test, "sanity", "--python", version, "--color", "no", *tests], cwd=str(copy),
                          capture_output=True, text=True, timeout=1800,
                          env={**_env(home), "HOME": str(home)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for name in SANITY_TESTS:
        assert f'Running sanity test "{name}"' in out, f"{name} did not run:\n{out[-3000:]}"
    assert "Skipping" not in out, out[-3000:]
    assert "ERROR" not in out, out[-3000:]
