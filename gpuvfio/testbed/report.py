"""``gpuvfio testbed report``: results.json, report.md and a self-contained report.html.

Each metric is a table with every variant as a share of bare metal (or of the best
variant when no baseline ran), with 95 % confidence intervals of each mean and of each
share (Fieller), and Welch's t-test against the reference (stats.py). Plots are matplotlib
PNGs embedded in the HTML as data URIs, so the page opens without a network; render.py
writes the Markdown and the HTML from one document, so both show the same sections.
"""

from __future__ import annotations

import glob
import json
import os

from gpuvfio import strictjson
from gpuvfio.errors import InputError
from gpuvfio.files import atomic_write, read_regular
from gpuvfio.testbed.render import document, html_page, markdown, method_paragraphs, plots, report_title
from gpuvfio.testbed.stats import ALPHA, METRICS, PERCENTILE_MIN_N, ratio_ci, summarize, welch_test


def read_identity(out: str, advice: str = "remove it and rerun") -> dict | None:
    """OUT/identity.json, the system a run's results were measured on (None: there is none);
    a regular file of strict JSON holding an object, else bad input with ``advice``."""
    path = os.path.join(out, "identity.json")
    try:
        data = read_regular(path)
        identity = strictjson.strict_loads(data) if data is not None else None
    except ValueError as exc:
        raise InputError(f"{path} is unreadable ({exc}); {advice}") from None
    if identity is not None and not isinstance(identity, dict):
        raise InputError(f"{path}: not a testbed identity (a JSON object); {advice}")
    return identity


def collect(out: str) -> dict:
    files = sorted(glob.glob(os.path.join(out, "results", "*", "rep-*.json")))
    if not files:
        raise InputError(f"no results under {out}/results (run gpuvfio testbed run first)")
    variants: dict[str, dict] = {}
    for path in files:
        try:
            with open(path, encoding="utf-8") as handle:
                record = json.load(handle)
        except ValueError:
            raise InputError(f"{path} is not valid JSON (a damaged result: remove it and rerun)") from None
        problem = result_problem(record)
        if problem:
            raise InputError(f"{path}: not a testbed result ({problem}); remove it and rerun")
        entry = variants.setdefault(record["variant"], {"kind": record["kind"], "reps": [], "guest": {}})
        entry["reps"].append(record["metrics"])
        entry["provisioning"] = describe(record)
        entry["guest"] = {k: v for k, v in record.get("guest", {}).items() if v is not None} or entry["guest"]
    identity = read_identity(out) or {}
    for entry in variants.values():
        entry["metrics"] = {key: summarize([rep.get(key) for rep in entry["reps"]]) for key in METRICS}
    baseline = next((name for name, e in variants.items() if e["kind"] == "baremetal"), None)
    return {"identity": identity, "baseline": baseline, "variants": variants}


def result_problem(record) -> str | None:
    """What is wrong with one rep-N.json as ``testbed run`` writes it (None: nothing)."""
    if not isinstance(record, dict):
        return "not a JSON object"
    for key in ("variant", "kind"):
        if not isinstance(record.get(key), str) or not record[key]:
            return f"{key} is not a name"
    metrics = record.get("metrics")
    if not isinstance(metrics, dict):
        return "metrics is not an object"
    for key, value in metrics.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value != value or value in (float("inf"), float("-inf"))):
            return f"metric {key!r} is not a finite number"
    for key in ("guest", "provisioning", "vgpu", "placement"):
        if record.get(key) is not None and not isinstance(record[key], dict):
            return f"{key} is not an object"
    return None


def describe(record: dict) -> str:
    """One line on how a variant was provisioned, from what its run recorded."""
    if record.get("kind") == "baremetal":
        return "the verifier on the host itself (baseline)"
    given = record.get("provisioning") or {}
    parts = [f"hugepages {given['hugepages']}" if "hugepages" in given else None,
             f"NUMA {given['numa']}" if "numa" in given else None]
    vgpu = record.get("vgpu") or {}
    if vgpu or given.get("profile"):
        profile = vgpu.get("profile") or given.get("profile")
        text = f"vGPU {profile}" + (f" ({vgpu['kind']} type {vgpu['type']})" if vgpu.get("type") else "")
        mig = vgpu.get("mig_backed")
        if mig:
            text += f", MIG-backed: {mig['slices']} slice(s), {mig['memory_gb']} GB"
        parts.append(text)
    scheduler = vgpu.get("scheduler") or ({"policy": given["scheduler"]} if given.get("scheduler") else None)
    if scheduler:
        parts.append(f"scheduler {scheduler['policy']}" + (f" (host default {scheduler['previous']})"
                                                            if scheduler.get("previous") else ""))
    placed = record.get("placement") or {}
    if placed:
        pages = f"{placed['hugepage_kib']} KiB pages" if placed.get("hugepage_kib") else "4K pages"
        nodes = f"memory on node(s) {placed['numa_nodeset']}" if placed.get("numa_nodeset") else "not NUMA-pinned"
        parts.append(f"placed: {placed.get('vcpus')} vCPUs, {pages}, {nodes}")
    return ", ".join(p for p in parts if p) or record.get("kind", "")


def _reference(results: dict, key: str) -> tuple[str | None, float | None]:
    higher_better = METRICS[key][2]
    base = results["baseline"]
    if base and results["variants"][base]["metrics"][key].get("count"):
        return base, results["variants"][base]["metrics"][key]["mean"]
    candidates = [(name, v["metrics"][key]["mean"]) for name, v in results["variants"].items()
                  if v["metrics"][key].get("count")]
    if not candidates:
        return None, None
    return (max if higher_better else min)(candidates, key=lambda c: c[1])


def _row(name: str, variant: dict, key: str, ref_name: str, ref_stats: dict, higher: bool) -> dict:
    stats = variant["metrics"][key]
    mean, ref = stats["mean"], ref_stats["mean"]
    if name == ref_name:
        share, share_ci, test = 100.0, None, None
    else:
        share = 100.0 * (mean / ref if higher else ref / mean) if mean and ref else None
        # Fieller's interval of the same ratio: variant/reference, or reference/variant when lower is better
        bounds = ratio_ci(stats, ref_stats) if higher else ratio_ci(ref_stats, stats)
        share_ci = [100.0 * b for b in bounds] if bounds and share is not None else None
        test = welch_test(stats, ref_stats)
    return {"variant": name, "kind": variant["kind"],
            **{k: stats[k] for k in ("count", "mean", "ci95", "median", "stdev", "min", "max", "p95", "p99")},
            "percent_of_reference": share, "percent_ci95": share_ci, "welch": test,
            "significant": None if test is None else test["significant"], "values": stats["values"]}


def tables(results: dict) -> list[dict]:
    out = []
    for key, (label, unit, higher) in METRICS.items():
        ref_name, ref = _reference(results, key)
        if ref is None:
            continue
        ref_stats = results["variants"][ref_name]["metrics"][key]
        rows = [_row(name, variant, key, ref_name, ref_stats, higher)
                for name, variant in results["variants"].items() if variant["metrics"][key].get("count")]
        out.append({"metric": key, "label": label, "unit": unit, "higher_is_better": higher,
                    "reference": ref_name, "reference_is_baseline": ref_name == results["baseline"], "rows": rows})
    return out


def write_report(out: str) -> dict:
    results = collect(out)
    metric_tables = tables(results)
    images = plots(results, metric_tables)
    for name, data in images.items():
        with open(os.path.join(out, name), "wb") as handle:
            handle.write(data)
    doc = document(results, metric_tables, images)
    machine = {"title": report_title(results), "synthetic": results["identity"].get("synthetic") is True,
               "identity": results["identity"], "baseline": results["baseline"],
               "method": {"test": "Welch's t-test (Welch 1947), two-sided, Welch-Satterthwaite df",
                          "alpha": ALPHA, "mean_ci": "Student's t, 95 %",
                          "percent_ci": "Fieller's interval for a ratio of independent means, Welch-Satterthwaite df",
                          "percentile_min_n": PERCENTILE_MIN_N, "notes": method_paragraphs()},
               "variants": {name: {"kind": v["kind"], "provisioning": v.get("provisioning"), "guest": v["guest"]}
                            for name, v in results["variants"].items()},
               "tables": metric_tables,
               "not_measured": [key for key in METRICS if key not in {t["metric"] for t in metric_tables}]}
    atomic_write(os.path.join(out, "results.json"), json.dumps(machine, indent=2, allow_nan=False))
    atomic_write(os.path.join(out, "report.md"), markdown(doc, images))
    atomic_write(os.path.join(out, "report.html"), html_page(doc, images))
    return {"out": out, "files": ["results.json", "report.md", "report.html", *sorted(images)],
            "variants": list(results["variants"]), "baseline": results["baseline"]}
