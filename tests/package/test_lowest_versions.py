"""The lowest versions gpuvfio declares, installed and tested (issue 24 item 4).

A virtual environment from the distribution's own Python (Debian 12's /usr/bin/python3, with its
site packages: its python3-libvirt is the binding a hypervisor has, no compiler needed) gets the
wheel with every dependency pinned to the floor pyproject.toml declares (``>=X`` installed as
``==X``), the report extra too. The unit tests that exercise each dependency then run on it:
typer (the command line), lxml (RelaxNG), jinja2 (the report), libvirt (test:///), paramiko
and cryptography (SSH targets, the cloud-init seed), rich (output), nvidia-ml-py (the vGPU
scheduler), matplotlib (the report)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DISTRIBUTION_PYTHON = "/usr/bin/python3"
# The unit tests run on the lowest versions: one or more per dependency (see the docstring).
UNIT_TESTS = ["tests/unit/test_cli.py", "tests/unit/test_lazy_commands.py", "tests/unit/test_domain.py",
              "tests/unit/test_domain_model.py",
              "tests/unit/test_libvirt_domains.py", "tests/unit/test_verify.py", "tests/unit/test_output.py",
              "tests/unit/test_vgpu_scheduler.py", "tests/unit/test_cloud_init.py", "tests/unit/test_inventory.py",
              "tests/unit/test_testbed.py"]
FLOOR = re.compile(r"^([A-Za-z0-9_.-]+)>=([0-9][0-9A-Za-z.]*)(?:\s*;\s*(.+))?$")


def declared() -> dict[str, tuple[str, str | None]]:
    """name -> (floor, environment marker) of every runtime dependency and the report extra."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        project = tomllib.load(handle)["project"]
    floors = {}
    for requirement in project["dependencies"] + project["optional-dependencies"]["report"]:
        match = FLOOR.match(requirement.replace(" ", "") if ";" not in requirement else requirement)
        assert match, f"{requirement!r}: every dependency declares its floor as >=X (and nothing else)"
        floors[match.group(1).lower()] = (match.group(2), match.group(3))
    return floors


def test_every_dependency_declares_a_floor_and_no_ceiling():
    floors = declared()
    assert {"libvirt-python", "lxml", "paramiko", "cryptography", "typer", "rich", "nvidia-ml-py", "jinja2",
            "matplotlib"} <= set(floors)
    assert "matplotlib" not in " ".join(tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))
                                        ["project"]["dependencies"])  # plotting is the report extra only


@pytest.fixture(scope="module")
def lowest(tmp_path_factory):
    assert os.access(DISTRIBUTION_PYTHON, os.X_OK), "the distribution's python3 is missing (make deps installs it)"
    base = tmp_path_factory.mktemp("lowest")
    wheels = base / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), REPO],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = wheels.glob("gpuvfio-*.whl")
    constraints = base / "lowest.txt"
    constraints.write_text("".join(f"{name}=={floor}\n" for name, (floor, marker) in declared().items()
                                   if marker is None))
    venv = base / "venv"
    subprocess.run([DISTRIBUTION_PYTHON, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    proc = subprocess.run([python, "-m", "pip", "install", "--constraint", str(constraints), f"{wheel}[report]",
                           "pytest", "hypothesis", "jsonschema"], capture_output=True, text=True, env=env,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return python, env, proc.stdout


def test_the_floors_are_what_got_installed(lowest):
    python, env, _log = lowest
    listed = subprocess.run([python, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                            env=env, check=True).stdout
    import json

    versions = {p["name"].lower(): p["version"] for p in json.loads(listed)}
    for name, (floor, marker) in declared().items():
        if marker is None:
            assert versions.get(name, "").split("+")[0] in (floor, floor + ".0"), (name, versions.get(name), floor)


def test_the_distributions_libvirt_bindings_are_used_not_compiled(lowest):
    python, env, log = lowest
    where = subprocess.run([python, "-c", "import libvirt; print(libvirt.__file__)"], capture_output=True,
                           text=True, env=env, check=True).stdout.strip()
    assert where.startswith("/usr/lib/python3/dist-packages/"), where  # Debian's python3-libvirt
    assert "Building wheel" not in log and "libvirt" not in " ".join(
        line for line in log.splitlines() if line.startswith("Collecting"))


def test_the_unit_tests_of_each_dependency_pass_on_the_lowest_versions(lowest):
    python, env, _log = lowest
    proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", *UNIT_TESTS],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1] and "skipped" not in proc.stdout.splitlines()[-1]
