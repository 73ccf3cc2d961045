"""Which host CPUs the other domains on a libvirt connection pin their threads to.

Read from each domain's XML (virDomainGetXMLDesc): ``<cputune>``'s ``vcpupin``, ``emulatorpin``
and ``iothreadpin`` cpusets, and ``<vcpu cpuset=...>``, the default for every thread of the
domain that has no pin of its own (libvirt's qemuProcessSetupPid falls back to def->cpumask for
vCPUs, the emulator and I/O threads alike). Placement uses the answer to keep a new guest's
vCPUs off cores another guest already has (gpuvfio.domain.placement.place_cell ``avoid``).

Stdlib XML parsing, as in gpuvfio.virt.usage.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from gpuvfio.errors import GpuvfioError
from gpuvfio.virt.connection import LibvirtError, call, libvirt_module

VCPU, EMULATOR, IOTHREAD = "vcpu", "emulator", "iothread"
ALL_PINS = frozenset({VCPU, EMULATOR, IOTHREAD})
VCPU_PINS = frozenset({VCPU})
# libvirt refuses cpusets naming a CPU at or above VIR_DOMAIN_CPUMASK_LEN (src/conf/domain_conf.h:
# 16384 in current releases, 1024 in old ones); a larger number is not something libvirt wrote.
CPUSET_LIMIT = 16384

_ITEM = re.compile(r"\s*(\^?)([0-9]+)\s*(?:-\s*([0-9]+)\s*)?", re.ASCII)  # \s: c_isspace, as virSkipSpaces


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


def domain_pins(domain_xml: str, kinds: frozenset[str] = ALL_PINS, name: str = "the domain") -> set[int]:
    """Host CPUs a domain definition pins its threads of ``kinds`` (VCPU, EMULATOR, IOTHREAD) to.
    ``<vcpu cpuset>`` counts for each kind that has a thread without its own pin: a vCPU without
    a ``vcpupin``, the emulator without ``emulatorpin``, an I/O thread without ``iothreadpin``."""
    try:
        root = ET.fromstring(domain_xml)
    except ET.ParseError as exc:
        raise UnreadablePins(f"{name}: libvirt's definition is not XML ({exc})") from None

    def cpuset(element, what: str) -> set[int]:
        try:
            return parse_cpuset(element.get("cpuset") or "")
        except UnreadablePins as exc:
            raise UnreadablePins(f"{name}: {what}: {exc}") from None

    def count(path: str) -> int:
        text = (root.findtext(path) or "0").strip()
        if not text.isdigit():
            raise UnreadablePins(f"{name}: <{path}> is {text[:20]!r}, not a count")
        return int(text)

    found: set[int] = set()
    unpinned = set()  # kinds with a thread that falls back to <vcpu cpuset>
    pinned_vcpus, pinned_iothreads = set(), set()
    for pin in root.iterfind("cputune/vcpupin"):
        pinned_vcpus.add(pin.get("vcpu"))
        if VCPU in kinds:
            found |= cpuset(pin, f"vcpupin of vCPU {pin.get('vcpu')}")
    if root.find("cputune/emulatorpin") is None:
        unpinned.add(EMULATOR)
    elif EMULATOR in kinds:
        found |= cpuset(root.find("cputune/emulatorpin"), "emulatorpin")
    for pin in root.iterfind("cputune/iothreadpin"):
        pinned_iothreads.add(pin.get("iothread"))
        if IOTHREAD in kinds:
            found |= cpuset(pin, f"iothreadpin of I/O thread {pin.get('iothread')}")
    if {str(n) for n in range(count("vcpu"))} - pinned_vcpus:
        unpinned.add(VCPU)
    iothread_ids = [t.get("id") for t in root.iterfind("iothreadids/iothread")]
    if set(iothread_ids or map(str, range(1, count("iothreads") + 1))) - pinned_iothreads:
        unpinned.add(IOTHREAD)
    vcpu = root.find("vcpu")
    if vcpu is not None and vcpu.get("cpuset") and vcpu.get("placement", "static") == "static" \
            and unpinned & kinds:
        found |= cpuset(vcpu, "<vcpu cpuset>")
    return found


def pinned_elsewhere(conn, exclude_name: str | None, *, kinds: frozenset[str] = ALL_PINS) -> dict[int, list[str]]:
    """Host CPU -> names of the other domains on ``conn`` whose threads of ``kinds`` are pinned
    to it (``exclude_name``: the domain being (re)defined, which does not count against itself).

    Every domain counts, running or only defined: a running one by its live pins (what its
    threads use now, ``virsh vcpupin --live`` included) and its persistent definition (what it
    gets on its next start); a defined, shut-off one by its definition, which it takes when
    started. ``kinds``: ALL_PINS, or VCPU_PINS for the vCPU pins only."""
    libvirt = libvirt_module()
    used: dict[int, set[str]] = {}
    for dom in call("listing libvirt's domains", conn.listAllDomains, 0):
        name = dom.name()
        if name == exclude_name:
            continue
        try:
            xmls = [dom.XMLDesc(0)]
            if dom.isActive() and dom.isPersistent():
                xmls.append(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                continue  # a transient domain that ended since the listing pins nothing
            raise LibvirtError(f"reading {name}'s definition: {exc.get_error_message()}") from None
        for xml in xmls:
            for cpu in domain_pins(xml, kinds, name):
                used.setdefault(cpu, set()).add(name)
    return {cpu: sorted(names) for cpu, names in sorted(used.items())}
