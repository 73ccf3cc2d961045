"""gpuvfio completion SHELL: the shell's completion script, printed (typer's own scripts).

typer's --install-completion would append to ~/.bashrc (or zsh's and fish's files) itself,
through links it did not create; gpuvfio prints the script and the admin puts it where the
shell reads it, e.g. ``gpuvfio completion bash > /etc/bash_completion.d/gpuvfio``. What it
completes: commands, options, the host's devices (from --root or /) and libvirt's domains.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from typer.completion import get_completion_script

from gpuvfio.cli.app import COMPLETE_VAR
from gpuvfio.cli.lazy import command_typer
from gpuvfio.errors import InputError

commands = command_typer()  # its commands, listed in gpuvfio.cli.lazy.COMMANDS

SHELLS = ("bash", "zsh", "fish")


@commands.command("completion")
def completion_cmd(shell: Annotated[str, typer.Argument(metavar="SHELL", help="bash | zsh | fish")]) -> None:
    """Print the shell completion script (put it where your shell reads completions)."""
    if shell not in SHELLS:
        raise InputError(f"shell must be one of {', '.join(SHELLS)}, not {shell!r}")
    sys.stdout.write(get_completion_script(prog_name="gpuvfio", complete_var=COMPLETE_VAR, shell=shell)
                     .rstrip("\n") + "\n")
