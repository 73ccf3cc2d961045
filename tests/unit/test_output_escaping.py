"""Escaped output (issue 22 item 4): what a host's sysfs and pci.ids, a guest, the journal or a
results file says reaches a terminal, a pipe or a report only through gpuvfio's one escape
(gpuvfio.cli.output.printable). A hostile host names its devices, drivers, vGPU types and
journal entries with escape sequences (ESC[2J, the 8-bit CSI U+009B, BEL), bidi overrides and
rich markup (``[link=file:///etc]`` would make a terminal hyperlink); the real commands run
against it in every --format and no control character, no markup and no HTML of its choosing
comes out."""

from __future__ import annotations

import csv
import io
import json
import os
import re

import pytest

from tests.conftest import run_on_pty
from tests.hostbuilder import BAR32, BAR64_PREF, GiB, HostBuilder, MiB

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLEAR, CSI8, BEL = "\x1b[2J", "\x9b31m", "\x07"
BIDI = "\u202e\u2066"  # right-to-left override, left-to-right isolate
LINK = "[link=file:///etc]x[/link]"
SCRIPT = "<script>alert(1)</script>"
# For file contents (pci.ids, sysfs attributes, the journal): anything goes.
# (NEL, U+0085, inside: sysfs and pci.ids values are stripped, and it ends a line for splitlines.)
EVIL = f"EVIL{CLEAR}{CSI8}{BEL}\x85\x7f{BIDI}{LINK}{SCRIPT}:warning:"
# For names of directories and links (a driver, an mdev type): no "/".
EVIL_NAME = f"nv{CLEAR}{CSI8}{BEL}{BIDI}[bold]<script>:warning:"
SHOWN = "EVIL\\x1b[2J\\x9b31m\\x07\\x85\\x7f\\u202e\\u2066"  # how printable() shows EVIL's controls
GPU, VGPU_PF, VF = "0000:01:00.0", "0000:02:00.0", "0000:02:00.4"
_BIDI_CONTROLS = set(range(0x202A, 0x202F)) | set(range(0x2066, 0x206A))


def raw_controls(text: str) -> list[str]:
    """What a terminal would act on: C0 but the newline, DEL, C1, bidi controls, and the lone
    surrogates bytes that are not UTF-8 decode to (surrogateescape)."""
    return [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) <= 0x9F
            or ord(c) in _BIDI_CONTROLS or 0xD800 <= ord(c) <= 0xDFFF]


def assert_clean(text: str, where: str) -> None:
    found = raw_controls(text)
    assert not found, f"{where}: raw {found!r} in {text!r}"
    assert "[link=" not in re.sub(r"\\\[link=|\[link=file:///etc\]x\[/link\]", "", text), where
    assert "⚠" not in text, f"{where}: an emoji code was obeyed"


def hostile_host(root) -> HostBuilder:
    """A GPU on a driver with a hostile name, named by a hostile pci.ids, offering legacy mdev
    types and (a second GPU) SR-IOV vGPU types with hostile names; a journal whose free fields
    are hostile."""
    b = HostBuilder(str(root))
    b.iommu("intel", 1)
    b.cpuinfo("Intel(R) Xeon(R) Gold 6430", 46)
    cpus = b.cpu_topology(1, 4, 2)
    b.numa_node(0, cpus[0], 64)
    rb = b.root_bus(numa=0)
    b.function(rb, "0000:00:00.0", "8086", "a700", "060000")
    port = b.bridge(rb, "0000:00:01.0", "8086", "a70d", secondary_bus=1, link=(4, 16))
    gpu = b.function(port, GPU, "10de", "1eb8", "030200", driver=EVIL_NAME, link=(4, 16),
                     bars=[(0, 16 * MiB, BAR32), (1, 16 * GiB, BAR64_PREF)])
    b.mdev_types(gpu, [(f"nvidia-222{CLEAR}{BIDI}", EVIL, 4, EVIL)])
    port2 = b.bridge(rb, "0000:00:02.0", "8086", "a70d", secondary_bus=2, link=(4, 16))
    pf = b.function(port2, VGPU_PF, "10de", "2236", "030200", driver="nvidia", link=(4, 16),
                    bars=[(0, 16 * MiB, BAR32), (1, 16 * GiB, BAR64_PREF)])
    for vf in b.sriov(pf, 4, [VF, "0000:02:00.5"], "2236", "10de", "030200", driver="nvidia"):
        b.vgpu_types(vf, [(592, EVIL), (593, "NVIDIA A10-4Q")])
    b.modules(["nvidia", "vfio", "vfio_pci", "vfio_iommu_type1"])
    ids = os.path.join(str(root), "usr", "share", "misc", "pci.ids")
    os.makedirs(os.path.dirname(ids), exist_ok=True)
    with open(ids, "w", encoding="utf-8") as handle:
        handle.write(f"10de  NVIDIA Corporation\n\t1eb8  {EVIL}\n\t2236  GA102GL [A10]\n"
                     "8086  Intel Corporation\n\ta700  Host bridge\n\ta70d  PCIe root port\n")
    state = os.path.join(str(root), "var", "lib", "gpuvfio")
    os.makedirs(state, exist_ok=True)
    journal = {"version": 1, "devices": {GPU: {"original_driver": "nvidia", "original_override": None, "group": 0}},
               "services_stopped": [], "mdevs": {}, "vgpus": {}, "schedulers": {},
               "broken": {GPU: {"reason": EVIL, "since": 1.0}}, "partitions": {},
               "operation": {"kind": EVIL, "pid": EVIL, "steps": [{"description": EVIL, "state": EVIL}]}}
    with open(os.path.join(state, "journal.json"), "w", encoding="utf-8") as handle:
        json.dump(journal, handle)
    return b


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUVFIO_PCI_IDS", raising=False)
    monkeypatch.delenv("GPUVFIO_STATE_DIR", raising=False)
    hostile_host(tmp_path / "host")
    return str(tmp_path / "host")


def check_run(result, fmt: str, where: str):
    assert_clean(result.out, f"{where} stdout")
    assert_clean(result.err, f"{where} stderr")
    if fmt == "json":
        assert result.out.isascii(), where  # ensure_ascii: every non-ASCII character as \uXXXX
        return json.loads(result.out)
    if fmt == "csv":
        list(csv.reader(io.StringIO(result.out)))
    return None


@pytest.mark.parametrize("fmt", ["table", "plain", "csv", "json"])
def test_list_and_doctor_show_a_hostile_host_in_every_format(cli, hostile, fmt, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # the table with every column
    listed = cli("--root", hostile, "list", "--format", fmt)
    assert listed.code == 0, listed.err
    data = check_run(listed, fmt, "list")
    if fmt == "json":  # the values themselves intact
        gpu = next(d for d in data["devices"] if d["address"] == GPU)
        assert gpu["device_name"] == EVIL and gpu["driver"] == EVIL_NAME
    else:
        assert SHOWN in listed.out and ":warning:" in listed.out
    doctor = cli("--root", hostile, "doctor", "--format", fmt)
    check_run(doctor, fmt, "doctor")


@pytest.mark.parametrize("json_flag", [False, True])
def test_topo_escapes_device_and_driver_names(cli, hostile, json_flag):
    result = cli("--root", hostile, "topo", *(["--json"] if json_flag else []))
    assert result.code == 0, result.err
    data = check_run(result, "json" if json_flag else "plain", "topo")
    if json_flag:
        assert any(d["device_name"] == EVIL for d in data["devices"])
    else:
        assert SHOWN in result.out and "nv\\x1b[2J\\x9b31m\\x07\\u202e\\u2066[bold]<script>" in result.out


@pytest.mark.parametrize("json_flag", [False, True])
@pytest.mark.parametrize("device", [GPU, VGPU_PF])  # legacy mdev types; SR-IOV types on the VFs
def test_vgpu_types_escapes_type_names(cli, hostile, device, json_flag):
    result = cli("--root", hostile, "vgpu", "types", device, *(["--json"] if json_flag else []))
    assert result.code == 0, result.err
    data = check_run(result, "json" if json_flag else "plain", "vgpu types")
    # (creatable_vgpu_types is read line by line: an SR-IOV type's name ends at the NEL.)
    if json_flag:
        names = [t["name"] for t in data["mdev_types"] + data["sriov_types"]]
        assert EVIL in names if device == GPU else EVIL.split("\x85")[0] in names
    else:
        assert SHOWN.split("\\x85")[0] in result.out


@pytest.mark.parametrize("fmt", ["table", "plain", "csv", "json"])
def test_status_escapes_the_journal(cli, hostile, fmt):
    result = cli("--root", hostile, "status", "--format", fmt)
    assert result.code == 0, result.err
    data = check_run(result, fmt, "status")
    if fmt == "json":
        assert data["broken"][GPU]["reason"] == EVIL and data["unfinished_operation"]["kind"] == EVIL
    elif fmt == "table":  # shown, markup and all, not obeyed
        assert result.out.count(SHOWN) >= 4 and result.out.count(LINK) >= 4 and "<script>" in result.out
    else:  # rows on stdout, the journal's other records as notes on stderr (plain) or not at all (CSV)
        assert "nv\\x1b[2J\\x9b31m" in result.out and (fmt == "csv" or (SHOWN in result.err and LINK in result.err))


def in_terminal(args: list[str]) -> str:
    """gpuvfio ARGS on a pty, colours on: every byte the terminal received, undecodable bytes kept
    as surrogates."""
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "GPUVFIO_PCI_IDS", "GPUVFIO_STATE_DIR")}
    env.update(TERM="xterm-256color", COLUMNS="200", PYTHONPATH=REPO)
    return run_on_pty(args, env).decode("utf-8", "surrogateescape")


def test_a_terminal_gets_no_hyperlink_and_no_sequence_from_the_journal(hostile):
    """On a real terminal rich colours what gpuvfio marks up; a journal field's [link=...] must
    not become an OSC 8 hyperlink, nor its ESC[2J clear the screen."""
    out = in_terminal(["--root", hostile, "status"])
    assert "\x1b]8;" not in out and CLEAR not in out and "\x9b" not in out and BEL not in out, repr(out)
    assert not set(out) & {chr(c) for c in _BIDI_CONTROLS}
    assert LINK in re.sub(r"\x1b\[[0-9;]*m", "", out)


def test_error_lines_quote_link_targets_escaped(cli, hostile):
    """An error quoting what the host's tree holds (here a link's target) is one escaped line."""
    group = os.path.join(os.path.realpath(os.path.join(hostile, "sys", "bus", "pci", "devices", GPU)), "iommu_group")
    os.unlink(group)
    os.symlink(f"/{EVIL}", group)
    result = cli("--root", hostile, "list")
    assert result.code == 2 and result.err.startswith("gpuvfio: error: ") and result.err.count("\n") == 1, result.err
    assert_clean(result.err, "error line")
    assert SHOWN in result.err


def test_error_lines_quote_type_names_escaped(cli, hostile):
    result = cli("--root", hostile, "vgpu", "create", GPU, "no-such-type")
    assert result.code == 1 and result.err.count("\n") == 1, result.err
    assert_clean(result.err, "error line")
    assert SHOWN in result.err


def test_progress_and_say_escape(capsys):
    from rich.console import Console

    from gpuvfio.cli.app import TerminalProgress, say

    say(EVIL)
    assert_clean(capsys.readouterr().err, "say")
    buffer = io.StringIO()
    progress = TerminalProgress(Console(file=buffer, force_terminal=True, width=200))
    progress(f"{EVIL} ...")
    progress(f"{EVIL}: done")
    progress.stop()
    out = buffer.getvalue()
    assert "\x1b]8;" not in out and CLEAR not in out and "\x9b" not in out and BEL not in out, repr(out)
    assert LINK in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)


@pytest.mark.parametrize("json_flag", [False, True])
def test_verify_escapes_what_the_guest_says(cli, hostile, monkeypatch, tmp_path, json_flag):
    """The guest chooses its driver's name and its kernel log: verify shows them, escaped."""
    from gpuvfio.cli import guest
    from gpuvfio.guest.checks import judge
    from gpuvfio.guest.verify import parse_probe, parse_verifier
    from tests.unit.test_verify import H100, probe_text, verifier_json

    said = EVIL.replace("\x85", "")  # the probe's answer is read line by line
    line = f"PCI|0000:01:00.0|0x10de|0x2330|0x030200|nv{said}|32.0 GT/s PCIe|16|32.0 GT/s PCIe|16|0000:00:02.0"
    report = judge(parse_probe(probe_text([line], dmesg=[f"NVRM: Xid {said}"])), parse_verifier(verifier_json()),
                   [H100])
    report.ssh_notes = [f"the guest says {EVIL}"]
    report.bandwidth_gbps[EVIL] = {"h2d": 1.0}
    monkeypatch.setattr(guest, "verify", lambda *args, **kwargs: report)
    known = tmp_path / "known_hosts"
    known.write_text("")
    result = cli("--root", hostile, "verify", "--ssh-host", "192.0.2.1", "--known-hosts", str(known),
                 *(["--json"] if json_flag else []))
    assert result.code == 1, result.err  # the driver check failed
    data = check_run(result, "json" if json_flag else "table", "verify")
    if json_flag:
        assert any(c["observed"] == f"nv{said}" for c in data["checks"])
    else:
        assert SHOWN.replace("\\x85", "") in result.out and LINK in result.out and SHOWN in result.err


def test_printable_forms():
    from gpuvfio.cli.output import printable, printable_report

    assert printable(EVIL) == printable(printable(EVIL))  # the control part is idempotent
    assert not raw_controls(printable(EVIL)) and SHOWN in printable(EVIL)
    assert printable("\udcff") == "\\udcff"  # a file name that was not UTF-8: shown, not a crash
    assert printable(LINK, "markup") == "\\[link=file:///etc]x\\[/link]"
    assert printable("a$b$c", "mathtext") == "a\\$b\\$c"
    md = printable("x_y _z_ *a* [t](javascript:alert(1)) <b>&amp; www.e.org a@b.org `c` |", "markdown")
    assert md == ("x_y \\_z\\_ \\*a\\* \\[t\\](javascript\\:alert(1)) &lt;b&gt;&amp;amp; www\\.e.org a`@`b.org "
                  "\\`c\\` \\|")
    assert printable_report({EVIL: [EVIL, 1, None, True, 2.5]}) == {printable(EVIL): [printable(EVIL), 1, None, True,
                                                                                      2.5]}
    with pytest.raises(ValueError):
        printable("x", "html")


# -- the testbed report ----------------------------------------------------------------------------

HOSTILE_VARIANT = f"pt{CLEAR}{BIDI} {SCRIPT} [x](javascript:alert(1)) <javascript:alert(2)> **b** a|b $\\notmath$"
HOSTILE_LINKS = "https://evil.example/p www.evil.example me@evil.example <img src=x onerror=alert(3)>"


def hostile_results(out: str) -> None:
    from tests.testbed_data import write_synthetic

    write_synthetic(out)
    results = os.path.join(out, "results")
    for rep in sorted(os.listdir(os.path.join(results, "passthrough-1g"))):
        path = os.path.join(results, "passthrough-1g", rep)
        with open(path) as handle:
            record = json.load(handle)
        record["variant"] = HOSTILE_VARIANT
        record["guest"]["driver_version"] = f"{SCRIPT} {HOSTILE_LINKS}"
        record["provisioning"]["hugepages"] = f"[y](javascript:alert(4)) {EVIL}"
        with open(path, "w") as handle:
            json.dump(record, handle)
    with open(os.path.join(out, "identity.json")) as handle:
        identity = json.load(handle)
    identity[f"<script>k{CLEAR}"] = f"[click](javascript:alert(5)) {HOSTILE_LINKS} {EVIL}"
    identity["host_cpu"] = "<b>bold</b> _em_ `code` ~~gone~~"
    with open(os.path.join(out, "identity.json"), "w") as handle:
        json.dump(identity, handle)


def test_testbed_report_carries_no_script_and_no_link_from_the_results(tmp_path):
    from markdown_it import MarkdownIt

    from gpuvfio.testbed.report import write_report

    out = str(tmp_path / "run")
    hostile_results(out)
    summary = write_report(out)
    md = open(os.path.join(out, "report.md"), encoding="utf-8").read()
    page = open(os.path.join(out, "report.html"), encoding="utf-8").read()
    for name, text in (("report.md", md), ("report.html", page)):
        assert not raw_controls(text), name
        assert "<script" not in text.lower() and "<img src=x" not in text, name
    # Markdown: no HTML, no link, no autolink of the results' making
    assert "javascript:" not in md and "https://" not in md and not re.search(r"<[A-Za-z/!?]", md)
    links = re.findall(r"(?<!\\)\]\(", md)  # "](" that is not an escaped "\]" followed by "("
    assert len(links) == len([f for f in summary["files"] if f.endswith(".png")])  # the plots only
    rendered = MarkdownIt("commonmark").enable("table").enable("strikethrough").render(md)
    assert "<a " not in rendered and "<script" not in rendered and "<b>" not in rendered
    assert "<em>" not in rendered and "<s>" not in rendered and "<code>c</code>" not in rendered
    assert [m for m in re.findall(r'<img src="([^"]*)"', rendered) if not m.endswith(".png")] == []
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in rendered  # shown as text
    assert "[x](javascript:alert(1))" in rendered and "pt\\x1b[2J\\u202e\\u2066" in rendered
    try:  # GitHub's renderer, where installed: its extended autolinks (www., https://, e-mail) too
        import cmarkgfm
    except ImportError:
        pass
    else:
        github = cmarkgfm.github_flavored_markdown_to_html(md)
        assert "<a " not in github and "<script" not in github
    # HTML: autoescaped; no attribute holds a value of the results
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "href=" not in page
    assert all(src.startswith("data:image/png;base64,") for src in re.findall(r'src="([^"]*)"', page))
    assert "pt\\x1b[2J\\u202e\\u2066" in page


def test_testbed_report_plots_take_names_as_text(tmp_path, monkeypatch):
    """matplotlib reads $...$ in a label as mathtext (a name with a bad one used to stop the
    report): the plots show the names as they are."""
    from matplotlib.axes import Axes

    from gpuvfio.testbed.report import write_report

    labels: list[str] = []
    original = Axes.set_xticks
    monkeypatch.setattr(Axes, "set_xticks", lambda self, ticks, names=None, **k: labels.extend(names or [])
                        or original(self, ticks, names, **k))
    out = str(tmp_path / "run")
    hostile_results(out)
    write_report(out)
    assert any("\\$\\notmath\\$" in label for label in labels)
    assert not any(raw_controls(label) for label in labels)
