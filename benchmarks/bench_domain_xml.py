#!/usr/bin/env python3
"""Domain XML rendering + validation, side by side with virt-install --print-xml, as a ratio.

gpuvfio: ``gpuvfio --root DGX xml <8 H100> --name dgx --vcpus 64 --memory 512G`` on the
bundled HGX H100 sample (whole process: inventory, policy, jinja2, lxml RelaxNG
validation), and the same in-process per domain (policy + render + validate, warm).
virt-install: ``--print-xml`` of the equivalent domain (8 PCI host devices, 64 vCPU pins,
numatune, 1G hugepages, q35/UEFI, host-passthrough topology) against a private libvirtd
(tests/lanes/daemon.py) -- virt-install needs a libvirt connection, gpuvfio does not.
This machine's own PCI nodedevs stand in for the H100s (virt-install looks devices up).
Median of interleaved runs. Goal: faster than virt-install (ratio < 1).
Usage: benchmarks/bench_domain_xml.py [--runs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GPUS = ["0000:1b:00.0", "0000:43:00.0", "0000:52:00.0", "0000:61:00.0",
        "0000:9d:00.0", "0000:c3:00.0", "0000:d1:00.0", "0000:df:00.0"]


def virt_install_args(uri: str, nodedevs: list[str], pins: list[tuple[int, int]]) -> list[str]:
    cputune = ",".join(f"vcpupin{i}.vcpu={v},vcpupin{i}.cpuset={c}" for i, (v, c) in enumerate(pins))
    args = ["virt-install", "--connect", uri, "--print-xml", "--name", "dgx", "--virt-type", "qemu",
            "--memory", str(512 * 1024), "--vcpus", "64,sockets=2,cores=16,threads=2", "--cpu",
            "host-passthrough,cell0.id=0,cell0.cpus=0-31,cell0.memory=268435456,"
            "cell1.id=1,cell1.cpus=32-63,cell1.memory=268435456",
            "--cputune", cputune + ",emulatorpin.cpuset=0", "--numatune", "0-1,mode=strict",
            "--memorybacking", "hugepages.page0.size=1,hugepages.page0.unit=G", "--machine", "q35",
            "--boot", "uefi", "--import", "--disk", "none", "--osinfo", "linux2022", "--network", "none",
            "--graphics", "none", "--memballoon", "none"]
    for name in nodedevs:
        args += ["--host-device", name]
    return args


def timed(cmd: list[str], env=None) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{cmd[0]} failed: {proc.stderr.strip()[-400:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11)
    args = parser.parse_args()
    import libvirt

    from gpuvfio.address import PciAddress
    from gpuvfio.domain.render import domain_xml
    from gpuvfio.domain.request import domain_request
    from gpuvfio.domain.spec import build_spec
    from gpuvfio.host.fixture import load_fixture
    from gpuvfio.host.root import HostRoot
    from gpuvfio.host.inventory import read_inventory
    from gpuvfio.host.numa import read_numa
    from tests.lanes.daemon import LibvirtDaemon
    from tests.make_samples import sample_path

    libvirt.registerErrorHandler(lambda *a: None, None)
    scratch = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=scratch) as root, LibvirtDaemon() as daemon:
        with open(sample_path("dgx-h100")) as handle:
            load_fixture(handle.read(), root)
        host = HostRoot(root)
        inventory, nodes = read_inventory(host), read_numa(host)
        options = domain_request("dgx", vcpus=64, memory="512G")
        spec = build_spec(host, inventory, nodes, [PciAddress.parse(g) for g in GPUS], options)
        domain_xml(spec)  # warm: templates and the RelaxNG schema compiled once per process
        samples = []
        for _ in range(max(args.runs, 20)):
            start = time.perf_counter()
            domain_xml(build_spec(host, inventory, nodes, [PciAddress.parse(g) for g in GPUS], options))
            samples.append(time.perf_counter() - start)
        in_process = statistics.median(samples)
        pins = [(v, c) for cell in spec.cells for v, c in zip(cell.vcpus, cell.host_cpus)]
        conn = daemon.connect()
        local = sorted(conn.listDevices("pci", 0))
        conn.close()
        nodedevs = (local * 8)[:8]
        env = {**os.environ, "PYTHONPATH": REPO}
        ours_cmd = [os.path.join(os.path.dirname(sys.executable), "gpuvfio"), "--root", root, "xml", *GPUS,
                    "--name", "dgx", "--vcpus", "64",
                    "--memory", "512G"]
        theirs_cmd = virt_install_args(daemon.uri, nodedevs, pins)
        timed(theirs_cmd)  # warm libvirt's capability cache
        ours, theirs = [], []
        for _ in range(args.runs):
            ours.append(timed(ours_cmd, env))
            theirs.append(timed(theirs_cmd))
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"8-GPU HGX H100 domain, median of {args.runs} interleaved runs")
    print(f"gpuvfio xml (whole process)        {o * 1000:8.1f} ms")
    print(f"virt-install --print-xml           {t * 1000:8.1f} ms")
    print(f"  ratio {o / t:.2f} (goal < 1.0)")
    print(f"gpuvfio in-process per domain      {in_process * 1000:8.1f} ms (policy + render + RelaxNG)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
