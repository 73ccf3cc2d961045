#!/usr/bin/env python3
"""Start-up of the gpuvfio command as users run it (the console script, one typer parser for
every command), side by side with the tools an admin runs for the same job, as ratios in one run:

1. ``gpuvfio --help`` vs ``virt-install --version`` (virtinst: another Python CLI of the stack).
2. ``gpuvfio list --all --json`` vs ``lspci -vmm -D -k``, both reading this machine's /sys.

Median of interleaved runs (drift hits both). No goal is asserted here: these numbers are
reported, not gated (see the README's benchmarks note).
Usage: benchmarks/bench_startup.py [--runs N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPUVFIO = os.path.join(os.path.dirname(sys.executable), "gpuvfio")


def once(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
    return time.perf_counter() - start


def compare(ours: list[str], theirs: list[str], runs: int, env: dict) -> tuple[float, float]:
    once(ours, env), once(theirs, env)  # warm the page cache for both
    a, b = [], []
    for _ in range(runs):
        a.append(once(ours, env))
        b.append(once(theirs, env))
    return statistics.median(a), statistics.median(b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    missing = [tool for tool in ("virt-install", "lspci") if shutil.which(tool) is None]
    if missing or not os.access(GPUVFIO, os.X_OK):
        raise SystemExit(f"needs {', '.join(missing or [GPUVFIO])} (make deps installs them)")
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("GPUVFIO_ROOT", None)
    help_ours, help_theirs = compare([GPUVFIO, "--help"], ["virt-install", "--version"], args.runs, env)
    list_ours, list_theirs = compare([GPUVFIO, "list", "--all", "--json"], ["lspci", "-vmm", "-D", "-k"],
                                     args.runs, env)
    results = {"runs": args.runs,
               "help": {"gpuvfio_s": help_ours, "virt_install_version_s": help_theirs,
                        "ratio": help_ours / help_theirs},
               "list": {"gpuvfio_s": list_ours, "lspci_s": list_theirs, "ratio": list_ours / list_theirs}}
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"median of {args.runs} interleaved runs, this machine's /sys")
    print(f"gpuvfio --help               {help_ours * 1000:8.1f} ms")
    print(f"virt-install --version       {help_theirs * 1000:8.1f} ms")
    print(f"  ratio {results['help']['ratio']:.2f}")
    print(f"gpuvfio list --all --json    {list_ours * 1000:8.1f} ms")
    print(f"lspci -vmm -D -k             {list_theirs * 1000:8.1f} ms")
    print(f"  ratio {results['list']['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
