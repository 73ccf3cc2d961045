"""``gpuvfio testbed report``: results.json, report.md and a self-contained report.html.

Each metric is a table with every variant as a share of bare metal (or of the best
variant when no baseline ran); plots are matplotlib PNGs embedded in the HTML as data
URIs, so the page opens without a network. A difference is called significant only when
the spread of the repetitions allows it (stats.significant).
"""

from __future__ import annotations

import base64
import glob
import html
import io
import json
import os

from gpuvfio.errors import InputError
from gpuvfio.files import atomic_write
from gpuvfio.testbed.stats import METRICS, significant, summarize


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
    identity = {}
    identity_path = os.path.join(out, "identity.json")
    if os.path.exists(identity_path):
        try:
            with open(identity_path, encoding="utf-8") as handle:
                identity = json.load(handle)
        except (OSError, ValueError) as exc:
            raise InputError(f"{identity_path} is unreadable ({exc}); remove it and rerun") from None
        if not isinstance(identity, dict):
            raise InputError(f"{identity_path}: not a testbed identity (a JSON object); remove it and rerun")
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


def tables(results: dict) -> list[dict]:
    out = []
    for key, (label, unit, higher) in METRICS.items():
        ref_name, ref = _reference(results, key)
        if ref is None:
            continue
        rows = []
        for name, variant in results["variants"].items():
            stats = variant["metrics"][key]
            if not stats.get("count"):
                continue
            share = 100.0 * (stats["mean"] / ref if higher else ref / stats["mean"]) if stats["mean"] and ref else None
            sig = None if name == ref_name else significant(stats, results["variants"][ref_name]["metrics"][key])
            rows.append({"variant": name, "kind": variant["kind"], **{k: stats[k] for k in
                         ("mean", "median", "p99", "min", "max", "count", "stdev")},
                         "percent_of_reference": share, "significant": sig})
        out.append({"metric": key, "label": label, "unit": unit, "higher_is_better": higher,
                    "reference": ref_name, "reference_is_baseline": ref_name == results["baseline"], "rows": rows})
    return out


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def markdown(results: dict, metric_tables: list[dict]) -> str:
    lines = ["# gpuvfio testbed report", "", "## System", ""]
    lines += [f"- **{k}**: {v}" for k, v in results["identity"].items()]
    lines += ["", "## Variants", ""]
    lines += [f"- **{name}** ({variant['kind']}): {variant.get('provisioning', '')}"
              for name, variant in results["variants"].items()]
    if any(variant["guest"] for variant in results["variants"].values()):
        lines += ["", "## What the verifier saw", ""]
    for name, variant in results["variants"].items():
        if variant["guest"]:
            lines.append(f"- **{name}** ({variant['kind']}): " + ", ".join(f"{k} {v}" for k, v in
                                                                              variant["guest"].items()))
    for table in metric_tables:
        ref = "bare metal" if table["reference_is_baseline"] else f"best variant ({table['reference']})"
        lines += ["", f"## {table['label']} ({table['unit']})", "",
                  f"| variant | mean | median | p99 | min | max | n | % of {ref} | significant |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in table["rows"]:
            sig = {True: "yes", False: "no", None: "n/a (too few runs)"}[row["significant"]]
            if row["variant"] == table["reference"]:
                sig = "reference"
            pct = "-" if row["percent_of_reference"] is None else f"{row['percent_of_reference']:.1f}%"
            lines.append(f"| {row['variant']} | {_fmt(row['mean'])} | {_fmt(row['median'])} | {_fmt(row['p99'])} | "
                         f"{_fmt(row['min'])} | {_fmt(row['max'])} | {row['count']} | {pct} | {sig} |")
    return "\n".join(lines) + "\n"


def plots(results: dict, metric_tables: list[dict]) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    images = {}
    for table in metric_tables:
        fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
        names = [r["variant"] for r in table["rows"]]
        means = [r["mean"] for r in table["rows"]]
        errors = [r["stdev"] for r in table["rows"]]
        ax.bar(names, means, yerr=errors, capsize=4, color="#4C72B0")
        ax.set_ylabel(table["unit"])
        ax.set_title(table["label"])
        ax.tick_params(axis="x", labelrotation=20)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        plt.close(fig)
        images[f"{table['metric']}.png"] = buffer.getvalue()
    latencies = {name: v["metrics"]["latency_p50_us"].get("values", []) for name, v in results["variants"].items()}
    latencies = {k: v for k, v in latencies.items() if v}
    if latencies:
        fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
        ax.boxplot(list(latencies.values()))
        ax.set_xticks(range(1, len(latencies) + 1), list(latencies))  # works before and after 3.9
        ax.set_ylabel("µs")
        ax.set_title("Small-copy latency (p50 per repetition)")
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        plt.close(fig)
        images["latency_distribution.png"] = buffer.getvalue()
    return images


def html_page(results: dict, metric_tables: list[dict], images: dict[str, bytes]) -> str:
    esc = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>gpuvfio testbed report</title><style>",
             "body{font-family:sans-serif;margin:2em;max-width:60em}table{border-collapse:collapse;margin:1em 0}",
             "td,th{border:1px solid #bbb;padding:.3em .6em;text-align:right}td:first-child{text-align:left}",
             "</style></head><body><h1>gpuvfio testbed report</h1><h2>System</h2><ul>"]
    parts += [f"<li><b>{esc(str(k))}</b>: {esc(str(v))}</li>" for k, v in results["identity"].items()]
    parts.append("</ul><h2>Variants</h2><ul>")
    parts += [f"<li><b>{esc(name)}</b> ({esc(v['kind'])}): {esc(v.get('provisioning', ''))}</li>"
              for name, v in results["variants"].items()]
    parts.append("</ul>")
    for table in metric_tables:
        ref = "bare metal" if table["reference_is_baseline"] else f"best variant ({table['reference']})"
        parts.append(f"<h2>{esc(table['label'])} ({esc(table['unit'])})</h2><table><tr><th>variant</th><th>mean</th>"
                     f"<th>median</th><th>p99</th><th>min</th><th>max</th><th>n</th><th>% of {esc(ref)}</th>"
                     "<th>significant</th></tr>")
        for row in table["rows"]:
            sig = {True: "yes", False: "no", None: "n/a"}[row["significant"]]
            if row["variant"] == table["reference"]:
                sig = "reference"
            pct = "-" if row["percent_of_reference"] is None else f"{row['percent_of_reference']:.1f}%"
            parts.append("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in (
                row["variant"], _fmt(row["mean"]), _fmt(row["median"]), _fmt(row["p99"]), _fmt(row["min"]),
                _fmt(row["max"]), row["count"], pct, sig)) + "</tr>")
        parts.append("</table>")
        image = images.get(f"{table['metric']}.png")
        if image:
            parts.append(f"<img alt='{esc(table['label'])}' src='data:image/png;base64,"
                         f"{base64.b64encode(image).decode()}'>")
    if "latency_distribution.png" in images:
        parts.append("<h2>Latency distribution</h2><img alt='latency distribution' src='data:image/png;base64,"
                     f"{base64.b64encode(images['latency_distribution.png']).decode()}'>")
    parts.append("</body></html>")
    return "".join(parts)


def write_report(out: str) -> dict:
    results = collect(out)
    metric_tables = tables(results)
    images = plots(results, metric_tables)
    for name, data in images.items():
        with open(os.path.join(out, name), "wb") as handle:
            handle.write(data)
    machine = {"identity": results["identity"], "baseline": results["baseline"],
               "variants": {name: {"kind": v["kind"], "provisioning": v.get("provisioning")}
                            for name, v in results["variants"].items()}, "tables": metric_tables}
    atomic_write(os.path.join(out, "results.json"), json.dumps(machine, indent=2))
    atomic_write(os.path.join(out, "report.md"), markdown(results, metric_tables))
    atomic_write(os.path.join(out, "report.html"), html_page(results, metric_tables, images))
    return {"out": out, "files": ["results.json", "report.md", "report.html", *sorted(images)],
            "variants": list(results["variants"]), "baseline": results["baseline"]}
