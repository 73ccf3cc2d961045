"""The product as users get it: a wheel built from the checkout, installed into a fresh virtual
environment with neither the source tree nor the editable install on its path, then run from
a directory outside the checkout. (On main the wheel had no gpuvfio/testbed, no verifier and
no domain template: xml, verify, attach and testbed failed from a normal install.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = os.path.join(REPO, "gpuvfio", "samples")
SPEC = """
[guest]
kernel = "/var/lib/gpuvfio/vmlinux"
vcpus = 4
memory = "8G"
[guest.ssh]
port = 2222
[run]
repetitions = 1
gpus = ["0000:81:00.0"]
[[variant]]
name = "pt"
kind = "passthrough"
hugepages = "2M"
[[variant]]
name = "bare"
kind = "baremetal"
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, gpuvfio console script, clean environment, a directory outside the checkout)."""
    base = tmp_path_factory.mktemp("package")
    wheels = base / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), REPO],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = wheels.glob("gpuvfio-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin"
    proc = subprocess.run([python, "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True,
                          env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    return python, str(venv / "bin" / "gpuvfio"), env, str(elsewhere), str(wheel)


def run(installed, *args, code=0):
    _python, gpuvfio, env, cwd, _wheel = installed
    proc = subprocess.run([gpuvfio, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    assert proc.returncode == code, (args, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    return proc


def test_the_wheel_holds_every_package_and_file(installed):
    names = set(zipfile.ZipFile(installed[4]).namelist())
    for path in ("gpuvfio/testbed/run.py", "gpuvfio/guest/payload/verifier.py", "gpuvfio/guest/payload/probe.sh",
                 "gpuvfio/testbed/templates/report.md.j2", "gpuvfio/testbed/templates/report.html.j2", "gpuvfio/samples/dgx-h100.host", "gpuvfio/ops/guests.py",
                 "gpuvfio/cli/app.py", "gpuvfio/guest/payload/gpuvfio_nvapi.py", "gpuvfio/guest/payload/gpuvfio_ncclxml.py",
                 "gpuvfio/guest/payload/gpuvfio_ncclpaths.py", "gpuvfio/guest/payload/gpuvfio_ncclconf.py",
                 "gpuvfio/guest/payload/kernels.ptx",
                 "gpuvfio/guest/payload/kernels.cu", "gpuvfio/host/nvidia_ids.txt"):
        assert path in names, path
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert any(n.endswith(".data/data/share/man/man1/gpuvfio.1") for n in names)  # the man page


def test_the_man_page_is_installed(installed):
    python, _gpuvfio, env, cwd, _wheel = installed
    page = os.path.join(os.path.dirname(os.path.dirname(python)), "share", "man", "man1", "gpuvfio.1")
    with open(page, encoding="utf-8") as handle:
        text = handle.read()
    assert text.startswith(".TH GPUVFIO 1") and "gpuvfio export kubevirt" in text


def test_the_installed_export_names_as_nvidias_plugin_registers(installed):
    """The table of the plugin's names travels in the wheel: the installed export reads it, and a
    host with nothing on vfio-pci is refused rather than given an empty list."""
    python, _gpuvfio, env, cwd, _wheel = installed
    names = subprocess.run([python, "-c", "from gpuvfio.ops.kubevirt_names import bundled; b = bundled(); "
                            "print(b.version, b.resource('2330'), b.resource('22a3'))"],
                           capture_output=True, text=True, env=env, cwd=cwd, timeout=120)
    assert names.returncode == 0, names.stderr[-2000:]
    assert names.stdout.split() == ["2025.07.11", "nvidia.com/GH100_H100_SXM5_80GB", "nvidia.com/GH100_H100_NVSWITCH"]
    host = subprocess.run([python, "-c", "import gpuvfio, os; print(os.path.join(os.path.dirname(gpuvfio.__file__), "
                           "'samples', 'dgx-h100.host'))"], capture_output=True, text=True, env=env, cwd=cwd,
                          check=True).stdout.strip()
    refused = run(installed, "--root", host, "export", "kubevirt", code=1)
    assert refused.stderr.count("\n") == 1 and "nothing to export" in refused.stderr


def test_installed_not_the_checkout(installed):
    python, _gpuvfio, env, cwd, _wheel = installed
    where = subprocess.run([python, "-c", "import gpuvfio, sys; print(gpuvfio.__file__); print(sys.path)"],
                           capture_output=True, text=True, env=env, cwd=cwd, check=True).stdout
    location = where.splitlines()[0]
    assert "site-packages" in location and not location.startswith(REPO), where
    assert REPO not in where.splitlines()[1]


def test_version_list_doctor(installed):
    assert run(installed, "--version").stdout.startswith("gpuvfio 0.1.0")
    listing = json.loads(run(installed, "--root", os.path.join(SAMPLES, "dgx-h100.host"), "list", "--json").stdout)
    assert len([d for d in listing["devices"] if d["class_id"].startswith("03")]) == 8
    doctor = run(installed, "--root", os.path.join(SAMPLES, "iommu-off.host"), "doctor", "--json", code=1)
    assert {c["id"]: c["status"] for c in json.loads(doctor.stdout)["checks"]}["iommu"] == "fail"


def test_xml_from_the_installed_template(installed):
    result = run(installed, "--root", os.path.join(SAMPLES, "epyc-mixed.host"), "xml", "0000:81:00.0", "--name",
                 "a100", "--vcpus", "8", "--memory", "16G", "--json")
    xml = json.loads(result.stdout)["xml"]
    assert "<name>a100</name>" in xml and "<hostdev mode='subsystem' type='pci'" in xml


def test_attach_plans_from_the_installed_wheel(installed):
    plan = json.loads(run(installed, "--root", os.path.join(SAMPLES, "epyc-mixed.host"), "attach", "0000:81:00.0",
                          "--name", "t", "--ssh-host", "192.0.2.7", "--kernel", "/boot/vmlinuz", "--dry-run",
                          "--json").stdout)
    assert [s["kind"] for s in plan["steps"]][:3] == ["bind", "define", "start"]


def test_a_hypervisor_install_has_no_plotting_and_the_report_names_its_extra(installed, tmp_path):
    """gpuvfio without extras (what a hypervisor installs) pulls no matplotlib or numpy; the report,
    the one command that plots, says which extra to install and writes nothing."""
    from tests.testbed_data import write_synthetic

    python, _gpuvfio, env, cwd, _wheel = installed
    for library in ("matplotlib", "numpy"):
        probe = subprocess.run([python, "-c", f"import {library}"], capture_output=True, text=True, env=env, cwd=cwd)
        assert probe.returncode == 1 and "ModuleNotFoundError" in probe.stderr, library
    out = tmp_path / "run"
    write_synthetic(str(out), reps=2)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    report = run(installed, "testbed", "report", str(out), code=1)
    assert "pip install 'gpuvfio[report]'" in report.stderr and report.stderr.count("\n") == 1
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_testbed_plan(installed, tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    plan = json.loads(run(installed, "--root", os.path.join(SAMPLES, "epyc-mixed.host"), "testbed", "plan",
                          str(spec), "--json").stdout)
    assert [v["name"] for v in plan["variants"]] == ["pt", "bare"] and plan["refused"] == []
    assert plan["variants"][0]["bind"]["devices"] == ["0000:81:00.0"]


def test_verifier_and_probe_are_found_and_run(installed):
    python, _gpuvfio, env, cwd, _wheel = installed
    code = ("import os; from gpuvfio.guest.payload import PROBE, VERIFIER; "
            "assert os.path.isfile(PROBE) and os.path.isfile(VERIFIER); print(VERIFIER)")
    verifier = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd=cwd,
                              check=True).stdout.strip()
    out = subprocess.run([python, verifier, "--no-bandwidth"], capture_output=True, text=True, env=env, cwd=cwd,
                         timeout=120).stdout
    assert out.startswith("GPUVFIO-VERIFIER ") and json.loads(out.split(" ", 1)[1])["version"] == 2
    # As verify sends it to a guest: the program and its kernels on python3's stdin.
    code = "import sys; from gpuvfio.guest.payload import verifier_program; sys.stdout.buffer.write(verifier_program())"
    program = subprocess.run([python, "-c", code], capture_output=True, env=env, cwd=cwd, check=True).stdout
    out = subprocess.run([python, "-", "--no-bandwidth"], input=program, capture_output=True, env=env, cwd="/",
                         timeout=120).stdout.decode()
    assert out.startswith("GPUVFIO-VERIFIER ") and "Traceback" not in out
