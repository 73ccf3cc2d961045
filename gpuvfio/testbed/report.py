"""``gpuvfio testbed report``: results.json, report.md and a self-contained report.html.

Each metric is a table with every variant as a share of bare metal (or of the best
variant when no baseline ran), with 95 % confidence intervals of each mean and of each
share (Fieller), and Welch's t-test against the reference (stats.py). Plots are matplotlib
PNGs embedded in the HTML as data URIs, so the page opens without a network; render.py
writes the Markdown and the HTML from one document, so both show the same sections.
"""

from __future__ import annotations

import json
import re
import stat

from gpuvfio import strictjson
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.files import Tree
from gpuvfio.sizes import pages_text
from gpuvfio.testbed.render import document, html_page, markdown, method_paragraphs, plots, report_title
from gpuvfio.testbed.spec import NAME
from gpuvfio.testbed.stats import ALPHA, METRICS, PERCENTILE_MIN_N, ratio_ci, summarize, welch_test


def read_identity(out: str, advice: str = "remove it and rerun") -> dict | None:
    """OUT/identity.json, the system a run's results were measured on (None: there is none);
    a regular file of strict JSON holding an object, else bad input with ``advice``."""
    tree = out_tree(out)
    path = tree.path("identity.json")
    try:
        data = tree.read("identity.json")
        identity = strictjson.strict_loads(data) if data is not None else None
    except (ValueError, GpuvfioError) as exc:
        raise InputError(f"{path} is unreadable ({exc}); {advice}") from None
    if identity is not None and not isinstance(identity, dict):
        raise InputError(f"{path}: not a testbed identity (a JSON object); {advice}")
    return identity


REP = re.compile(r"rep-[0-9]{1,6}\.json")
RESULT_LIMIT = 1 << 20


def out_tree(out: str) -> Tree:
    """A testbed's OUT directory: the directory the user named (followed), and everything in it
    read and written beneath it, never through a link (gpuvfio.files)."""
    if not out or not out.strip() or "\0" in out:
        raise InputError("the testbed output directory is empty")
    return Tree(out)


def result_files(tree: Tree) -> list[str]:
    """results/<variant>/rep-N.json beneath OUT, sorted: regular files of the expected names only
    (a link there is not a result gpuvfio recorded: never read, never sent); a link or a file
    where a results directory should be is bad input (gpuvfio.files refuses it)."""
    try:
        return [rel for variant in tree.listdir("results") if NAME.fullmatch(variant)
                for name in tree.listdir(f"results/{variant}") if REP.fullmatch(name)
                for rel in [f"results/{variant}/{name}"] if _regular(tree.lstat(rel))]
    except GpuvfioError as exc:
        raise InputError(f"cannot read the results under {tree.path('results')}: {exc}") from None


def _regular(st) -> bool:
    return st is not None and stat.S_ISREG(st.st_mode)


def collect(out: str) -> dict:
    tree = out_tree(out)
    files = result_files(tree)
    if not files:
        raise InputError(f"no results under {out}/results (run gpuvfio testbed run first)")
    variants: dict[str, dict] = {}
    for rel in files:
        path = tree.path(rel)
        try:
            record = strictjson.strict_loads(tree.read(rel, RESULT_LIMIT) or b"")
        except (ValueError, GpuvfioError) as exc:
            raise InputError(f"{path} is not a readable result ({exc}): a damaged result: remove it and rerun") from None
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
    return _fields_problem(record, FIELDS)


NUMBER, TEXT, NONE = (int, float), (str,), (type(None),)
# The fields of a rep-N.json that the report reads, each with the types it takes where present
# (what testbed run writes: gpuvfio.testbed.run.write_rep); a results file is input from a
# hypervisor, so anything else is refused here, not met as a TypeError in describe().
FIELDS = {
    "guest": {"guest_kernel": TEXT + NONE, "driver_version": TEXT + NONE, "cuda_driver_version": NUMBER + TEXT + NONE,
              "virtualization_mode": TEXT + NONE, "pcie_link_under_load": TEXT + NONE},
    "provisioning": {"hugepages": TEXT + NUMBER, "numa": TEXT + NUMBER, "profile": TEXT, "scheduler": TEXT},
    "vgpu": {"profile": TEXT, "kind": TEXT, "type": TEXT + (int,),
             "mig_backed": (dict, type(None), {"slices": (int,), "memory_gb": NUMBER}),
             "scheduler": (dict, type(None), {"policy": TEXT, "previous": TEXT + NONE})},
    "placement": {"hugepage_kib": (int,) + NONE, "numa_nodeset": TEXT + NONE, "vcpus": (int,) + NONE},
}


def _fields_problem(record: dict, fields: dict, where: str = "") -> str | None:
    for key, wanted in fields.items():
        if key not in record:
            continue
        value = record[key]
        nested = wanted if isinstance(wanted, dict) else (wanted[-1] if isinstance(wanted[-1], dict) else None)
        types = tuple(t for t in (() if isinstance(wanted, dict) else wanted) if isinstance(t, type)) or (dict, type(None))
        if isinstance(value, bool) or not isinstance(value, types):
            return f"{where}{key} is not {' or '.join(t.__name__ for t in types)}"
        if nested is not None and isinstance(value, dict):
            problem = _fields_problem(value, nested, f"{where}{key}.")
            if problem:
                return problem
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
            text += f", MIG-backed: {mig.get('slices', '?')} slice(s), {mig.get('memory_gb', '?')} GB"
        parts.append(text)
    scheduler = vgpu.get("scheduler") or ({"policy": given["scheduler"]} if given.get("scheduler") else None)
    if scheduler:
        parts.append(f"scheduler {scheduler.get('policy', '?')}" + (f" (host default {scheduler['previous']})"
                                                                     if scheduler.get("previous") else ""))
    placed = record.get("placement") or {}
    if placed:
        pages = pages_text(placed.get("hugepage_kib"))
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
    tree = out_tree(out)
    for name, data in images.items():
        tree.write(name, data)
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
    tree.write("results.json", json.dumps(machine, indent=2, allow_nan=False))
    tree.write("report.md", markdown(doc, images))
    tree.write("report.html", html_page(doc, images))
    return {"out": out, "files": ["results.json", "report.md", "report.html", *sorted(images)],
            "variants": list(results["variants"]), "baseline": results["baseline"]}
