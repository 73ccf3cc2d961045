"""A recording's structure is bounded (issue 34 item 7): its depth by the file layer's walk, a
record's length by what the recorder writes, the record count; a CPU list that repeats a range
costs its length, not the range times the repeats. Each refusal is one line, exit 2, and leaves
no scratch tree behind."""

from __future__ import annotations

import glob
import os
import tempfile

import pytest

from gpuvfio.host import fixture
from gpuvfio.host.model import parse_cpulist
from tests.make_samples import sample_path

COMMANDS = (["list"], ["doctor"], ["dump-host", "-"])


@pytest.fixture(autouse=True)
def own_scratch(tmp_path, monkeypatch):
    """This test's own scratch place (TMPDIR, and tempfile's documented default for an
    in-process run): other tests running at the same time make and remove their own."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


def scratch_trees() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "gpuvfio-host-*")))


def recording(tmp_path, *extra: str) -> str:
    with open(sample_path("iommu-off"), encoding="utf-8") as handle:
        text = handle.read()
    path = tmp_path / "hostile.host"
    path.write_text(text + "".join(line + "\n" for line in extra))
    return str(path)


def refused_in_one_line(cli, path: str, words: str) -> None:
    before = scratch_trees()
    for command in COMMANDS:
        result = cli("--root", path, *command)
        assert result.code == 2, (command, result.err[-500:])
        assert "Traceback" not in result.err and len(result.err.strip().splitlines()) == 1, result.err[-500:]
        assert words in result.err, result.err
    assert scratch_trees() <= before, "a refused recording left its scratch tree"


def test_a_recording_deeper_than_the_walk_is_refused(cli, tmp_path):
    deep = "sys/devices/" + "/".join(["d"] * 3000)
    refused_in_one_line(cli, recording(tmp_path, f"D {deep}", f"F {deep}/x 1"),
                        "3002 path components; at most 128 (the file layer's walk)")


def test_a_huge_record_is_refused(cli, tmp_path):
    refused_in_one_line(cli, recording(tmp_path, "F sys/devices/huge " + "A" * (6 << 20)),
                        "characters; a record is at most 5242880")


def test_too_many_records_are_refused(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(fixture, "MAX_RECORDS", 100)
    refused_in_one_line(cli, recording(tmp_path), "records; at most 100 are loaded")


def test_a_repeated_cpu_range_is_taken_once():
    """0-8191 repeated 9,000 times made doctor take 30 s and 2.85 GB: every CPU was listed once
    per repeat. Each CPU is there once now, in order."""
    assert parse_cpulist(",".join(["0-8191"] * 9000)) == list(range(8192))
    assert parse_cpulist("8,0-3,2-5,3") == [0, 1, 2, 3, 4, 5, 8]
    assert parse_cpulist("0-15:2/4") == list(range(16))
