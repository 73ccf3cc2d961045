"""Fuzzing the edges: generated and mutated fixtures, journals, testbed specs, addresses and option
values, through the real command line in-process.

Properties: the exit status is 0, 1 or 2, never a traceback (an exception escaping ``main``
fails the test); nothing is written outside the temporary root; after an exit 2 the host's state
is as it was. Derandomized (the same cases every run, so CI stays reproducible); the number of
cases per property is in MAX_EXAMPLES, and GPUVFIO_FUZZ_EXAMPLES raises it for a longer hunt.
"""

from __future__ import annotations

import json
import os
import shutil
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuvfio.cli import main
from gpuvfio.host.fixture import load_fixture
from tests.make_samples import sample_path

MAX_EXAMPLES = int(os.environ.get("GPUVFIO_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SAMPLE = sample_path("workstation")
with open(SAMPLE, encoding="utf-8") as _handle:
    SAMPLE_LINES = _handle.read().splitlines()

NASTY = ["", " ", "nan", "NaN", "inf", "-inf", "-1", "0", "1e309", "99999999999999999999", "0x10", "../..",
         "/etc/passwd", "\u2603", "a" * 300, "1G", "0000:01:00.0", "(null)", "-", "--help", "\t", "%s%n"]
values = st.one_of(st.sampled_from(NASTY), st.text(max_size=40),
                   st.integers(-2**40, 2**40).map(str), st.floats(allow_nan=True).map(str))


def run(*args: str) -> int:
    """The command line in-process: its exit status; an escaping exception fails the test."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(list(args))
    assert code in (0, 1, 2), (args, code)
    assert "Traceback" not in err.getvalue()
    return code


def mutate(lines: list[str], edits: list[tuple[int, int, str]]) -> str:
    lines = list(lines)
    for kind, where, value in edits:
        if not lines:
            break
        index = where % len(lines)
        if kind == 0:  # drop a record
            del lines[index]
        elif kind == 1:  # replace a file's content
            head = lines[index].split(" ", 2)
            lines[index] = " ".join(head[:2] + [value.encode("unicode_escape").decode().replace(" ", "\\x20")])
        elif kind == 2:  # duplicate a record
            lines.insert(index, lines[index])
        elif kind == 3:  # truncate the fixture there
            lines = lines[:index]
        else:  # a record of another kind for the same path
            head = lines[index].split(" ", 2)
            if len(head) >= 2:
                lines[index] = f"{'DFLB'[where % 4]} {head[1]} {value}"
    return "\n".join(lines) + "\n"


edits = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 10**6), values), min_size=1, max_size=6)


@pytest.fixture
def sandbox(tmp_path):
    """A directory the fixture is loaded into, and a sentinel one beside it that must stay empty."""
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    return tmp_path, sentinel


def _fresh(tmp_path, name: str) -> str:
    path = tmp_path / name
    if path.exists():
        shutil.rmtree(path)
    return str(path)


@FUZZ
@given(edits=edits)
def test_mutated_fixtures(sandbox, edits):
    tmp_path, sentinel = sandbox
    text = mutate(SAMPLE_LINES, edits)
    fixture = tmp_path / "mutated.host"
    fixture.write_text(text, encoding="utf-8")
    for args in (["list", "--all", "--json"], ["doctor", "--json"],
                 ["xml", "0000:01:00.0", "--name", "fuzz", "--firmware", "bios", "--json"]):
        run("--root", str(fixture), *args)
    root = _fresh(tmp_path, "root")
    try:
        load_fixture(text, root)
    except Exception as exc:  # noqa: BLE001 - a loader failure must be gpuvfio's own, one line
        assert type(exc).__module__.startswith("gpuvfio"), exc
    else:
        run("--root", root, "bind", "0000:01:00.0", "--dry-run", "--connect", "none", "--json")
        run("--root", root, "persist", "0000:01:00.0", "--dry-run")
    assert os.listdir(sentinel) == []


journals = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.sampled_from(NASTY)),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.sampled_from(["version", "devices", "services_stopped", "operation",
                                                                "mdevs", "vgpus", "schedulers", "broken", "reason", "original_driver",
                                                                "0000:01:00.0", "group", "steps", "state"]),
                                               children, max_size=4)),
    max_leaves=12)


@FUZZ
@given(journal=journals)
def test_generated_journals(tmp_path, monkeypatch, journal):
    from tests.conftest import gpu_workstation

    root = tmp_path / "host"
    if not root.exists():
        gpu_workstation(root)
    state = tmp_path / "state"
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir()
    text = json.dumps(journal)
    (state / "journal.json").write_text(text)
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(state))
    drivers = {a: os.readlink(os.path.join(root, "sys", "bus", "pci", "devices", a, "driver"))
               for a in ("0000:01:00.0", "0000:01:00.1")}
    for args in (["status", "--json"], ["restore", "--json"], ["vgpu", "remove", "0000:41:00.4"],
                 ["bind", "0000:01:00.0", "--dry-run", "--connect", "none"],
                 ["reset", "0000:01:00.0", "--connect", "none"]):
        code = run("--root", str(root), *args)
        if code == 2:  # refused as bad input: nothing was acted on, the journal is kept
            assert (state / "journal.json").read_text() == text
            assert {a: os.readlink(os.path.join(root, "sys", "bus", "pci", "devices", a, "driver"))
                    for a in drivers} == drivers


spec_keys = st.sampled_from(["vcpus", "memory", "hugepages", "numa", "port", "trust_on_first_use", "repetitions",
                             "gpus", "kind", "name", "profile", "scheduler", "boot_timeout", "stop_services"])
toml_values = st.one_of(st.integers(-3, 10**12), st.booleans(), st.floats(allow_nan=False, allow_infinity=False),
                        st.sampled_from(NASTY), st.lists(st.sampled_from(NASTY), max_size=2))


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(["guest", "guest.ssh", "run", "variant"]), spec_keys, toml_values),
                        min_size=1, max_size=4))
def test_generated_testbed_specs(tmp_path, changes):
    tables = {"guest": {"disk": '"/var/lib/libvirt/images/g.qcow2"', "vcpus": "4", "memory": '"8G"'},
              "guest.ssh": {"port": "2222"}, "run": {"gpus": '["0000:01:00.0"]', "stop_services": "true"},
              "variant": {"name": '"pt"', "kind": '"passthrough"'}}
    for table, key, value in changes:
        tables[table][key] = _toml(value)
    text = ""
    for table, entries in tables.items():
        text += ("[[variant]]" if table == "variant" else f"[{table}]") + "\n"
        text += "".join(f"{k} = {v}\n" for k, v in entries.items())
    spec = tmp_path / "spec.toml"
    spec.write_text(text)
    run("--root", SAMPLE, "testbed", "plan", str(spec), "--json")


@FUZZ
@given(value=values, which=st.integers(0, 11))
def test_option_values(tmp_path, value, which):
    from tests.conftest import gpu_workstation

    root = tmp_path / "host"
    if not root.exists():
        gpu_workstation(root)
    sentinel = tmp_path / "nothing-here"
    commands = [
        ["bind", "0000:01:00.0", "--dry-run", "--timeout", value],
        ["restore", "--lock-timeout", value],
        ["verify", "--ssh-host", "127.0.0.1", "--ssh-port", value, "--timeout", "0.1"],
        ["verify", "--ssh-host", value, "--ssh-port", "1", "--timeout", "0.1"],
        ["xml", "0000:01:00.0", "--name", value, "--firmware", "bios"],
        ["xml", "0000:01:00.0", "--name", "x", "--memory", value, "--firmware", "bios"],
        ["xml", "0000:01:00.0", "--name", "x", "--hugepages", value, "--firmware", "bios"],
        ["xml", "0000:01:00.0", "--name", "x", "--numa", value, "--firmware", "bios"],
        ["list", value],
        ["reset", value, "--connect", "none"],
        ["reset", "0000:01:00.0", "--timeout", value, "--lock-timeout", value],
        ["dump-host", str(sentinel / value.replace("/", "_")) if value not in ("", "-") else value],
    ]
    run("--root", str(root), *commands[which])
    assert not sentinel.exists()


@given(text=st.text(alphabet=string.hexdigits + ":.x-/ \n", max_size=20) | values)
@settings(max_examples=MAX_EXAMPLES * 4, deadline=None, derandomize=True, database=None)
def test_addresses(text):
    from gpuvfio.address import PciAddress
    from gpuvfio.errors import InputError

    try:
        address = PciAddress.parse(text)
    except InputError:
        return
    assert PciAddress.parse(str(address)) == address
