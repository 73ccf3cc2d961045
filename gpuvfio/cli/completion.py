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
from typer.completion import completion_init, get_completion_script

from gpuvfio.cli.app import app
from gpuvfio.errors import InputError

SHELLS = ("bash", "zsh", "fish")
completion_init()  # typer's completion classes, which answer _GPUVFIO_COMPLETE at run time


@app.command("completion")
def completion_cmd(shell: Annotated[str, typer.Argument(metavar="SHELL", help="bash | zsh | fish")]) -> None:
    """Print the shell completion script (put it where your shell reads completions)."""
    if shell not in SHELLS:
        raise InputError(f"shell must be one of {', '.join(SHELLS)}, not {shell!r}")
    sys.stdout.write(get_completion_script(prog_name="gpuvfio", complete_var="_GPUVFIO_COMPLETE", shell=shell)
                     .rstrip("\n") + "\n")
