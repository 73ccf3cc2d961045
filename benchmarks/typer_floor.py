#!/usr/bin/env python3
"""The floor under gpuvfio's start-up: a typer program that parses what ``gpuvfio list`` parses
(the root's ``--root``/``-v``, then list's devices, ``-d``, ``--all``, ``--format``, ``--json``,
``--root``) and then does nothing. It imports no gpuvfio module.

What it costs is what any typer CLI with these options pays before its first line of work: the
interpreter, importing typer, and, since typer 0.27, each non-flag option's value coerced through
a pydantic TypeAdapter built when the option is parsed (typer.core._TyperParameter.process_value,
typer._adapters.build_adapter; a value of None too). The benchmarks run it beside gpuvfio, in the
same rounds, so a ratio can be read against the lowest a typer CLI can reach: gpuvfio's time less
this one is gpuvfio's own (its modules, and the host it reads).

tests/unit/test_benchmarks.py holds its options to gpuvfio's (names, flags, repeatable or not).
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

app = typer.Typer(name="gpuvfio", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]})


@app.callback()
def global_options(
    root: Annotated[Optional[str], typer.Option("--root", envvar="GPUVFIO_ROOT", metavar="DIR")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    version: Annotated[bool, typer.Option("--version", is_eager=True)] = False,
) -> None:
    """The root's options, as gpuvfio.cli.app declares them."""


@app.command("list")
def list_cmd(
    addresses: Annotated[Optional[list[str]], typer.Argument(metavar="DEVICE")] = None,
    device_ids: Annotated[Optional[list[str]], typer.Option("--device-id", "-d")] = None,
    all: Annotated[bool, typer.Option("--all")] = False,  # gpuvfio.options RUN "all"
    output_format: Annotated[Optional[str], typer.Option("--format", metavar="FORMAT")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    root: Annotated[Optional[str], typer.Option("--root", envvar="GPUVFIO_ROOT", metavar="DIR")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """gpuvfio list's parameters; nothing is read."""


@app.command("doctor")
def doctor_cmd() -> None:
    """A second command, so that the root is a group as gpuvfio's is."""


if __name__ == "__main__":
    app(prog_name="gpuvfio")
