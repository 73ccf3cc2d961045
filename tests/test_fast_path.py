"""The light entry point and the typer layer must answer the same."""

import pytest

from gpuvfio import main as entry
from gpuvfio.cli import app


@pytest.fixture
def typer_cli(capsys):
    from gpuvfio.cli import typer_main

    def run(*args):
        code = 0
        try:
            typer_main(list(args))
        except SystemExit as exc:
            code = exc.code or 0
        cap = capsys.readouterr()
        return code, cap.out, cap.err

    return run


@pytest.mark.parametrize("args", [
    ["list", "--json"],
    ["list", "--all", "--json"],
    ["list", "--json", "--all", "0000:01:00.1", "0000:04:00.0"],
    ["list", "--json", "0000:09:00.0"],
    ["list", "--json", "0000:01:00.9"],
])
def test_fast_list_equals_typer(args, workstation, cli, typer_cli):
    args = ["--root", workstation.root] + args
    assert entry._fast_list(args) is not None  # really took the fast path
    fast = cli(*args)
    slow = typer_cli(*args)
    assert (fast.code, fast.out, fast.err) == slow


@pytest.mark.parametrize("args", [["list"], ["list", "--json", "--frob"], ["doctor", "--json"],
                                  ["list", "--help"], ["--root"]])
def test_other_invocations_go_to_typer(args):
    assert entry._fast_list(args) is None


def test_light_help_lists_every_typer_command(cli):
    result = cli("--help")
    registered = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert registered == set(entry.COMMANDS)
    for name, text in entry.COMMANDS.items():
        assert f"  {name}" in result.out and text in result.out
    assert "--root DIR" in result.out
