"""Statistics for testbed metrics, in pure Python (the standard library only).

- Welch's unequal-variance t-test (Welch 1947) with the Welch-Satterthwaite degrees of
  freedom (Satterthwaite 1946); the two-sided p-value from Student's t distribution,
  whose CDF is a regularized incomplete beta function evaluated with the modified Lentz
  continued fraction (Numerical Recipes, 3rd ed., section 6.4).
- 95 % confidence intervals: of a mean (t-based), and of a ratio of two independent means
  by Fieller's theorem (Fieller 1954) with Welch-Satterthwaite degrees of freedom.
- Percentiles only where the sample holds them (see PERCENTILE_MIN_N).
- Only measurements (see metric_problem): a value is 0 or a finite number whose magnitude lies
  within 1e-12..1e12 of its unit, anything else is refused in one line.
"""

from __future__ import annotations

import math
import statistics

from gpuvfio.errors import InputError
from gpuvfio.numbers import finite, shown

# Metrics the testbed records per repetition: key -> (label, unit, higher is better)
METRICS = {
    "h2d_gbps": ("Host-to-device bandwidth (pinned, copy engine)", "GB/s", True),
    "d2h_gbps": ("Device-to-host bandwidth", "GB/s", True),
    "bidir_gbps": ("Bidirectional host<->device bandwidth (sum of both directions)", "GB/s", True),
    "d2d_gbps": ("Device-to-device copy bandwidth", "GB/s", True),
    "latency_us": ("Host-device latency (pointer chase over pinned host memory)", "µs", False),
    "copy_overhead_us": ("Small-copy API overhead (4-byte async copy + sync, median)", "µs", False),
    "saxpy_ms": ("SAXPY kernel, fixed size (compute)", "ms", False),
    "p2p_gbps": ("GPU peer copy bandwidth (lowest pair)", "GB/s", True),
    "nccl_busbw_gbps": ("NCCL all-reduce bus bandwidth (largest size)", "GB/s", True),
    "time_to_verified_s": ("Attach to verified guest", "s", False),
}

ALPHA = 0.05  # significance level of the two-sided test; the intervals are 1 - ALPHA = 95 %

# A nearest-rank q-percentile of n values is their maximum until n >= 1 / (1 - q): with fewer
# runs "p99" would only rename the max. So p95 needs n >= 20 and p99 n >= 100, the smallest
# samples where at least one observation lies beyond the percentile.
PERCENTILE_MIN_N = {"p95": 20, "p99": 100}

# What a measured value may be: 0, or a magnitude from 1e-12 to 1e12 of its unit. Every metric is
# a bandwidth in GB/s or a time in µs, ms or s, so a real run lies many orders inside (1e-12 GB/s
# is 1 mB/s, 1e-12 µs an attosecond; 1e12 GB/s a zettabyte per second, 1e12 s 31,700 years).
# The bounds are what keeps the arithmetic below exact enough and finite: subnormal floats
# (5e-324, IEEE 754 values under sys.float_info.min) have lost their significant digits and their
# reciprocals overflow; the tests square variances and Fieller raises a ratio of means to the
# fourth power, where Python's float ** raises OverflowError past 1.8e308 instead of returning
# inf, so a value of 1e80 (or an int of 400 digits, which JSON gives Python exactly) would be a
# traceback, not a table. Within the bounds the fourth power of a ratio of means times a squared
# variance stays under 1e112 * n**4 (a mean that cancels to its last bit included).
METRIC_MAGNITUDE = (1e-12, 1e12)


# --- Student's t distribution -------------------------------------------------------------

def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b), by the modified Lentz method (NR 6.4, betacf)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                   -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            delta = d * c
            h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float, y: float | None = None) -> float:
    """The regularized incomplete beta function I_x(a, b); y = 1 - x when the caller has it
    exactly (avoids the cancellation of 1 - x for x near 1)."""
    y = 1.0 - x if y is None else y
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(y))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, y) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom (df may be fractional):
    I_{df/(df+t^2)}(df/2, 1/2)."""
    if math.isinf(t):
        return 0.0
    t2 = t * t
    return min(1.0, betainc(df / 2.0, 0.5, df / (df + t2), t2 / (df + t2)))


def t_cdf(t: float, df: float) -> float:
    tail = t_two_sided_p(t, df) / 2.0
    return 1.0 - tail if t >= 0 else tail


def t_pdf(t: float, df: float) -> float:
    return math.exp(math.lgamma((df + 1.0) / 2.0) - math.lgamma(df / 2.0) - 0.5 * math.log(df * math.pi)
                    - (df + 1.0) / 2.0 * math.log1p(t * t / df))


def t_quantile(q: float, df: float) -> float:
    """The q-quantile of Student's t (0 < q < 1): Newton's method on the CDF, kept inside a
    bracket (a step that leaves it bisects instead)."""
    if not 0.0 < q < 1.0:
        raise ValueError("q must lie strictly between 0 and 1")
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    target = 2.0 * (1.0 - q)  # two-sided tail mass beyond the quantile
    low, high = 0.0, 1.0
    while t_two_sided_p(high, df) > target:
        low, high = high, high * 2.0
    t = (low + high) / 2.0
    for _ in range(200):
        excess = t_two_sided_p(t, df) - target  # decreasing in t
        if excess > 0:
            low = t
        else:
            high = t
        step = excess / (2.0 * t_pdf(t, df))
        if abs(step) <= 1e-14 * t:
            # converged: a step this small may round to nothing (t + step == t), which the
            # bracket test below would take for a step out of the bracket and bisect
            return t + step
        t = t + step if low < t + step < high else (low + high) / 2.0
        if high - low <= 1e-14 * high:
            break
    return t


# --- Summaries, tests and intervals -------------------------------------------------------

def _nearest_rank(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def metric_problem(value) -> str | None:
    """Why ``value`` is not a measurement (None: it is one, or it is None, not measured)."""
    if value is None:
        return None
    low, high = METRIC_MAGNITUDE
    if not finite(value) or (value != 0 and not low <= abs(value) <= high):
        return f"{shown(value)} is not 0 or a finite number of magnitude {low:g} to {high:g}"
    return None


def summarize(values: list[float]) -> dict:
    """Count, mean, its 95 % CI (n >= 2), median, spread, and p95/p99 only where
    PERCENTILE_MIN_N allows (None otherwise). A value metric_problem refuses is bad input
    (InputError, one line): a damaged result, not a statistic."""
    for value in values:
        problem = metric_problem(value)
        if problem:
            raise InputError(f"a testbed result is not a measurement ({problem}): remove the damaged result "
                             "and rerun")
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"count": 0}
    n = len(values)
    summary = {"count": n, "mean": statistics.mean(values), "median": statistics.median(values),
               "min": values[0], "max": values[-1], "stdev": statistics.stdev(values) if n > 1 else None,
               "values": values}
    summary["ci95"] = mean_ci(summary)
    for name, minimum in PERCENTILE_MIN_N.items():
        summary[name] = _nearest_rank(values, int(name[1:]) / 100.0) if n >= minimum else None
    return summary


def mean_ci(summary: dict, level: float = 1.0 - ALPHA) -> list[float] | None:
    """t-based interval of the mean: mean +- t_{(1+level)/2, n-1} * s / sqrt(n); None for n < 2."""
    n = summary.get("count", 0)
    if n < 2:
        return None
    half = t_quantile((1.0 + level) / 2.0, n - 1) * summary["stdev"] / math.sqrt(n)
    return [summary["mean"] - half, summary["mean"] + half]


def welch_test(a: dict, b: dict) -> dict | None:
    """Welch's t-test of two summaries (count, mean, stdev): t, the Welch-Satterthwaite df, the
    two-sided p and whether p < ALPHA. None when either side has fewer than two samples (its
    spread is unknown). Two constant samples have no spread to test against: equal ones give
    p = 1, different ones p = 0 (t and df are then None, and "note" says why)."""
    if a.get("count", 0) < 2 or b.get("count", 0) < 2:
        return None
    va, vb = a["stdev"] ** 2 / a["count"], b["stdev"] ** 2 / b["count"]
    if va + vb == 0.0:
        same = a["mean"] == b["mean"]
        return {"t": None, "df": None, "p": 1.0 if same else 0.0, "significant": not same,
                "note": "both samples are constant and " + ("equal" if same else "differ")}
    t = (a["mean"] - b["mean"]) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (a["count"] - 1) + vb ** 2 / (b["count"] - 1))
    p = t_two_sided_p(t, df)
    return {"t": t, "df": df, "p": p, "significant": p < ALPHA}


def ratio_ci(num: dict, den: dict, level: float = 1.0 - ALPHA) -> list[float] | None:
    """Fieller's interval for mean(num) / mean(den), the samples independent, the variances
    unequal: the rho with (x - rho*y)^2 <= t^2 (vx + rho^2 vy), t at the Welch-Satterthwaite
    df of x - rho_hat*y. None when either side has n < 2, or when the denominator's mean is
    not clearly away from zero (the set is then unbounded)."""
    if num.get("count", 0) < 2 or den.get("count", 0) < 2 or not den["mean"]:
        return None
    x, y = num["mean"], den["mean"]
    vx, vy = num["stdev"] ** 2 / num["count"], den["stdev"] ** 2 / den["count"]
    rho = x / y
    spread = vx ** 2 / (num["count"] - 1) + rho ** 4 * vy ** 2 / (den["count"] - 1)
    if spread == 0.0:
        return [rho, rho]
    tq = t_quantile((1.0 + level) / 2.0, (vx + rho * rho * vy) ** 2 / spread)
    a = y * y - tq * tq * vy
    if a <= 0.0:
        return None
    root = math.sqrt(max(0.0, (x * y) ** 2 - a * (x * x - tq * tq * vx)))
    return sorted([(x * y - root) / a, (x * y + root) / a])
