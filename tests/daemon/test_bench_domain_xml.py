"""benchmarks/bench_domain_xml.py as make bench runs it: gpuvfio xml for the 8-GPU HGX sample beside
virt-install --print-xml of the same domain against a private libvirtd, and beside the typer
floor, in the shared ratio table (benchmarks/ratios.py) with issue 39's goal of 0.5x."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.lanes import daemon as dl

_REASON = dl.skip_reason() or (None if shutil.which("virt-install") else "needs virt-install (apt-get install virtinst)")
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)


def test_the_domain_benchmark_gives_its_ratio_goal_and_floor():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_domain_xml.py"), "--runs", "1",
                           "--json"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    (goal,) = report["goals"]
    assert goal["goal"] == 0.5 and goal["anchor"][0] == "virt-install" and "--print-xml" in goal["anchor"]
    assert goal["anchor"].count("--host-device") == 8 and goal["ours"].count("xml") == 1
    assert goal["ours_ms"] > 0 and goal["anchor_ms"] > 0 and goal["floor_ms"] > 0
    assert goal["floor"][1].endswith("typer_floor.py") and goal["floor"][-1] == "list"
    assert goal["own_ms"] == round(goal["ours_ms"] - goal["floor_ms"], 2)
    assert 0 < report["in_process_ms"] < goal["ours_ms"]
