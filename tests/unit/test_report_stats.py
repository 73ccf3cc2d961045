"""The testbed report's statistics (gpuvfio/testbed/stats.py), checked against values from
outside the code under test: closed forms of Student's t, published t-table critical
values, a numerical integration of the t density, published results of Welch's test
(Wikipedia's worked examples, R's t.test), and simulations of the error rates."""

import math
import random
import statistics

import pytest

from gpuvfio.testbed.stats import (betainc, mean_ci, ratio_ci, summarize, t_cdf, t_quantile, t_two_sided_p,
                                   welch_test)

try:  # scipy is not a dependency; only a cross-check where it happens to be installed
    from scipy import stats as scipy_stats
except ImportError:
    scipy_stats = None


@pytest.mark.parametrize("t", [0.0, 0.1, 0.7, 1.0, 2.0, 5.0, 31.8, 400.0])
def test_t_closed_forms(t):
    # df = 1 is Cauchy: p = 1 - (2/pi) atan|t|; df = 2: p = 1 - |t| / sqrt(2 + t^2)
    assert t_two_sided_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), rel=1e-12, abs=1e-15)
    assert t_two_sided_p(-t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-12, abs=1e-15)


# Two-sided critical values t(0.975, df) and t(0.995, df) as printed in t tables (3 decimals).
TABLE = {1: (12.706, 63.657), 2: (4.303, 9.925), 3: (3.182, 5.841), 4: (2.776, 4.604), 5: (2.571, 4.032),
         6: (2.447, 3.707), 8: (2.306, 3.355), 10: (2.228, 3.169), 20: (2.086, 2.845), 30: (2.042, 2.750),
         120: (1.980, 2.617)}


@pytest.mark.parametrize("df", sorted(TABLE))
def test_t_table_values(df):
    t95, t99 = TABLE[df]
    assert round(t_quantile(0.975, df), 3) == t95 and round(t_quantile(0.995, df), 3) == t99
    assert t_two_sided_p(t95, df) == pytest.approx(0.05, abs=2e-4 * t95)
    assert t_cdf(-t99, df) == pytest.approx(0.005, rel=0.01)


def test_t_approaches_the_normal():
    for z in (0.5, 1.959964, 3.0):
        assert t_two_sided_p(z, 1e8) == pytest.approx(math.erfc(z / math.sqrt(2)), rel=1e-6)


def _p_by_integration(t: float, df: float) -> float:
    """1 - 2 * integral_0^|t| of the t density, by Simpson's rule: independent of the beta function."""
    const = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    pdf = lambda x: const * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
    steps = 4000
    h = abs(t) / steps
    total = pdf(0) + pdf(abs(t)) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, steps))
    return 1 - 2 * total * h / 3


@pytest.mark.parametrize("df", [2.5, 4.1, 5.307, 9.905, 24.52])
@pytest.mark.parametrize("t", [0.3, 1.57, 2.2255, 3.4, 6.0])
def test_fractional_df_against_integration(t, df):
    """Welch's df is fractional: the incomplete beta route agrees with integrating the density."""
    assert t_two_sided_p(t, df) == pytest.approx(_p_by_integration(t, df), abs=1e-9)
    if scipy_stats is not None:
        assert t_two_sided_p(t, df) == pytest.approx(2 * scipy_stats.t.sf(t, df), rel=1e-9)


def test_betainc_symmetry_and_edges():
    for a, b, x in ((0.5, 0.5, 0.3), (2.0, 3.5, 0.8), (12.0, 0.5, 0.97), (0.5, 40.0, 0.01)):
        assert betainc(a, b, x) + betainc(b, a, 1 - x) == pytest.approx(1.0, abs=1e-13)
    assert betainc(2, 3, 0.0) == 0.0 and betainc(2, 3, 1.0) == 1.0
    assert betainc(1, 1, 0.37) == pytest.approx(0.37)  # uniform
    assert betainc(0.5, 0.5, 0.25) == pytest.approx(2 / math.pi * math.asin(0.5))  # arcsine


# Welch's t, df and two-sided p as published, to the digits printed: Wikipedia "Welch's t-test",
# examples 1 and 2; and R's t.test() output (Welch is its default) for the third.
PUBLISHED = [
    ([27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7, 21.4],
     [27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5, 24.4],
     "-2.46", "25.0", "0.021"),
    ([17.2, 20.9, 22.6, 18.1, 21.7, 21.4, 23.5, 24.2, 14.7, 21.8],
     [21.5, 22.8, 21.0, 23.0, 21.6, 23.6, 22.5, 20.7, 23.4, 21.8, 20.7, 21.7, 21.5, 22.5, 23.6, 21.5, 22.5,
      23.5, 21.5, 21.8], "-1.57", "9.9", "0.149"),
    ([11, 9, 10, 11, 10, 12, 9, 11, 12, 9], [11, 13, 10, 13, 12, 9, 11, 12, 12, 11], "-1.8325", "17.9", "0.08356"),
]


def _digits(text: str) -> float:
    """Half a unit of the last digit printed."""
    return 0.5 * 10 ** -len(text.partition(".")[2])


@pytest.mark.parametrize("a, b, t, df, p", PUBLISHED)
def test_welch_against_published_results(a, b, t, df, p):
    result = welch_test(summarize(a), summarize(b))
    assert result["t"] == pytest.approx(float(t), abs=_digits(t) + 1e-9)
    assert result["df"] == pytest.approx(float(df), abs=_digits(df) + 1e-9)
    assert result["p"] == pytest.approx(float(p), abs=_digits(p) + 1e-9)
    assert result["significant"] is (float(p) < 0.05)
    assert welch_test(summarize(b), summarize(a))["t"] == pytest.approx(-result["t"])
    if scipy_stats is not None:
        reference = scipy_stats.ttest_ind(a, b, equal_var=False)
        assert result["p"] == pytest.approx(reference.pvalue, rel=1e-9)


def test_welch_edge_cases():
    assert welch_test(summarize([1.0]), summarize([1.0, 2.0, 3.0])) is None
    assert welch_test({"count": 0}, summarize([1.0, 2.0])) is None
    same = welch_test(summarize([5.0] * 4), summarize([5.0] * 3))
    assert same["p"] == 1.0 and same["significant"] is False and "equal" in same["note"]
    differ = welch_test(summarize([5.0] * 4), summarize([6.0] * 3))
    assert differ["p"] == 0.0 and differ["significant"] is True and "differ" in differ["note"]
    # one side constant: the other side's spread alone, df = its n - 1
    one = welch_test(summarize([5.0] * 4), summarize([4.0, 5.0, 6.0, 7.0, 8.0]))
    assert one["df"] == pytest.approx(4.0) and one["p"] == pytest.approx(t_two_sided_p(one["t"], 4))


def test_false_positive_rate_at_small_n():
    """Where nothing differs, Welch at p < 0.05 says "significant" about 5 % of the time at n = 3-5;
    the old rule (gap > 2 standard errors) said it 8-12 % of the time."""
    rng = random.Random(13)
    for n in (3, 4, 5):
        welch_hits = old_hits = 0
        trials = 3000
        for _ in range(trials):
            a = summarize([rng.gauss(50, 1) for _ in range(n)])
            b = summarize([rng.gauss(50, 1) for _ in range(n)])
            welch_hits += welch_test(a, b)["significant"]
            se = math.sqrt(a["stdev"] ** 2 / n + b["stdev"] ** 2 / n)
            old_hits += abs(a["mean"] - b["mean"]) > 2 * se
        assert 0.03 < welch_hits / trials < 0.065, (n, welch_hits / trials)
        assert old_hits / trials > 0.075, (n, old_hits / trials)


def test_mean_ci():
    assert mean_ci(summarize([1, 2, 3, 4, 5])) == pytest.approx([3 - 2.776445 * math.sqrt(0.5),
                                                                  3 + 2.776445 * math.sqrt(0.5)], rel=1e-6)
    assert summarize([7.0])["ci95"] is None
    rng = random.Random(5)
    covered = 0
    for _ in range(2000):
        ci = summarize([rng.gauss(10, 2) for _ in range(4)])["ci95"]
        covered += ci[0] <= 10 <= ci[1]
    assert 0.93 < covered / 2000 < 0.97


def test_fieller_ratio_ci():
    num, den = summarize([10.0, 11.0, 12.0]), summarize([5.0, 5.5, 6.0])
    low, high = ratio_ci(num, den)
    assert low < 11 / 5.5 < high
    # small spread: Fieller agrees with the delta method (same t, same df)
    num, den = summarize([100.0, 100.2, 99.8, 100.1, 99.9]), summarize([50.0, 50.1, 49.9, 50.05, 49.95])
    rho = num["mean"] / den["mean"]
    vx, vy = num["stdev"] ** 2 / 5, den["stdev"] ** 2 / 5
    df = (vx + rho ** 2 * vy) ** 2 / (vx ** 2 / 4 + rho ** 4 * vy ** 2 / 4)
    half = t_quantile(0.975, df) * math.sqrt(vx + rho ** 2 * vy) / den["mean"]
    assert ratio_ci(num, den) == pytest.approx([rho - half, rho + half], rel=1e-5)
    assert ratio_ci(summarize([4.0, 4.0]), summarize([2.0, 2.0, 2.0])) == [2.0, 2.0]
    assert ratio_ci(summarize([4.0]), den) is None and ratio_ci(num, summarize([2.0])) is None
    assert ratio_ci(num, summarize([-1.0, 0.5, 1.0])) is None  # denominator not clearly away from zero


def test_fieller_coverage():
    """95 % intervals of a ratio of means (0.85, a remote-NUMA share) cover it about 95 % of the time."""
    rng = random.Random(11)
    covered, trials = 0, 2000
    for _ in range(trials):
        num = summarize([rng.gauss(42.5, 1.0) for _ in range(5)])
        den = summarize([rng.gauss(50.0, 0.4) for _ in range(4)])
        low, high = ratio_ci(num, den)
        covered += low <= 0.85 <= high
    assert 0.93 < covered / trials < 0.97


def test_percentiles_need_the_sample_size():
    five = summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert five["p95"] is None and five["p99"] is None and five["max"] == 5.0
    assert summarize([float(i) for i in range(19)])["p95"] is None
    twenty = summarize([float(i) for i in range(1, 21)])
    assert twenty["p95"] == 19.0 and twenty["p99"] is None  # nearest rank, below the maximum
    hundred = summarize([float(i) for i in range(1, 101)])
    assert hundred["p95"] == 95.0 and hundred["p99"] == 99.0
    assert summarize([None, None]) == {"count": 0}
    assert summarize([1.0, None, 3.0])["mean"] == statistics.mean([1.0, 3.0])


# Closed forms of the quantile: df = 1 (Cauchy) t_q = tan(pi (q - 1/2)); df = 2
# t_q = (2q - 1) / sqrt(2 q (1 - q)). Both tails, to the precision the iteration promises.
@pytest.mark.parametrize("q", [0.001, 0.025, 0.3, 0.7, 0.9, 0.975, 0.9995])
def test_t_quantile_against_its_closed_forms_in_both_tails(q):
    assert t_quantile(q, 1) == pytest.approx(math.tan(math.pi * (q - 0.5)), rel=1e-9)
    assert t_quantile(q, 2) == pytest.approx((2 * q - 1) / math.sqrt(2 * q * (1 - q)), rel=1e-9)


@pytest.mark.parametrize("q", [0.0, 1.0, 1.5, -0.1])
def test_t_quantile_outside_the_open_interval_is_refused(q):
    with pytest.raises(ValueError):
        t_quantile(q, 5)


def test_t_two_sided_p_at_the_ends():
    assert t_two_sided_p(math.inf, 5) == 0.0 and t_two_sided_p(-math.inf, 5) == 0.0
    # a tiny t: the lower tail's own complement (t^2 / (df + t^2)) keeps the precision 1 - x loses
    assert t_two_sided_p(1e-9, 1) == pytest.approx(1 - 2 / math.pi * math.atan(1e-9), rel=1e-15, abs=1e-17)


def test_welch_at_two_samples_each_and_with_equal_spreads():
    two = welch_test(summarize([1.0, 2.0]), summarize([3.0, 5.0]))  # the fewest that have a spread
    assert two is not None and two["df"] == pytest.approx((0.25 + 1.0) ** 2 / (0.25 ** 2 + 1.0 ** 2))
    assert welch_test({}, summarize([1.0, 2.0])) is None and welch_test(summarize([1.0, 2.0]), {}) is None
    equal_spread = welch_test(summarize([1.0, 2.0, 3.0]), summarize([4.0, 5.0, 6.0]))
    assert equal_spread["t"] == pytest.approx(-3 / math.sqrt(2 / 3)) and equal_spread["df"] == pytest.approx(4.0)
    same = welch_test(summarize([5.0] * 4), summarize([5.0] * 3))
    assert (same["t"], same["df"], same["note"]) == (None, None, "both samples are constant and equal")
    differ = welch_test(summarize([5.0] * 2), summarize([6.0] * 2))
    assert (differ["t"], differ["df"], differ["note"]) == (None, None, "both samples are constant and differ")


# -- edges mutation testing found untested (docs/mutation.md) ------------------------------------

@pytest.mark.parametrize("t", [-3.0, -1.0, -0.25, 0.0, 0.5, 1.0, 7.0])
def test_t_cdf_and_pdf_against_their_closed_forms(t):
    from gpuvfio.testbed.stats import t_pdf
    # df = 1 (Cauchy): F = 1/2 + atan(t)/pi, f = 1/(pi (1 + t^2)); df = 2: F = 1/2 + t / (2 sqrt(2 + t^2)),
    # f = (2 + t^2)^(-3/2)
    assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, rel=1e-12, abs=1e-15)
    assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), rel=1e-12, abs=1e-15)
    assert t_pdf(t, 1) == pytest.approx(1 / (math.pi * (1 + t * t)), rel=1e-12)
    assert t_pdf(t, 2) == pytest.approx((2 + t * t) ** -1.5, rel=1e-12)


def test_t_quantile_at_the_median_and_its_refusal_names_the_interval():
    assert t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-12) and t_quantile(0.5, 1.5) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        t_quantile(0.0, 3)


def test_a_summary_names_its_parts():
    summary = summarize([3.0, 1.0, 2.0])
    assert (summary["median"], summary["min"], summary["max"], summary["values"]) == (2.0, 1.0, 3.0, [1.0, 2.0, 3.0])


def test_a_value_out_of_any_metrics_magnitude_is_bad_input():
    from gpuvfio.errors import InputError
    from gpuvfio.testbed.stats import METRIC_MAGNITUDE, metric_problem
    low, high = METRIC_MAGNITUDE
    assert [metric_problem(v) for v in (0, low, high, -high)] == [None] * 4
    assert all(metric_problem(v) for v in (low / 2, high * 2, -high * 2, math.inf, math.nan))
    with pytest.raises(InputError, match="not a measurement"):
        summarize([1.0, high * 10])


def test_p99_of_101_values_is_the_100th():
    # nearest rank: ceil(0.99 * 101) = 100; a quantile taken as 99/101 would give the 99th
    assert summarize([float(v) for v in range(1, 102)])["p99"] == 100.0


def test_two_samples_have_an_interval_and_a_summary_without_a_count_has_none():
    # t(0.975, 1) = tan(0.475 pi); s / sqrt(n) = 1 for [1, 3]
    assert summarize([1.0, 3.0])["ci95"] == pytest.approx([2 - math.tan(0.475 * math.pi),
                                                           2 + math.tan(0.475 * math.pi)], rel=1e-12)
    assert mean_ci({"mean": 1.0}) is None and welch_test({}, {}) is None
    assert ratio_ci({"mean": 1.0}, {"mean": 1.0}) is None
    assert ratio_ci(summarize([1.0, 2.0, 3.0]), {"mean": 1.0}) is None


@pytest.mark.parametrize("num, den", [
    ([1.0, 1.2, 0.9, 1.1], [10.0, 10.001]),  # two samples in the denominator
    ([0.10, 0.11, 0.09], [0.5, 0.5001, 0.4999]),  # a small denominator: y^2 - t^2 vy < 1
    ([0.010, 0.011, 0.009], [0.020, 0.0201, 0.0199]),  # a discriminant well under 1
])
def test_fieller_bounds_solve_its_equation(num, den):
    """Fieller's bounds are the roots of (x - rho y)^2 = t^2 (vx + rho^2 vy), t at the
    Welch-Satterthwaite df: checked on the equation itself, not on the code's algebra."""
    a, b = summarize(num), summarize(den)
    low, high = ratio_ci(a, b)
    x, y = a["mean"], b["mean"]
    vx, vy = a["stdev"] ** 2 / a["count"], b["stdev"] ** 2 / b["count"]
    rho = x / y
    df = (vx + rho * rho * vy) ** 2 / (vx ** 2 / (a["count"] - 1) + rho ** 4 * vy ** 2 / (b["count"] - 1))
    t = t_quantile(0.975, df)
    for bound in (low, high):
        assert (x - bound * y) ** 2 == pytest.approx(t * t * (vx + bound * bound * vy), rel=1e-9)
    assert low < rho < high


@pytest.mark.parametrize("q", [0.6, 0.9, 0.95, 0.975, 0.99, 0.995, 0.999, 1 - 1e-6, 1 - 1e-9])
def test_the_quantile_inverts_the_tail_for_every_df(q):
    """t_quantile against the tail it inverts (t_two_sided_p, itself checked on closed forms
    above), over fractional Welch dfs and whole ones: a Newton step that rounds to nothing
    (t + step == t) once read as a step out of the bracket, and the bisection that followed was
    returned: t(0.95, 4) came out 2.316 where it is 2.132, t(0.975, 5.68) 2.740."""
    for df in [0.5 + i * 0.37 for i in range(300)] + list(range(1, 200)):
        t = t_quantile(q, df)
        assert t_two_sided_p(t, df) == pytest.approx(2 * (1 - q), rel=1e-11), df


def test_t_quantile_matches_the_cauchy_just_past_the_median():
    assert t_quantile(0.51, 1) == pytest.approx(math.tan(math.pi * 0.01), rel=1e-9)
