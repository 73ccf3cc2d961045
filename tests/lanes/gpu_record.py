"""Turn a GPU-lane run's raw outputs (tests/lanes/gpu_lane.sh) into a committed recording.

What machine ran the lane is read from its own outputs: the GPU's model and nvidia-smi's
"Virtualization Mode" (Pass-Through in a guest the GPU is passed through to, VGPU in a vGPU
guest, None on bare metal) name the variant the numbers are filed under, e.g.
``h200-vm-passthrough`` for an H200 seen from inside a guest. Writes, under OUT_DIR:

* ``results/<variant>/rep-N.json`` and ``identity.json``: the shape ``gpuvfio testbed run``
  writes (same parser, same evaluation, same writer), so ``gpuvfio testbed report OUT_DIR``
  reads them like any run;
* ``raw/``: the lane's files, unchanged (nvidia-smi-q.txt, probe.txt, verifier.txt,
  gpu-bench.txt, gpu-torch.txt, lane.log);
* ``comparison.json``: for H2D, D2H, bidirectional (total), D2D and latency, the verifier's
  figure (the median over repetitions of each repetition's median) beside gpu_bench's and
  PyTorch/CuPy's, the relative difference in percent, and a verdict against issue 13's goal
  (the verifier within 3 % of the independent measurements).

    .venv/bin/python -m tests.lanes.gpu_record LANE_OUT_DIR tests/data/gpu-lane-h200
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys

from gpuvfio.files import Tree
from gpuvfio.guest.checks import judge
from gpuvfio.guest.verify import VerifyError, parse_probe, parse_verifier
from gpuvfio.testbed.run import write_rep
from gpuvfio.testbed.spec import Variant

RAW_FILES = ("nvidia-smi-q.txt", "probe.txt", "verifier.txt", "gpu-bench.txt", "gpu-torch.txt", "lane.log")
TOLERANCE_PCT = 3.0  # issue 13, item 7: the verifier within 3 % of the independent figures
_SMI = {"Product Name": "model", "Driver Version": "driver", "CUDA Version": "cuda",
        "Virtualization Mode": "virtualization_mode"}
# nvidia-smi -q's "Virtualization Mode" -> (the variant name's suffix, the testbed kind, the host as seen)
_MODES = {"pass-through": ("vm-passthrough", "passthrough", "a guest with the GPU passed through (the guest's view)"),
          "vgpu": ("vm-vgpu", "vgpu", "a guest with a vGPU (the guest's view)"),
          "none": ("baremetal", "baremetal", "the GPU's own host, no virtualization")}
# metric: (verifier's bandwidth/latency entry, the independent tools' key, unit, what it is)
METRICS = {
    "h2d": ("h2d", "h2d_gbps", "GB/s", "host to device, pinned, one stream"),
    "d2h": ("d2h", "d2h_gbps", "GB/s", "device to host, pinned, one stream"),
    "bidir": ("bidir_total", "bidir_total_gbps", "GB/s", "both directions at once, two streams, sum"),
    "d2d": ("d2d", "d2d_gbps", "GB/s", "device to device copy (bytes copied, not read + written)"),
    "latency": ("median_us", "latency_us", "us/hop", "pointer chase over pinned host memory, one GPU thread"),
}


def smi_facts(text: str) -> dict:
    facts = {}
    for line in text.splitlines():
        match = re.match(r"\s*([A-Za-z ]+?)\s+:\s+(.+)$", line)
        if match and match.group(1) in _SMI and _SMI[match.group(1)] not in facts:
            facts[_SMI[match.group(1)]] = match.group(2).strip()
    return facts


def variant_for(smi: dict) -> Variant:
    """The variant a recording is filed under, from nvidia-smi -q's facts (smi_facts): the
    model without "NVIDIA" and the virtualization mode, e.g. ``h200-vm-passthrough``; an
    unknown mode (no nvidia-smi, or a mode not above) gives ``<model>-unknown-mode``."""
    words = [w for w in re.findall(r"[a-z0-9]+", (smi.get("model") or "").lower()) if w != "nvidia"]
    model = "-".join(words)[:24].strip("-") or "gpu"
    suffix, kind, _ = _MODES.get((smi.get("virtualization_mode") or "").strip().lower(),
                                 ("unknown-mode", "unknown", None))
    return Variant(name=f"{model}-{suffix}", kind=kind, hugepages="unknown", numa="unknown")


def host_words(smi: dict) -> str:
    """identity.json's "host": what the lane's own files say about the machine."""
    mode = smi.get("virtualization_mode")
    seen = _MODES.get((mode or "").strip().lower(), (None, None, None))[2]
    if seen is None:
        seen = f"virtualization mode {mode!r} (nvidia-smi -q)" if mode else "virtualization mode not reported"
    return f"the machine tests/lanes/gpu_lane.sh ran on: {seen}; raw/lane.log and raw/nvidia-smi-q.txt say more"


_BEGIN = re.compile(r"^GPU-LANE-BEGIN (\S+) rep=(\d+)$")
_END = re.compile(r"^GPU-LANE-END (\S+) rep=(\d+) rc=(-?\d+) seconds=(\S+)$")


def sections(text: str, step: str) -> dict[int, dict]:
    """{rep: {"text", "rc", "seconds"}} of one step in a folded file (gpu_lane.sh's markers);
    a section cut off by the lane's limit has rc None."""
    out: dict[int, dict] = {}
    current = None
    for line in text.splitlines():
        begin, end = _BEGIN.match(line), _END.match(line)
        if begin:
            current = None
            if begin.group(1) == step:
                current = out[int(begin.group(2))] = {"text": "", "rc": None, "seconds": None}
        elif end:
            if current is not None and end.group(1) == step:
                current["rc"], current["seconds"] = int(end.group(3)), float(end.group(4))
            current = None
        elif current is not None:
            current["text"] += line + "\n"
    return out


def marked_json(text: str, marker: str) -> tuple[dict | None, str | None]:
    """The JSON object on the line ``MARKER <json>`` (the last one), or None and why not."""
    found = None
    for line in text.splitlines():
        if line.startswith(marker + " "):
            found = line[len(marker) + 1:]
    if found is None:
        return None, f"no {marker} line (not run, or it crashed; see lane.log)"
    try:
        data = json.loads(found)
    except ValueError:
        return None, f"the {marker} line is not valid JSON"
    if not isinstance(data, dict):
        return None, f"the {marker} line is not a JSON object"
    return data, None


def _read(raw: str, name: str) -> str:
    path = os.path.join(raw, name)
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def _pick(table: dict, bus: str | None) -> dict | None:
    """The entry of the GPU the independent tools measured (by address), else the only one."""
    if not isinstance(table, dict) or not table:
        return None
    if bus:
        for key, value in table.items():
            if key.lower()[-12:] == bus.lower()[-12:]:
                return value
    return table[sorted(table)[0]]


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value)


def verifier_figure(data: dict, metric: str, bus: str | None) -> float | None:
    key = METRICS[metric][0]
    if metric == "latency":
        return _number((_pick(data.get("latency") or {}, bus) or {}).get(key))
    entry = (_pick(data.get("bandwidth") or {}, bus) or {}).get(key)
    return _number(entry.get("median")) if isinstance(entry, dict) else None


def independent_figure(data: dict | None, metric: str) -> float | None:
    if not data:
        return None
    value = _number(data.get(METRICS[metric][1]))
    if value is None and metric == "bidir":
        parts = [_number(data.get(k)) for k in ("bidir_h2d_gbps", "bidir_d2h_gbps")]
        value = None if None in parts else sum(parts)
    return value


def diff_pct(value: float | None, reference: float | None) -> float | None:
    """How far the verifier's figure is from a reference, in percent of the reference."""
    if value is None or reference is None or reference == 0:
        return None
    return 100.0 * (value - reference) / reference


def compare(verifiers: list[dict], bench: dict | None, torch: dict | None,
            tolerance_pct: float = TOLERANCE_PCT) -> dict:
    """The verifier's figures (one dict per repetition) against gpu_bench's and gpu_torch's."""
    bus = ((bench or {}).get("device") or {}).get("bus_id") or ((torch or {}).get("device") or {}).get("bus_id")
    metrics = {}
    for metric, (_key, _ind, unit, what) in METRICS.items():
        per_rep = [verifier_figure(v, metric, bus) for v in verifiers]
        seen = [x for x in per_rep if x is not None]
        verifier = statistics.median(seen) if seen else None
        refs = {"gpu_bench": independent_figure(bench, metric), "torch": independent_figure(torch, metric)}
        diffs = {name: diff_pct(verifier, ref) for name, ref in refs.items()}
        known = [abs(d) for d in diffs.values() if d is not None]
        if not known:
            verdict = "no figure" if verifier is None else "no independent figure"
        else:
            verdict = "within" if max(known) <= tolerance_pct else "outside"
        ref_values = [r for r in refs.values() if r is not None]
        spread = (diff_pct(refs["gpu_bench"], refs["torch"]) if len(ref_values) == 2 else None)
        metrics[metric] = {"unit": unit, "what": what, "verifier": verifier, "verifier_per_rep": per_rep,
                           "gpu_bench": refs["gpu_bench"], "torch": refs["torch"],
                           "diff_pct": {k: None if d is None else round(d, 2) for k, d in diffs.items()},
                           "independent_spread_pct": None if spread is None else round(spread, 2),
                           "verdict": verdict}
    verdicts = [m["verdict"] for m in metrics.values()]
    if "outside" in verdicts:
        overall = "outside"
    elif all(v == "within" for v in verdicts):
        overall = "within"
    else:
        overall = "incomplete"
    return {"goal": f"the verifier within {tolerance_pct:g} % of each independent measurement",
            "tolerance_pct": tolerance_pct, "bus_id": bus, "verdict": overall, "metrics": metrics,
            "diff_pct_is": "100 * (verifier - independent) / independent",
            "verifier_figure_is": "median over repetitions of each repetition's median of samples"}


_EXITS = {None: "cut off (no end marker: the lane was stopped from outside?)",
          124: "timed out (the lane's per-step limit)", 125: "skipped (the lane's time budget was spent)"}


def _empty_probe() -> dict:
    return {"kernel": None, "python3": None, "pci": [], "modules": [], "nvidia_version": None, "nvidia_smi": None}


def _lane_facts(log: str) -> dict:
    facts: dict = {"steps": []}
    for line in log.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "GPU-LANE" and rest.startswith("1 started "):
            facts["started"] = rest[len("1 started "):]
        elif kind == "GPU-LANE-UNAME":
            facts["uname"] = rest
        elif kind == "GPU-LANE-PARAMS":
            facts["params"] = dict(p.split("=", 1) for p in rest.split() if "=" in p)
        elif kind == "GPU-LANE-NVCC":
            facts["nvcc"] = rest
        elif kind == "GPU-LANE-STEP":
            match = re.match(r"(\S+) rep=(\d+) rc=(-?\d+) seconds=(\S+)$", rest)
            if match:
                facts["steps"].append({"step": match.group(1), "rep": int(match.group(2)),
                                       "rc": int(match.group(3)), "seconds": float(match.group(4))})
    return facts


def convert(raw: str, out: str) -> dict:
    """Write the recording; returns {"reps": [paths], "comparison": path, "problems": [...]}."""
    verifier_text = _read(raw, "verifier.txt")
    runs = sections(verifier_text, "verifier")
    if not runs:
        raise SystemExit(f"no verifier run in {raw}/verifier.txt: run tests/lanes/gpu_lane.sh with OUT={raw} first")
    probes = sections(_read(raw, "probe.txt"), "probe")
    smi = smi_facts(_read(raw, "nvidia-smi-q.txt"))
    lane = _lane_facts(_read(raw, "lane.log"))
    os.makedirs(out, exist_ok=True)
    kernel = (lane.get("uname") or "").split(" ")[1:2]
    variant = variant_for(smi)
    identity = {"host": host_words(smi),
                "recorded": "a real GPU run of tests/lanes/gpu_lane.sh, " + (lane.get("started") or "date unknown"),
                "accelerators": [{"model": smi.get("model")}], "accelerator_count": 1,
                "host_nvidia_driver": smi.get("driver"), "cuda_version": smi.get("cuda"),
                "virtualization_mode": smi.get("virtualization_mode"),
                "guest_kernel": kernel[0] if kernel else None, "lane": lane.get("params")}
    Tree(out).write("identity.json", json.dumps(identity, indent=2))
    problems, written, verifiers = [], [], []
    for rep in sorted(runs):
        run = runs[rep]
        if run["rc"] != 0:
            problems.append(f"verifier rep {rep}: " + _EXITS.get(run["rc"], f"exit {run['rc']}"))
        try:
            verifier = parse_verifier(run["text"])
        except VerifyError as exc:
            problems.append(f"verifier rep {rep}: {exc}")
            continue
        verifiers.append(verifier)
        probe = _empty_probe()
        if rep in probes:
            try:
                probe = parse_probe(probes[rep]["text"])
            except VerifyError as exc:
                problems.append(f"probe rep {rep}: {exc}")
        else:
            problems.append(f"probe rep {rep}: not run")
        report = judge(probe, verifier, [])
        write_rep(out, variant, rep, report, {"source": "GPU lane (tests/lanes/gpu_lane.sh)",
                                              "lane": {"rc": run["rc"], "seconds": run["seconds"]}})
        written.append(os.path.join(out, "results", variant.name, f"rep-{rep}.json"))
    bench, why = marked_json(_read(raw, "gpu-bench.txt"), "GPU-BENCH")
    if why or (bench or {}).get("error"):
        problems.append("gpu_bench: " + (why or bench["error"]))
    torch, why = marked_json(_read(raw, "gpu-torch.txt"), "GPU-TORCH")
    if why or (torch or {}).get("errors"):
        problems.append("gpu_torch: " + (why or json.dumps(torch["errors"])))
    comparison = compare(verifiers, bench, torch)
    # nvbandwidth's own latency layout (a 2 MiB ring, 128-byte stride): the verifier does not
    # measure it; beside latency_us it shows whether the chain's layout matters on this machine.
    comparison["reference_only"] = {"latency_ring128_us": {
        "gpu_bench": _number((bench or {}).get("latency_ring128_us")),
        "torch": _number((torch or {}).get("latency_ring128_us"))}}
    comparison.update({"problems": problems, "lane": lane,
                       "verifier_method": (verifiers[0].get("method") if verifiers else None),
                       "gpu_bench_method": (bench or {}).get("method"), "torch_method": (torch or {}).get("method")})
    comparison_path = os.path.join(out, "comparison.json")
    Tree(out).write("comparison.json", json.dumps(comparison, indent=2))
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    for name in RAW_FILES:
        if os.path.exists(os.path.join(raw, name)):
            shutil.copyfile(os.path.join(raw, name), os.path.join(out, "raw", name))
    return {"reps": written, "comparison": comparison_path, "problems": problems}


def table(comparison: dict) -> str:
    """The comparison as a few lines of text (for the commit message that adds a recording)."""
    def fmt(value):
        return "-" if value is None else f"{value:.4g}"

    def pct(value):
        return "-" if value is None else f"{value:+.2f} %"

    lines = [f"{'metric':8} {'unit':7} {'verifier':>9} {'gpu_bench':>9} {'torch':>9} {'vs bench':>10} "
             f"{'vs torch':>10}  verdict"]
    for name, m in comparison["metrics"].items():
        d = m["diff_pct"]
        lines.append(f"{name:8} {m['unit']:7} {fmt(m['verifier']):>9} {fmt(m['gpu_bench']):>9} {fmt(m['torch']):>9} "
                     f"{pct(d['gpu_bench']):>10} {pct(d['torch']):>10}  {m['verdict']}")
    lines.append(f"overall: {comparison['verdict']} ({comparison['goal']})")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m tests.lanes.gpu_record LANE_OUT_DIR OUT_DIR")
    result = convert(sys.argv[1], sys.argv[2])
    for name in result["reps"]:
        print(name)
    with open(result["comparison"], encoding="utf-8") as handle:
        print(table(json.load(handle)))
    for problem in result["problems"]:
        print("problem:", problem)
    if not result["reps"]:
        raise SystemExit("no verifier repetition could be recorded (the raw files and comparison.json are kept)")
