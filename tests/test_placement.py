"""Property tests for placement: random topologies, invariants that must always hold."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gpuvfio.address import PciAddress
from gpuvfio.errors import Refused
from gpuvfio.host.model import Bar, PciFunction
from gpuvfio.host.numa import Cpu
from gpuvfio.domain.placement import guest_phys_bits_needed, mmio64_window_mb, place_cell
from tests.hostbuilder import BAR64_PREF


@st.composite
def topologies(draw):
    """(cpus, node_cpus): a node of N cores with 1..4 threads each, Linux-like numbering."""
    cores = draw(st.integers(1, 48))
    threads = draw(st.integers(1, 4))
    offset = draw(st.integers(0, 64))
    cpus, node = {}, []
    for t in range(threads):
        for c in range(cores):
            cpu = offset + t * cores + c
            siblings = tuple(offset + s * cores + c for s in range(threads))
            cpus[cpu] = Cpu(cpu, 0, c, siblings)
            node.append(cpu)
    return cpus, sorted(node)


@settings(max_examples=200, deadline=None)
@given(topologies(), st.integers(1, 200))
def test_pins_stay_on_node_and_never_repeat(topology, vcpus):
    cpus, node_cpus = topology
    try:
        cell = place_cell(0, node_cpus, cpus, list(range(vcpus)), 1 << 20)
    except Refused:
        assert vcpus > len(node_cpus)
        return
    assert len(cell.host_cpus) == vcpus
    assert set(cell.host_cpus) <= set(node_cpus)
    assert len(set(cell.host_cpus)) == vcpus
    # guest cores are whole host cores: each group of `threads` vCPUs are siblings
    for i in range(0, vcpus, cell.threads):
        group = cell.host_cpus[i:i + cell.threads]
        assert set(group) <= set(cpus[group[0]].siblings)
    assert set(cell.emulator_cpus) <= set(node_cpus)


@settings(max_examples=100, deadline=None)
@given(topologies(), st.integers(1, 64))
def test_forced_overcommit_stays_on_node(topology, vcpus):
    cpus, node_cpus = topology
    cell = place_cell(0, node_cpus, cpus, list(range(vcpus)), 1 << 20, force=True)
    assert set(cell.host_cpus) <= set(node_cpus) and len(cell.host_cpus) == vcpus


bar_sizes = st.sampled_from([2**k for k in range(20, 39)])  # 1 MiB .. 256 GiB


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(bar_sizes, min_size=1, max_size=3), min_size=1, max_size=8), st.integers(1, 2048))
def test_mmio_window_covers_bars(ports, memory_gib):
    devices = []
    for n, sizes in enumerate(ports):
        fn = PciFunction(PciAddress(0, n + 1, 0, 0), "10de", "2330", "030200")
        fn.bars = [Bar(i, 0, size, BAR64_PREF) for i, size in zip((1, 3, 5), sizes)]
        devices.append([fn])
    window = mmio64_window_mb(devices)
    total = sum(sum(sizes) for sizes in ports)
    assert window * 2**20 >= total
    assert window & (window - 1) == 0  # a power of two
    assert window >= 32 * 1024
    bits = guest_phys_bits_needed(memory_gib << 20, window)
    assert 2**bits >= (4 << 30) + (memory_gib << 30) + window * 2**20


def test_odd_vcpus_fall_back_to_one_thread_per_core():
    cpus = {c: Cpu(c, 0, c % 4, (c % 4, c % 4 + 4)) for c in range(8)}
    cell = place_cell(0, list(range(8)), cpus, [0, 1, 2], 1 << 20)
    assert cell.threads == 1 and len({cpus[c].core for c in cell.host_cpus}) == 3
    six = {c: Cpu(c, 0, c % 3, (c % 3, c % 3 + 3)) for c in range(6)}
    cell = place_cell(0, list(range(6)), six, list(range(5)), 1 << 20)  # 5 of 3x2: whole cores first
    assert cell.threads == 1 and cell.host_cpus[:4] == [1, 4, 2, 5]  # CPU 0's core last, siblings together
    assert len(set(cell.host_cpus)) == 5


def test_cpu0_core_left_to_the_host_when_possible():
    cpus = {c: Cpu(c, 0, c % 4, (c % 4, c % 4 + 4)) for c in range(8)}
    cell = place_cell(0, list(range(8)), cpus, [0, 1, 2, 3], 1 << 20)
    assert 0 not in cell.host_cpus and 4 not in cell.host_cpus
    with pytest.raises(Refused):
        place_cell(0, list(range(8)), cpus, list(range(10)), 1 << 20)
