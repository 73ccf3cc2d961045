#!/usr/bin/env python3
"""Inventory and start-up timings, side by side with their anchors, as ratios in one run.

1. Whole-process ``gpuvfio list --all --json`` (the console script) vs ``lspci -vmm -D -k``
   on the same generated host of ~600 PCI functions (2-socket server: 8 GPUs behind
   switches, 4 NVSwitches, 4 dual-port NICs with SR-IOV VFs enabled). Goal: ratio <= 1.0.
2. ``gpuvfio list -d 10de: --json`` (a selector: every NVIDIA function) vs ``lspci -d 10de:
   -vmm -D -k`` on that host. Goal: ratio <= 1.0 (the selector reads ids only, then the list).
3. ``gpuvfio --help`` vs ``python3 -c pass``. Goal: ratio < 3.
(benchmarks/bench_startup.py compares start-up with virt-install and lspci on this host.)

Median of repeated runs; runs alternate between the two commands so drift hits both.
Usage: benchmarks/bench_inventory.py [--runs N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.hostbuilder import BAR32, BAR64_PREF, GiB, HostBuilder, MiB  # noqa: E402


def build_large_host(root: str) -> int:
    """A 2-socket HGX-class server with SR-IOV NICs: about 600 PCI functions."""
    b = HostBuilder(root)
    b.iommu("intel", 8)
    per_socket = b.cpu_topology(2, 56, 2)
    for node in (0, 1):
        b.numa_node(node, per_socket[node], 1024, {1048576: (256, 256)})
    bus = 0x10
    for socket in (0, 1):
        rb = b.root_bus(0, socket * 0x80, numa=socket)
        base = socket * 0x80
        b.function(rb, f"0000:{base:02x}:00.0", "8086", "09a2", "088000")
        for sw in range(4):
            up_bus = base + 0x10 + sw * 0x10
            rp = b.bridge(rb, f"0000:{base:02x}:{sw + 1:02x}.0", "8086", "352a", secondary_bus=up_bus,
                          link=(5, 16))
            up = b.bridge(rp, f"0000:{up_bus:02x}:00.0", "1000", "c030", secondary_bus=up_bus + 1, link=(5, 16))
            for port in range(3):
                dn_bus = up_bus + 2 + port
                dn = b.bridge(up, f"0000:{up_bus + 1:02x}:{port:02x}.0", "1000", "c030",
                              secondary_bus=dn_bus, link=(5, 16))
                if port == 0:
                    b.function(dn, f"0000:{dn_bus:02x}:00.0", "10de", "2330", "030200", driver="nvidia",
                               link=(5, 16), bars=[(0, 16 * MiB, BAR32), (1, 128 * GiB, BAR64_PREF),
                                                   (3, 32 * MiB, BAR64_PREF)])
                elif port == 1:
                    pf = b.function(dn, f"0000:{dn_bus:02x}:00.0", "15b3", "1021", "020000",
                                    driver="mlx5_core", link=(5, 16), bars=[(0, 32 * MiB, BAR64_PREF)],
                                    multifunction=True)
                    pf2 = b.function(dn, f"0000:{dn_bus:02x}:00.1", "15b3", "1021", "020000",
                                     driver="mlx5_core", link=(5, 16), bars=[(0, 32 * MiB, BAR64_PREF)])
                    for n, p in enumerate((pf, pf2)):
                        vfs = [f"0000:{dn_bus:02x}:{(n * 8 + i // 8) + 1:02x}.{i % 8}" for i in range(32)]
                        b.sriov(p, 127, vfs, "101e", "15b3", "020000", driver="mlx5_core", vf_bar=1 * MiB)
                else:
                    b.function(dn, f"0000:{dn_bus:02x}:00.0", "144d", "a80a", "010802", driver="nvme",
                               link=(4, 4), bars=[(0, 16 * 1024, BAR32)])
            bus += 1
    sw = b.bridge(b.root_bus(0, 0x7f, numa=0), "0000:7f:01.0", "8086", "352a", secondary_bus=0x7e)
    for n in range(4):
        b.function(sw, f"0000:7e:{n:02x}.0", "10de", "22a3", "068000", driver="nvidia")
    return len(b.functions)


def median_runtime(cmd: list[str], runs: int, env: dict) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
        times.append(time.perf_counter() - start)
    return times


def compare(a: list[str], b: list[str], runs: int, env: dict) -> tuple[float, float]:
    ta, tb = [], []
    for _ in range(runs):  # interleave
        ta += median_runtime(a, 1, env)
        tb += median_runtime(b, 1, env)
    return statistics.median(ta), statistics.median(tb)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": REPO}
    gpuvfio = [os.path.join(os.path.dirname(sys.executable), "gpuvfio")]
    with tempfile.TemporaryDirectory(prefix="gpuvfio-bench-") as root:
        count = build_large_host(root)
        inv_ours, inv_lspci = compare(
            gpuvfio + ["--root", root, "list", "--all", "--json"],
            ["lspci", "-A", "linux-sysfs", "-O", f"sysfs.path={root}/sys/bus/pci", "-vmm", "-D", "-k"],
            args.runs, env)
        sel_ours, sel_lspci = compare(
            gpuvfio + ["--root", root, "list", "-d", "10de:", "--json"],
            ["lspci", "-A", "linux-sysfs", "-O", f"sysfs.path={root}/sys/bus/pci", "-d", "10de:", "-vmm", "-D", "-k"],
            args.runs, env)
    help_ours, bare = compare(gpuvfio + ["--help"], [sys.executable, "-c", "pass"], args.runs, env)
    results = {
        "functions": count,
        "runs": args.runs,
        "inventory": {"gpuvfio_s": inv_ours, "lspci_s": inv_lspci, "ratio": inv_ours / inv_lspci, "goal": 1.0},
        "selector": {"gpuvfio_s": sel_ours, "lspci_s": sel_lspci, "ratio": sel_ours / sel_lspci, "goal": 1.0},
        "startup": {"gpuvfio_help_s": help_ours, "python_pass_s": bare, "ratio": help_ours / bare, "goal": 3.0},
    }
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        inv, st = results["inventory"], results["startup"]
        print(f"host: {count} PCI functions, median of {args.runs} interleaved runs")
        print(f"gpuvfio list --all --json  {inv['gpuvfio_s'] * 1000:8.1f} ms")
        print(f"lspci -vmm -D -k           {inv['lspci_s'] * 1000:8.1f} ms")
        print(f"  ratio {inv['ratio']:.2f} (goal <= 1.0)")
        sel = results["selector"]
        print(f"gpuvfio list -d 10de: --json {sel['gpuvfio_s'] * 1000:6.1f} ms")
        print(f"lspci -d 10de: -vmm -D -k    {sel['lspci_s'] * 1000:6.1f} ms")
        print(f"  ratio {sel['ratio']:.2f} (goal <= 1.0)")
        print(f"gpuvfio --help             {st['gpuvfio_help_s'] * 1000:8.1f} ms")
        print(f"python3 -c pass            {st['python_pass_s'] * 1000:8.1f} ms")
        print(f"  ratio {st['ratio']:.2f} (goal < 3.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
