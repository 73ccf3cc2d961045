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
from gpuvfio.cli.lazy import COMMANDS, command_typer
from gpuvfio.errors import InputError

commands = command_typer()  # its commands, listed in gpuvfio.cli.lazy.COMMANDS

SHELLS = ("bash", "zsh", "fish")


@commands.command("completion")
def completion_cmd(shell: Annotated[str, typer.Argument(metavar="SHELL", help="bash | zsh | fish")]) -> None:
    """Print the shell completion script (put it where your shell reads completions)."""
    if shell not in SHELLS:
        raise InputError(f"shell must be one of {', '.join(SHELLS)}, not {shell!r}")
    script = get_completion_script(prog_name="gpuvfio", complete_var=COMPLETE_VAR, shell=shell).rstrip("\n") + "\n"
    sys.stdout.write(with_command_names(script) if shell == "bash" else script)


# typer's bash function (typer.completion, COMPLETION_SCRIPT_BASH) starts with this line.
BASH_FUNCTION = "_gpuvfio_completion() {\n"


def with_command_names(script: str) -> str:
    """typer's bash script, answering a command name itself: the first word after ``gpuvfio``
    is completed by bash from the names the index held when the script was printed, with no
    process started (a Python start-up is most of a Tab's wait). A word starting with '-',
    every later word, and a name the list does not have (a newer gpuvfio than the script) go to
    gpuvfio as before. The names are the index's (gpuvfio.cli.lazy.COMMANDS)."""
    if BASH_FUNCTION not in script:
        raise InputError("typer's bash completion script changed shape: cannot add the command names")
    names = " ".join(COMMANDS)
    fast = (f"{BASH_FUNCTION}"
            f"    if [[ $COMP_CWORD -eq 1 && ${{COMP_WORDS[1]}} != -* ]]; then\n"
            f"        COMPREPLY=( $(compgen -W '{names}' -- \"${{COMP_WORDS[1]}}\") )\n"
            f"        [[ ${{#COMPREPLY[@]}} -gt 0 ]] && return 0\n"
            f"    fi\n")
    return script.replace(BASH_FUNCTION, fast, 1)
