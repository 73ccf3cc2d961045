"""Property tests for placement: random topologies, invariants that must always hold."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvfio.errors import Refused
from gpuvfio.host.numa import Cpu
from gpuvfio.domain.placement import hugepage_choice, host_cores, place_cell


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


# -- neighbours: CPUs other domains pin (issue 14 item 6) ------------------------------------------


@settings(max_examples=200, deadline=None)
@given(topologies(), st.integers(1, 64), st.data())
def test_avoided_cores_stay_free_or_the_plan_refuses(topology, vcpus, data):
    cpus, node_cpus = topology
    avoid = frozenset(data.draw(st.sets(st.sampled_from(node_cpus), max_size=len(node_cpus))))
    taken = {cpu for core in host_cores(cpus, node_cpus) if avoid & set(core) for cpu in core}
    free = [c for c in node_cpus if c not in taken]
    try:
        cell = place_cell(0, node_cpus, cpus, list(range(vcpus)), 1 << 20, avoid=avoid)
    except Refused as exc:
        assert vcpus > len(free) and f"{len(free)} free" in str(exc) or not avoid
        return
    assert len(free) >= vcpus or not avoid
    assert not taken & set(cell.host_cpus) and not taken & set(cell.emulator_cpus)
    assert len(set(cell.host_cpus)) == vcpus and set(cell.host_cpus) <= set(node_cpus)
    assert cell.avoided == sorted(taken) and bool(cell.notes) == bool(avoid) and not cell.warnings
    for i in range(0, vcpus, cell.threads):
        group = cell.host_cpus[i:i + cell.threads]
        assert set(group) <= set(cpus[group[0]].siblings)


@settings(max_examples=100, deadline=None)
@given(topologies(), st.integers(1, 64), st.data())
def test_forced_sharing_takes_free_cores_first(topology, vcpus, data):
    cpus, node_cpus = topology
    avoid = frozenset(data.draw(st.sets(st.sampled_from(node_cpus), min_size=1, max_size=len(node_cpus))))
    taken = {cpu for core in host_cores(cpus, node_cpus) if avoid & set(core) for cpu in core}
    free = [c for c in node_cpus if c not in taken]
    cell = place_cell(0, node_cpus, cpus, list(range(vcpus)), 1 << 20, avoid=avoid, force=True)
    assert len(cell.host_cpus) == vcpus and set(cell.host_cpus) <= set(node_cpus)
    if vcpus <= len(free):
        assert not taken & set(cell.host_cpus) and not cell.warnings
        return
    assert set(free) <= set(cell.host_cpus)  # every free CPU is used before a shared one
    assert cell.warnings and "--force" in cell.warnings[0]
    assert set(cell.emulator_cpus) <= set(cell.host_cpus)  # never onto another domain's CPUs alone


@settings(max_examples=100, deadline=None)
@given(topologies(), st.integers(1, 200), st.booleans())
def test_nothing_to_avoid_on_the_node_changes_nothing(topology, vcpus, force):
    """CPUs pinned on other nodes (or none) leave the placement exactly as it was."""
    cpus, node_cpus = topology
    elsewhere = frozenset(range(max(node_cpus) + 1, max(node_cpus) + 9))
    try:
        plain = place_cell(0, node_cpus, cpus, list(range(vcpus)), 1 << 20, force=force)
    except Refused as exc:
        with pytest.raises(Refused) as again:
            place_cell(0, node_cpus, cpus, list(range(vcpus)), 1 << 20, force=force, avoid=elsewhere)
        assert str(again.value) == str(exc)
        return
    assert place_cell(0, node_cpus, cpus, list(range(vcpus)), 1 << 20, force=force, avoid=elsewhere) == plain
    assert plain.avoided == [] and plain.notes == [] and plain.warnings == []


def _two_threads(cores: int) -> dict[int, Cpu]:
    """``cores`` cores x 2 threads, Linux numbering: CPU c and c + cores are siblings."""
    return {c: Cpu(c, 0, c % cores, (c % cores, c % cores + cores)) for c in range(2 * cores)}


def test_two_guests_on_one_node_no_longer_get_identical_pins():
    cpus = _two_threads(8)
    node = list(range(16))
    first = place_cell(0, node, cpus, list(range(4)), 1 << 20)
    again = place_cell(0, node, cpus, list(range(4)), 1 << 20)
    assert first.host_cpus == again.host_cpus == [1, 9, 2, 10]  # what happened before: the same pins
    pinned = {cpu: ["guest-a"] for cpu in first.host_cpus}
    second = place_cell(0, node, cpus, list(range(4)), 1 << 20, avoid=frozenset(pinned), pinned_by=pinned)
    assert second.host_cpus == [3, 11, 4, 12] and second.threads == 2
    assert not set(second.emulator_cpus) & set(first.host_cpus)
    assert second.avoided == [1, 2, 9, 10]
    assert second.notes == ["node 0: vCPUs and emulator threads stayed off CPUs 1-2,9-10 (pinned by guest-a: "
                            "1-2,9-10)"]


def test_avoiding_half_a_core_leaves_the_whole_core():
    cpus = _two_threads(4)
    cell = place_cell(0, list(range(8)), cpus, [0, 1], 1 << 20, avoid=frozenset({1}), pinned_by={1: ["guest-a"]})
    assert cell.host_cpus == [2, 6] and 5 not in cell.emulator_cpus and cell.avoided == [1, 5]
    assert "stayed off CPUs 1,5 (pinned by guest-a: 1, and those cores' sibling threads)" in cell.notes[0]


def test_refusal_says_what_is_free_and_who_holds_the_rest():
    cpus = _two_threads(8)
    pinned = {**{c: ["guest-a"] for c in (8, 9, 10, 11)}, **{c: ["guest-b"] for c in (12, 13, 14, 15)}}
    with pytest.raises(Refused) as refused:
        place_cell(0, list(range(16)), cpus, list(range(10)), 1 << 20, avoid=frozenset(pinned), pinned_by=pinned)
    message = str(refused.value)
    assert "NUMA node 0 has 16 CPUs (8 cores): 0 free, 16 on cores other domains pin" in message
    assert "guest-a: 8-11, guest-b: 12-15" in message and "10 vCPUs" in message and "--force" in message
    # Half the node pinned by one guest: 4 vCPUs fit in the rest, 10 do not.
    half = {c: ["guest-a"] for c in (4, 5, 6, 7)}
    assert place_cell(0, list(range(16)), cpus, list(range(4)), 1 << 20, avoid=frozenset(half)).host_cpus == [
        1, 9, 2, 10]
    with pytest.raises(Refused, match="8 free, 8 on cores other domains pin \\(other domains: 4-7\\)"):
        place_cell(0, list(range(16)), cpus, list(range(10)), 1 << 20, avoid=frozenset(half))


def test_forced_sharing_warns_and_names_the_neighbour():
    cpus = _two_threads(4)
    pinned = {c: ["guest-a"] for c in (2, 3, 6, 7)}
    cell = place_cell(0, list(range(8)), cpus, list(range(6)), 1 << 20, avoid=frozenset(pinned), pinned_by=pinned,
                      force=True)
    assert cell.host_cpus == [1, 5, 0, 4, 2, 6]  # both free cores (CPU 0's too), then one of guest-a's
    assert cell.warnings == ["node 0: 6 vCPUs do not fit in the 4 CPUs other domains leave free; they share CPUs "
                             "2,6 with guest-a: 2-3,6-7 (--force)"]
    assert cell.avoided == [3, 7] and set(cell.emulator_cpus) <= set(cell.host_cpus)


def test_hugepage_refusal_names_the_node_and_where_to_reserve():
    free = {0: {1048576: 256, 2048: 0}, 1: {1048576: 3, 2048: 0}}
    with pytest.raises(Refused) as refused:
        hugepage_choice("1G", [(1, 64 << 20)], free)
    message = str(refused.value)
    assert "node 1: 3 free x 1G, 64 needed" in message
    assert "node 1 needs 61 more (reserve them in /sys/devices/system/node/node1/hugepages/hugepages-1048576kB/" \
           "nr_hugepages)" in message
    assert "node 0 has enough, but the guest's memory is bound to node 1" in message
    assert hugepage_choice("1G", [(0, 64 << 20)], free) == (1048576, None)
    with pytest.raises(Refused, match="not a whole number of 1G pages"):
        hugepage_choice("1G", [(0, (64 << 20) + 2048)], free)


def test_hugepage_hints_name_only_the_nodes_that_are_short():
    """Two cells: node 0 has exactly its 16 pages, node 1 has 3 of 16; only node 1 is told to
    reserve more (a hint of "0 more" for node 0 would send the admin to the wrong node)."""
    free = {0: {1048576: 16}, 1: {1048576: 3}}
    with pytest.raises(Refused) as refused:
        hugepage_choice("1G", [(0, 16 << 20), (1, 16 << 20)], free)
    message = str(refused.value)
    assert "node 1 needs 13 more" in message and "node 0 needs" not in message
