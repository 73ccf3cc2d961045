"""Goals as ratios to an anchor, measured side by side in one run (the benchmarks' shared part).

Each goal times gpuvfio's command and its anchor's (another tool doing the same job) as whole
processes, alternately, round after round, so a busy machine slows both alike; the ratio is of
the medians. The table says, for each goal, both medians, the ratio, the goal and PASS or MISS,
and the machine's load while it ran (the benchmarks are reported, not gated: a shared machine
moves the absolute numbers; ``--strict`` exits 1 on a MISS).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

VENV_BIN = os.path.dirname(sys.executable)
GPUVFIO = os.path.join(VENV_BIN, "gpuvfio")  # the console script users run


@dataclass
class Goal:
    """``ours`` takes at most ``limit`` times what ``anchor`` takes."""

    name: str
    ours: list[str]
    anchor: list[str]
    limit: float
    env: dict[str, str] = field(default_factory=dict)  # added to the environment of ``ours`` only
    ours_s: list[float] = field(default_factory=list)
    anchor_s: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return statistics.median(self.ours_s) / statistics.median(self.anchor_s)

    @property
    def passed(self) -> bool:
        return self.ratio <= self.limit

    def to_json(self) -> dict:
        return {"name": self.name, "ours": self.ours, "anchor": self.anchor, "goal": self.limit,
                "ours_ms": round(statistics.median(self.ours_s) * 1000, 2),
                "anchor_ms": round(statistics.median(self.anchor_s) * 1000, 2),
                "ratio": round(self.ratio, 3), "pass": self.passed}


def base_env(repo: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": repo}
    env.pop("GPUVFIO_ROOT", None)  # the live host, unless a goal names a root
    env.pop("_GPUVFIO_COMPLETE", None)
    return env


def once(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 1):  # list/doctor exit 1 for a refusal; anything else is broken
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.decode(errors='replace')[-400:]}")
    return elapsed


def measure(goals: list[Goal], runs: int, env: dict[str, str]) -> None:
    """Round after round, every goal's command and its anchor, in turn (the first round warms the
    page cache and is not counted); which of the two goes first alternates."""
    for round_no in range(runs + 1):
        for goal in goals:
            ours_env = {**env, **goal.env}
            pair = [(goal.ours, ours_env, goal.ours_s), (goal.anchor, env, goal.anchor_s)]
            for cmd, cmd_env, times in (pair if round_no % 2 else pair[::-1]):
                elapsed = once(cmd, cmd_env)
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
        print(f"{'goal':<{width}}  {'gpuvfio':>9}  {'anchor':>9}  {'ratio':>6}  {'goal':>6}  result")
        for g in goals:
            row = g.to_json()
            print(f"{g.name:<{width}}  {row['ours_ms']:7.1f}ms  {row['anchor_ms']:7.1f}ms  {g.ratio:6.2f}  "
                  f"{'<= ' + format(g.limit, 'g'):>6}  {'PASS' if g.passed else 'MISS'}")
    return sum(not g.passed for g in goals)
