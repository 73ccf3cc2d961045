#!/usr/bin/env python3
"""Inventory side by side with lspci on a generated host, as ratios measured in one run
(benchmarks/ratios.py), both reading the same tree (lspci -A linux-sysfs -O sysfs.path=...):

The host (tests/hostbuilder.py build_sriov_server): two sockets, 8 GPUs and 16 single-port
ConnectX-7 PFs with 127 VFs each behind PCIe switches, 4 NVSwitches: 2,119 PCI functions.

1. ``gpuvfio list -d 10de: --json`` <= 2x ``lspci -d 10de: -vmm -D -k`` (a selection: the ids of
   every function, then the rest of the NVIDIA ones only);
2. ``gpuvfio list --all --json`` <= 1.5x ``lspci -vmm -D -k`` (every function, whole);
3. ``gpuvfio --root ROOT bind <TAB>`` (bash asking gpuvfio for device addresses) <= 1.2x the floor
   itself: what a Tab costs beyond parsing, on this host.

Beside each, its floor (benchmarks/typer_floor.py: the same command line parsed by typer alone)
and gpuvfio's own time above it: its modules and the reading.

Median of interleaved runs. Usage: benchmarks/bench_inventory.py [--runs N] [--json] [--strict]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from ratios import GPUVFIO, TYPER_FLOOR, Goal, base_env, load, measure, report  # noqa: E402
from gpuvfio.files import scratch_dir  # noqa: E402
from tests.hostbuilder import build_sriov_server  # noqa: E402


def goals(root: str) -> list[Goal]:
    lspci = ["lspci", "-A", "linux-sysfs", "-O", f"sysfs.path={root}/sys/bus/pci"]
    ours, floor = [GPUVFIO, "--root", root, "list"], TYPER_FLOOR + ["--root", root, "list"]
    selection, whole = ["-d", "10de:", "--json"], ["--all", "--json"]
    tab = {"_GPUVFIO_COMPLETE": "complete_bash", "COMP_WORDS": f"gpuvfio --root {root} bind ", "COMP_CWORD": "4"}
    return [
        Goal("complete 'bind <TAB>' (devices) / the floor (typer parsing list)", [GPUVFIO], floor, 1.2, env=tab,
             floor=floor),
        Goal("list -d 10de: --json / lspci -d 10de: -vmm -D -k", ours + selection,
             lspci + ["-d", "10de:", "-vmm", "-D", "-k"], 2.0, floor=floor + selection),
        Goal("list --all --json / lspci -vmm -D -k", ours + whole, lspci + ["-vmm", "-D", "-k"], 1.5,
             floor=floor + whole),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args()
    if shutil.which("lspci") is None or not os.access(GPUVFIO, os.X_OK):
        raise SystemExit("needs lspci and the gpuvfio console script (make deps installs them)")
    # In memory where it can be (/dev/shm), as sysfs is: a tree of 90,000 small files on a disk
    # takes a minute to write, and the page cache decides what is measured.
    with scratch_dir("gpuvfio-bench-") as root:
        count = len(build_sriov_server(root).functions)
        chosen, before = goals(root), load()
        measure(chosen, args.runs, base_env(REPO))
    missed = report(f"gpuvfio inventory, a generated host of {count} PCI functions", chosen, args.runs, before,
                    as_json=args.json, extra={"functions": count})
    return 1 if missed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
