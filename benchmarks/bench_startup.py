#!/usr/bin/env python3
"""Start-up of the gpuvfio command as users run it (the console script), side by side with the
tools an admin runs, as ratios measured in one run (benchmarks/ratios.py):

1. completing a command name (``gpuvfio li<TAB>``: bash runs the function of the script
   ``gpuvfio completion bash`` prints, which answers a command name without starting gpuvfio)
   <= 0.5x ``virt-install --version`` (virtinst: another Python CLI of the stack); beside it,
   for the record, an option's completion, which runs gpuvfio (``gpuvfio bind --d<TAB>``);
2. ``gpuvfio --help`` <= 0.5x ``virt-install --version``;
3. ``gpuvfio list`` on this machine's /sys <= 5x ``lspci -nnk``.

Beside 2 and 3, their floor (benchmarks/typer_floor.py: the same command line parsed by typer
alone) and gpuvfio's own time above it.

Median of interleaved runs. Usage: benchmarks/bench_startup.py [--runs N] [--json] [--strict]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ratios import GPUVFIO, TYPER_FLOOR, Goal, base_env, load, measure, report  # noqa: E402

REPO = os.path.dirname(HERE)
# What bash does when a user presses TAB after "gpuvfio li": the completion function, run by a
# bash that has read the script (a new bash per run: its start-up is counted against us).
TAB = ('source "$1"; COMP_WORDS=(gpuvfio "$2"); COMP_CWORD=1; _gpuvfio_completion "$3"; '
       'test -n "${COMPREPLY[*]}"')
# An option's completion is gpuvfio's own answer (click's shell completion protocol).
COMPLETE_OPTION_ENV = {"_GPUVFIO_COMPLETE": "complete_bash", "COMP_WORDS": "gpuvfio bind --d", "COMP_CWORD": "2"}


def goals(script: str) -> list[Goal]:
    return [
        Goal("complete 'gpuvfio li' (bash) / virt-install --version",
             ["bash", "-c", TAB, "bash", script, "li", GPUVFIO], ["virt-install", "--version"], 0.5),
        Goal("complete 'gpuvfio bind --d' / virt-install --version", [GPUVFIO], ["virt-install", "--version"], 0.5,
             env=COMPLETE_OPTION_ENV),
        Goal("gpuvfio --help / virt-install --version", [GPUVFIO, "--help"], ["virt-install", "--version"], 0.5,
             floor=TYPER_FLOOR + ["--help"]),
        Goal("gpuvfio list / lspci -nnk (this host)", [GPUVFIO, "list"], ["lspci", "-nnk"], 5.0,
             floor=TYPER_FLOOR + ["list"]),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args()
    missing = [tool for tool in ("virt-install", "lspci") if shutil.which(tool) is None]
    if missing or not os.access(GPUVFIO, os.X_OK):
        raise SystemExit(f"needs {', '.join(missing or [GPUVFIO])} (make deps installs them)")
    with tempfile.NamedTemporaryFile("w", prefix="gpuvfio-completion-", suffix=".bash") as script:
        script.write(subprocess.run([GPUVFIO, "completion", "bash"], capture_output=True, text=True,
                                    check=True).stdout)
        script.flush()
        chosen, before = goals(script.name), load()
        measure(chosen, args.runs, base_env(REPO))
    missed = report("gpuvfio start-up", chosen, args.runs, before, as_json=args.json)
    return 1 if missed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
