#!/usr/bin/env python3
"""Domain XML rendering + validation, side by side with virt-install --print-xml, as a ratio
measured in one run (benchmarks/ratios.py).

gpuvfio: ``gpuvfio --root DGX xml <8 H100> --name dgx --vcpus 64 --memory 512G`` on the
bundled HGX H100 sample (whole process: inventory, policy, jinja2, lxml RelaxNG
validation), and the same in-process per domain (policy + render + validate, warm).
virt-install: ``--print-xml`` of the equivalent domain (8 PCI host devices, 64 vCPU pins,
numatune, 1G hugepages, q35/UEFI, host-passthrough topology) against a private libvirtd
(tests/lanes/daemon.py) -- virt-install needs a libvirt connection, gpuvfio does not.
This machine's own PCI nodedevs stand in for the H100s (virt-install looks devices up).
Goal (issue 39): at most 0.5x virt-install. Beside it the floor: a typer CLI parsing
``list``'s options on the same root (benchmarks/typer_floor.py parses list's, not xml's), so
"own" is what gpuvfio's modules and its work on the host add to start-up.
Usage: benchmarks/bench_domain_xml.py [--runs N] [--json] [--strict]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from ratios import GPUVFIO, TYPER_FLOOR, Goal, base_env, load, measure, report  # noqa: E402

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


def xml_goal(root: str, virt_install: list[str]) -> Goal:
    """gpuvfio xml on ROOT (the HGX sample) against virt-install's command line, goal 0.5x."""
    return Goal("xml, 8 GPUs, whole process / virt-install --print-xml",
                [GPUVFIO, "--root", root, "xml", *GPUS, "--name", "dgx", "--vcpus", "64", "--memory", "512G"],
                virt_install, 0.5, floor=TYPER_FLOOR + ["--root", root, "list"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the goal is missed")
    args = parser.parse_args()
    import libvirt

    from tests.lanes.daemon import LibvirtDaemon

    libvirt.registerErrorHandler(lambda *a: None, None)
    scratch = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=scratch) as root, LibvirtDaemon() as daemon:
        in_process, pins = _in_process(root, args.runs)
        conn = daemon.connect()
        local = sorted(conn.listDevices("pci", 0))
        conn.close()
        goal = xml_goal(root, virt_install_args(daemon.uri, (local * 8)[:8], pins))
        before = load()
        measure([goal], args.runs, base_env(REPO))  # its first round (virt-install's capability cache) uncounted
    missed = report("8-GPU HGX H100 domain", [goal], args.runs, before, as_json=args.json,
                    extra={"in_process_ms": round(in_process * 1000, 2)})
    if not args.json:
        print(f"gpuvfio in-process per domain: {in_process * 1000:.1f} ms (policy + render + RelaxNG, warm)")
    return 1 if missed and args.strict else 0


def _in_process(root: str, runs: int) -> tuple[float, list[tuple[int, int]]]:
    """The median time of one domain's policy, rendering and validation in a warm process, and the
    vCPU pins it chose (virt-install is given the same)."""
    from gpuvfio.address import PciAddress
    from gpuvfio.domain.render import domain_xml
    from gpuvfio.domain.request import domain_request
    from gpuvfio.domain.spec import build_spec
    from gpuvfio.host.fixture import load_fixture
    from gpuvfio.host.inventory import read_inventory
    from gpuvfio.host.numa import read_numa
    from gpuvfio.host.root import HostRoot
    from tests.make_samples import sample_path

    with open(sample_path("dgx-h100")) as handle:
        load_fixture(handle.read(), root)
    host = HostRoot(root)
    inventory, nodes = read_inventory(host), read_numa(host)
    options = domain_request("dgx", vcpus=64, memory="512G")
    spec = build_spec(host, inventory, nodes, [PciAddress.parse(g) for g in GPUS], options)
    domain_xml(spec)  # warm: templates and the RelaxNG schema compiled once per process
    samples = []
    for _ in range(max(runs, 20)):
        start = time.perf_counter()
        domain_xml(build_spec(host, inventory, nodes, [PciAddress.parse(g) for g in GPUS], options))
        samples.append(time.perf_counter() - start)
    pins = [(v, c) for cell in spec.cells for v, c in zip(cell.vcpus, cell.host_cpus)]
    return statistics.median(samples), pins


if __name__ == "__main__":
    sys.exit(main())
