"""Output people read, through a real terminal (a pty at 80 and 200 columns) and through a pipe
(issue 15 item 1): tables fit the terminal by dropping the least needed columns, never cut an
address or a fix command; a pipe gets plain aligned lines; --format csv|plain|table|json."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import run_on_pty
from tests.make_samples import sample_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
BOX = set("│┃┏┓┗┛┡┩└┘┌┐━─╇┼┳┻┬┴╈╋")


def in_terminal(args: list[str], columns: int) -> str:
    """gpuvfio ARGS with its output on a pty of ``columns`` x 50; what the terminal received."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    env["TERM"] = "xterm-256color"
    return ANSI.sub("", run_on_pty(args, env, columns).decode("utf-8", "replace")).replace("\r\n", "\n")


def piped(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuvfio", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120, check=False)


WORKSTATION = sample_path("workstation")
ADDRESSES = ["0000:01:00.0", "0000:01:00.1", "0000:04:00.0", "0000:04:00.1"]


def test_list_at_80_columns_drops_columns_and_cuts_nothing():
    out = in_terminal(["--root", WORKSTATION, "list"], 80)
    table = [line for line in out.splitlines() if set(line) & BOX]
    assert table and all(len(line) <= 80 for line in table), "\n".join(table)
    assert "…" not in out
    for address in ADDRESSES:
        assert any(address in line for line in table), address  # whole, on one line
    assert re.search(r"not shown at 80 columns: .*Virtualization", out)
    assert "group 6 not viable: shares IOMMU group 6 with 0000:03:00.0" in out


def test_list_at_200_columns_shows_every_column():
    out = in_terminal(["--root", WORKSTATION, "list"], 200)
    header = next(line for line in out.splitlines() if "Address" in line)
    for title in ("Address", "Device", "Driver", "Group", "Viable", "NUMA", "Link", "Largest BAR", "Virtualization"):
        assert title in header
    assert "not shown" not in out and "…" not in out


@pytest.mark.parametrize("columns", [80, 200])
def test_doctor_fixes_are_whole_below_the_table(columns):
    fixes = [c["fix"] for c in json.loads(piped(["--root", WORKSTATION, "doctor", "--json"]).stdout)["checks"]
             if c["fix"]]
    assert fixes
    out = in_terminal(["--root", WORKSTATION, "doctor"], columns)
    table = [line for line in out.splitlines() if set(line) & BOX]
    assert all(len(line) <= columns for line in table)
    for fix in fixes:  # each copyable as it is: one line, not cut, not wrapped by gpuvfio
        assert any(line.endswith(fix) and " fix: " in line for line in out.splitlines()), fix
    assert "…" not in out


def test_a_pipe_gets_plain_lines_and_csv_parses():
    plain = piped(["--root", WORKSTATION, "list"])
    assert plain.returncode == 0 and not set(plain.stdout) & BOX
    lines = plain.stdout.splitlines()
    assert lines[0].split()[:3] == ["Address", "Device", "Driver"]
    for address in ADDRESSES:  # grep-able: a row starts with its address and has its driver
        (row,) = [line for line in lines if line.startswith(address)]
        assert ("nvidia" if address.endswith(".0") else "snd_hda_intel") in row
    rows = list(csv.reader(io.StringIO(piped(["--root", WORKSTATION, "list", "--format", "csv"]).stdout)))
    assert rows[0][:2] == ["Address", "Device"] and [r[0] for r in rows[1:]] == ADDRESSES
    doctor = list(csv.DictReader(io.StringIO(piped(["--root", WORKSTATION, "doctor", "--format", "csv"]).stdout)))
    assert {"Check", "Status", "Summary", "Fix"} == set(doctor[0]) and any(r["Fix"] for r in doctor)
    table = piped(["--root", WORKSTATION, "list", "--format", "table"])  # asked for: a table even in a pipe
    assert set(table.stdout) & BOX
    same = json.loads(piped(["--root", WORKSTATION, "list", "--format", "json"]).stdout)
    assert same == json.loads(piped(["--root", WORKSTATION, "list", "--json"]).stdout)


@pytest.mark.parametrize("args", [["--format", "yaml"], ["--format", "csv", "--json"], ["--format", ""]])
def test_bad_formats_are_one_line(args):
    result = piped(["--root", WORKSTATION, "list", *args])
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_progress_is_a_spinner_on_a_terminal_and_lines_in_a_pipe(capsys):
    """A step that runs shows as a spinner on a terminal, cleared when the step ends; in a pipe
    each step is a line of its own (issue 15 item 1)."""
    import time

    from rich.console import Console

    from gpuvfio.cli.app import TerminalProgress, progress_for, stop_progress

    buffer = io.StringIO()
    progress = TerminalProgress(Console(file=buffer, force_terminal=True, width=80))
    progress("wait for ssh ...")
    time.sleep(0.3)
    progress("wait for ssh: done (0.3s)")
    progress("verify ...")
    stop_progress()  # as main() does before it writes an error
    out = ANSI.sub("", buffer.getvalue())
    assert "⠋ gpuvfio: wait for ssh" in out and "gpuvfio: wait for ssh: done (0.3s)\n" in out
    assert TerminalProgress.current is None
    piped_progress = progress_for(False)  # stderr is not a terminal under pytest
    piped_progress("bind ...")
    piped_progress("bind: done (0.1s)")
    assert capsys.readouterr().err == "gpuvfio: bind ...\ngpuvfio: bind: done (0.1s)\n"


def test_progress_on_a_terminal_that_hung_up_ends_quietly():
    """A remote testbed run's stderr is a pty; when the connection drops the pty is hung up and
    every write to it fails with EIO (dropbear 2022+, OpenSSH). Progress then stops quietly: on
    Debian 13 the run's teardown died on its own "detach" line and left the guest defined."""
    import errno
    import time

    from rich.console import Console

    from gpuvfio.cli.app import TerminalProgress, stop_progress

    master, slave = os.openpty()
    tty = os.fdopen(slave, "w", buffering=1)
    try:
        progress = TerminalProgress(Console(file=tty, force_terminal=True, width=80))
        progress("tiny-4k: repetition 2/2")
        progress("verify ...")  # a spinner, refreshed by a thread of its own
        time.sleep(0.2)
        os.close(master)  # the hangup
        with pytest.raises(OSError) as hung_up:
            os.write(slave, b"x")
        assert hung_up.value.errno == errno.EIO  # the kernel's answer the progress meets
        progress("verify: done (0.2s)")
        progress("tiny-4k: detach")
        progress("destroy ...")
        stop_progress()
        assert progress.gone and progress.status is None and TerminalProgress.current is None
    finally:
        try:
            tty.close()
        except OSError:  # what it still buffered had nowhere to go
            pass


def test_control_characters_from_a_host_are_shown_not_obeyed():
    """A driver or device name from a hostile recording with an escape sequence or a newline
    neither recolours the terminal nor makes a row of its own."""
    from gpuvfio.cli.output import Column, Listing, print_listing

    listing = Listing("t", [Column("Address", keep=True), Column("Driver")])
    listing.add("0000:01:00.0", "evil\x1b[31m\nfake-row")
    listing.notes.append("note\x1b]0;title\x07")
    for fmt in ("plain", "csv", "table"):
        out = io.StringIO()
        print_listing(listing, fmt, out)
        text = out.getvalue()
        assert "\x1b" not in text and "\x07" not in text, fmt
        assert not any(line.lstrip("│ ").startswith("fake-row") for line in text.splitlines()), fmt
        assert "evil\\x1b[31m\\nfake-row" in text, fmt


def _pipeline(args: list[str], reader: list[str]) -> tuple[int, str, str]:
    """gpuvfio ARGS | READER through a real pipe: gpuvfio's exit status, READER's output and
    gpuvfio's stderr."""
    env = {**os.environ, "PYTHONPATH": REPO}
    writer = subprocess.Popen([sys.executable, "-m", "gpuvfio", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              cwd=REPO, env=env)
    read = subprocess.run(reader, stdin=writer.stdout, capture_output=True, text=True, timeout=60)
    writer.stdout.close()
    err = writer.stderr.read().decode("utf-8", "replace")
    return writer.wait(timeout=60), read.stdout, err


@pytest.mark.parametrize("args", [["list", "--all"], ["list", "--all", "--json"], ["doctor"], ["dump-host", "-"]])
def test_a_closed_pipe_ends_quietly_with_exit_0(args):
    """gpuvfio list | head -1 exited 1 (click's EPIPE handling); lspci ends quietly."""
    code, out, err = _pipeline(["--root", sample_path("dgx-h100"), *args], ["head", "-c", "20"])
    assert code == 0 and err == "" and len(out) == 20, (code, err)


@pytest.mark.parametrize("args", [["health"], ["list", "--all"], ["list", "--json"], ["dump-host", "-"]])
def test_an_output_that_cannot_be_written_is_one_line_and_exit_1(args):
    """gpuvfio health > /dev/full ended in a traceback; the output failing fails the command,
    said in one line, whether the write or the flush at exit meets the full device."""
    if not os.path.exists("/dev/full"):
        pytest.fail("/dev/full is missing: the check cannot run")
    env = {**os.environ, "PYTHONPATH": REPO}
    with open("/dev/full", "wb") as full:
        done = subprocess.run([sys.executable, "-m", "gpuvfio", "--root", sample_path("dgx-h100"), *args], stdout=full,
                              stderr=subprocess.PIPE, cwd=REPO, env=env, timeout=120, check=False)
    err = done.stderr.decode("utf-8", "replace")
    assert (done.returncode, err) == (1, "gpuvfio: error: could not write the output: No space left on device\n")


def test_plain_output_in_a_pipe_is_data_lines_only_notes_on_stderr():
    """Plain (the default in a pipe) carries one header line and rows; "group 6 not viable" and
    such notes go to stderr, as lspci's warnings do."""
    code, out, err = _pipeline(["--root", WORKSTATION, "list"], ["cat"])
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("Address") and all(line.startswith("0000:") for line in lines[1:])
    assert "not viable" not in out and "group 6 not viable: shares IOMMU group 6 with 0000:03:00.0" in err


@pytest.mark.parametrize("fmt", ["plain", "csv", "json"])
def test_status_takes_format_and_a_recording(fmt, tmp_path):
    """status answered only --json, and a recording (--root X.host) was "not a directory"."""
    result = piped(["--root", WORKSTATION, "status", "--format", fmt])
    assert result.returncode == 0, result.stderr
    if fmt == "json":
        assert json.loads(result.stdout)["devices"] == []
    elif fmt == "csv":
        assert next(csv.reader(io.StringIO(result.stdout))) == ["Address", "Group", "Driver now", "Override now",
                                                                 "Original driver", "Original override"]
    else:
        assert result.stdout.splitlines()[0].split()[:2] == ["Address", "Group"]


def test_dry_runs_take_a_recording_and_show_the_plan_before_a_missing_yes():
    """bind/persist --dry-run on a recording exited 2 ("host root is not a directory"); a dry run
    of a selector that expands to two devices refused for --yes and showed nothing."""
    result = piped(["--root", sample_path("epyc-mixed"), "bind", "0000:81:00.0", "--dry-run"])
    assert result.returncode in (0, 1) and "not a directory" not in result.stderr
    assert "Devices that end on vfio-pci" in result.stdout
    result = piped(["--root", sample_path("epyc-mixed"), "persist", "0000:81:00.0", "--dry-run"])
    assert result.returncode in (0, 1) and "not a directory" not in result.stderr, result.stderr



def test_a_dry_run_shows_the_plan_then_says_the_run_needs_yes(tmp_path):
    """A selector that expands to two GPUs: the dry run shows the plan and exits as the run would
    without --yes (refused, saying so); with --yes it is the plan alone."""
    from tests.conftest import BAR64_PREF, GiB, HostBuilder

    b = HostBuilder(str(tmp_path / "host"))
    b.iommu("intel", 1)
    rb = b.root_bus(numa=0)
    for n, bus in enumerate((1, 2)):
        port = b.bridge(rb, f"0000:00:0{n + 1}.0", "8086", "a70d", secondary_bus=bus, link=(4, 16))
        b.function(port, f"0000:0{bus}:00.0", "10de", "2684", "030000", driver="nvidia", link=(4, 16),
                   bars=[(1, 32 * GiB, BAR64_PREF)], boot_vga=False)
    b.modules(["nvidia", "vfio_pci"])
    result = piped(["--root", b.root, "bind", "-d", "10de:", "--dry-run"])
    assert result.returncode == 1 and "Devices that end on vfio-pci: 0000:01:00.0, 0000:02:00.0" in result.stdout
    assert "add --yes" in result.stderr, result.stderr
    result = piped(["--root", b.root, "bind", "-d", "10de:", "--dry-run", "--yes"])
    assert result.returncode == 0 and "--yes" not in result.stderr and "Devices that end on vfio-pci" in result.stdout
