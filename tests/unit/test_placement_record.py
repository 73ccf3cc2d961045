"""A record of placement's whole answer (gpuvfio/domain/placement.py) over a matrix of host
nodes, vCPU counts, other domains' pins and --force, and of the hugepage choice over demands and
free pages: tests/golden/placements.json. The rules are tested one by one in test_placement.py
and test_pins.py (invariants, and cases derived by hand); this record holds every field, note,
warning and refusal of every answer, so a change to any of them is a reviewed change to the
record. Rewrite it with ``python -m tests.unit.test_placement_record --write`` and review the diff."""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys

from gpuvfio.domain.placement import hugepage_choice, place_cell
from gpuvfio.errors import Refused
from gpuvfio.host.numa import Cpu
from tests.unit.test_address_record import assert_recorded, load, write

RECORD = os.path.join(os.path.dirname(__file__), os.pardir, "golden", "placements.json")
GiB_KIB = 1 << 20


def node(cores: int, threads: int, offset: int = 0, single: int = 0) -> tuple[dict[int, Cpu], list[int]]:
    """A node of ``cores`` cores of ``threads`` threads (Linux numbering: first threads first),
    then ``single`` cores of one thread (a hybrid CPU's E-cores), CPUs from ``offset``."""
    cpus: dict[int, Cpu] = {}
    for t in range(threads):
        for c in range(cores):
            cpu = offset + t * cores + c
            cpus[cpu] = Cpu(cpu, 0, c, tuple(offset + s * cores + c for s in range(threads)))
    base = offset + cores * threads
    for e in range(single):
        cpus[base + e] = Cpu(base + e, 0, cores + e, (base + e,))
    return cpus, sorted(cpus)


NODES = {"4x2@0": node(4, 2), "4x2@8": node(4, 2, 8), "8x1@0": node(8, 1), "2x4@0": node(2, 4),
         "hybrid 2x2+4@0": node(2, 2, 0, 4), "1x1@0": node(1, 1), "3x2@0": node(3, 2)}
VCPUS = (1, 2, 3, 4, 6, 7, 8, 9, 12)


def avoids(cpus: list[int]) -> dict[str, frozenset[int]]:
    return {"none": frozenset(), "first": frozenset(cpus[:1]), "half": frozenset(cpus[: len(cpus) // 2]),
            "all": frozenset(cpus)}


def placement(name: str, vcpus: int, avoid: str, force: bool) -> dict:
    cpus, node_cpus = NODES[name]
    pinned = avoids(node_cpus)[avoid]
    try:
        cell = place_cell(1, node_cpus, cpus, list(range(vcpus)), 4 * GiB_KIB, force=force, avoid=pinned,
                          pinned_by={cpu: ["guest-b"] for cpu in sorted(pinned)[:1]})
    except Refused as refused:
        return {"refused": str(refused)}
    return dataclasses.asdict(cell)


FREE = {"none": {}, "n0 1G": {0: {GiB_KIB: 8, 2048: 0}}, "n1 1G": {0: {GiB_KIB: 0, 2048: 100}, 1: {GiB_KIB: 16}},
        "both 2M": {0: {2048: 4096}, 1: {2048: 4096, GiB_KIB: 2}}, "split 1G": {0: {GiB_KIB: 4}, 1: {GiB_KIB: 4}},
        # node 0 one page short, nodes 1 and 2 exactly enough, node 3 without the size at all
        "n0 short": {0: {GiB_KIB: 7}, 1: {GiB_KIB: 8}, 2: {GiB_KIB: 8, 2048: 0}, 3: {2048: 10}},
        "no 1G": {0: {2048: 10}, 1: {2048: 10}}}
DEMANDS = {"any 8G": [(None, 8 * GiB_KIB)], "n0 8G": [(0, 8 * GiB_KIB)],
           "n0 4G n1 4G": [(0, 4 * GiB_KIB), (1, 4 * GiB_KIB)], "n0 3M": [(0, 3 * 1024)],
           "n0 7G": [(0, 7 * GiB_KIB)], "n1 12G": [(1, 12 * GiB_KIB)],
           "n0 3M n1 12G": [(0, 3 * 1024), (1, 12 * GiB_KIB)], "n0 1G": [(0, GiB_KIB)]}


def pages(requested: str, demand: str, free: str, force: bool) -> dict:
    try:
        size, warning = hugepage_choice(requested, DEMANDS[demand], FREE[free], force=force)
    except Refused as refused:
        return {"refused": str(refused)}
    return {"size_kib": size, "warning": warning}


def recorded() -> dict:
    answers = {f"cell {n} vcpus={v} avoid={a} force={f}": placement(n, v, a, f)
               for n, v, a, f in itertools.product(NODES, VCPUS, ("none", "first", "half", "all"), (False, True))}
    answers |= {f"pages {r} {d} free={fr} force={f}": pages(r, d, fr, f)
                for r, d, fr, f in itertools.product(("none", "1G", "2M", "auto"), DEMANDS, FREE, (False, True))}
    return answers


def test_every_placement_is_the_recorded_one():
    assert_recorded(RECORD, recorded())


def test_the_record_covers_every_way_a_placement_ends():
    record = load(RECORD).values()
    assert any(a.get("warnings") for a in record) and any(a.get("notes") for a in record)
    assert any("refused" in a and "hugepages" in a["refused"] for a in record)
    assert any("refused" in a and "do not fit" in a["refused"] for a in record)
    assert {a.get("threads") for a in record} >= {1, 2, 4}
    assert any(a.get("warning") for a in record) and {a.get("size_kib") for a in record} >= {2048, GiB_KIB}


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    write(RECORD, recorded())
