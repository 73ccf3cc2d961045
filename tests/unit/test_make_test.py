"""make test prints its own duration at the end (issue 39): the whole run and each of its two
pytest runs, whether they pass or fail, and still exits as they did. The recipe is run for real
by make, with a stand-in for pytest that sleeps, then passes or fails (deps is taken as made)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO, need_tool


@pytest.mark.parametrize("outcome, rc", [("true", 0), ("false", 2)])
def test_make_test_says_how_long_each_run_took(tmp_path, outcome, rc):
    need_tool(shutil.which("make") is not None, "make")
    stand_in = tmp_path / "pytest"
    stand_in.write_text(f"#!/bin/sh\nsleep 1\nexec {outcome}\n")
    stand_in.chmod(0o755)
    proc = subprocess.run(["make", "-s", "-o", "deps", "test", f"PYTEST={stand_in}"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == rc, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"make test: (\d+) s \(unit and package lanes (\d+) s, guest lanes (\d+) s\)", last)
    assert match, proc.stdout
    total, first, second = map(int, match.groups())
    assert first >= 1 and second >= 1 and abs(total - first - second) <= 1  # three readings of one clock
