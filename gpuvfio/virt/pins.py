"""Which host CPUs the other domains on a libvirt connection pin their threads to.

Read from each domain's XML (virDomainGetXMLDesc): ``<cputune>``'s ``vcpupin``, ``emulatorpin``
and ``iothreadpin`` cpusets, and ``<vcpu cpuset=...>``, the default for every thread of the
domain that has no pin of its own (libvirt's qemuProcessSetupPid falls back to def->cpumask for
vCPUs, the emulator and I/O threads alike). Placement uses the answer to keep a new guest's
vCPUs off cores another guest already has (gpuvfio.domain.placement.place_cell ``avoid``).

Read through gpuvfio.domain.model, the one model of a domain's definition.
"""

from __future__ import annotations

import re
from typing import Iterable

from gpuvfio.domain import model
from gpuvfio.domain.elements import UnreadableXml
from gpuvfio.errors import GpuvfioError
from gpuvfio.numbers import uint
from gpuvfio.virt.defined import HostDomain

VCPU, EMULATOR, IOTHREAD = "vcpu", "emulator", "iothread"
ALL_PINS = frozenset({VCPU, EMULATOR, IOTHREAD})
VCPU_PINS = frozenset({VCPU})
# libvirt refuses cpusets naming a CPU at or above VIR_DOMAIN_CPUMASK_LEN (src/conf/domain_conf.h:
# 16384 in current releases, 1024 in old ones); a larger number is not something libvirt wrote.
CPUSET_LIMIT = 16384

_ITEM = re.compile(r"\s*(\^?)([0-9]{1,5})\s*(?:-\s*([0-9]{1,5})\s*)?", re.ASCII)  # \s: c_isspace, as virSkipSpaces


class UnreadablePins(GpuvfioError):
    """A domain definition from libvirt whose CPU pins cannot be read (not libvirt's cpuset syntax,
    or not XML): gpuvfio will not guess which CPUs that domain holds."""


def parse_cpuset(text: str) -> set[int]:
    """libvirt's cpuset syntax (src/util/virbitmap.c virBitmapParseSeparator): comma-separated
    ``N``, ``N-M`` (N <= M) and ``^N``, applied left to right, so ``0-7,^3`` is 0-2,4-7; spaces
    around the parts and one trailing comma are allowed, as there. Nothing at all (libvirt's
    domain parser refuses an empty cpuset), or anything else, is UnreadablePins."""
    cpus: set[int] = set()
    shown = text.strip()[:60]
    if not text.strip():
        raise UnreadablePins("empty cpuset")
    parts = text.split(",")
    if len(parts) > 1 and not parts[-1].strip():
        parts.pop()
    for part in parts:
        match = _ITEM.fullmatch(part)
        if match is None:
            raise UnreadablePins(f"malformed cpuset {shown!r}")
        negate, first, last = match.group(1), int(match.group(2)), match.group(3)
        if negate and last is not None:  # virbitmap.c: a range cannot be excluded
            raise UnreadablePins(f"malformed cpuset {shown!r} (^ takes one CPU, not a range)")
        end = int(last) if last is not None else first
        if end < first or end >= CPUSET_LIMIT:
            raise UnreadablePins(f"malformed cpuset {shown!r}")
        if negate:
            cpus.discard(first)
        else:
            cpus.update(range(first, end + 1))
    return cpus


def domain_pins(definition: "str | model.Domain", kinds: frozenset[str] = ALL_PINS,
                name: str = "the domain") -> set[int]:
    """Host CPUs a domain definition (its XML, or the model read from it) pins its threads of
    ``kinds`` (VCPU, EMULATOR, IOTHREAD) to. ``<vcpu cpuset>`` counts for each kind that has a
    thread without its own pin: a vCPU without a ``vcpupin``, the emulator without
    ``emulatorpin``, an I/O thread without ``iothreadpin``."""
    domain = _read(definition, name)

    def cpuset(element, what: str) -> set[int]:
        try:
            return parse_cpuset(element.cpuset or "")
        except UnreadablePins as exc:
            raise UnreadablePins(f"{name}: {what}: {exc}") from None

    cputune = domain.cputune or model.Cputune()
    found: set[int] = set()
    for pin in cputune.vcpupins if VCPU in kinds else ():
        found |= cpuset(pin, f"vcpupin of vCPU {pin.vcpu}")
    if cputune.emulatorpin is not None and EMULATOR in kinds:
        found |= cpuset(cputune.emulatorpin, "emulatorpin")
    for pin in cputune.iothreadpins if IOTHREAD in kinds else ():
        found |= cpuset(pin, f"iothreadpin of I/O thread {pin.iothread}")
    vcpu = domain.vcpu
    if vcpu is not None and vcpu.cpuset and (vcpu.placement or "static") == "static" \
            and _unpinned(domain, name) & kinds:
        found |= cpuset(vcpu, "<vcpu cpuset>")
    return found


def _read(definition, name: str) -> model.Domain:
    if not isinstance(definition, str):
        return definition
    try:
        return model.read_domain(definition)
    except UnreadableXml as exc:
        raise UnreadablePins(f"{name}: libvirt's {exc}") from None


def _unpinned(domain: model.Domain, name: str) -> set[str]:
    """The kinds with a thread that has no pin of its own and falls back to ``<vcpu cpuset>``."""
    cputune = domain.cputune or model.Cputune()
    vcpus = domain.vcpu.count if domain.vcpu is not None else 0
    if vcpus is None:
        raise UnreadablePins(f"{name}: <vcpu> is not a count")
    iothreads = uint(domain.iothreads or "0")
    if iothreads is None:
        raise UnreadablePins(f"{name}: <iothreads> is {domain.iothreads[:20]!r}, not a count")
    unpinned = set()
    if {str(n) for n in range(min(vcpus, CPUSET_LIMIT))} - {p.vcpu for p in cputune.vcpupins}:
        unpinned.add(VCPU)
    if cputune.emulatorpin is None:
        unpinned.add(EMULATOR)
    ids = [t.id for t in domain.iothreadids.threads] if domain.iothreadids else []
    if set(ids or map(str, range(1, min(iothreads, CPUSET_LIMIT) + 1))) - {p.iothread for p in cputune.iothreadpins}:
        unpinned.add(IOTHREAD)
    return unpinned


def pinned_elsewhere(domains: Iterable[HostDomain], exclude_name: str | None, *,
                     kinds: frozenset[str] = ALL_PINS) -> dict[int, list[str]]:
    """Host CPU -> names of the other ``domains`` (as listed) whose threads of ``kinds`` are pinned
    to it (``exclude_name``: the domain being (re)defined, which does not count against itself).

    Every domain counts, running or only defined: a running one by its live pins (what its
    threads use now, ``virsh vcpupin --live`` included) and its persistent definition (what it
    gets on its next start); a defined, shut-off one by its definition, which it takes when
    started. ``kinds``: ALL_PINS, or VCPU_PINS for the vCPU pins only."""
    used: dict[int, set[str]] = {}
    for domain in (d for d in domains if d.name != exclude_name):
        for defined in domain.definitions:
            for cpu in domain_pins(defined.model, kinds, domain.name):
                used.setdefault(cpu, set()).add(domain.name)
    return {cpu: sorted(names) for cpu, names in sorted(used.items())}
