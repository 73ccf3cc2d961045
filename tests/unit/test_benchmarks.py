"""The start-up and inventory benchmarks (issue 25) as ``make bench`` runs them: each goal timed
beside its anchor and, where it has one, its floor. The floor (benchmarks/typer_floor.py) parses
what ``gpuvfio list`` parses: the same options, flags and repeatable ones, of the same types,
under the same root options. If it drifted, its time would no longer be the floor under
gpuvfio's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import typer.main

from gpuvfio.cli.app import app
from tests.conftest import REPO

FLOOR = os.path.join(REPO, "benchmarks", "typer_floor.py")


def _floor_app():
    spec = importlib.util.spec_from_file_location("typer_floor", FLOOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.app


def _parameters(group) -> list[tuple]:
    """What parsing does with each parameter of the root and of ``list``: how it is named, how
    many values it takes, and the annotation typer coerces its value to."""
    command = group.get_command(None, "list")
    return [(p.name, tuple(p.opts), p.param_type_name, p.multiple, p.nargs, bool(getattr(p, "is_flag", False)),
             p.envvar, p.expose_value, p.type_descriptor.annotation) for p in group.params + command.params]


def test_the_floor_parses_what_gpuvfio_list_parses():
    ours = _parameters(typer.main.get_command(app))
    floor = _parameters(typer.main.get_command(_floor_app()))
    assert [p[:7] + p[8:] for p in floor] == [p[:7] + p[8:] for p in ours]
    # A typer CLI pays for the options that carry a value: the floor has as many.
    assert sum(not p[5] for p in floor) == sum(not p[5] for p in ours) >= 4


def test_the_floor_runs_as_the_benchmark_runs_it_and_loads_no_gpuvfio_module():
    probe = "\n".join([
        "import runpy, sys",
        "sys.argv = ['gpuvfio', '--root', '/nonexistent', 'list', '-d', '10de:', '--json']",
        "try:",
        f"    runpy.run_path({FLOOR!r}, run_name='__main__')",
        "except SystemExit as exc:",
        "    assert exc.code in (0, None), exc.code",
        "print(sorted(m for m in sys.modules if m.startswith('gpuvfio') or m == 'pydantic'))"])
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(FLOOR))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # pydantic is there (typer coerced the values); gpuvfio is not.
    assert proc.stdout.split("\n")[-2] == "['pydantic']"


def _bench(name: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", name), "--runs", "1", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _measured(goal: dict, floored: bool) -> None:
    assert goal["ours_ms"] > 0 and goal["anchor_ms"] > 0 and goal["ratio"] > 0 and goal["goal"] > 0
    assert ("floor_ms" in goal) is floored, goal["name"]
    if floored:
        assert goal["floor"][0] == sys.executable and goal["floor"][1].endswith("typer_floor.py")
        assert goal["floor_ratio"] > 0 and goal["own_ms"] == round(goal["ours_ms"] - goal["floor_ms"], 2)


def test_the_start_up_benchmark_runs_each_goal_beside_its_anchor_and_floor():
    report = _bench("bench_startup.py")
    names = [g["name"] for g in report["goals"]]
    assert [n.split(" / ")[1].split(" (")[0] for n in names] == ["virt-install --version"] * 3 + ["lspci -nnk"]
    for goal in report["goals"]:
        _measured(goal, floored=goal["ours"][-1] in ("--help", "list"))


def test_the_inventory_benchmark_reads_the_generated_host_beside_lspci_and_the_floor():
    report = _bench("bench_inventory.py")
    assert report["functions"] == 2119
    tab, *lists = report["goals"]
    _measured(tab, floored=True)  # a Tab on a device: gpuvfio answering bash, against the floor itself
    assert tab["name"].startswith("complete 'bind <TAB>'") and tab["anchor"] == tab["floor"]
    assert tab["floor"][-3] == "--root" and tab["floor"][-1] == "list" and len(tab["ours"]) == 1
    assert len(lists) == 2
    for goal in lists:
        _measured(goal, floored=True)
        assert goal["anchor"][0] == "lspci" and goal["ours"][-1] == "--json"
        assert goal["floor"][2:] == goal["ours"][1:]  # the same command line, parsed by typer alone
