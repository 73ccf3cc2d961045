#!/usr/bin/env python3
"""Fleet scaling: playbooks/inventory.yml against 1, 8 and 32 simulated hosts.

Each host is one of gpuvfio's sample fixtures loaded into its own directory (the four
samples in turn: an HGX H100, an EPYC host, a host with the IOMMU off, a workstation),
reached with ``ansible_connection=local``; the gpuvfio.gpuvfio.facts module runs once per host
(list + doctor + status), then the controller writes the fleet report. ``forks`` is the
number of hosts unless ``--forks`` says otherwise. Reported: wall time of the whole
ansible-playbook run, seconds per host, and hosts per second; the best of ``--runs``
runs. One run of ``ansible-playbook`` on an empty play is measured first, as the
fixed cost (start-up, inventory parsing) that every size pays.

Usage: benchmarks/bench_fleet.py [--sizes 1,8,32] [--forks N] [--runs N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAYBOOKS = os.path.join(REPO, "playbooks")
VENV_BIN = os.path.dirname(sys.executable)
sys.path.insert(0, PLAYBOOKS)

from simfleet import make_fleet  # noqa: E402  (playbooks/simfleet.py)

EMPTY_PLAY = "- name: Nothing\n  hosts: gpu_hosts\n  gather_facts: false\n  tasks: []\n"


def ansible_env(home: str, forks: int) -> dict:
    return {**os.environ, "PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", ""),
            "ANSIBLE_CONFIG": os.path.join(PLAYBOOKS, "ansible.cfg"), "ANSIBLE_HOME": home,
            "ANSIBLE_LOCAL_TEMP": os.path.join(home, "tmp"), "ANSIBLE_FORKS": str(forks),
            "ANSIBLE_NOCOLOR": "1", "ANSIBLE_PYTHON_INTERPRETER": sys.executable}


def timed(argv: list[str], env: dict) -> float:
    started = time.perf_counter()
    proc = subprocess.run(argv, cwd=PLAYBOOKS, env=env, capture_output=True, text=True, timeout=1800)
    elapsed = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,32", help="fleet sizes (comma-separated)")
    parser.add_argument("--forks", type=int, help="ansible forks (default: the fleet size)")
    parser.add_argument("--runs", type=int, default=2, help="runs per size; the best counts")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    playbook = os.path.join(VENV_BIN, "ansible-playbook")
    results = []
    scratch = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="gpuvfio-bench-fleet-", dir=scratch) as tmp:
        home = os.path.join(tmp, "ansible-home")
        os.makedirs(home)
        empty = os.path.join(tmp, "empty.yml")
        with open(empty, "w", encoding="utf-8") as handle:
            handle.write(EMPTY_PLAY)
        for size in sizes:
            out = os.path.join(tmp, f"fleet-{size}")
            started = time.perf_counter()
            make_fleet(out, size, sys.executable)
            load_s = time.perf_counter() - started
            forks = args.forks or size
            env = ansible_env(home, forks)
            inventory = os.path.join(out, "hosts.yml")
            fixed = min(timed([playbook, "-i", inventory, empty], env) for _ in range(args.runs))
            wall = min(timed([playbook, "-i", inventory, "inventory.yml", "-e",
                              f"gpuvfio_report_dir={os.path.join(out, 'reports')}"], env)
                       for _ in range(args.runs))
            with open(os.path.join(out, "reports", "inventory.json"), encoding="utf-8") as handle:
                report = json.load(handle)
            assert sorted(report) == sorted(os.listdir(os.path.join(out, "roots"))), "report misses hosts"
            assert all(report[host] for host in report), "a host has no facts"
            results.append({"hosts": size, "forks": forks, "wall_s": round(wall, 2),
                            "fixed_s": round(fixed, 2), "per_host_s": round(wall / size, 3),
                            "per_host_beyond_fixed_s": round((wall - fixed) / size, 3),
                            "hosts_per_s": round(size / wall, 2), "fixture_load_s": round(load_s, 2)})
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "results": results}, indent=1))
        return 0
    print(f"inventory.yml against simulated hosts ({os.cpu_count()} CPUs; best of {args.runs})")
    print(f"{'hosts':>5} {'forks':>5} {'wall s':>8} {'fixed s':>8} {'s/host':>8} {'s/host>fixed':>13} {'hosts/s':>8}")
    for r in results:
        print(f"{r['hosts']:>5} {r['forks']:>5} {r['wall_s']:>8.2f} {r['fixed_s']:>8.2f} {r['per_host_s']:>8.3f} "
              f"{r['per_host_beyond_fixed_s']:>13.3f} {r['hosts_per_s']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
