"""The GPU lane (issue 13, item 7; docs/gpu-lane.md), tested without a GPU.

These tests run what the lane runs on a GPU machine -- tests/lanes/gpu_lane.sh and
tests/lanes/gpu_record.py -- against the stand-in CUDA library (tests/fakecuda) and a
stand-in nvidia-smi, compile tests/lanes/gpu_bench.cu with nvcc so a typo cannot wait for
the GPU, check the comparison arithmetic on hand-made outputs, and report from every
recording committed as tests/data/gpu-lane-<gpu> (none is committed yet).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from glob import glob

import pytest

from gpuvfio.testbed.report import write_report
from tests.conftest import REPO
from tests.lanes.gpu_record import (compare, convert, diff_pct, host_words, marked_json, sections, smi_facts, table,
                                    variant_for)
from tests.lanes.gpu_torch import build_chain

RECORDED = sorted(glob(os.path.join(REPO, "tests", "data", "gpu-lane-*")))
LANE = os.path.join(REPO, "tests", "lanes", "gpu_lane.sh")
BENCH = os.path.join(REPO, "tests", "lanes", "gpu_bench.cu")
TORCH = os.path.join(REPO, "tests", "lanes", "gpu_torch.py")
LANE_FILES = ["gpu-bench.txt", "gpu-torch.txt", "lane.log", "nvidia-smi-q.txt", "probe.txt", "verifier.txt"]
SMI = """
==============NVSMI LOG==============
Driver Version                            : 570.86.15
CUDA Version                              : 12.8
Attached GPUs                             : 1
GPU 00000000:00:05.0
    Product Name                          : NVIDIA H200
    Virtualization Mode                   : Pass-Through
"""
# What gpu_bench / gpu_torch print, cut to the keys the comparison reads.
BENCH_LINE = ('GPU-BENCH {"version": 1, "tool": "gpu_bench", "device": {"bus_id": "0000:00:05.0"}, '
              '"h2d_gbps": 50.0, "d2h_gbps": 52.0, "bidir_h2d_gbps": 45.0, "bidir_d2h_gbps": 47.0, '
              '"bidir_total_gbps": 92.0, "d2d_gbps": 2000.0, "latency_us": 1.0, "error": null}')
TORCH_LINE = ('GPU-TORCH {"version": 1, "tool": "gpu_torch", "device": {"bus_id": "0000:00:05.0"}, '
              '"h2d_gbps": 49.0, "d2h_gbps": 55.0, "bidir_h2d_gbps": 46.0, "bidir_d2h_gbps": 46.5, '
              '"d2d_gbps": 2010.0, "latency_us": null, "errors": {"cupy": "ModuleNotFoundError: cupy"}}')


def test_smi_facts():
    assert smi_facts(SMI) == {"driver": "570.86.15", "cuda": "12.8", "model": "NVIDIA H200",
                              "virtualization_mode": "Pass-Through"}


def test_variant_and_host_come_from_what_nvidia_smi_said():
    passthrough = smi_facts(SMI)
    assert variant_for(passthrough).name == "h200-vm-passthrough" and variant_for(passthrough).kind == "passthrough"
    assert "passed through" in host_words(passthrough)
    bare = {"model": "NVIDIA A100-SXM4-80GB", "virtualization_mode": "None"}
    assert (variant_for(bare).name, variant_for(bare).kind) == ("a100-sxm4-80gb-baremetal", "baremetal")
    vgpu = {"model": "NVIDIA L40S-24Q", "virtualization_mode": "VGPU"}
    assert (variant_for(vgpu).name, variant_for(vgpu).kind) == ("l40s-24q-vm-vgpu", "vgpu")
    unknown = variant_for({})
    assert (unknown.name, unknown.kind) == ("gpu-unknown-mode", "unknown")
    assert "not reported" in host_words({}) and "'Host VGPU'" in host_words({"virtualization_mode": "Host VGPU"})


def _verifier(h2d, d2h, total, d2d, latency, bus="00000000:00:05.0"):
    return {"version": 2, "bandwidth": {bus: {"h2d": {"median": h2d}, "d2h": {"median": d2h},
                                              "bidir_total": {"median": total}, "d2d": {"median": d2d}}},
            "latency": {bus: {"hops": 100000, "median_us": latency}}}


def test_comparison_math_on_hand_made_outputs():
    bench, why = marked_json("noise\n" + BENCH_LINE + "\n", "GPU-BENCH")
    assert why is None
    torch, why = marked_json(TORCH_LINE, "GPU-TORCH")
    assert why is None
    # Three repetitions: the verifier's figure is the median of the per-rep medians.
    reps = [_verifier(49.0, 51.0, 91.0, 1990.0, 1.02), _verifier(51.0, 51.5, 93.0, 2005.0, 1.01),
            _verifier(50.5, 60.0, 90.0, 1995.0, 0.99)]
    result = compare(reps, bench, torch)
    m = result["metrics"]
    assert m["h2d"]["verifier"] == 50.5 and m["h2d"]["verifier_per_rep"] == [49.0, 51.0, 50.5]
    assert m["h2d"]["diff_pct"] == {"gpu_bench": 1.0, "torch": round(100 * 1.5 / 49, 2)}  # 1.0 %, 3.06 %
    assert m["h2d"]["verdict"] == "outside"  # 3.06 % from torch: over the 3 % goal
    assert m["d2h"]["verifier"] == 51.5 and m["d2h"]["diff_pct"]["gpu_bench"] == -0.96
    assert m["d2h"]["diff_pct"]["torch"] == round(100 * (51.5 - 55) / 55, 2) and m["d2h"]["verdict"] == "outside"
    # bidir: gpu_bench gives the total, torch only the two directions (summed: 92.5)
    assert m["bidir"]["verifier"] == 91.0 and m["bidir"]["torch"] == 92.5
    assert m["bidir"]["diff_pct"] == {"gpu_bench": round(-100 / 92, 2), "torch": round(-150 / 92.5, 2)}
    assert m["bidir"]["verdict"] == "within"
    assert m["d2d"]["verifier"] == 1995.0 and m["d2d"]["verdict"] == "within"
    assert m["d2d"]["independent_spread_pct"] == round(100 * (2000 - 2010) / 2010, 2)
    # latency: no torch figure (no CuPy); gpu_bench alone decides
    assert m["latency"]["verifier"] == 1.01 and m["latency"]["torch"] is None
    assert m["latency"]["diff_pct"] == {"gpu_bench": 1.0, "torch": None} and m["latency"]["verdict"] == "within"
    assert result["verdict"] == "outside" and result["bus_id"] == "0000:00:05.0"
    assert "outside" in table(result) and "h2d" in table(result)
    # Nothing independent: incomplete, never a pass.
    alone = compare(reps, None, None)
    assert alone["verdict"] == "incomplete"
    assert {v["verdict"] for v in alone["metrics"].values()} == {"no independent figure"}
    assert compare([], None, None)["metrics"]["h2d"]["verdict"] == "no figure"
    assert diff_pct(1.0, 0.0) is None and diff_pct(None, 1.0) is None
    # A verifier that measured two GPUs: the one the independent tools measured counts.
    two = _verifier(10.0, 10.0, 20.0, 100.0, 5.0, bus="00000000:00:04.0")
    two["bandwidth"].update(_verifier(50.0, 52.0, 92.0, 2000.0, 1.0)["bandwidth"])
    two["latency"].update(_verifier(50.0, 52.0, 92.0, 2000.0, 1.0)["latency"])
    picked = compare([two], bench, None)["metrics"]
    assert picked["h2d"]["verifier"] == 50.0 and picked["latency"]["verifier"] == 1.0


def test_marked_json_and_sections_say_what_is_missing():
    assert marked_json("", "GPU-BENCH") == (None, "no GPU-BENCH line (not run, or it crashed; see lane.log)")
    assert marked_json("GPU-BENCH {oops", "GPU-BENCH")[1] == "the GPU-BENCH line is not valid JSON"
    folded = ("GPU-LANE-BEGIN verifier rep=0\nA\nGPU-LANE-END verifier rep=0 rc=0 seconds=1.50\n"
              "GPU-LANE-BEGIN build rep=0\nnoise\nGPU-LANE-END build rep=0 rc=0 seconds=2\n"
              "GPU-LANE-BEGIN verifier rep=1\nB\nC\n")  # rep 1 cut off by the lane's limit
    assert sections(folded, "verifier") == {0: {"text": "A\n", "rc": 0, "seconds": 1.5},
                                            1: {"text": "B\nC\n", "rc": None, "seconds": None}}


def test_convert_keeps_the_raw_files_and_says_what_went_wrong(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    with pytest.raises(SystemExit, match="no verifier run"):
        convert(str(raw), str(tmp_path / "none"))
    (raw / "verifier.txt").write_text("GPU-LANE-BEGIN verifier rep=0\nTraceback (most recent call last):\n"
                                      "GPU-LANE-END verifier rep=0 rc=1 seconds=0.30\n")
    (raw / "gpu-bench.txt").write_text("GPU-LANE-BEGIN gpu_bench rep=0\n" + BENCH_LINE + "\n")
    (raw / "gpu-torch.txt").write_text(TORCH_LINE + "\n")
    (raw / "nvidia-smi-q.txt").write_text(SMI)
    (raw / "lane.log").write_text("GPU-LANE 1 started 2026-12-01T10:00:00Z\nGPU-LANE-UNAME Linux 6.1.0 x86_64\n"
                                  "GPU-LANE-STEP verifier rep=0 rc=1 seconds=0.30\n")
    out = tmp_path / "recorded"
    result = convert(str(raw), str(out))
    assert result["reps"] == []
    assert result["problems"][0] == "verifier rep 0: exit 1"
    assert any(p.startswith("verifier rep 0: ") and "no result" in p for p in result["problems"])
    assert any(p.startswith("gpu_torch: ") and "cupy" in p for p in result["problems"])
    assert sorted(os.listdir(out / "raw")) == ["gpu-bench.txt", "gpu-torch.txt", "lane.log", "nvidia-smi-q.txt",
                                               "verifier.txt"]
    identity = json.loads((out / "identity.json").read_text())
    assert identity["accelerators"] == [{"model": "NVIDIA H200"}] and identity["guest_kernel"] == "6.1.0"
    assert identity["host"] == host_words(smi_facts(SMI))
    assert "2026-12-01T10:00:00Z" in identity["recorded"] and "synthetic" not in json.dumps(identity).lower()
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["verdict"] == "incomplete" and comparison["metrics"]["h2d"]["gpu_bench"] == 50.0
    assert comparison["lane"]["steps"] == [{"step": "verifier", "rep": 0, "rc": 1, "seconds": 0.3}]


@pytest.fixture(scope="module")
def nvcc():
    path = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    if path is None:
        pytest.skip("nvcc not installed")
    return path


@pytest.mark.parametrize("arch", ["90", "75"])
def test_gpu_bench_compiles(tmp_path, nvcc, arch):
    """sm_90 + compute_90 PTX is what the lane builds for a Hopper GPU (H100, H200);
    compute_75/sm_75 (nvcc 13's oldest target: its ptxas refuses sm_60) shows the program
    uses nothing Hopper-only."""
    binary = tmp_path / "gpu_bench"
    proc = subprocess.run([nvcc, "-O2", "-Xcompiler", "-Wall,-Wextra,-Werror", "-Werror", "all-warnings",
                           "-gencode", f"arch=compute_{arch},code=[sm_{arch},compute_{arch}]", "-o", str(binary),
                           BENCH], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # Without a GPU it still answers in its format: bad options become a GPU-BENCH error line.
    proc = subprocess.run([str(binary), "--copies", "0"], capture_output=True, text=True, timeout=60)
    data, why = marked_json(proc.stdout, "GPU-BENCH")
    assert proc.returncode == 1 and why is None
    assert data["error"].startswith("--copies:") and data["h2d_gbps"] is None and data["verified"] is None
    assert data["method"]["size_bytes"] == 512 << 20 and data["method"]["copies"] == 16
    assert data["method"]["samples"] == 3 and data["method"]["warmups"] == 4


def test_gpu_torch_reports_instead_of_crashing(tmp_path):
    """Here there is neither torch nor CuPy (or no GPU): the reasons, in the JSON, exit 0."""
    proc = subprocess.run([sys.executable, TORCH, "--size-mib", "4", "--copies", "2"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    data, why = marked_json(proc.stdout, "GPU-TORCH")
    assert why is None and data["method"]["size_bytes"] == 4 << 20 and data["method"]["copies"] == 2
    if data["h2d_gbps"] is None:
        assert "torch" in data["errors"]
    proc = subprocess.run([sys.executable, TORCH, "--bogus"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and marked_json(proc.stdout, "GPU-TORCH")[0]["errors"]["arguments"]


@pytest.mark.parametrize("nodes, stride, shuffled", [(2048, 4096, True), ((2 << 20) // 128, 128, False)])
def test_gpu_torch_pointer_chain_is_one_cycle(nodes, stride, shuffled):
    """The latency chain gpu_torch writes into pinned memory, walked here as the GPU thread
    would: one cycle through every node, each hop to a node ``stride`` bytes apart."""
    numpy = pytest.importorskip("numpy")
    dev = 0x7F0000000000
    words = numpy.zeros(nodes * stride // 8, dtype=numpy.uint64)
    order = build_chain(words, dev, nodes, stride, shuffled)
    assert sorted(order) == list(range(nodes)) and (order != sorted(order)) == shuffled
    pointer, seen = dev + order[0] * stride, set()
    for hop in range(1, nodes + 1):
        offset = pointer - dev
        assert offset % stride == 0 and offset // stride not in seen
        seen.add(offset // stride)
        pointer = int(words[offset // 8])
        assert pointer == dev + order[hop % nodes] * stride
    assert len(seen) == nodes and pointer == dev + order[0] * stride


def _fake_bench(tmp_path):
    """A stand-in for the compiled gpu_bench (no GPU here): prints a GPU-BENCH line."""
    path = tmp_path / "fake_gpu_bench"
    path.write_text("#!/bin/sh\necho 'GPU-BENCH {\"version\": 1, \"tool\": \"gpu_bench\", \"device\": "
                    "{\"bus_id\": \"0000:01:00.0\"}, \"args\": \"'\"$*\"'\", \"h2d_gbps\": 1.0, \"d2h_gbps\": 1.0, "
                    "\"bidir_total_gbps\": 2.0, \"d2d_gbps\": 1.0, \"latency_us\": 1.0, \"error\": null}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _fake_smi(tmp_path):
    """A stand-in nvidia-smi on PATH: -q prints SMI, the compute_cap query "8.0", anything else nothing."""
    folder = tmp_path / "smi-bin"
    folder.mkdir()
    (folder / "smi-q.txt").write_text(SMI)
    path = folder / "nvidia-smi"
    path.write_text('#!/bin/sh\ncase "$*" in\n  -q) cat "$(dirname "$0")/smi-q.txt" ;;\n'
                    '  *compute_cap*) echo 8.0 ;;\nesac\nexit 0\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(folder)


def test_gpu_lane_script_to_report_on_the_stand_in_library(tmp_path, fakecuda_libdir):
    raw = tmp_path / "raw" / "made-by-the-lane"  # OUT need not exist
    env = {**os.environ, "OUT": str(raw), "PATH": _fake_smi(tmp_path) + os.pathsep + os.environ.get("PATH", ""),
           "GPU_LANE_REPS": "2", "GPU_LANE_SIZE_MIB": "4", "GPU_LANE_COPIES": "2",
           "GPU_LANE_SAMPLES": "3", "GPU_LANE_HOPS": "1000", "GPU_LANE_PYTHON": sys.executable,
           "GPU_BENCH_BIN": _fake_bench(tmp_path), "LD_LIBRARY_PATH": fakecuda_libdir}
    proc = subprocess.run(["sh", LANE], cwd=str(tmp_path), capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(raw)) == LANE_FILES  # 6 files whatever the repetitions
    log = (raw / "lane.log").read_text()
    # arch: the stand-in nvidia-smi's compute capability 8.0
    assert "GPU-LANE-PARAMS reps=2 size_mib=4 copies=2 samples=3 warmups=4 hops=1000 arch=sm_80 " in log
    assert "Virtualization Mode" in (raw / "nvidia-smi-q.txt").read_text()
    runs = sections((raw / "verifier.txt").read_text(), "verifier")
    assert sorted(runs) == [0, 1] and all(r["rc"] == 0 for r in runs.values())
    assert "--size-mib 4 --copies 2 --samples 3 --warmups 4 --hops 1000" in (raw / "gpu-bench.txt").read_text()
    assert marked_json((raw / "gpu-torch.txt").read_text(), "GPU-TORCH")[0]["method"]["size_bytes"] == 4 << 20

    data, _ = marked_json(runs[0]["text"], "GPUVFIO-VERIFIER")
    assert data["version"] == 2 and data["errors"] == {}, data and data["errors"]
    out = tmp_path / "recorded"
    result = convert(str(raw), str(out))
    assert [os.path.basename(p) for p in result["reps"]] == ["rep-0.json", "rep-1.json"], result["problems"]
    assert sorted(os.listdir(out / "raw")) == LANE_FILES
    record = json.load(open(result["reps"][0]))
    assert record["kind"] == "passthrough" and record["metrics"]["h2d_gbps"] > 0
    assert record["metrics"]["saxpy_ms"] is not None
    identity = json.loads((out / "identity.json").read_text())
    assert "synthetic" not in json.dumps(identity).lower() and identity["host"] == host_words(smi_facts(SMI))
    comparison = json.load(open(out / "comparison.json"))
    assert set(comparison["metrics"]) == {"h2d", "d2h", "bidir", "d2d", "latency"}
    for metric in ("h2d", "d2h", "bidir", "d2d", "latency"):
        assert comparison["metrics"][metric]["verifier"] > 0 and comparison["metrics"][metric]["gpu_bench"] == (
            2.0 if metric == "bidir" else 1.0)
    assert comparison["verifier_method"]["size_bytes"] == 4 << 20
    summary = write_report(str(out))
    assert summary["baseline"] is None and "h200-vm-passthrough" in summary["variants"]
    assert "| h200-vm-passthrough |" in (out / "report.md").read_text()


@pytest.mark.skipif(not RECORDED, reason="no GPU-lane recording committed yet (tests/data/gpu-lane-<gpu>)")
@pytest.mark.parametrize("recorded", RECORDED or [None])
def test_report_from_the_recorded_gpu_lane_result(tmp_path, recorded):
    out = tmp_path / "recorded"
    shutil.copytree(recorded, out)
    summary = write_report(str(out))
    smi = smi_facts((out / "raw" / "nvidia-smi-q.txt").read_text())
    assert list(summary["variants"]) == [variant_for(smi).name]  # filed by what the lane's nvidia-smi said
    assert "synthetic" not in (out / "identity.json").read_text().lower()
    metrics = json.load(open(out / "results.json"))["tables"]
    h2d = next(t for t in metrics if t["metric"] == "h2d_gbps")["rows"][0]
    assert 0.5 < h2d["mean"] < 1000  # GB/s: a units check (PCIe Gen3 x16 ~12, Gen5 x16 ~55, NVLink-C2C more)
    comparison = json.load(open(out / "comparison.json"))
    assert set(comparison["metrics"]) == {"h2d", "d2h", "bidir", "d2d", "latency"}
    assert comparison["verdict"] in ("within", "outside", "incomplete")
    print(table(comparison))  # pytest -s shows how far the verifier is from the independent figures
