"""A guest's figures are believed only where hardware could report them (issue 34 item 5): a
lying guest -- no GPU, yet Gen5 x16 behind a Gen4 slot and 1e300 GB/s -- passed every check and
its number was printed with 300 digits. A link above the host slot, a link no PCIe device has, a
bandwidth above what the link carries, NaN or infinity, an implausible launch time: each fails,
and each figure is shown in a bounded form."""

from __future__ import annotations

import json

import pytest

from gpuvfio.guest.checks import evaluate, shown
from gpuvfio.guest.expect import Expected
from gpuvfio.guest.verify import parse_probe, parse_verifier
from tests.unit.test_verify import GPU_LINE, H100, probe_text, verifier_data

IN_GEN4 = Expected("0000:1b:00.0", "10de", "2330", "030200", 4, 16, "slot Gen4 x16")


def judged(expected, **changes):
    data = verifier_data()
    measured = data["bandwidth"]["0000:01:00.0"]
    for key, value in changes.items():
        if key in ("h2d", "d2h", "bidir_total"):
            measured[key] = {"median": value, "samples": [value]}
        elif key == "link":
            measured["link_under_load"] = value
        elif key == "launch_ms":
            data["compute"]["0000:01:00.0"]["launch_ms"] = value
    text = "GPUVFIO-VERIFIER " + json.dumps(data) + "\n"
    report = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(text), [expected])
    return {c["id"]: c for c in report["checks"]}, report


def test_a_link_above_the_host_slot_fails():
    checks, report = judged(IN_GEN4, link={"current_gen": 5, "current_width": 16, "max_gen": 5, "max_width": 16})
    assert checks["pcie_link"]["status"] == "fail" and "above what the host slot allows" in checks["pcie_link"]["reason"]
    assert not report["ok"]


@pytest.mark.parametrize("link", [{"current_gen": 9, "current_width": 16}, {"current_gen": 5, "current_width": 3},
                                  {"current_gen": 5, "current_width": 0}, {"current_gen": 5, "current_width": 64}])
def test_a_link_no_device_has_fails(link):
    checks, _report = judged(H100, link=link)
    assert checks["pcie_link"]["status"] == "fail" and "no PCIe device has" in checks["pcie_link"]["reason"]


@pytest.mark.parametrize("value, words", [(1e300, "1e+300"), (64.0, "64"), (-1.0, "-1"), (1.7e308, "1.7e+308")])
def test_a_bandwidth_above_the_link_or_below_zero_fails_and_is_shown_bounded(value, words):
    checks, report = judged(H100, h2d=value)
    h2d = checks["h2d_bandwidth"]
    assert h2d["status"] == "fail", h2d
    assert "the link carries at most 63.0 GB/s (Gen5 x16)" in h2d["reason"]
    assert len(json.dumps(report)) < 20000 and h2d["observed"] == words


def test_bidirectional_is_judged_against_both_directions():
    checks, _ = judged(H100, bidir_total=110.0)
    assert checks["bidir_bandwidth"]["status"] == "pass"
    checks, _ = judged(H100, bidir_total=130.0)
    assert checks["bidir_bandwidth"]["status"] == "fail"


def test_an_implausible_launch_time_fails_and_is_bounded():
    checks, _ = judged(H100, launch_ms=1e300)
    assert checks["compute"]["status"] == "fail" and checks["compute"]["observed"] == "1e+300"


def test_shown_is_bounded():
    assert shown(1e300) == "1e+300" and shown(float("nan")) == "nan" and shown(2.5) == "2.5"
    assert len(shown(10 ** 400)) <= 40 and len(shown("x" * 1000)) <= 40
