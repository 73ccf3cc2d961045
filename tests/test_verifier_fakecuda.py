"""The in-guest verifier's CUDA/NVML code paths, run against a stand-in library (not a GPU).

There is no NVIDIA hardware on the unit lane; tests/fakecuda/fakecuda.c implements the
driver-API and NVML entry points the verifier calls with host memory and a monotonic
clock, so argument types, call order, event timing, data verification and the JSON
shape are exercised for real. Bandwidth numbers from it mean nothing.
"""

import os
import shutil
import subprocess
import sys

import pytest

from gpuvfio.guest.payload import VERIFIER
from gpuvfio.guest.verify import Expected, evaluate, parse_probe, parse_verifier

SOURCE = os.path.join(os.path.dirname(__file__), "fakecuda", "fakecuda.c")
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")


@pytest.fixture(scope="module")
def libdir(fakecuda_libdir):
    return fakecuda_libdir


def run(libdir, *extra, env=None):
    proc = subprocess.run([sys.executable, VERIFIER, "--size-mib", "8", "--copies", "2", "--samples", "3", *extra],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LD_LIBRARY_PATH": libdir, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return parse_verifier(proc.stdout)


def test_measures_verifies_and_reads_link_under_load(libdir):
    data = run(libdir)
    assert data["errors"] == {}
    assert data["nvml"]["devices"][0]["virtualization_mode"] == "Pass-Through"
    assert data["nvml"]["devices"][0]["bar1_bytes"] == 128 << 30
    bw = data["bandwidth"]["0000:01:00.0"]
    assert bw["verified"] is True and len(bw["h2d"]["samples"]) == 3
    assert all(bw[d]["median"] > 0 for d in ("h2d", "d2h", "d2d"))
    assert bw["link_under_load"] == {"current_gen": 5, "current_width": 16, "max_gen": 5, "max_width": 16}
    compute = data["compute"]["0000:01:00.0"]
    assert compute["verified"] is True and compute["elements"] == (8 << 20) // 4 and compute["gflops"] > 0
    lat = data["latency"]["0000:01:00.0"]
    assert lat["count"] == 2000 and lat["min_us"] <= lat["p50_us"] <= lat["p99_us"] <= lat["max_us"]


def test_corrupted_copy_is_caught(libdir):
    data = run(libdir, env={"FAKECUDA_CORRUPT": "1"})
    assert data["bandwidth"]["0000:01:00.0"]["verified"] is False
    probe = parse_probe("GPUVFIO-PROBE 1\nPYTHON3 /usr/bin/python3\nPCI 0000:01:00.0 0x10de 0x2330 0x030200 nvidia "
                        "- - - -\nEND\n")
    report = evaluate(probe, data, [Expected("0000:1b:00.0", "10de", "2330", True, 5, 16)])
    assert {c["id"]: c["status"] for c in report["checks"]}["data_verified"] == "fail"


def test_narrow_link_under_load_fails_the_check(libdir):
    data = run(libdir, env={"FAKECUDA_WIDTH": "8"})
    probe = parse_probe("GPUVFIO-PROBE 1\nPYTHON3 /usr/bin/python3\nPCI 0000:01:00.0 0x10de 0x2330 0x030200 nvidia "
                        "- - - -\nEND\n")
    report = evaluate(probe, data, [Expected("0000:1b:00.0", "10de", "2330", True, 5, 16)])
    link = next(c for c in report["checks"] if c["id"] == "pcie_link")
    assert link["status"] == "fail" and link["observed"] == "Gen5 x8"


def test_no_devices(libdir):
    data = run(libdir, env={"FAKECUDA_NODEV": "1"})
    assert data["cuda"]["devices"] == [] and data["bandwidth"] == {}
