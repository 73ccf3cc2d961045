"""The health service: what the host still sees of the devices it hands out.

The devices: those named, else every NVIDIA function and, with ``every_assigned``, every
function on vfio-pci. Each is rated by gpuvfio.host.pcie_health (config space, the journal's
mark, the AER counters of the device and the ports above it, the link, the IOMMU faults, the
reset's qualification); the service adds the
libvirt domains that assign it, asked by the one policy of gpuvfio.ops.binding (libvirt not
answering is an unknown finding on every device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError, Refused
from gpuvfio.host.aer_baseline import FILE_NAME as BASELINE_FILE, Sample, read_baseline
from gpuvfio.host.inventory import Inventory, read_inventory
from gpuvfio.host.pcie_health import DeviceHealth, Rating, device_health, plan_findings, read_records
from gpuvfio.host.model import PciFunction
from gpuvfio.host.reset_verdicts import ResetVerdicts, read_verdicts
from gpuvfio.host.state import make_state_dir
from gpuvfio.ops.binding import libvirt_view
from gpuvfio.ops.plans import Check, CheckStatus, Plan

if TYPE_CHECKING:  # the annotation only: a Context is passed in, never made here
    from gpuvfio.ops.context import Context

__all__ = ["HealthReport", "health_report", "plan_health", "reset_verdicts", "first_reset_verdict"]


@dataclass
class HealthReport:
    devices: list[DeviceHealth]
    libvirt: str | None = None  # why libvirt was not asked or did not answer

    @property
    def ok(self) -> bool:
        return all(d.status is Rating.OK for d in self.devices)

    def to_json(self) -> dict:
        return {"ok": self.ok, "libvirt": self.libvirt, "devices": [d.to_json() for d in self.devices]}


def health_report(ctx: Context, *, only: list[PciAddress] | None = None, every_assigned: bool = False,
                  uri: str | None = None, record: bool = False, acknowledge: bool = False) -> HealthReport:
    """The health of ``only`` (the devices named), else of every NVIDIA function and, with
    ``every_assigned``, of every function on vfio-pci. ``record``: keep each device's AER counts
    as the last sample (correctable errors above it are rising); ``acknowledge``: take the
    named devices' errors so far as known (rated again afterwards). Both under the run lock."""
    if acknowledge and not only:
        raise InputError("--acknowledge takes the devices whose errors so far are known (name them)")
    if not (record or acknowledge):
        return _report(ctx, only, every_assigned, uri)
    with ctx.lock():
        report = _report(ctx, only, every_assigned, uri)
        _keep_counts(ctx, report, acknowledge)
        return _report(ctx, only, every_assigned, uri) if acknowledge else report


def _report(ctx: Context, only: list[PciAddress] | None, every_assigned: bool, uri: str | None) -> HealthReport:
    inventory = read_inventory(ctx.host)
    for address in only or []:
        if inventory.require(address)[0].is_bridge:
            raise InputError(f"{address} is a PCI bridge: health rates the devices below it, and its AER "
                             "counters count for them")
    watched = only or [a for a, f in sorted(inventory.functions.items())
                       if f.is_nvidia or (every_assigned and f.driver == "vfio-pci")]
    records = read_records(ctx.host, ctx.state, ctx.journal().data["broken"])
    devices = [device_health(ctx.host, inventory, inventory.require(a)[0], records) for a in watched]
    view = libvirt_view(ctx, list(watched), uri=uri)
    for device in devices:  # which domains hold a device is no PCIe finding: libvirt down is a note
        if view.users is not None:
            device.domains = view.users.get(device.address, [])
    return HealthReport(devices, view.not_asked or (f"libvirt did not answer: {view.error}" if view.error else None))


def _keep_counts(ctx: Context, report: HealthReport, acknowledge: bool) -> None:
    """Each device's counts as the last sample (and, ``acknowledge``, as known), in this boot's
    baseline (host.aer_baseline), written atomically to the state dir."""
    baseline = read_baseline(ctx.host, ctx.state)
    if baseline.error is not None:
        raise Refused(f"refused: the AER baseline cannot be read, so none is kept: {baseline.error} (move it away)")
    if baseline.now is None:
        raise Refused("refused: this boot's id cannot be read (proc/sys/kernel/random/boot_id): counts kept now "
                      "could not be told from the next boot's")
    baseline.restart()
    at = ctx.clock.utc()
    for device in report.devices:
        for key, totals in device.counters.items():
            baseline.last[key] = Sample(at, totals)
            if acknowledge:
                baseline.acknowledged[key] = Sample(at, totals)
    make_state_dir(ctx.state)
    ctx.state.write(BASELINE_FILE, baseline.render(), 0o600)


def reset_verdicts(ctx: Context) -> ResetVerdicts:
    """What gpuvfio qualify recorded (the state dir's file, or the fleet's GPUVFIO_RESET_VERDICTS)."""
    return read_verdicts(ctx.host, ctx.state)


def first_reset_verdict(verdicts: ResetVerdicts, fn: PciFunction) -> str | None:
    """passed or failed: what qualify found of the method the kernel resets ``fn`` by first
    (host.pcie_health.reset_findings); None where that is not qualified or none is listed."""
    first = verdicts.first_method(fn.vendor_id, fn.device_id, fn.reset_method)
    return first[2].outcome.value if first and first[2] else None


def plan_health(ctx: Context, plan: Plan, addresses: list[PciAddress], *, force: bool = False, mends: bool = False,
                inventory: Inventory | None = None, broken: dict | None = None) -> None:
    """The health checks of a plan that hands ``addresses`` out without binding them (a vGPU's
    GPU, a bare-metal testbed variant's) or resets them, by the bind's rule (bind.plan): a
    failed finding refuses -- ``force`` overrides it for counters and links, never for a device
    that does not answer or came back broken -- and a degraded one warns. A reset (``mends``)
    is what mends a failed device, so there every finding warns: the plan says what the reset
    is for. ``inventory`` and ``broken`` (the journal's marks): those the caller's plan read
    already (one journal load per operation), else read here."""
    if not addresses:
        return
    inventory = inventory or read_inventory(ctx.host)
    records = read_records(ctx.host, ctx.state, ctx.journal().data["broken"] if broken is None else broken)
    for address in addresses:
        fn = inventory.functions.get(address)
        if fn is None:
            plan.refuse("health", f"{address}: not on this host")
            continue
        for finding in plan_findings(ctx.host, inventory, fn, records):
            refuse = finding.status is Rating.FAILED and not mends and not (force and finding.overridable)
            plan.checks.append(Check("health", CheckStatus.REFUSE if refuse else CheckStatus.WARN,
                                     f"{address}: {finding.message}", overridable=refuse and finding.overridable))
