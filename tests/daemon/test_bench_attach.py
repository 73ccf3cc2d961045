"""benchmarks/bench_attach.py as make bench runs it: gpuvfio attach to a verified tiny guest beside
virsh create and an OpenSSH loop on the same private libvirtd, in the shared ratio table
(benchmarks/ratios.py) with issue 39's goal of 1.05x, and attach's own steps beside it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.lanes import daemon as dl

_REASON = dl.skip_reason() or (None if shutil.which("ssh") else "needs OpenSSH's client (openssh-client)")
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)


def test_the_attach_benchmark_gives_its_ratio_goal_and_steps():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_attach.py"), "--runs", "1",
                           "--json"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    (goal,) = report["goals"]
    assert goal["goal"] == 1.05 and goal["anchor"][:2] == ["sh", "-c"] and "virsh" in goal["anchor"][2]
    assert goal["ours"][1] == "attach" and "--json" in goal["ours"]
    assert goal["ours_ms"] > 0 and goal["anchor_ms"] > 0 and "floor_ms" not in goal
    steps = report["attach_step_ms"]
    assert {"define", "start", "outside steps"} <= set(steps), steps
    assert sum(steps.values()) == pytest.approx(goal["ours_ms"], abs=1.0)
