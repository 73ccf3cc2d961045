"""The GPU lane's path from raw outputs to a report, run here on the stand-in CUDA library.

No GPU machine was lent to this project so far, so tests/data holds no real GPU-lane
result yet; this test runs the very script and converter a GPU session would use
(tests/lanes/gpu_lane.sh, tests/lanes/gpu_record.py) against tests/fakecuda, so the
first real recording only has to be fetched, converted and committed. Once
tests/data/gpu-lane-h200 exists, the second test reports from it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from gpuvfio.testbed.report import write_report
from tests.conftest import REPO
from tests.lanes.gpu_record import convert, smi_facts

RECORDED = os.path.join(REPO, "tests", "data", "gpu-lane-h200")
SMI = """
==============NVSMI LOG==============
Driver Version                            : 570.86.15
CUDA Version                              : 12.8
Attached GPUs                             : 1
GPU 00000000:00:05.0
    Product Name                          : NVIDIA H200
    Virtualization Mode                   : Pass-Through
"""


def test_smi_facts():
    assert smi_facts(SMI) == {"driver": "570.86.15", "cuda": "12.8", "model": "NVIDIA H200",
                              "virtualization_mode": "Pass-Through"}


def test_gpu_lane_script_to_report_on_the_stand_in_library(tmp_path, fakecuda_libdir):
    raw = tmp_path / "raw"
    raw.mkdir()
    proc = subprocess.run(["sh", os.path.join(REPO, "tests", "lanes", "gpu_lane.sh"), "--size-mib", "4",
                           "--copies", "2", "--samples", "3"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OUT": str(raw), "GPU_LANE_REPS": "2",
                               "LD_LIBRARY_PATH": fakecuda_libdir})
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(raw)) == ["nvidia-smi-q.txt", "probe-0.txt", "probe-1.txt", "verifier-0.txt",
                                       "verifier-1.txt"]  # 5 files: under the device tool's 8
    out = tmp_path / "recorded"
    written = convert(str(raw), str(out))
    assert [os.path.basename(p) for p in written] == ["rep-0.json", "rep-1.json"]
    record = json.load(open(written[0]))
    assert record["kind"] == "passthrough" and record["metrics"]["h2d_gbps"] > 0
    assert record["metrics"]["latency_p50_us"] is not None and record["metrics"]["saxpy_ms"] is not None
    summary = write_report(str(out))
    assert summary["baseline"] is None and "h200-vm-passthrough" in summary["variants"]
    assert "| h200-vm-passthrough |" in (out / "report.md").read_text()


@pytest.mark.skipif(not os.path.isdir(RECORDED), reason="no GPU-lane recording committed yet (no GPU lent)")
def test_report_from_the_recorded_gpu_lane_result(tmp_path):
    out = tmp_path / "recorded"
    shutil.copytree(RECORDED, out)
    summary = write_report(str(out))
    assert "h200-vm-passthrough" in summary["variants"]
    metrics = json.load(open(out / "results.json"))["tables"]
    h2d = next(t for t in metrics if t["metric"] == "h2d_gbps")["rows"][0]
    assert 5 < h2d["mean"] < 80  # GB/s over PCIe Gen5 x16, as a sanity bound
