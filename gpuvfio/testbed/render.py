"""The testbed report as a document -- title, sections of paragraphs, bullets, tables and
plots -- written out as Markdown and as a self-contained HTML page, both by jinja2 templates
(templates/report.md.j2 and report.html.j2) from the same structure, so both always show the same sections and numbers.

What the results say (variant names, identity.json's keys and values, the guest's facts, how a
variant was provisioned) is another machine's text: the document holds it as :class:`Host`
pieces, through gpuvfio's one escape (printable, below) already, and each template
escapes it once more for its form -- the HTML one by autoescaping, the Markdown one by the
``md`` filter (printable's "markdown" form: no HTML, no link, no emphasis from a value); the
plots take names through its "mathtext" form. gpuvfio's own words are written as they are.

Results marked synthetic (identity.json ``"synthetic": true``) are labelled as such in the
title and on every plot; a recorded run has no such mark and no label.
"""

from __future__ import annotations

import base64
import io
import math
import os

from gpuvfio.errors import GpuvfioError, Refused
from gpuvfio.testbed.stats import ALPHA, METRICS, PERCENTILE_MIN_N
from gpuvfio.text import printable
from gpuvfio.user_files import for_another_program

TITLE = "gpuvfio testbed report"
MARKDOWN, PAGE = "report.md.j2", "report.html.j2"  # in the top-level templates/
SYNTHETIC_LABEL = "SYNTHETIC SAMPLE, not measured"
COLUMNS = ["variant", "n", "mean", "95 % CI of mean", "median", "min", "max", "p95", "p99", "% of {ref}",
           "95 % CI of %", "Welch p (df)", "significant"]
# Why a metric can have no value at all in a run.
ABSENT_BECAUSE = {"p2p_gbps": "needs two or more GPUs in the guest",
                  "nccl_busbw_gbps": "needs NCCL, libnccl.so.2, and two or more GPUs in the guest",
                  "time_to_verified_s": "measured for guests only"}

def synthetic_label(results: dict) -> str | None:
    return SYNTHETIC_LABEL if results["identity"].get("synthetic") is True else None


def report_title(results: dict) -> str:
    label = synthetic_label(results)
    return f"{TITLE} — {label}" if label else TITLE


def chart_title(text: str, results: dict) -> str:
    label = synthetic_label(results)
    return f"{text}\n{label}" if label else text


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def _interval(bounds: list[float] | None, suffix: str = "") -> str:
    if bounds is None:
        return "-"
    low, high = bounds
    if suffix:
        return f"{low:.1f}–{high:.1f}{suffix}"
    return f"{fmt(low)}–{fmt(high)}"


def _welch_cells(row: dict, reference: str) -> tuple[str, str]:
    if row["variant"] == reference:
        return "-", "reference"
    test = row["welch"]
    if test is None:
        return "-", "n/a (n < 2)"
    p = "<0.001" if test["p"] < 0.001 else f"{test['p']:.3f}"
    cell = f"{p} ({test['df']:.1f})" if test["df"] is not None else p
    verdict = "yes" if test["significant"] else "no"
    return cell, f"{verdict} ({test['note']})" if test.get("note") else verdict


class Host(str):
    """A piece of the document that the results gave, not gpuvfio: printable already; the
    Markdown template escapes it (md), the HTML one autoescapes every string."""


def host(value) -> Host:
    return Host(printable(value))


def _md(text) -> str:
    """A document text (a string, or a list of pieces) as Markdown: Host pieces escaped."""
    if isinstance(text, (list, tuple)):
        return "".join(_md(piece) for piece in text)
    return printable(text, "markdown") if isinstance(text, Host) else str(text)


def _joined(text) -> str:
    """A document text as one string, for the HTML template (which escapes it)."""
    return "".join(map(str, text)) if isinstance(text, (list, tuple)) else str(text)


def _metric_section(table: dict) -> dict:
    ref = ["bare metal"] if table["reference_is_baseline"] else ["best variant (", host(table["reference"]), ")"]
    rows = []
    for row in table["rows"]:
        pct = row["percent_of_reference"]
        p_cell, verdict = _welch_cells(row, table["reference"])
        rows.append([host(row["variant"]), str(row["count"]), fmt(row["mean"]), _interval(row["ci95"]),
                     fmt(row["median"]), fmt(row["min"]), fmt(row["max"]), fmt(row["p95"]), fmt(row["p99"]),
                     "-" if pct is None else f"{pct:.1f}%", _interval(row["percent_ci95"], "%"),
                     p_cell, verdict])
    better = "higher" if table["higher_is_better"] else "lower"
    return {"heading": f"{table['label']} ({table['unit']})",
            "paragraphs": [f"Key {table['metric']}; {better} is better."],
            "table": {"header": [[c.split("{ref}")[0], *ref, c.split("{ref}")[1]] if "{ref}" in c else c
                                 for c in COLUMNS], "rows": rows},
            "image": {"name": f"{table['metric']}.png", "alt": table["label"]}}


def method_paragraphs() -> list[str]:
    level = round(100 * (1 - ALPHA))
    return [
        "% of reference: the variant's mean over the reference's where higher is better, the reference's over "
        "the variant's where lower is better; 100 % is parity, less is worse. The reference is bare metal when "
        "it ran, else the best variant.",
        f"{level} % CI of mean: mean ± t(0.975, n−1) · s / √n (Student's t). {level} % CI of %: Fieller's "
        "interval for the ratio of two independent means, t at Welch–Satterthwaite degrees of freedom; \"-\" "
        "when a side has fewer than 2 repetitions or the denominator is not clearly away from zero.",
        f"Significant: Welch's unequal-variance t-test (Welch 1947) against the reference, two-sided p < "
        f"{ALPHA:g}, degrees of freedom by Welch–Satterthwaite (shown in brackets). Each comparison is tested on "
        "its own, without a correction for the number of comparisons: where nothing differs, about one in twenty "
        "says \"yes\" by chance. \"n/a\": fewer than 2 repetitions on a side, no spread to test against.",
        f"Percentiles: p95 from {PERCENTILE_MIN_N['p95']} repetitions on, p99 from {PERCENTILE_MIN_N['p99']} on "
        "(nearest rank); with fewer, the percentile would only be the maximum renamed, so those cells say \"-\".",
        f"Plots: bars are means (the reference in green), error bars their {level} % confidence interval (none "
        "for a single repetition).",
    ]


def document(results: dict, metric_tables: list[dict], images: dict[str, bytes]) -> dict:
    """The whole report as data: what markdown() and html_page() both render."""
    label = synthetic_label(results)
    banner = (f"{label}: identity.json marks these results synthetic. No GPU was measured; the numbers only "
              "show what a report looks like.") if label else None
    # A bullet: (its name, its text as pieces); what the results say is a Host piece.
    sections = [{"heading": "System", "bullets": [(host(k), [": ", host(v)]) for k, v in results["identity"].items()]},
                {"heading": "Variants", "bullets": [(host(name), [" (", host(v["kind"]), "): ",
                                                                  host(v.get("provisioning", ""))])
                                                    for name, v in results["variants"].items()]}]
    seen = [(host(name), [" (", host(v["kind"]), "): ",
                          host(", ".join(f"{k} {value}" for k, value in v["guest"].items()))])
            for name, v in results["variants"].items() if v["guest"]]
    if seen:
        sections.append({"heading": "What the verifier saw", "bullets": seen})
    sections.append({"heading": "How to read this report", "paragraphs": method_paragraphs()})
    sections += [_metric_section(table) for table in metric_tables]
    shown = {table["metric"] for table in metric_tables}
    absent = [(label_, f": no repetition recorded it ({ABSENT_BECAUSE[key]})" if key in ABSENT_BECAUSE else
               ": no repetition recorded it") for key, (label_, _unit, _higher) in METRICS.items() if key not in shown]
    if absent:
        sections.append({"heading": "Not measured in this run", "bullets": absent})
    if "latency_distribution.png" in images:
        sections.append({"heading": "Latency distribution",
                         "paragraphs": ["Host-device latency (latency_us, pointer chase) of every repetition, "
                                        "per variant: the box spans the middle half, the dots are the runs."],
                         "image": {"name": "latency_distribution.png", "alt": "latency distribution"}})
    sections = [{"paragraphs": [], "bullets": [], "table": None, "image": None, **section} for section in sections]
    return {"title": report_title(results), "banner": banner, "sections": sections}


# Markdown is not HTML: no autoescape here; every text that can hold a Host piece goes through md.
def templates_dir() -> str:
    """The report templates: shipped in the package (a wheel maps the repository's top-level
    templates/ to gpuvfio/testbed/templates), or templates/ at the top of a checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    checkout = os.path.dirname(os.path.dirname(here))
    for candidate in (os.path.join(here, "templates"), os.path.join(checkout, "templates")):
        if for_another_program(os.path.join(candidate, MARKDOWN)):
            return candidate
    raise GpuvfioError(f"the report templates are missing from {os.path.join(here, 'templates')} (a broken install?)")


def environment(*, autoescape: bool, **filters):
    """A jinja2 environment for one report form (jinja2 is imported here, where reports are
    written: a command that writes none does not load it)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates_dir()), autoescape=autoescape,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters.update(filters)
    return env


def markdown(doc: dict, images: dict[str, bytes]) -> str:
    """report.md: the same document as html_page(), rendered by jinja2 as Markdown."""
    template = environment(autoescape=False, md=_md).get_template(MARKDOWN)
    return template.render(doc=doc, images=images).rstrip("\n") + "\n"


def html_page(doc: dict, images: dict[str, bytes]) -> str:
    encoded = {name: base64.b64encode(data).decode() for name, data in images.items()}
    return environment(autoescape=True, joined=_joined).get_template(PAGE).render(doc=doc, images=encoded)


REPORT_EXTRA = "gpuvfio[report]"  # pyproject.toml: the plotting libraries a hypervisor does not need


def plotting():
    """matplotlib, imported where a report is drawn; without it, one line that names the extra
    to install (a hypervisor install has no plotting libraries)."""
    try:
        import matplotlib
    except ImportError:
        raise Refused(f"testbed report draws its plots with matplotlib, which this installation does not have: "
                      f"install the report extra (pip install '{REPORT_EXTRA}')") from None
    return matplotlib


def plots(results: dict, metric_tables: list[dict]) -> dict[str, bytes]:
    """A bar chart per metric (means, 95 % CI error bars) and the latency of every repetition."""
    matplotlib = plotting()

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    label = synthetic_label(results)

    def finish(fig, ax) -> bytes:
        if label:  # on the plot itself too, so a PNG copied out of the report keeps it
            ax.text(0.5, 0.5, "SYNTHETIC", transform=ax.transAxes, fontsize=40, color="#c0392b", alpha=0.25,
                    ha="center", va="center", rotation=20, zorder=5)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        plt.close(fig)
        return buffer.getvalue()

    images = {}
    for table in metric_tables:
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
        rows = table["rows"]
        means = [r["mean"] for r in rows]
        below = [r["mean"] - r["ci95"][0] if r["ci95"] else math.nan for r in rows]  # nan: no error bar
        above = [r["ci95"][1] - r["mean"] if r["ci95"] else math.nan for r in rows]
        colours = ["#55A868" if r["variant"] == table["reference"] else "#4C72B0" for r in rows]
        ax.bar([printable(r["variant"], "mathtext") for r in rows], means, yerr=[below, above], capsize=4,
               color=colours, zorder=2)
        ax.set_ylabel(f"{table['unit']} (mean, 95 % CI)")
        ax.set_title(chart_title(table["label"], results), fontsize=10)
        ax.tick_params(axis="x", labelrotation=15)
        images[f"{table['metric']}.png"] = finish(fig, ax)
    latencies = {name: v["metrics"]["latency_us"].get("values", []) for name, v in results["variants"].items()}
    latencies = {k: v for k, v in latencies.items() if v}
    if latencies:
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
        ax.boxplot(list(latencies.values()), zorder=2)
        for i, values in enumerate(latencies.values(), start=1):
            ax.plot([i] * len(values), values, "o", color="#4C72B0", alpha=0.6, zorder=3)
        ax.set_xticks(range(1, len(latencies) + 1),  # works before and after 3.9
                      [printable(name, "mathtext") for name in latencies])
        ax.set_ylabel("µs")
        ax.set_title(chart_title("Host-device latency per repetition (pointer chase)", results), fontsize=10)
        images["latency_distribution.png"] = finish(fig, ax)
    return images
