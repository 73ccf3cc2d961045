"""Summary statistics and a conservative significance test for testbed metrics."""

from __future__ import annotations

import math
import statistics

# Metrics the testbed reports: key -> (label, unit, higher is better)
METRICS = {
    "h2d_gbps": ("Host-to-device bandwidth", "GB/s", True),
    "d2h_gbps": ("Device-to-host bandwidth", "GB/s", True),
    "d2d_gbps": ("Device-to-device bandwidth", "GB/s", True),
    "latency_p50_us": ("4-byte H2D copy latency, p50", "µs", False),
    "latency_p99_us": ("4-byte H2D copy latency, p99", "µs", False),
    "saxpy_ms": ("SAXPY kernel, fixed size (compute)", "ms", False),
    "time_to_verified_s": ("Attach to verified guest", "s", False),
}


def summarize(values: list[float]) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"count": 0}
    p99 = values[min(len(values) - 1, max(0, math.ceil(0.99 * len(values)) - 1))]
    return {"count": len(values), "mean": statistics.mean(values), "median": statistics.median(values),
            "p99": p99, "min": values[0], "max": values[-1],
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0, "values": values}


def significant(a: dict, b: dict) -> bool | None:
    """Welch-style: the means differ by more than twice the combined standard error.
    None when either side has fewer than two samples (the spread is unknown)."""
    if a.get("count", 0) < 2 or b.get("count", 0) < 2:
        return None
    se = math.sqrt(a["stdev"] ** 2 / a["count"] + b["stdev"] ** 2 / b["count"])
    if se == 0:
        return a["mean"] != b["mean"]
    return abs(a["mean"] - b["mean"]) > 2 * se
