"""Turn a GPU-lane run's raw outputs (tests/lanes/gpu_lane.sh) into testbed results.

The device machine is a VM with an H200 passed through, so its numbers are one
"passthrough" variant measured inside its guest. The records have the shape
``gpuvfio testbed run`` writes (same parser, same evaluation, same writer), so
``gpuvfio testbed report`` reads them like any run:

    .venv/bin/python -m tests.lanes.gpu_record FETCHED_DIR tests/data/gpu-lane-h200
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

from gpuvfio.files import atomic_write
from gpuvfio.testbed.run import write_rep
from gpuvfio.testbed.spec import Variant
from gpuvfio.guest.verify import evaluate, parse_probe, parse_verifier

VARIANT = Variant(name="h200-vm-passthrough", kind="passthrough", hugepages="unknown", numa="unknown")
_SMI = {"Product Name": "model", "Driver Version": "driver", "CUDA Version": "cuda",
        "Virtualization Mode": "virtualization_mode"}


def smi_facts(text: str) -> dict:
    facts = {}
    for line in text.splitlines():
        match = re.match(r"\s*([A-Za-z ]+?)\s+:\s+(.+)$", line)
        if match and match.group(1) in _SMI and _SMI[match.group(1)] not in facts:
            facts[_SMI[match.group(1)]] = match.group(2).strip()
    return facts


def convert(raw: str, out: str) -> list[str]:
    reps = sorted(glob.glob(os.path.join(raw, "verifier-*.txt")),
                  key=lambda p: int(re.search(r"(\d+)\.txt$", p).group(1)))
    if not reps:
        raise SystemExit(f"no verifier-N.txt under {raw}: run tests/lanes/gpu_lane.sh there first")
    smi = {}
    if os.path.exists(os.path.join(raw, "nvidia-smi-q.txt")):
        smi = smi_facts(open(os.path.join(raw, "nvidia-smi-q.txt"), encoding="utf-8").read())
    os.makedirs(out, exist_ok=True)
    identity = {"host": "device tool machine: a VM with the GPU passed through (guest view)",
                "accelerators": [{"model": smi.get("model")}], "accelerator_count": 1,
                "host_nvidia_driver": smi.get("driver"), "cuda_version": smi.get("cuda"),
                "virtualization_mode": smi.get("virtualization_mode")}
    atomic_write(os.path.join(out, "identity.json"), json.dumps(identity, indent=2))
    written = []
    for path in reps:
        rep = int(re.search(r"(\d+)\.txt$", path).group(1))
        probe_path = os.path.join(raw, f"probe-{rep}.txt")
        probe = parse_probe(open(probe_path, encoding="utf-8").read()) if os.path.exists(probe_path) else {}
        report = evaluate(probe, parse_verifier(open(path, encoding="utf-8").read()), [])
        write_rep(out, VARIANT, rep, report, {"source": "GPU lane (tests/lanes/gpu_lane.sh)"})
        written.append(os.path.join(out, "results", VARIANT.name, f"rep-{rep}.json"))
    return written


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m tests.lanes.gpu_record FETCHED_DIR OUT_DIR")
    for name in convert(sys.argv[1], sys.argv[2]):
        print(name)
