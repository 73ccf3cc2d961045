"""Hostile host fixtures (``gpuvfio --root bug-report.host``) never write outside their directory.

On main a fixture could write anywhere: link targets were checked by their text, ``proc/*/fd/*``
links were exempt, and later records were written through links.
"""

from __future__ import annotations

import os
import random
import signal
import stat
import subprocess
import sys

import pytest

from gpuvfio.errors import InputError
from gpuvfio.host.fixture import HEADER, load_fixture
from tests.conftest import CANARY, REPO, untouched

FD = "proc/1/fd/9"


def fixture(*records: str) -> str:
    return HEADER + "\n" + "\n".join(records) + "\n"


@pytest.mark.parametrize("records", [
    # the exemption for fd links, then a file written through it
    lambda out: [f"L {FD} {out}", f"F {FD}/pwned yes"],
    lambda out: [f"L {FD} {out}", f"D {FD}/pwned"],
    lambda out: [f"L {FD} {out}", f"L {FD}/pwned ../x"],
    # a link inside the root, then a record through it
    lambda out: ["D sys", "L sys/up ..", "F sys/up/pwned yes"],
    # a record at a path that is a link already
    lambda out: ["D sys", f"L {FD} {out}/secret", f"F {FD} clobbered"],
    # a link that is lexically inside but really leaves: "." then "<it>/.."
    lambda out: ["L here .", "L out here/../outside/pwned", "F out yes"],
    # absolute and parent-directory targets, and paths
    lambda out: [f"L sys/x {out}"],
    lambda out: ["L sys/x ../../outside"],
    lambda out: ["F ../outside/pwned yes"],
    lambda out: [f"F {out}/pwned yes"],
    lambda out: ["F sys//x yes"],
    lambda out: ["F sys/./x yes"],
])
def test_records_cannot_leave_the_directory(tmp_path, outside, records):
    text = fixture(*records(outside))
    with pytest.raises(InputError):
        load_fixture(text, str(tmp_path / "root"))
    assert untouched(outside)


def test_the_cli_refuses_a_hostile_fixture_in_one_line(cli, tmp_path, outside):
    evil = tmp_path / "evil.host"
    evil.write_text(fixture(f"L {FD} {outside}", f"F {FD}/pwned yes"))
    result = cli("--root", str(evil), "list")
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1 and "Traceback" not in result.err
    assert untouched(outside)


def test_fd_links_stay_data(tmp_path):
    """What the recorder writes for a process holding a GPU still loads: the fd link names a device
    node outside the root, read with readlink only."""
    text = fixture("D sys", f"L {FD} /dev/nvidia0", "F proc/1/comm nvidia-persiste")
    root = load_fixture(text, str(tmp_path / "r"))
    assert os.readlink(os.path.join(root, FD)) == "/dev/nvidia0"


@pytest.mark.parametrize("record, fragment", [
    ("B sys/config zz", "bad hex data"),
    ("X sys/thing", "unknown record"),
    ("L sys/x ", "empty link target"),
])
def test_malformed_records_are_bad_input(tmp_path, record, fragment):
    with pytest.raises(InputError, match=fragment):
        load_fixture(fixture("D sys", record), str(tmp_path / "root"))


@pytest.mark.parametrize("plant", ["fifo", "device", "directory"])
def test_a_planted_fifo_device_or_directory_is_refused_not_opened(tmp_path, plant):
    """The loader writes into a directory the user named: what is already at a record's path and
    is not a regular file is refused before any open (a FIFO would block, a device could act)."""
    root = tmp_path / "root"
    (root / "sys").mkdir(parents=True)
    target = root / "sys" / "x"
    if plant == "fifo":
        os.mkfifo(target)
    elif plant == "device":
        os.mknod(target, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    else:
        target.mkdir()
    signal.alarm(10)  # a blocking open would hang the test: fail it instead
    try:
        with pytest.raises(InputError, match="is a link or a directory already"):
            load_fixture(fixture("D sys", "F sys/x data"), str(root))
    finally:
        signal.alarm(0)
    assert os.lstat(target).st_mode & 0o170000 == {"fifo": stat.S_IFIFO, "device": stat.S_IFCHR,
                                                   "directory": stat.S_IFDIR}[plant]


def _tree(top: str) -> dict:
    found = {}
    for directory, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, top)
            if os.path.islink(path):
                found[rel] = ("L", os.readlink(path))
            elif os.path.isdir(path):
                found[rel] = ("D",)
            else:
                with open(path, "rb") as handle:
                    found[rel] = ("F", handle.read())
    return found


def test_records_in_any_order_load_the_same_tree(tmp_path):
    """The loader keeps the directories of the current path open between records: a sample's
    records shuffled (directories first, so every parent is there) load the same tree as in
    their recorded order."""
    sample = os.path.join(os.path.dirname(__file__), "..", "..", "gpuvfio", "samples", "pcie-switch.host")
    with open(sample, encoding="utf-8") as handle:
        header, *records = handle.read().splitlines()
    shuffled = records[:]
    random.Random(7).shuffle(shuffled)
    shuffled.sort(key=lambda line: not line.startswith("D "))
    in_order = load_fixture("\n".join([header, *records]), str(tmp_path / "a"))
    any_order = load_fixture("\n".join([header, *shuffled]), str(tmp_path / "b"))
    assert shuffled != records and len(_tree(in_order)) > 1000
    assert _tree(in_order) == _tree(any_order)


def test_a_failed_write_is_one_line_with_its_record(tmp_path):
    """A record whose bytes cannot be written (no space, a file-size limit) is the loader's one
    line naming the record, not an OSError (a 64 MiB /dev/shm holds less than a large recording)."""
    big = tmp_path / "big.host"
    big.write_text(fixture("D sys", "B sys/config " + "00" * 300_000))
    code = ("import resource, sys\nresource.setrlimit(resource.RLIMIT_FSIZE, (200 << 10, 200 << 10))\n"
            "from gpuvfio.cli import main\nsys.exit(main(['--root', sys.argv[1], 'list']))\n")
    # cwd: the repository, where a mutation run's configuration is (tests/mutation/mutate.py)
    proc = subprocess.run([sys.executable, "-c", code, str(big)], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "fixture line 3" in proc.stderr, proc.stderr


@pytest.mark.parametrize("record", ["F sys/a\\ud800 hi", "L sys/x \\udc80"])
def test_a_path_or_target_with_no_utf8_bytes_is_bad_input(tmp_path, record):
    with pytest.raises(InputError, match="not UTF-8"):
        load_fixture(fixture("D sys", record), str(tmp_path / "root"))


def test_a_record_written_twice_replaces_the_file_never_writes_through_it(tmp_path, outside):
    """Loaded into a directory that holds a hard link to a file outside, a record at the link's
    name replaces the link's name; the file outside keeps its bytes."""
    root = tmp_path / "root"
    (root / "sys").mkdir(parents=True)
    os.link(outside / "secret", root / "sys" / "x")
    load_fixture(fixture("D sys", "F sys/x first", "F sys/x second"), str(root))
    assert (root / "sys" / "x").read_text() == "second"
    assert (outside / "secret").read_text() == CANARY
