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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
