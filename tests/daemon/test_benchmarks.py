"""The daemon lane's benchmarks as make bench runs them, once each, in the shared ratio table
(benchmarks/ratios.py) with issue 39's goals:

* bench_domain_xml: gpuvfio xml for the 8-GPU HGX sample beside virt-install --print-xml of the
  same domain against a private libvirtd, and beside the typer floor (goal 0.5x);
* bench_attach: gpuvfio attach to a verified tiny guest beside virsh create and an OpenSSH loop on
  the same private libvirtd, with attach's own steps beside it (goal 1.05x).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.lanes import daemon as dl

if dl.skip_reason():
    pytest.skip(dl.skip_reason(), allow_module_level=True)


def _report(script: str, tool: str, package: str) -> dict:
    """One run of benchmarks/SCRIPT with --json; its report. Fails closed where TOOL is missing."""
    assert shutil.which(tool), f"{script} needs {tool} (apt-get install {package})"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", script), "--runs", "1", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_the_domain_benchmark_gives_its_ratio_goal_and_floor():
    report = _report("bench_domain_xml.py", "virt-install", "virtinst")
    (goal,) = report["goals"]
    assert goal["goal"] == 0.5 and goal["anchor"][0] == "virt-install" and "--print-xml" in goal["anchor"]
    assert goal["anchor"].count("--host-device") == 8 and goal["ours"].count("xml") == 1
    assert goal["ours_ms"] > 0 and goal["anchor_ms"] > 0 and goal["floor_ms"] > 0
    assert goal["floor"][1].endswith("typer_floor.py") and goal["floor"][-1] == "list"
    assert goal["own_ms"] == round(goal["ours_ms"] - goal["floor_ms"], 2)
    assert 0 < report["in_process_ms"] < goal["ours_ms"]


def test_the_attach_benchmark_gives_its_ratio_goal_and_steps():
    report = _report("bench_attach.py", "ssh", "openssh-client")
    (goal,) = report["goals"]
    assert goal["goal"] == 1.05 and goal["anchor"][:2] == ["sh", "-c"] and "virsh" in goal["anchor"][2]
    assert goal["ours"][1] == "attach" and "--json" in goal["ours"]
    assert goal["ours_ms"] > 0 and goal["anchor_ms"] > 0 and "floor_ms" not in goal
    steps = report["attach_step_ms"]
    assert {"define", "start", "outside steps"} <= set(steps), steps
    assert sum(steps.values()) == pytest.approx(goal["ours_ms"], abs=1.0)
