"""Testbeds on the unit lane: spec validation, plan, report (tables, plots, headless Chromium)."""

import json
import os
import re
import shutil
import subprocess
import sys
from html import unescape as html_unescape

import pytest

from gpuvfio.ops.context import Context, open_context
from gpuvfio.errors import InputError
from gpuvfio.testbed.report import collect, tables, write_report
from gpuvfio.testbed.spec import load_spec
from tests.conftest import REPO
from tests.make_samples import sample_path
from tests.testbed_data import write_synthetic

GOOD = """\
[guest]
disk = "/var/lib/libvirt/images/g.qcow2"
vcpus = 8
memory = "32G"
[guest.ssh]
port = 2222

[run]
repetitions = 3
gpus = ["0000:1b:00.0"]

[[variant]]
name = "pt-1g"
kind = "passthrough"
hugepages = "1G"

[[variant]]
name = "pt-remote"
kind = "passthrough"
numa = "remote"

[[variant]]
name = "baremetal"
kind = "baremetal"
"""


def write(tmp_path, text):
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return str(path)


def test_good_spec(tmp_path):
    spec = load_spec(write(tmp_path, GOOD))
    assert [v.name for v in spec.variants] == ["pt-1g", "pt-remote", "baremetal"]
    assert spec.repetitions == 3 and spec.ssh["port"] == 2222


@pytest.mark.parametrize("old, new, line, fragment", [
    ('kind = "passthrough"\nhugepages = "1G"', 'kind = "passthru"\nhugepages = "1G"', 14, "variant kind"),
    ('hugepages = "1G"', 'hugepages = "3G"', 15, "hugepages must be"),
    ('name = "pt-remote"', 'name = "pt-1g"', 18, "duplicate variant name"),
    ('repetitions = 3', 'repetitions = 0', 9, "repetitions"),
    ('gpus = ["0000:1b:00.0"]', 'gpus = ["0000:1b:00.9"]', 10, "not a PCI address"),
    ('memory = "32G"', 'memory = "lots"', 4, "not a size"),
    ('numa = "remote"', 'numa = "far"', 20, "numa must be"),
    ('vcpus = 8', 'vcpus = 8\ncolour = "red"', 4, "unknown key 'colour'"),
    ('port = 2222', 'port = 2222\npasword = "x"', 7, "unknown key 'pasword' in [guest.ssh]"),
    ('port = 2222', 'port = 2222\nboot_timeout = -1', 7, "boot_timeout must be"),
])
def test_bad_spec_points_at_the_line(tmp_path, old, new, line, fragment):
    assert old in GOOD
    with pytest.raises(InputError) as info:
        load_spec(write(tmp_path, GOOD.replace(old, new, 1)))
    message = str(info.value)
    assert f"spec.toml:{line}:" in message and fragment in message, message


def test_toml_syntax_error(tmp_path):
    with pytest.raises(InputError, match="not valid TOML"):
        load_spec(write(tmp_path, GOOD.replace('kind = "baremetal"', 'kind = "baremetal')))


def test_plan_shows_bind_and_xml_diff(cli, tmp_path):
    spec = write(tmp_path, GOOD.replace("repetitions = 3", "repetitions = 3\nstop_services = true"))
    result = cli("--root", sample_path("dgx-h100"), "testbed", "plan", spec, "--json")
    assert result.code == 0, result.err
    plan = result.json()
    assert plan["refused"] == []
    first, remote, bare = plan["variants"]
    assert first["bind"]["devices"] == ["0000:1b:00.0"] and first["hugepages_kib"] == 1048576
    assert [s["name"] for s in first["bind"]["steps"] if s["kind"] == "stop_service"] == [
        "nvidia-dcgm", "nvidia-fabricmanager", "nvidia-persistenced"]
    assert remote["numa_nodes"] == [1] and "DMA crosses sockets" in remote["warnings"][0]
    assert "-    <vcpupin vcpu='0' cpuset='1'/>" in remote["xml_diff"]
    assert bare["kind"] == "baremetal" and "xml" not in bare


@pytest.mark.parametrize("as_json", [False, True])
def test_plan_that_the_run_would_refuse_exits_1_and_says_why(cli, tmp_path, as_json):
    """The DGX runs persistenced, fabricmanager and DCGM: without stop_services every bind is refused.
    On main the plan printed "bind ... (4 steps)" and exited 0 while its --json listed the refusals."""
    result = cli("--root", sample_path("dgx-h100"), "testbed", "plan", write(tmp_path, GOOD),
                 *(["--json"] if as_json else []))
    assert result.code == 1
    assert "the run would refuse variant(s) pt-1g, pt-remote" in result.err
    if as_json:
        plan = result.json()
        assert plan["refused"] == ["pt-1g", "pt-remote"]
        assert any("nvidia-persistenced is running" in r for r in plan["variants"][0]["refused"])
    else:
        assert "REFUSED: nvidia-persistenced is running" in result.out and "refused)" in result.out


def test_plan_expands_the_specs_selectors_and_wants_yes_beyond_one_device(cli, tmp_path):
    """[run] gpus and gpu_ids are device arguments, expanded on the hypervisor as the command
    line's are; more than one device from a slot or an id filter needs --yes, in the plan as in
    the run (the plan exits as the run would)."""
    base = GOOD.replace("repetitions = 3", "repetitions = 3\nstop_services = true").replace(
        'memory = "32G"', 'memory = "32G"\nrom_bar = "off"')
    spec = write(tmp_path, base.replace('gpus = ["0000:1b:00.0"]', 'gpus = ["1b:00"]'))
    result = cli("--root", sample_path("dgx-h100"), "testbed", "plan", spec, "--json")
    assert result.code == 0, result.err
    plan = result.json()
    assert plan["gpus"] == ["0000:1b:00.0"] and plan["selected"] == ["selected 1b:00 -> 0000:1b:00.0"]
    assert plan["variants"][0]["bind"]["devices"] == ["0000:1b:00.0"]
    assert "<rom bar='off'/>" in plan["variants"][0]["xml"]
    spec = write(tmp_path, base.replace('gpus = ["0000:1b:00.0"]', 'gpu_ids = ["10de:2330"]'))
    refused = cli("--root", sample_path("dgx-h100"), "testbed", "plan", spec)
    assert refused.code == 1 and "-d 10de:2330 matches 8 physical devices" in refused.err and "add --yes" in refused.err
    assert refused.out == ""
    result = cli("--root", sample_path("dgx-h100"), "testbed", "plan", spec, "--yes", "--json")
    plan = result.json()
    assert len(plan["gpus"]) == 8 and plan["gpus"][0] == "0000:1b:00.0", result.err
    assert set(plan["gpus"]) <= set(plan["variants"][0]["bind"]["devices"])
    text = cli("--root", sample_path("dgx-h100"), "testbed", "plan", spec, "--yes")
    assert text.out.startswith("selected -d 10de:2330 -> 0000:1b:00.0, 0000:43:00.0")
    bad = cli("--root", sample_path("dgx-h100"), "testbed", "plan",
              write(tmp_path, base.replace('gpus = ["0000:1b:00.0"]', 'gpu_ids = ["10de:2330:030000"]')))
    assert bad.code == 2 and "spec.toml:12: not a device id filter" in bad.err


def test_a_resumed_run_measures_the_gpus_the_earlier_one_did(cli, tmp_path):
    """Results measured on other GPUs than the selection means now refuse the run before anything
    changes (one report would mix two setups); an identity that cannot say is bad input; without
    results there is nothing to mix."""
    from gpuvfio.host.fixture import load_fixture

    root = tmp_path / "dgx"
    with open(sample_path("dgx-h100"), encoding="utf-8") as handle:
        load_fixture(handle.read(), str(root))
    out = tmp_path / "out"
    (out / "results" / "pt-1g").mkdir(parents=True)
    (out / "results" / "pt-1g" / "rep-0.json").write_text("{}")
    identity = out / "identity.json"
    identity.write_text(json.dumps({"gpus": ["0000:43:00.0"]}))
    spec = write(tmp_path, GOOD.replace('gpus = ["0000:1b:00.0"]', 'gpus = ["1b:00"]'))
    run = ("--root", str(root), "testbed", "run", spec, "--out", str(out), "--connect", "test:///default")
    result = cli(*run)
    assert result.code == 1, result.err
    assert "the spec selects 0000:1b:00.0 on this host now, the results in" in result.err
    assert "were measured on 0000:43:00.0" in result.err
    assert json.loads(identity.read_text()) == {"gpus": ["0000:43:00.0"]}
    for damaged in ("not json", '{"host_cpu": "x"}', "[]"):
        identity.write_text(damaged)
        result = cli(*run)
        assert result.code == 2 and "identity.json" in result.err and "--out" in result.err, result.err
    identity.unlink()
    identity.symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text(json.dumps({"gpus": ["0000:1b:00.0"]}))
    result = cli(*run)
    assert result.code == 2 and "a link" in result.err, result.err
    identity.unlink()
    shutil.rmtree(out / "results")
    identity.write_text(json.dumps({"gpus": ["0000:43:00.0"]}))
    result = cli(*run)  # no results: the selection may change; the bind refuses (services run) instead
    assert result.code == 1 and "were measured on" not in result.err and "nvidia-persistenced" in result.err, \
        result.err


def test_stop_services_and_force_per_variant_or_globally(tmp_path):
    text = GOOD.replace("repetitions = 3", "repetitions = 3\nstop_services = true\nforce = true").replace(
        'numa = "remote"', 'numa = "remote"\nstop_services = false')
    spec = load_spec(write(tmp_path, text))
    assert [(v.stop_services, v.force) for v in spec.variants] == [(True, True), (False, True), (True, True)]
    with pytest.raises(InputError, match="stop_services must be true or false"):
        load_spec(write(tmp_path, GOOD.replace("repetitions = 3", 'repetitions = 3\nstop_services = "yes"')))


@pytest.mark.parametrize("old, new, fragment", [
    ("repetitions = 3", "repetitions = 3\nparallel = 2", "unknown key 'parallel' in [run]"),
    ("port = 2222", 'port = 2222\ntrust_on_first_use = "false"', "trust_on_first_use must be true or false"),
    ("port = 2222", "port = true", "ssh port must be"),
    ("vcpus = 8", "vcpus = true", "vcpus must be"),
    ('hugepages = "1G"', "hugepages = 2", "hugepages must be"),
])
def test_spec_types_are_checked(tmp_path, old, new, fragment):
    with pytest.raises(InputError, match=re.escape(fragment)):
        load_spec(write(tmp_path, GOOD.replace(old, new, 1)))


@pytest.mark.parametrize("spelling", ["4K", "1g", "2MiB", "none"])
def test_spec_and_xml_take_the_same_spellings(tmp_path, spelling, cli):
    spec = load_spec(write(tmp_path, GOOD.replace('hugepages = "1G"', f'hugepages = "{spelling}"')))
    wanted = spec.variants[0].hugepages
    xml = cli("--root", sample_path("dgx-h100"), "xml", "0000:1b:00.0", "--name", "s", "--vcpus", "8",
              "--memory", "32G", "--hugepages", spelling, "--json")
    assert xml.code in (0, 1), xml.err  # parsed (a host without 2M pages refuses, it does not reject)
    assert wanted in ("none", "2M", "1G")


def test_report_from_synthetic_results(tmp_path):
    out = str(tmp_path / "run")
    write_synthetic(out)
    results = collect(out)
    metric_tables = {t["metric"]: t for t in tables(results)}
    h2d = {r["variant"]: r for r in metric_tables["h2d_gbps"]["rows"]}
    assert metric_tables["h2d_gbps"]["reference"] == "baremetal"
    assert 98 < h2d["passthrough-1g"]["percent_of_reference"] < 101
    remote = h2d["passthrough-remote-4k"]
    assert remote["significant"] is True and remote["percent_of_reference"] < 90
    assert remote["welch"]["p"] < 0.001 and 4 <= remote["welch"]["df"] <= 8  # Welch-Satterthwaite, n = 5 + 5
    low, high = remote["percent_ci95"]
    assert low < remote["percent_of_reference"] < high < 90
    assert remote["ci95"][0] < remote["mean"] < remote["ci95"][1]
    assert remote["p95"] is None and remote["p99"] is None  # five runs hold no p95, let alone a p99
    assert h2d["baremetal"]["welch"] is None and h2d["baremetal"]["percent_ci95"] is None
    boot = metric_tables["time_to_verified_s"]
    assert boot["reference"] != "baremetal" and all(r["count"] == 1 for r in boot["rows"])
    assert all(r["significant"] is None and r["ci95"] is None and r["percent_ci95"] is None
               for r in boot["rows"] if r["variant"] != boot["reference"])
    assert "p2p_gbps" not in metric_tables and "nccl_busbw_gbps" not in metric_tables  # one GPU, no NCCL
    summary = write_report(out)
    assert {"report.md", "report.html", "results.json", "h2d_gbps.png", "bidir_gbps.png",
            "latency_distribution.png"} <= set(summary["files"])
    assert not any("latency_p" in name for name in summary["files"])
    md = (tmp_path / "run" / "report.md").read_text()
    assert "| passthrough-1g |" in md and "% of bare metal" in md and "95 % CI of %" in md
    assert "Fieller" in md and "Welch" in md and "p95 from 20 repetitions" in md
    assert "## Not measured in this run" in md and "needs two or more GPUs" in md
    # One data model, two jinja2 templates: the same sections in the same order in both.
    html = (tmp_path / "run" / "report.html").read_text()
    import html as html_module
    import re as re_module

    md_sections = re_module.findall(r"^## (.+)$", md, re_module.M)
    html_sections = [html_module.unescape(h) for h in re_module.findall(r"<h2>(.+?)</h2>", html)]
    assert md_sections == html_sections and "What the verifier saw" in md_sections
    machine = json.loads((tmp_path / "run" / "results.json").read_text(),
                         parse_constant=lambda c: pytest.fail(f"results.json holds {c}"))
    assert machine["baseline"] == "baremetal" and machine["synthetic"] is True
    row = next(r for t in machine["tables"] if t["metric"] == "h2d_gbps" for r in t["rows"]
               if r["variant"] == "passthrough-remote-4k")
    assert set(row["welch"]) == {"t", "df", "p", "significant"} and len(row["ci95"]) == len(row["percent_ci95"]) == 2
    assert machine["not_measured"] == ["p2p_gbps", "nccl_busbw_gbps"]


def _headings(out) -> tuple[list[str], list[str]]:
    md = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    return re.findall(r"^#+ (.*)$", md, re.M), [html_unescape(h) for h in re.findall(r"<h[12]>(.*?)</h[12]>", page)]


def _plot_titles(monkeypatch) -> list[str]:
    """Every plot title the report sets, as it sets it."""
    from matplotlib.axes import Axes

    titles: list[str] = []
    original = Axes.set_title
    monkeypatch.setattr(Axes, "set_title", lambda self, label, *a, **k: titles.append(label) or original(
        self, label, *a, **k))
    return titles


def test_synthetic_results_are_labelled_in_the_title_and_on_every_plot(tmp_path, monkeypatch):
    titles = _plot_titles(monkeypatch)
    out = tmp_path / "run"
    write_synthetic(str(out))
    summary = write_report(str(out))
    pngs = [f for f in summary["files"] if f.endswith(".png")]
    assert len(titles) == len(pngs) >= 9 and all("SYNTHETIC SAMPLE, not measured" in t for t in titles)
    md_headings, html_headings = _headings(out)
    assert md_headings[0] == html_headings[0] == "gpuvfio testbed report — SYNTHETIC SAMPLE, not measured"
    assert "<title>gpuvfio testbed report — SYNTHETIC SAMPLE, not measured</title>" in (out / "report.html").read_text()


def test_recorded_results_are_not_labelled(tmp_path, monkeypatch):
    """The label comes from the data: without "synthetic": true in identity.json, none anywhere."""
    titles = _plot_titles(monkeypatch)
    out = tmp_path / "run"
    write_synthetic(str(out))
    identity = json.loads((out / "identity.json").read_text())
    del identity["synthetic"]
    identity["host_cpu"] = "Intel Xeon Platinum 8480+"
    (out / "identity.json").write_text(json.dumps(identity))
    write_report(str(out))
    assert titles and not any("SYNTHETIC" in t for t in titles)
    for name in ("report.md", "report.html", "results.json"):
        text = (out / name).read_text()
        assert "SYNTHETIC" not in text and "not measured," not in text, name
    assert _headings(out)[0][0] == "gpuvfio testbed report"


def test_markdown_and_html_show_the_same_sections_and_cells(tmp_path):
    out = tmp_path / "run"
    write_synthetic(str(out))
    write_report(str(out))
    md_headings, html_headings = _headings(out)
    assert md_headings == html_headings
    assert {"What the verifier saw", "How to read this report", "Not measured in this run",
            "Latency distribution"} <= set(md_headings)
    md = (out / "report.md").read_text()
    page = html_unescape((out / "report.html").read_text())
    md_rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in md.splitlines()
               if line.startswith("| ") and not line.startswith("| variant")]
    html_rows = [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(<td>.*?)</tr>", page)]
    assert md_rows == html_rows and len(md_rows) > 20
    assert md.count("](") == page.count("<img ")  # every plot in both


def test_html_report_escapes_what_the_results_say(tmp_path):
    out = tmp_path / "run"
    write_synthetic(str(out))
    rep = out / "results" / "baremetal" / "rep-4.json"  # the last repetition's guest facts are shown
    record = json.loads(rep.read_text())
    record["guest"]["driver_version"] = "<script>alert(1)</script>"
    rep.write_text(json.dumps(record))
    write_report(str(out))
    page = (out / "report.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_percentiles_only_where_the_sample_holds_them(tmp_path):
    out = tmp_path / "run"
    write_synthetic(str(out), reps=20)
    rows = {r["variant"]: r for t in tables(collect(str(out))) if t["metric"] == "latency_us" for r in t["rows"]}
    assert rows["baremetal"]["p95"] is not None and rows["baremetal"]["p95"] < rows["baremetal"]["max"]
    assert rows["baremetal"]["p99"] is None


def test_report_when_nothing_was_measured(tmp_path):
    """A run whose verifier measured nothing (no CUDA) still gets a report that says so."""
    out = tmp_path / "run"
    write_synthetic(str(out), reps=1)
    for rep in (out / "results").glob("*/rep-*.json"):
        record = json.loads(rep.read_text())
        record["metrics"] = {key: None for key in record["metrics"]}
        rep.write_text(json.dumps(record))
    summary = write_report(str(out))
    assert not [f for f in summary["files"] if f.endswith(".png")]
    md = (out / "report.md").read_text()
    assert md.count("no repetition recorded it") == 10 and "| variant |" not in md


def test_report_without_results(cli, tmp_path):
    result = cli("testbed", "report", str(tmp_path))
    assert result.code == 2 and "no results" in result.err


def test_a_report_without_the_plotting_extra_names_it_and_writes_nothing(tmp_path):
    """matplotlib lives in the gpuvfio[report] extra: an installation without it (a hypervisor)
    is told which extra to install, in one line, exit 1, and the results directory is untouched."""
    out = tmp_path / "run"
    write_synthetic(str(out), reps=2)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    hide = "import sys; sys.modules['matplotlib'] = None; from gpuvfio.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", hide, "testbed", "report", str(out)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and "pip install 'gpuvfio[report]'" in proc.stderr
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_html_report_renders_in_chromium(tmp_path):
    assert CHROMIUM, "chromium is not installed (make deps installs it): the page cannot be checked"
    out = str(tmp_path / "run")
    write_synthetic(out)
    write_report(out)
    page = os.path.join(out, "report.html")
    html = open(page).read()
    assert "http://" not in html and "https://" not in html  # self-contained
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                          f"file://{page}"], capture_output=True, text=True, timeout=120)
    assert "<table>" in dom.stdout and "passthrough-remote-4k" in dom.stdout
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--no-first-run", f"--user-data-dir={tmp_path / 'profile2'}", f"--screenshot={shot}",
                    "--window-size=1000,1400", f"file://{page}"], capture_output=True, timeout=120)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000  # tables and plots, not a blank page


HOST = """
[host]
address = "hv1.example.org"
known_hosts = "/etc/ssh/ssh_known_hosts"
gpuvfio = ["/usr/local/bin/gpuvfio"]
"""


def test_remote_host_section(tmp_path):
    spec = load_spec(write(tmp_path, GOOD + HOST))
    assert spec.host.ssh.host == "hv1.example.org" and spec.host.ssh.port == 22 and spec.host.gpuvfio == [
        "/usr/local/bin/gpuvfio"]
    assert spec.host.label() == "root@hv1.example.org" and load_spec(write(tmp_path, GOOD)).host is None


@pytest.mark.parametrize("old, new, fragment", [
    ('address = "hv1.example.org"', 'address = "hv1;reboot"', "address must be"),
    ('address = "hv1.example.org"', 'address = "hv1.example.org"\nport = 0', "port must be"),
    ('known_hosts = "/etc/ssh/ssh_known_hosts"', 'trust_on_first_use = "yes"', "trust_on_first_use must be"),
    ('known_hosts = "/etc/ssh/ssh_known_hosts"', 'user = "root"', "needs known_hosts"),
    ('gpuvfio = ["/usr/local/bin/gpuvfio"]', 'gpuvfio = "gpuvfio --root /"', "list of strings"),
    ('gpuvfio = ["/usr/local/bin/gpuvfio"]', 'root = "relative/host.fixture"', "absolute path"),
    ('gpuvfio = ["/usr/local/bin/gpuvfio"]', 'password = "hunter2"', "unknown key 'password'"),
])
def test_bad_remote_host_points_at_the_line(tmp_path, old, new, fragment):
    text = GOOD + HOST.replace(old, new)
    with pytest.raises(InputError) as info:
        load_spec(write(tmp_path, text))
    message = str(info.value)
    wrong = text.splitlines().index(new.splitlines()[-1]) + 1 if new.splitlines()[-1] in text.splitlines() else None
    assert fragment in message and "hunter2" not in message, message
    assert f"spec.toml:{wrong}:" in message if "needs" not in fragment else "spec.toml:" in message, message


def test_report_says_how_each_variant_was_provisioned(tmp_path):
    out = str(tmp_path / "run")
    write_synthetic(out)
    write_report(out)
    md = (tmp_path / "run" / "report.md").read_text()
    assert ("- **vgpu-h100-40c** (vgpu): hugepages 1G, NUMA auto, vGPU NVIDIA H100-40C (sriov type 1054), "
            "scheduler equal-share (host default best-effort)") in md
    assert "- **passthrough-remote-4k** (passthrough): hugepages none, NUMA remote" in md
    assert "- **baremetal** (baremetal): the verifier on the host itself (baseline)" in md
    machine = json.loads((tmp_path / "run" / "results.json").read_text())
    assert machine["variants"]["passthrough-1g"]["provisioning"] == "hugepages 1G, NUMA auto"


def test_describe_mig_backed_variant():
    from gpuvfio.testbed.report import describe

    record = {"kind": "vgpu", "provisioning": {"profile": "NVIDIA A100-3-20C"},
              "vgpu": {"profile": "NVIDIA A100-3-20C", "kind": "sriov", "type": 700,
                       "mig_backed": {"slices": 3, "memory_gb": 20, "media": False}}}
    assert describe(record) == "vGPU NVIDIA A100-3-20C (sriov type 700), MIG-backed: 3 slice(s), 20 GB"


def test_identity_describes_the_system(tmp_path):
    from gpuvfio.address import PciAddress
    from gpuvfio.ops.identity import host_identity
    with open_context(sample_path("dgx-h100")) as (ctx, _label):
        ident = host_identity(ctx, [PciAddress.parse("0000:1b:00.0"), PciAddress.parse("0000:43:00.0")]).to_json()
    assert ident["accelerator_count"] == 2 and ident["accelerators"][0]["numa_node"] == 0
    assert ident["accelerators"][0]["link_max"] == "Gen5 x16"
    assert ident["numa_nodes"] == 2 and ident["host_cpus"] and ident["host_memory_kb"]
    assert 1048576 in ident["hugepage_sizes_kb"] and ident["iommu"] == "intel"
    assert ident["host_kernel"]
    with open_context(sample_path("workstation")) as (ctx, _label):  # a slot: the GPU and its audio function
        ident = host_identity(ctx, [PciAddress.parse("0000:01:00.0"), PciAddress.parse("0000:01:00.1")]).to_json()
    assert ident["accelerator_count"] == 1 and "4090" in ident["accelerators"][0]["model"]


VGPU_SPEC = """\
[guest]
disk = "/var/lib/libvirt/images/g.qcow2"
[guest.ssh]
port = 2222
[run]
SELECTION
[[variant]]
name = "v"
kind = "vgpu"
profile = "NVIDIA A10-4Q"
"""


@pytest.mark.parametrize("selection, code, fragment", [
    ('gpus = ["01:00"]', 1, "0000:01:00.0 has no SR-IOV VFs"),  # the GPU of the slot, not its audio function
    ('gpu_ids = ["10de::03xx"]', 2, "variant v: a vGPU takes one GPU, the selection holds 2 (0000:01:00.0, 0000:04:00.0)"),
    ('gpus = ["01:00.1"]', 2, "holds 0 (no display function)"),
    ('gpus = ["0000:07:00.0"]', 2, "no such PCI function on this host: 0000:07:00.0"),
])
def test_a_vgpu_variant_takes_the_one_gpu_selected(cli, tmp_path, selection, code, fragment):
    spec = write(tmp_path, VGPU_SPEC.replace("SELECTION", selection))
    result = cli("--root", sample_path("workstation"), "testbed", "plan", spec, "--yes")
    assert result.code == code and fragment in result.out + result.err, (result.out, result.err)


def test_placement_is_read_from_the_domain_xml(regenerate):
    from gpuvfio.testbed.run import placement

    golden = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "domain")
    xml = open(os.path.join(golden, sorted(f for f in os.listdir(golden) if "local" in f)[0])).read()
    placed = placement(xml)
    assert placed["hugepage_kib"] == 1048576 and placed["numa_nodeset"] is not None
    assert placed["vcpus"] > 0 and placed["vcpu_pins"] and placed["machine"] == "q35"
    assert placement(None) is None


def test_signals_during_teardown_wait_for_it():
    """A TERM or hangup while a variant is torn down is held until the teardown is over, and a
    second one after the first interrupt changes nothing (a remote Ctrl-C brings both)."""
    import signal

    from gpuvfio.testbed.run import Interrupted, SignalGuard

    signals = SignalGuard()
    signals.install()
    try:
        finished = []
        with pytest.raises(Interrupted):
            with signals.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGHUP)
                finished.append("teardown")
        assert finished == ["teardown"] and signals.fired
        with signals.deferred():
            os.kill(os.getpid(), signal.SIGTERM)  # after the interrupt: noted, not raised again
    finally:
        signals.uninstall()
    assert signal.getsignal(signal.SIGTERM) is not signals.handler


def test_result_archive_from_a_hypervisor_is_checked(tmp_path, monkeypatch):
    """Only identity.json and results/<variant>/rep-N.json come in, as regular files; and only
    regular result files go up (root unpacks them there)."""
    import io
    import tarfile

    from gpuvfio.errors import GpuvfioError
    from gpuvfio.testbed.remote import pack_results, unpack_results

    def archive(*entries):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for name, data, kind in entries:
                info = tarfile.TarInfo(name)
                info.type = kind
                if kind == tarfile.SYMTYPE:
                    info.linkname = "/root/.ssh/authorized_keys"
                info.size = len(data) if kind == tarfile.REGTYPE else 0
                tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
        return buffer.getvalue()

    good = archive(("./", b"", tarfile.DIRTYPE), ("./results", b"", tarfile.DIRTYPE),
                   ("./results/pt-1g", b"", tarfile.DIRTYPE), ("./results/pt-1g/rep-0.json", b"{}", tarfile.REGTYPE),
                   ("./identity.json", b"{}", tarfile.REGTYPE))
    assert sorted(unpack_results(good, str(tmp_path / "out"))) == ["identity.json", "results/pt-1g/rep-0.json"]
    for bad in (("./.ssh/authorized_keys", b"key", tarfile.REGTYPE), ("./results/../../x", b"", tarfile.REGTYPE),
                ("./results/pt-1g/rep-1.json", b"", tarfile.SYMTYPE), ("./results/pt-1g/notes.txt", b"", tarfile.REGTYPE)):
        with pytest.raises(GpuvfioError, match="refusing a result archive entry"):
            unpack_results(archive(bad), str(tmp_path / "out"))
    with pytest.raises(GpuvfioError, match="damaged"):
        unpack_results(b"not a tar archive at all" * 40, str(tmp_path / "out"))
    # Bounded in entries (issue 34 item 4): past what MAX_VARIANTS variants of 1000 repetitions
    # make, the archive is refused before anything of it is written.
    from gpuvfio.testbed import remote

    monkeypatch.setattr(remote, "MAX_MEMBERS", 40)  # the rule, not 257,000 entries
    many = archive(*[(f"./results/pt-1g/rep-{n}.json", b"{}", tarfile.REGTYPE) for n in range(remote.MAX_MEMBERS + 1)])
    with pytest.raises(GpuvfioError, match=f"more than {remote.MAX_MEMBERS} entries"):
        unpack_results(many, str(tmp_path / "many"))
    assert not (tmp_path / "many").exists()
    out = tmp_path / "out"
    os.symlink("/etc/passwd", out / "results" / "pt-1g" / "rep-1.json")
    spec = tmp_path / "spec.toml"
    spec.write_text(GOOD)
    with tarfile.open(fileobj=io.BytesIO(pack_results(str(spec), str(out)))) as tar:
        assert [(m.name, m.isfile()) for m in tar.getmembers()] == [
            ("spec.toml", True), ("out/identity.json", True), ("out/results/pt-1g/rep-0.json", True)]
    os.unlink(out / "identity.json")  # the identity through a link is not read: one line, nothing sent
    os.symlink("/etc/shadow", out / "identity.json")
    with pytest.raises(InputError, match="identity.json.*a link"):
        pack_results(str(spec), str(out))
    os.unlink(out / "identity.json")
    os.rename(out / "results", tmp_path / "real-results")
    os.symlink(tmp_path / "real-results", out / "results")  # the results directory itself a link
    with pytest.raises(InputError, match="results is a link"):
        pack_results(str(spec), str(out))


def test_identity_of_a_gpu_pci_ids_does_not_know(tmp_path, monkeypatch):
    """Debian 12's pci.ids has no H200: on main identity read fn.vendor/fn.device (no such
    attributes) and the run died with an AttributeError before the first variant."""
    from gpuvfio.address import PciAddress
    from gpuvfio.host.root import HostRoot
    from gpuvfio.ops.identity import host_identity
    from tests.hostbuilder import HostBuilder

    empty = tmp_path / "pci.ids"
    empty.write_text("# no entries\n")
    monkeypatch.setenv("GPUVFIO_PCI_IDS", str(empty))
    b = HostBuilder(str(tmp_path / "host"))
    b.iommu("intel", 1)
    rb = b.root_bus()
    b.function(rb, "0000:01:00.0", "10de", "2335", "030200", driver="nvidia")
    ident = host_identity(Context(host=HostRoot(b.root)), [PciAddress.parse("0000:01:00.0")]).to_json()
    assert ident["accelerators"][0]["model"] == "10de:2335"


def test_results_are_of_the_specs_gpu_not_cuda_device_0(tmp_path):
    """The verifier measures every CUDA device it sees; a result names the spec's GPU (on main the
    bare-metal baseline took whatever came first: device 0)."""
    from gpuvfio.address import PciAddress
    from gpuvfio.testbed.run import write_rep
    from gpuvfio.testbed.spec import Variant

    from gpuvfio.guest.checks import VerifyReport

    report = VerifyReport([], {"latency": {"00000000:1b:00.0": {"median_us": 9.0},
                                           "00000000:43:00.0": {"median_us": 5.0}}},
                          {"00000000:1b:00.0": {"h2d": 20.0, "d2h": 21.0, "d2d": 900.0},
                           "00000000:43:00.0": {"h2d": 50.0, "d2h": 51.0, "d2d": 1900.0}})
    variant = Variant("baremetal", "baremetal")
    write_rep(str(tmp_path), variant, 0, report, {}, [PciAddress.parse("0000:43:00.0")])
    record = json.loads((tmp_path / "results" / "baremetal" / "rep-0.json").read_text())
    assert record["metrics"]["h2d_gbps"] == 50.0 and record["metrics"]["latency_us"] == 5.0
    assert record["verify"] == report.to_json() and record["verify"]["ok"] is True


def test_a_run_refuses_a_selection_a_later_variant_cannot_take_before_measuring(cli, tmp_path):
    """Bare metal first, then a vGPU variant whose selection holds two GPUs: bad input before the
    first measurement (not after hours of it), nothing written to OUT."""
    from gpuvfio.host.fixture import load_fixture

    root = tmp_path / "ws"
    with open(sample_path("workstation"), encoding="utf-8") as handle:
        load_fixture(handle.read(), str(root))
    text = VGPU_SPEC.replace("SELECTION", 'gpu_ids = ["10de::03xx"]').replace(
        "[[variant]]", '[[variant]]\nname = "bare"\nkind = "baremetal"\n\n[[variant]]', 1)
    out = tmp_path / "out"
    result = cli("--root", str(root), "testbed", "run", write(tmp_path, text), "--out", str(out), "--yes",
                 "--connect", "test:///default")
    assert result.code == 2 and "variant v: a vGPU takes one GPU, the selection holds 2" in result.err, result.err
    assert not (out / "identity.json").exists() and not (out / "results").exists()


def test_a_spec_has_at_most_max_variants(tmp_path):
    """Issue 34 item 7: 10,000 variants planned for 15 minutes; past MAX_VARIANTS the spec is
    refused at once, naming the count and what to do."""
    from gpuvfio.testbed.spec import MAX_VARIANTS

    base = GOOD.split("[[variant]]")[0]
    spec = tmp_path / "many.toml"
    spec.write_text(base + "".join(f'\n[[variant]]\nname = "v{n}"\nkind = "passthrough"\n'
                                   for n in range(MAX_VARIANTS + 1)))
    with pytest.raises(InputError, match=f"{MAX_VARIANTS + 1} \\[\\[variant\\]\\] tables: a testbed compares at most "
                                         f"{MAX_VARIANTS}"):
        load_spec(str(spec))
    spec.write_text(base + "".join(f'\n[[variant]]\nname = "v{n}"\nkind = "passthrough"\n'
                                   for n in range(MAX_VARIANTS)))
    assert len(load_spec(str(spec)).variants) == MAX_VARIANTS
