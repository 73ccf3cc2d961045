"""Lazy command loading (issue 25 item 1): the root knows each command by its index
(gpuvfio.cli.lazy.COMMANDS); ``gpuvfio --help`` and the completion of a command name load no
command module and none of the heavy libraries; the index says what the commands say."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import typer.main
from typer.core import TyperCommand, TyperGroup

from gpuvfio.cli.lazy import COMMANDS, load
from tests.conftest import REPO

HEAVY = ("jinja2", "lxml", "libvirt", "paramiko", "matplotlib", "numpy", "pynvml", "rich", "yaml")
COMMAND_MODULES = sorted({e.module for e in COMMANDS.values()})

# What the process loaded, after the command: gpuvfio's modules and the heavy libraries.
PROBE = r"""
import contextlib, io, json, sys
from gpuvfio.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    code = main(sys.argv[1:])
json.dump({"code": code, "out": out.getvalue(), "modules": sorted(sys.modules)}, sys.__stdout__)
"""


def probe(*args: str, env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_help_loads_no_command_module_and_no_heavy_library():
    seen = probe("--help")
    assert seen["code"] == 0 and all(name in seen["out"] for name in COMMANDS)
    loaded = set(seen["modules"])
    assert loaded.isdisjoint(COMMAND_MODULES), sorted(loaded & set(COMMAND_MODULES))
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))
    assert not any(m.startswith(("gpuvfio.ops", "gpuvfio.host", "gpuvfio.bind", "gpuvfio.domain")) for m in loaded)


def test_completing_a_command_name_loads_no_command_module():
    words = "gpuvfio d"
    seen = probe(env={"_GPUVFIO_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": "1"})
    assert seen["out"].split() == ["detach", "doctor", "dump-host"]
    loaded = set(seen["modules"])
    assert loaded.isdisjoint(COMMAND_MODULES) and loaded.isdisjoint(HEAVY), sorted(loaded & (set(HEAVY) | set(
        COMMAND_MODULES)))


def test_a_command_loads_its_own_module_only():
    seen = probe("--root", os.path.join(REPO, "gpuvfio", "samples", "dgx-h100.host"), "list", "--json")
    assert seen["code"] == 0 and json.loads(seen["out"])["devices"]
    loaded = set(seen["modules"])
    assert "gpuvfio.cli.inventory" in loaded
    assert loaded.isdisjoint(set(COMMAND_MODULES) - {"gpuvfio.cli.inventory"})
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))
    # Nor the services of other commands: the doctor's checks, a host's recording, binding's
    # journal, libvirt's connection helpers, NVLink (gpuvfio.ops.readiness, gpuvfio.ops.identity,
    # gpuvfio.ops.domain_completion hold them apart from what list runs).
    elsewhere = ("gpuvfio.bind", "gpuvfio.virt", "gpuvfio.domain", "gpuvfio.guest", "gpuvfio.vgpu", "gpuvfio.testbed",
                 "gpuvfio.ops.readiness", "gpuvfio.ops.identity", "gpuvfio.ops.domain_completion",
                 "gpuvfio.host.doctor", "gpuvfio.host.recording", "gpuvfio.host.nvlink", "gpuvfio.host.kernel")
    assert not [m for m in loaded if m.startswith(elsewhere)], sorted(m for m in loaded if m.startswith(elsewhere))


def test_the_index_names_every_command_its_modules_declare():
    declared = {}
    for module in COMMAND_MODULES:
        loaded = importlib.import_module(module)
        for entry_name, entry in COMMANDS.items():
            if entry.module == module and entry.attribute != "commands":
                declared[entry_name] = module
        if hasattr(loaded, "commands"):
            built = typer.main.get_command(loaded.commands)
            names = list(built.commands) if isinstance(built, TyperGroup) else [built.name]
            declared.update({n: module for n in names})
    assert declared == {name: e.module for name, e in COMMANDS.items()}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_index_help_is_the_commands_own(name):
    """What --help lists from the index is what the loaded command would list, at any width."""
    command = load(name)
    assert command.get_short_help_str(limit=1000) == COMMANDS[name].help
    for limit in (30, 45, 80):
        assert command.get_short_help_str(limit) == TyperCommand(name=name, help=COMMANDS[name].help) \
            .get_short_help_str(limit)
    assert command.name == name


def test_an_unknown_command_is_refused_with_a_suggestion(cli):
    result = cli("lst")
    assert result.code == 2 and "Did you mean 'list'?" in result.err


def test_verbose_after_the_command_as_before_it(cli, workstation):
    """-v/--verbose is the root's and every command's (issue 24 item 6): either spelling turns the
    progress lines of a --json run on for that run, and the next run starts without them."""
    from gpuvfio.cli.app import progress_for
    from gpuvfio.cli.lazy import GlobalOptions

    silent = progress_for(True)
    for spelling in (["-v", "status", "--json"], ["status", "--json", "-v"], ["status", "--verbose", "--json"]):
        assert cli("--root", workstation.root, *spelling).code == 0
        assert GlobalOptions.verbose is True, spelling
        assert progress_for(True).__name__ != silent.__name__  # lines, not the silent default
    assert cli("--root", workstation.root, "status", "--json").code == 0
    assert GlobalOptions.verbose is False


def test_arguments_show_in_words_and_errors_point_to_the_commands_help(cli):
    help_text = cli("bind", "-h").out
    assert "DEVICE  PCI devices" in help_text and "<list[str]>" not in help_text
    assert "-v, --verbose" in help_text
    wrong = cli("bind", "--bogus")
    assert wrong.code == 2 and wrong.err.rstrip().endswith("(see gpuvfio bind -h)")
    missing = cli("vgpu", "types")
    assert missing.code == 2 and missing.err.rstrip().endswith("(see gpuvfio vgpu types -h)")
