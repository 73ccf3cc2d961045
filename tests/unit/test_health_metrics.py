"""gpuvfio health --textfile (issue 38 item 2): the report as node_exporter's textfile collector
reads it, checked with the Prometheus client library's own text parser
(prometheus_client.parser, as Prometheus' exposition format 0.0.4 is read)."""

from __future__ import annotations

import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuvfio.address import PciAddress
from gpuvfio.host.model import Link
from gpuvfio.host.pcie_health import DeviceHealth, Finding, Rating
from gpuvfio.ops.health import HealthReport
from gpuvfio.ops.health_metrics import METRICS, textfile
from tests.unit.test_pcie_health import GPU, PORT, fn, host


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(family, **labels) -> list:
    return [s for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())]


def test_the_textfile_is_what_prometheus_parses_with_every_metric_typed(cli, tmp_path):
    b = host(tmp_path)
    b.aer(fn(b, PORT), correctable={"RxErr": 3}, fatal={"DLP": 1})
    out = tmp_path / "collector" / "gpuvfio.prom"
    out.parent.mkdir()
    result = cli("--root", b.root, "health", "--textfile", str(out))
    assert result.code == 1  # the port's fatal error fails both functions below it
    got = families(out.read_text())
    # the client names a counter's family without its _total suffix
    assert {name: got[name.removesuffix("_total")].type for name in METRICS} == {
        name: kind for name, (kind, _help) in METRICS.items()}
    aer = got["gpuvfio_pcie_aer_errors"]
    (fatal,) = samples(aer, device=GPU, seen_by=PORT, severity="fatal")
    assert fatal.value == 1 and fatal.name == "gpuvfio_pcie_aer_errors_total"
    assert samples(aer, device=GPU, seen_by=PORT, severity="correctable")[0].value == 3
    assert samples(aer, device=GPU, seen_by=GPU, severity="fatal")[0].value == 0
    status = {s.labels["status"]: s.value for s in samples(got["gpuvfio_device_health_status"], device=GPU)}
    assert status == {"ok": 0, "degraded": 0, "failed": 1}
    width = {s.labels["link"]: s.value for s in samples(got["gpuvfio_pcie_link_width_lanes"], device=GPU)}
    speed = {s.labels["link"]: s.value for s in samples(got["gpuvfio_pcie_link_speed_gtps"], device=GPU)}
    assert width == {"current": 16, "max": 16} and speed == {"current": 16.0, "max": 16.0}
    assert sorted(os.listdir(out.parent)) == ["gpuvfio.prom"]  # no temp file left beside it


def test_label_values_are_escaped_as_the_format_says():
    """A libvirt domain name is someone's input: quotes, backslashes and newlines in it stay in
    their label, and no line of the file is theirs."""
    hostile = 'vm"1\\x\nfake_metric{device="x"} 1'
    device = DeviceHealth(PciAddress.parse(GPU), "vfio-pci", [Finding("config", Rating.OK, "")], [hostile, "b"],
                          link=Link(16.0, 16, 32.0, 16))
    got = families(textfile(HealthReport([device])))
    assert "fake_metric" not in got
    (ok,) = samples(got["gpuvfio_device_health_status"], status="ok")
    assert ok.labels["domain"] == hostile + ",b" and ok.value == 1
    assert {s.labels["link"]: s.value for s in got["gpuvfio_pcie_link_speed_gtps"].samples} == {
        "current": 16.0, "max": 32.0}


@pytest.mark.parametrize("make", [
    lambda p: os.symlink("/etc/passwd", p),
    lambda p: os.mkfifo(p),
    lambda p: os.mkdir(p),
])
def test_a_textfile_that_is_not_a_regular_file_is_bad_input_and_nothing_is_read(cli, tmp_path, make):
    b = host(tmp_path)
    out = tmp_path / "gpuvfio.prom"
    make(str(out))
    before = os.lstat(out)
    result = cli("--root", b.root, "health", "--textfile", str(out))
    assert result.code == 2 and "cannot write" in result.err and result.out == ""
    assert os.lstat(out).st_ino == before.st_ino and os.lstat(out).st_mode == before.st_mode


def test_an_existing_textfile_is_replaced_whole(cli, tmp_path):
    b = host(tmp_path)
    out = tmp_path / "gpuvfio.prom"
    out.write_text("stale 1\n" * 10000)
    assert cli("--root", b.root, "health", "--textfile", str(out)).code == 0
    text = out.read_text()
    assert "stale" not in text and families(text)["gpuvfio_device_health_status"]
