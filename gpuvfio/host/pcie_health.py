"""A device's PCIe health as the host sees it, rated: what ``gpuvfio health`` reports
(gpuvfio.ops.health) and what a bind's plan refuses or warns about (gpuvfio.bind.plan).

For one function and the ports above it:

* config space: a function whose vendor ID reads 0xffff has fallen off the bus (or sits in
  D3cold and does not come back) -- failed, and reported, never left out;
* the journal's mark of a device that came back broken from its last guest -- failed until
  ``gpuvfio reset``;
* the AER counters of the device and of every port between it and its root port
  (gpuvfio.host.aer): fatal errors fail it, non-fatal ones degrade it, correctable ones are
  reported with their kinds;
* the link: a width below what the device and its slot both allow degrades it (a lane lost
  stays lost); a lower speed alone does not, since GPUs lower the link speed while idle
  (``verify`` measures it under load); a link that reads width 0 is down -- failed;
* IOMMU faults the kernel log holds for it (gpuvfio.host.iommu_faults): DMA to an address its
  domain does not map, or an interrupt the remapping table blocks -- degraded (a driver or a
  guest misprogramming the device, or a device that no longer behaves);
* the reset the kernel gives it, as ``gpuvfio qualify`` found it for its model
  (gpuvfio.host.reset_verdicts): one that failed there degrades it.

A check that could not run (no AER counters, an unreadable config space) is ``unknown``, and a
device with an unknown finding is rated degraded: health vouches only for what it read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError
from gpuvfio.host.aer_baseline import AerBaseline, read_baseline
from gpuvfio.host.aer import AerCounts, AerError, Severity, read_aer, read_rootport_totals
from gpuvfio.host.inventory import Inventory
from gpuvfio.files import Tree
from gpuvfio.host.iommu_faults import IommuFault, KernelLog, read_kernel_log
from gpuvfio.host.model import Link, PciFunction
from gpuvfio.host.reset_verdicts import Outcome, ResetVerdicts, read_verdicts
from gpuvfio.host.root import HostRoot

__all__ = ["Rating", "Finding", "DeviceHealth", "HealthRecords", "device_health", "read_records", "plan_findings", "reset_findings"]


class Rating(str, Enum):
    OK = "ok"
    UNKNOWN = "unknown"  # a finding only: the check could not run
    DEGRADED = "degraded"
    FAILED = "failed"


RANK = {Rating.OK: 0, Rating.UNKNOWN: 1, Rating.DEGRADED: 1, Rating.FAILED: 2}


@dataclass(frozen=True)
class Finding:
    check: str  # config, journal, aer, pf_aer, port_aer, link, iommu, reset
    status: Rating
    message: str
    absent: bool = False  # unknown because the kernel offers nothing to read (no counters, no link
    #                       reading), not because what is there could not be trusted

    @property
    def overridable(self) -> bool:
        """Whether --force may hand the device out despite this finding when it failed: not when
        it does not answer or came back broken (dead, not free: gpuvfio reset is its way back),
        yes for its counters and its link (the admin may hand it out to test it)."""
        return self.check not in ("config", "journal")

    def to_json(self) -> dict:
        return {"check": self.check, "status": self.status.value, "message": self.message}


@dataclass
class DeviceHealth:
    address: PciAddress
    driver: str | None
    findings: list[Finding] = field(default_factory=list)
    domains: list[str] | None = None  # None: libvirt not asked or not answering
    aer: dict[str, dict[Severity, AerCounts]] = field(default_factory=dict)  # "self" or a port's address
    link: Link | None = None
    iommu: dict[str, int] | None = None  # the IOMMU faults the kernel log holds, by "unit kind"; None: no log
    counters: dict[str, dict[str, int]] = field(default_factory=dict)  # baseline key -> severity -> total

    @property
    def status(self) -> Rating:
        worst = max((f.status for f in self.findings), key=RANK.__getitem__, default=Rating.OK)
        return Rating.DEGRADED if worst is Rating.UNKNOWN else worst

    def to_json(self) -> dict:
        return {"address": str(self.address), "status": self.status.value, "driver": self.driver,
                "domain": ", ".join(self.domains) if self.domains else None, "domains": self.domains,
                "findings": [f.to_json() for f in self.findings],
                "aer": {where: {s.value: c.to_json() for s, c in counts.items()} for where, counts in self.aer.items()},
                "iommu_faults": self.iommu}


@dataclass(frozen=True)
class HealthRecords:
    """What rating a device takes besides its sysfs files, read once per operation: the
    journal's marks of devices come back broken, the kernel log, the reset verdicts, the AER
    counts last sampled and acknowledged."""

    broken: dict
    log: KernelLog
    verdicts: ResetVerdicts
    baseline: AerBaseline = field(default_factory=AerBaseline)


def read_records(host: HostRoot, state: Tree | None, broken: dict) -> HealthRecords:
    """The records of one operation: ``broken`` (the journal's marks, which the caller has
    loaded), the kernel log, the verdicts (in ``state``, gpuvfio's state directory, unless
    GPUVFIO_RESET_VERDICTS names a fleet's file), the AER baseline (in ``state``)."""
    return HealthRecords(broken, read_kernel_log(host), read_verdicts(host, state), read_baseline(host, state))


def device_health(host: HostRoot, inventory: Inventory, fn: PciFunction, records: HealthRecords) -> DeviceHealth:
    """One function's findings: config space, the journal's mark, its AER counters and its
    ports', its link, its IOMMU faults in the kernel log, its reset's qualification."""
    device = DeviceHealth(fn.address, fn.driver, link=fn.link)
    device.findings += _config_findings(fn, records.broken)
    baseline = records.baseline
    if baseline.error is not None:
        device.findings.append(Finding("aer", Rating.UNKNOWN, f"the AER baseline cannot be read: {baseline.error}"))
    _aer_findings(host, device, fn.address, baseline)
    if fn.physfn is not None:
        _aer_findings(host, device, fn.physfn, baseline, "PF")
    for port in fn.parents:
        _aer_findings(host, device, port, baseline, "port")
    device.findings += _unclaimed_findings(host, inventory, fn, device, baseline)
    device.findings += _link_findings(inventory, fn)
    _iommu_findings(inventory, device, fn, records.log)
    device.findings += reset_findings(fn, records.verdicts)
    if fn.physfn is not None:  # an SR-IOV VF: what its PF counts and trains is the link's
        device.findings = [f for f in device.findings if not f.absent]
    return device


def plan_findings(host: HostRoot, inventory: Inventory, fn: PciFunction, records: HealthRecords) -> list[Finding]:
    """What a plan that hands ``fn`` out (bind, persist, attach, testbed) or resets it acts on:
    every finding that is not ok -- a failed one refuses, a degraded one or a reading that
    cannot be trusted warns -- but not what the kernel does not offer (no AER counters, no link
    reading): health and doctor report that, and a plan goes on as on any host without it."""
    return [f for f in device_health(host, inventory, fn, records).findings if f.status is not Rating.OK
            and not f.absent]


def _config_findings(fn: PciFunction, broken: dict) -> list[Finding]:
    out = []
    alive = fn.health.alive if fn.health else None
    if alive is False:
        bound = f" while bound to {fn.driver}" if fn.driver else ""
        out.append(Finding("config", Rating.FAILED, f"config space reads 0xffff{bound}: the device fell off the bus "
                                                    "(or sits in D3cold and does not come back)"))
    elif alive is None:
        out.append(Finding("config", Rating.UNKNOWN, "config space could not be read"))
    else:
        out.append(Finding("config", Rating.OK, "config space answers"))
    mark = broken.get(str(fn.address))
    if mark is not None:
        out.append(Finding("journal", Rating.FAILED, f"came back broken from its last guest "
                                                     f"({mark.get('reason', '?')}); gpuvfio reset {fn.address}"))
    return out


def _aer_findings(host: HostRoot, device: DeviceHealth, address: PciAddress, baseline: AerBaseline,
                  role: str | None = None) -> None:
    """The findings of the counters of ``address``: the device itself (``role`` None), or one
    that counts for it (``role`` "port": a port above it, which counts the errors of the link it
    shares with the device below; "PF": an SR-IOV VF's physical function, whose failure is its
    VFs' and whose link is theirs)."""
    where = "self" if role is None else str(address)
    who = "" if role is None else f"its {role} {address}: "
    check = "aer" if role is None else f"{role.lower()}_aer"
    try:
        counts = read_aer(host, address)
    except (AerError, GpuvfioError) as exc:
        device.findings.append(Finding(check, Rating.UNKNOWN, f"{who}AER counters unreadable: {exc}"))
        return
    if counts is None:
        if role is None:
            device.findings.append(Finding(check, Rating.UNKNOWN, "no AER counters (no AER capability, or a "
                                                                  "kernel without CONFIG_PCIEAER or with pci=noaer)",
                                           absent=True))
        return
    device.aer[where] = counts
    device.counters[str(address)] = {s.value: c.total for s, c in counts.items()}
    for severity, rating in SEVERITY_RATINGS:
        if counts[severity].total:
            rating, since = _against(baseline, str(address), severity, counts[severity].total, rating)
            device.findings.append(Finding(check, rating, who + counts[severity].describe() + " since boot" + since))
    if role is None and not any(c.total for c in counts.values()):
        device.findings.append(Finding(check, Rating.OK, "no AER errors since boot"))


SEVERITY_RATINGS = ((Severity.FATAL, Rating.FAILED), (Severity.NONFATAL, Rating.DEGRADED),
                    (Severity.CORRECTABLE, Rating.OK))


def _against(baseline: AerBaseline, key: str, severity: Severity, total: int, rating: Rating) -> tuple[Rating, str]:
    """A count's rating against this boot's records, and the words that say why: correctable
    errors above the last sample are rising (degraded); non-fatal and fatal ones at or below
    the acknowledged count are known (ok), above it only the new ones are named."""
    if severity is Severity.CORRECTABLE:
        last = baseline.last_sample(key)
        before = last.totals.get(severity.value) if last else None
        if before is not None and total > before:
            return Rating.DEGRADED, f"; rising: {total - before} since the sample of {last.at}"
        return rating, ""
    ack = baseline.acknowledgement(key)
    known = ack.totals.get(severity.value, 0) if ack else 0
    if ack and total <= known:
        return Rating.OK, f"; acknowledged at {ack.at}, none since"
    return rating, f"; {total - known} since the acknowledgement of {ack.at}" if ack and known else ""


def _unclaimed_findings(host: HostRoot, inventory: Inventory, fn: PciFunction, device: DeviceHealth,
                        baseline: AerBaseline) -> list[Finding]:
    """The error messages ``fn``'s root port received that no function below it counted
    (aer.read_rootport_totals): a fatal error whose link went down counts there only. Each
    function below the port is rated on them, since which one sent them is not known."""
    root = fn.parents[0] if fn.parents else None
    if root not in inventory.functions:  # no root port, or one missing from the tree (its own finding)
        return []
    try:
        totals = read_rootport_totals(host, root)
        if totals is None:
            return []
        below = [root] + [a for a, f in inventory.functions.items() if root in f.parents]
        counted = {s: 0 for s in Severity}
        for address in below:
            for severity, counts in (read_aer(host, address) or {}).items():
                counted[severity] += counts.total
    except (AerError, GpuvfioError) as exc:
        return [Finding("port_aer", Rating.UNKNOWN, f"its root port {root}: AER totals unreadable: {exc}")]
    out = []
    key = f"rootport:{root}"
    device.counters[key] = {s.value: max(0, totals[s] - counted[s]) for s in Severity}
    for severity, rating in SEVERITY_RATINGS:
        unclaimed = totals[severity] - counted[severity]
        if unclaimed > 0:
            rating, since = _against(baseline, key, severity, unclaimed, rating)
            out.append(Finding("port_aer", rating, f"its root port {root}: {unclaimed} {severity.value} error "
                                                   "message(s) since boot that no function below it counted (the "
                                                   "kernel could not read the sender: its link went down)" + since))
    return out


def _link_findings(inventory: Inventory, fn: PciFunction) -> list[Finding]:
    """The link against what the device and the port above it both allow."""
    link = fn.link
    if fn.physfn is not None or (link is not None and link.max_width == 0):
        return []  # an SR-IOV VF, a function with no link of its own: its PF's link is the link
    if link is not None and link.current_width == 0:  # whether or not its maximum reads (a dead
        return [Finding("link", Rating.FAILED, "the link is down (width 0)")]  # device reads 255)
    if link is None or link.current_width is None or link.max_width is None:
        return [Finding("link", Rating.UNKNOWN, "no link reading", absent=True)] if fn.is_nvidia_gpu else []
    if link.current_width > link.max_width:
        return [Finding("link", Rating.UNKNOWN, f"width x{link.current_width} above its maximum x{link.max_width}: "
                                                "not a reading to trust")]
    port = inventory.functions.get(fn.parents[-1]) if fn.parents else None
    width, gen = link.max_width, link.max_gen
    if port is not None and port.link is not None:
        width = min(width, port.link.max_width or width)
        gen = min(gen, port.link.max_gen or gen) if gen else port.link.max_gen
    slot = f"the device and its slot allow x{width}" + (f" Gen{gen}" if gen else "")
    if link.current_width < width:
        return [Finding("link", Rating.DEGRADED, f"trained to x{link.current_width}: {slot} (lanes lost)")]
    if gen and link.current_gen and link.current_gen < gen:
        return [Finding("link", Rating.OK, f"x{link.current_width} at Gen{link.current_gen} of Gen{gen}: GPUs "
                                           "lower the link speed while idle; verify measures it under load")]
    return [Finding("link", Rating.OK, f"{link.describe()}, as {slot}")]


def _iommu_findings(inventory: Inventory, device: DeviceHealth, fn: PciFunction, log: KernelLog) -> None:
    """The IOMMU faults ``log`` holds for ``fn``, counted by kind (``device.iommu``), with the
    last one quoted. A line without a PCI segment (Intel's, AMD's before Linux 6.1) counts for
    every function at its bus address, and says so where the host has more than one."""
    if log.error is not None:
        device.findings.append(Finding("iommu", Rating.UNKNOWN, f"the kernel log could not be read: {log.error}"))
        return
    if log.missing:
        device.findings.append(Finding("iommu", Rating.UNKNOWN, "no kernel log to read for IOMMU faults (dev/kmsg)",
                                       absent=True))
        return
    faults = log.of(fn.address)
    device.iommu = kinds = _fault_kinds(faults)
    if not faults:
        device.findings.append(Finding("iommu", Rating.OK, "no IOMMU faults in the kernel log"))
        return
    last = faults[-1]
    twins = [a for a in inventory.functions if (a.bus, a.slot, a.function) == (fn.address.bus, fn.address.slot,
                                                                               fn.address.function)]
    unsure = " (its line names no PCI segment: a function at the same bus address in another segment may " \
             "have caused it)" if len(twins) > 1 and any(f.segment is None for f in faults) else ""
    device.findings.append(Finding("iommu", Rating.DEGRADED, f"{len(faults)} IOMMU fault(s) in the kernel log "
                                   f"({', '.join(f'{k} {n}' for k, n in kinds.items())}){unsure}; the last, "
                                   f"{last.usec / 1e6:.0f} s after boot: {last.text}"))


def reset_findings(fn: PciFunction, verdicts: ResetVerdicts) -> list[Finding]:
    """The qualification of the reset the kernel gives ``fn`` (ResetVerdicts.first_method), as
    gpuvfio qualify recorded it for the model. A method that failed there degrades the device:
    the next tenant may get what the last one left."""
    if verdicts.error is not None:
        return [Finding("reset", Rating.UNKNOWN, f"the reset verdicts cannot be read: {verdicts.error}")]
    first = None if fn.is_bridge else verdicts.first_method(fn.vendor_id, fn.device_id, fn.reset_method)
    if first is None:
        return []  # no reset at all: doctor's device_health says so
    model, method, record = first
    if record is None:
        return [Finding("reset", Rating.OK, f"its reset ({method}) is not qualified for {model}: gpuvfio qualify "
                                            f"{fn.address}")]
    runs = record.passed + record.failed
    if record.outcome is Outcome.FAILED:
        last = record.last_failure
        return [Finding("reset", Rating.DEGRADED, f"the kernel resets it by {method}, which failed qualification "
                                                  f"for {model} in {record.failed} of {runs} run(s) (last on "
                                                  f"{last.device} of {last.host or 'a host'} at {last.at}: "
                                                  f"{last.failure})")]
    return [Finding("reset", Rating.OK, f"its reset ({method}) qualified for {model} in {runs} run(s), "
                                        f"{record.last.cycles} cycle(s) the last")]


def _fault_kinds(faults: list[IommuFault]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for fault in faults:
        kinds[f"{fault.unit} {fault.kind}"] = kinds.get(f"{fault.unit} {fault.kind}", 0) + 1
    return kinds
