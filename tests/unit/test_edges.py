"""Exact edges the unit lane did not pin (issue 35 item 3): placement with exactly one spare
core or CPU (CPU 0's stays the host's), a bandwidth exactly at its gate, a sysfs attribute at
and one byte over the read bound. Each test fails on the planted bug named in it."""

from __future__ import annotations

import os

import pytest

from gpuvfio import files
from gpuvfio.domain.placement import place_cell
from gpuvfio.errors import GpuvfioError
from gpuvfio.guest.checks import evaluate
from gpuvfio.guest.expect import Expected, gates
from gpuvfio.guest.verify import parse_probe, parse_verifier
from gpuvfio.host.numa import Cpu
from gpuvfio.host.root import HostRoot
from tests.unit.test_verify import GPU_LINE, probe_text, statuses, verifier_json

# Four cores of two threads: core c holds CPUs c and c + 4 (Linux numbers siblings so).
SMT = {c: Cpu(c, 0, c % 4, (c % 4, c % 4 + 4)) for c in range(8)}


def test_exactly_one_spare_core_is_cpu_0s():
    """Planted bug: CPU 0's core is moved last only when two or more cores are spare
    (``len(usable) > needed + 1``): six vCPUs then take it."""
    cell = place_cell(0, list(range(8)), SMT, list(range(6)), 1 << 20)
    assert sorted(cell.host_cpus) == [1, 2, 3, 5, 6, 7] and cell.emulator_cpus == [0, 4]
    full = place_cell(0, list(range(8)), SMT, list(range(8)), 1 << 20)  # no spare: CPU 0 is used
    assert sorted(full.host_cpus) == list(range(8))


def test_exactly_one_spare_cpu_is_cpu_0():
    """Seven vCPUs on eight CPUs: one thread per CPU, and the one left over is CPU 0 (the
    kernel's IRQs and housekeeping land there), not its sibling. Planted bug: the same
    ``len(usable) > needed + 1`` (CPU 0 then takes a vCPU and CPU 4 is left over)."""
    cell = place_cell(0, list(range(8)), SMT, list(range(7)), 1 << 20)
    assert 0 not in cell.host_cpus and cell.emulator_cpus == [0]


H100 = Expected("0000:1b:00.0", "10de", "2330", "030200", 5, 16, "0000:1b:00.0 Gen5 x16")


@pytest.mark.parametrize("h2d, verdict", [(40.0, "pass"), (39.99, "fail")])
def test_a_bandwidth_exactly_at_the_gate_passes_and_just_under_fails(h2d, verdict):
    """Planted bug: ``gbps > floor`` (a result exactly at the gate fails)."""
    report = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json(h2d=h2d)), [H100],
                      gates=gates(min_gbps=40.0))
    assert statuses(report)["h2d_bandwidth"] == verdict


def test_a_sysfs_attribute_at_the_bound_is_read_and_one_byte_over_is_refused(tmp_path):
    """Planted bug: the reader asks for ``limit`` bytes instead of ``limit + 1`` (an attribute
    one byte over is cut short and believed)."""
    device = tmp_path / "sys" / "bus" / "pci" / "devices" / "0000:01:00.0"
    device.mkdir(parents=True)
    (device / "at").write_bytes(b"x" * files.ATTRIBUTE_LIMIT)
    (device / "over").write_bytes(b"x" * (files.ATTRIBUTE_LIMIT + 1))
    host = HostRoot(str(tmp_path))
    assert len(host.read(os.path.join(str(device), "at"))) == files.ATTRIBUTE_LIMIT
    with pytest.raises(GpuvfioError, match="over|large|bound|limit"):
        host.read(os.path.join(str(device), "over"))
