"""Goals as ratios to an anchor, measured side by side in one run (the benchmarks' shared part).

Each goal times gpuvfio's command and its anchor's (another tool doing the same job) as whole
processes, alternately, round after round, so a busy machine slows both alike; the ratio is of
the medians. The table says, for each goal, both medians, the ratio, the goal and PASS or MISS,
and the machine's load while it ran (the benchmarks are reported, not gated: a shared machine
moves the absolute numbers; ``--strict`` exits 1 on a MISS).

A goal may name a floor, timed in the same rounds: the same command line parsed by a typer
program that does nothing else (benchmarks/typer_floor.py). Its ratio to the anchor is the lowest
a typer CLI can reach there; gpuvfio's median less the floor's is gpuvfio's own time (its modules
and what it reads), which the table gives beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

VENV_BIN = os.path.dirname(sys.executable)
GPUVFIO = os.path.join(VENV_BIN, "gpuvfio")  # the console script users run
# The floor: what a typer CLI with gpuvfio list's options pays before any work (run as a script
# by the same interpreter, as the console script runs gpuvfio).
TYPER_FLOOR = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "typer_floor.py")]


@dataclass
class Goal:
    """``ours`` takes at most ``limit`` times what ``anchor`` takes."""

    name: str
    ours: list[str]
    anchor: list[str]
    limit: float
    env: dict[str, str] = field(default_factory=dict)  # added to the environment of ``ours`` only
    floor: list[str] | None = None  # the same command line parsed by typer alone (TYPER_FLOOR)
    # A command that changes something (attach boots a guest) is undone after each run, untimed.
    reset: Callable[[], None] | None = None
    exit_codes: tuple[int, ...] = (0, 1)  # list/doctor exit 1 for a refusal; anything else is broken
    ours_out: list[bytes] | None = None  # a list: each counted run's stdout is kept there
    ours_s: list[float] = field(default_factory=list)
    anchor_s: list[float] = field(default_factory=list)
    floor_s: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return statistics.median(self.ours_s) / statistics.median(self.anchor_s)

    @property
    def floor_ratio(self) -> float | None:
        """The floor's median over the anchor's: the lowest ratio a typer CLI reaches here."""
        if not self.floor_s:
            return None
        return statistics.median(self.floor_s) / statistics.median(self.anchor_s)

    @property
    def passed(self) -> bool:
        return self.ratio <= self.limit

    def to_json(self) -> dict:
        row = {"name": self.name, "ours": self.ours, "anchor": self.anchor, "goal": self.limit,
               "ours_ms": round(statistics.median(self.ours_s) * 1000, 2),
               "anchor_ms": round(statistics.median(self.anchor_s) * 1000, 2),
               "ratio": round(self.ratio, 3), "pass": self.passed}
        if self.floor_s:
            floor_ms = statistics.median(self.floor_s) * 1000
            row.update(floor=self.floor, floor_ms=round(floor_ms, 2), floor_ratio=round(self.floor_ratio, 3),
                       own_ms=round(row["ours_ms"] - floor_ms, 2))
        return row


def base_env(repo: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": repo}
    # Bytecode as an installed package has it (pip compiles a wheel's modules when it installs
    # them): written by the first, uncounted round (where PYTHONPYCACHEPREFIX says, else beside
    # the sources) and read after. Where the environment forbids writing it, every run would
    # compile every module it imports again.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("GPUVFIO_ROOT", None)  # the live host, unless a goal names a root
    env.pop("_GPUVFIO_COMPLETE", None)
    return env


def once(cmd: list[str], env: dict[str, str], exit_codes: tuple[int, ...] = (0, 1),
         out: list[bytes] | None = None) -> float:
    """Seconds ``cmd`` took as a process; its stdout kept in ``out`` where one is given."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if out is None else subprocess.PIPE,
                          stderr=subprocess.PIPE, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode not in exit_codes:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.decode(errors='replace')[-400:]}")
    if out is not None:
        out.append(proc.stdout)
    return elapsed


def measure(goals: list[Goal], runs: int, env: dict[str, str]) -> None:
    """Round after round, every goal's command, its anchor and its floor, in turn (the first
    round warms the page cache and is not counted); which goes first changes from round to
    round."""
    for round_no in range(runs + 1):
        for goal in goals:
            ours_env = {**env, **goal.env}
            turn = [(goal.ours, ours_env, goal.ours_s, goal.ours_out), (goal.anchor, env, goal.anchor_s, None)]
            if goal.floor:
                turn.append((goal.floor, ours_env, goal.floor_s, None))
            shift = round_no % len(turn)
            for cmd, cmd_env, times, out in turn[shift:] + turn[:shift]:
                elapsed = once(cmd, cmd_env, goal.exit_codes, out if round_no else None)
                if goal.reset:
                    goal.reset()
                if round_no:
                    times.append(elapsed)


def load() -> str:
    try:
        with open("/proc/loadavg", encoding="ascii") as handle:
            one, five = handle.read().split()[:2]
    except OSError:
        return "load unknown"
    return f"load {one} (1 min), {five} (5 min) on {os.cpu_count()} CPUs"


def report(title: str, goals: list[Goal], runs: int, load_before: str, *, as_json: bool,
           extra: dict | None = None) -> int:
    load_after = load()
    if as_json:
        print(json.dumps({"title": title, "runs": runs, "load_before": load_before, "load_after": load_after,
                          **(extra or {}), "goals": [g.to_json() for g in goals]}, indent=2))
    else:
        print(f"{title}: median of {runs} interleaved runs; {load_before} before, {load_after} after")
        width = max(len(g.name) for g in goals)
        print(f"{'goal':<{width}}  {'gpuvfio':>9}  {'anchor':>9}  {'ratio':>6}  {'goal':>6}  result  "
              f"{'floor':>9}  {'ratio':>6}  {'own':>9}")
        for g in goals:
            row = g.to_json()
            floor = (f"  {row['floor_ms']:7.1f}ms  {row['floor_ratio']:6.2f}  {row['own_ms']:7.1f}ms"
                     if g.floor_s else "")
            print(f"{g.name:<{width}}  {row['ours_ms']:7.1f}ms  {row['anchor_ms']:7.1f}ms  {g.ratio:6.2f}  "
                  f"{'<= ' + format(g.limit, 'g'):>6}  {'PASS' if g.passed else 'MISS'}{floor}")
        if any(g.floor_s for g in goals):
            print("floor: the same command line parsed by typer alone (benchmarks/typer_floor.py); "
                  "own: gpuvfio less the floor")
    return sum(not g.passed for g in goals)
