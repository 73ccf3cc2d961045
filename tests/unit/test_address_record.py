"""A record of the address-space planner's whole answer over a matrix of hosts and guests
(firmware, virt type, CPU vendor, RAM, phys-bits, GPUs, switches, pxb-pcie buses, pcie.0 BARs):
tests/golden/address_plans.json. The rules are tested one by one, with numbers derived by hand,
in test_address_space.py; this record holds every field and line of every plan (and every
refusal's report), so that a change to any of them is seen and reviewed as a change to the
record, not passed by a matrix nobody looks at. Rewrite it with
``python -m tests.unit.test_address_record --write`` and review the diff."""

from __future__ import annotations

import itertools
import json
import os
import sys

from gpuvfio.domain.address_space import plan_address_space
from gpuvfio.errors import Refused
from gpuvfio.host.model import IORESOURCE_MEM, IORESOURCE_MEM_64, IORESOURCE_PREFETCH, Bar

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
PREF64 = IORESOURCE_MEM | IORESOURCE_MEM_64 | IORESOURCE_PREFETCH
RECORD = os.path.join(os.path.dirname(__file__), os.pardir, "golden", "address_plans.json")


def gpu(bar1: int) -> list[Bar]:
    return [Bar(0, 0, 16 * MiB, IORESOURCE_MEM), Bar(1, 0, bar1, PREF64), Bar(3, 0, 32 * MiB, PREF64),
            Bar(6, 0, 512 * KiB, IORESOURCE_MEM | IORESOURCE_PREFETCH)]


# name -> (groups, buses, root_bars)
GUESTS = {
    "none": ([], None, None),
    "a10": ([gpu(16 * GiB)], None, None),
    "h100": ([gpu(128 * GiB)], None, None),
    "2xh100-pxb": ([gpu(128 * GiB), gpu(128 * GiB)], [0, 1], None),
    "4xl40s-pxb2": ([gpu(64 * GiB)] * 4, [1, 1, 2, 2], None),
    "switch-2xh100": ([[gpu(128 * GiB), gpu(128 * GiB)]], None, None),
    "8xh100": ([gpu(128 * GiB)] * 8, None, None),
    "root-bar": ([gpu(16 * GiB)], None, [Bar(2, 0, 8 * GiB, PREF64), Bar(4, 0, 4 * KiB, IORESOURCE_MEM)]),
    "h200-nvl": ([gpu(256 * GiB)] * 2, [1, 2], None),
    "a pebibyte BAR": ([gpu(1 << 50)], None, None),  # needs 51 phys-bits
    "no bits fit": ([gpu(1 << 53), [Bar(0, 0, 64 * KiB, IORESOURCE_MEM)]], None, None),  # and a 32-bit NIC
}
MEMORIES = {"2G": 2 * MiB, "2.75G": 0xB0000000 // KiB, "3G": 3 * MiB, "64G": 64 * MiB, "1T": TiB // KiB, "3T": 3 * TiB // KiB}
HOSTS = [("kvm", "GenuineIntel", 46), ("kvm", "GenuineIntel", 39), ("kvm", "AuthenticAMD", 48),
         ("kvm", "AuthenticAMD", 40), ("kvm", None, None), ("kvm", "GenuineIntel", 52), ("qemu", None, 52),
         ("qemu", "GenuineIntel", 43), ("kvm", "HygonGenuine", 39), ("kvm", "AuthenticAMD", None)]


def cases():
    for (guest, (groups, buses, root)), memory, (virt, vendor, bits), firmware in itertools.product(
            GUESTS.items(), MEMORIES.items(), HOSTS, ("efi", "bios")):
        yield f"{guest} {memory[0]} {virt} {vendor} {bits} {firmware}", groups, buses, root, memory[1], virt, \
            vendor, bits, firmware


def answer(groups, buses, root, memory_kib, virt, vendor, bits, firmware) -> dict:
    try:
        plan = plan_address_space(groups, memory_kib, host_phys_bits=bits, virt_type=virt, firmware=firmware,
                                  cpu_vendor=vendor, root_bars=root, buses=buses)
    except Refused as refused:
        return {"refused": str(refused), "report": refused.report}
    return plan.to_json()


def recorded() -> dict:
    return {name: answer(*rest) for name, *rest in cases()}


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def assert_recorded(path: str, answers: dict) -> None:
    """Every case's answer (in its JSON form) is the recorded one, and no case is added or gone."""
    record, now = load(path), json.loads(json.dumps(answers))
    assert sorted(now) == sorted(record)
    changed = [name for name in now if now[name] != record[name]]
    assert not changed, f"{len(changed)} answers differ from {os.path.basename(path)}, e.g. {changed[0]}: " \
                        f"{now[changed[0]]} != {record[changed[0]]}"


def test_every_plan_is_the_recorded_one():
    assert_recorded(RECORD, recorded())


def test_the_record_covers_every_way_a_plan_ends():
    record = load(RECORD).values()
    hows = {line.split(":")[0] for plan in record for line in plan.get("lines", [])}
    assert {"OVMF 64-bit window", "SeaBIOS 64-bit window", "QEMU start check"} <= hows
    assert any(plan.get("pcihole64_kib") for plan in record)
    assert any("refused" in plan for plan in record) and any(plan.get("ovmf_mmio64_mb") for plan in record)
    assert any((plan.get("maxphysaddr") or {}).get("mode") == "emulate" for plan in record)
    assert any("HyperTransport" in line for plan in record for line in plan.get("lines", []))


def write(path: str, answers: dict) -> None:
    """One case per line: a change to a plan is a changed line in the diff."""
    lines = [f"{json.dumps(name)}: {json.dumps(answers[name], sort_keys=True)}" for name in sorted(answers)]
    with open(path, "w", encoding="utf-8") as out:
        out.write("{\n" + ",\n".join(lines) + "\n}\n")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    write(RECORD, recorded())
