"""gpuvfio testbed run: provision each variant, measure, tear down, resume after interruption.

The results directory is the record: ``<out>/results/<variant>/rep-<n>.json`` is written
atomically when a repetition is done, so a second run skips what exists. A variant's
guest is always detached (and its devices restored, its vGPU removed) before the next
variant starts -- also on Ctrl-C, SIGTERM or SIGHUP (a remote run's SSH channel closing,
see testbed/remote.py) -- and a guest left over from an interrupted run is detached first.
Every step is an ops service, the same gpuvfio attach, detach, verify and vgpu use.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.guest.checks import bus_key
from gpuvfio.ops import binding, domains, guests, vgpu
from gpuvfio.ops.guests import VerifyReport
from gpuvfio.ops.context import Context
from gpuvfio.ops.identity import host_identity
from gpuvfio.ops.plans import Step, StepKind
from gpuvfio.testbed.plan import addresses_for, gpus_on, plan_variant, policy_for, request_for, ssh_for
from gpuvfio.testbed.report import out_tree, read_identity, result_files
from gpuvfio.testbed.spec import Spec, Variant, boot_timeout as spec_boot_timeout


def _metrics(report: VerifyReport, gpus: list[PciAddress]) -> dict:
    """The numbers a report compares: of the spec's first GPU when the report has it (the
    verifier measures every CUDA device it sees), else of the only device measured."""
    facts = report.facts or {}

    def pick(table: dict) -> dict:
        if gpus:
            wanted = bus_key(str(gpus[0]))
            for bus, value in table.items():
                if bus_key(bus) == wanted:
                    return value
        return next(iter(table.values()), {}) if len(table) == 1 or not gpus else {}

    bw = pick(report.bandwidth_gbps or {})
    latency = pick(facts.get("latency") or {})
    overhead = pick(facts.get("copy_overhead") or {})
    compute = pick(facts.get("compute") or {})
    pairs = [v.get("median") for v in ((facts.get("p2p") or {}).get("bandwidth") or {}).values()
             if v.get("verified") is True]
    nccl = (facts.get("nccl") or {}).get("results") or []
    largest = max(nccl, key=lambda r: r.get("bytes", 0)) if nccl else {}
    return {"h2d_gbps": bw.get("h2d"), "d2h_gbps": bw.get("d2h"), "bidir_gbps": bw.get("bidir"),
            "d2d_gbps": bw.get("d2d"), "latency_us": latency.get("median_us"),
            "copy_overhead_us": overhead.get("p50_us"), "saxpy_ms": compute.get("launch_ms"),
            "p2p_gbps": min(pairs) if pairs else None,
            "nccl_busbw_gbps": largest.get("busbw_gbps") if largest.get("verified") is True else None}


def placement(xml: str | None) -> dict | None:
    """What the variant's domain really got (auto choices resolved), read from its XML by the one
    reader of a defined domain (gpuvfio.ops.domains.read_defined)."""
    return domains.read_defined(xml).placement_json() if xml else None


def _guest_facts(report: VerifyReport) -> dict:
    facts = report.facts or {}
    nvml = facts.get("nvml") or {}
    device = (nvml.get("devices") or [{}])[0]
    link = None
    for check in report.checks:
        if check.check_id == "pcie_link" and check.observed:
            link = check.observed
    return {"guest_kernel": facts.get("guest_kernel"), "driver_version": nvml.get("driver_version"),
            "cuda_driver_version": nvml.get("cuda_driver_version"),
            "virtualization_mode": device.get("virtualization_mode"), "pcie_link_under_load": link}


STEPS_FILE = "steps.json"  # beside a variant's results: its plan's steps and the ones its last run took


class Interrupted(BaseException):
    pass


class SignalGuard:
    """SIGINT, SIGTERM and SIGHUP interrupt the run once. While a teardown runs they are only
    noted, and raised after it: a remote Ctrl-C brings a hangup and a TERM moments apart,
    and a teardown cut in half would leave a guest, a vGPU or a binding behind."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.deferring, self.pending, self.fired = 0, None, False
        self.previous: dict = {}

    def handler(self, signum, frame) -> None:
        if self.deferring or self.fired:
            self.pending = signum
            return
        self.fired = True
        raise Interrupted()

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.handler) for sig in self.SIGNALS}

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    @contextlib.contextmanager
    def deferred(self):
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
        if not self.deferring and self.pending is not None and not self.fired:
            self.fired = True
            raise Interrupted()


def run_testbed(ctx: Context, spec: Spec, out: str, *, uri: str | None = None, yes: bool = False) -> dict:
    gpus = gpus_on(ctx, spec, yes=yes, tell=ctx.progress)
    for variant in spec.variants:  # a selection a later variant cannot take is bad input now, not hours in
        addresses_for(ctx, gpus, variant)
    _same_gpus_as_before(out, gpus)
    tree = out_tree(out)
    tree.make_dir("results")
    identity = {**host_identity(ctx, gpus, ctx.libvirt(uri)).to_json(), "gpus": [str(g) for g in gpus]}
    tree.write("identity.json", json.dumps(identity, indent=2))
    signals = SignalGuard()
    signals.install()
    summary = {}
    try:
        for variant in spec.variants:
            summary[variant.name] = _run_variant(ctx, spec, variant, gpus, out, uri, signals)
    except (Interrupted, KeyboardInterrupt):
        raise GpuvfioError("testbed run interrupted; everything was torn down; run it again to resume") from None
    finally:
        signals.uninstall()
    return summary


def recorded_results(out: str) -> list[str]:
    """The results recorded in OUT, as relative paths (gpuvfio.testbed.report.result_files)."""
    return result_files(out_tree(out))


def _same_gpus_as_before(out: str, gpus: list[PciAddress]) -> None:
    """A run that resumes recorded results measures the GPUs they were measured on: a slot or an
    id filter that now expands to other devices (a GPU gone, one added) would mix two setups in
    one report. Without results there is nothing to mix (a refused first try may be corrected)."""
    if not recorded_results(out):
        return
    path = os.path.join(out, "identity.json")
    earlier = read_identity(out, "remove it with the results, or give a new --out") or {}
    gpus_then = earlier.get("gpus")
    if not isinstance(gpus_then, list):
        raise InputError(f"{path} does not say which GPUs the results in {out} were measured on (a run from "
                         "before gpuvfio recorded it, or a damaged file); give a new --out")
    now = [str(g) for g in gpus]
    if gpus_then != now:
        raise Refused(f"the spec selects {', '.join(now) or 'no GPU'} on this host now, the results in {out} were "
                      f"measured on {', '.join(map(str, gpus_then)) or 'no GPU'}; give a new --out for the new "
                      "selection")


def _rep_path(variant: Variant, rep: int) -> str:
    return f"results/{variant.name}/rep-{rep}.json"


def write_rep(out: str, variant: Variant, rep: int, report: VerifyReport, extra: dict,
              gpus: list[PciAddress] = ()) -> None:
    extra = dict(extra)
    metrics = {**_metrics(report, list(gpus)), **extra.pop("metrics", {})}
    provisioning = {k: v for k, v in (("hugepages", variant.hugepages), ("numa", variant.numa),
                                       ("profile", variant.profile), ("scheduler", variant.scheduler))
                    if v is not None and variant.kind != "baremetal"}
    record = {"variant": variant.name, "kind": variant.kind, "rep": rep, "metrics": metrics,
              "provisioning": provisioning,
              "guest": _guest_facts(report), "verify": report.to_json(), **extra}
    out_tree(out).write(_rep_path(variant, rep), json.dumps(record, indent=2))


def _run_variant(ctx: Context, spec: Spec, variant: Variant, gpus: list[PciAddress], out: str, uri: str | None,
                 signals) -> dict:
    """The variant's plan (plan_variant, the one testbed plan prints), made under the run lock
    and carried out step by step; the lock is held from provision to teardown, so no other
    gpuvfio run moves these GPUs meanwhile."""
    tree = out_tree(out)
    todo = [r for r in range(spec.repetitions) if not tree.exists(_rep_path(variant, r))]
    if not todo:
        ctx.progress(f"{variant.name}: done already ({spec.repetitions} repetitions)")
        return {"ran": 0}
    # A guest variant holds the run lock from provision to teardown (a baremetal one changes
    # nothing on the host and takes none).
    with binding.operation_lock(ctx) if variant.kind != "baremetal" else contextlib.nullcontext():
        planned = plan_variant(ctx, spec, variant, gpus, uri=uri, todo=len(todo))
        planned.raise_if_refused()
        run = VariantRun(ctx, spec, variant, gpus, out, uri, todo)
        try:
            for step in planned.steps:
                if step.kind is StepKind.TEARDOWN:
                    break
                run.execute(step)
        finally:
            with signals.deferred():
                try:
                    if any(s.kind is StepKind.TEARDOWN for s in planned.steps):
                        run.teardown()
                        run.taken.append(planned.steps[-1])
                finally:  # the record of what ran against what was planned, also for a failed variant
                    _record_steps(ctx, tree, variant, planned.steps, run.taken)
    return {"ran": len(todo), "steps": [s.to_json() for s in run.taken]}


def _record_steps(ctx: Context, tree, variant: Variant, planned: list[Step], taken: list[Step]) -> None:
    """results/<variant>/steps.json: the variant's plan and the steps its run took. A record
    that cannot be written is said, and never hides why the variant itself stopped."""
    try:
        tree.write(f"results/{variant.name}/{STEPS_FILE}", json.dumps(
            {"planned": [s.to_json() for s in planned], "taken": [s.to_json() for s in taken]}, indent=2))
    except GpuvfioError as exc:
        ctx.progress(f"{variant.name}: its steps were not recorded: {exc}")


class VariantRun:
    """What one variant's run has done so far: the steps taken, the vGPU instance made, the
    scheduler change to put back, the results recorded."""

    def __init__(self, ctx: Context, spec: Spec, variant: Variant, gpus: list[PciAddress], out: str,
                 uri: str | None, todo: list[int]) -> None:
        self.ctx, self.spec, self.variant, self.gpus, self.out, self.uri, self.todo = \
            ctx, spec, variant, gpus, out, uri, todo
        self.request = request_for(ctx, spec, variant, gpus) if variant.kind != "baremetal" else None
        self.addresses = addresses_for(ctx, gpus, variant)
        self.options = guests.verify_options(**spec.verify)  # every repetition, the first included, alike
        self.taken: list[Step] = []
        self.instance: str | None = None
        self.scheduled = None
        self.extra: dict = {"verify_settings": dict(spec.verify)}  # [run]'s, the same for every repetition
        self.vgpu_record: dict = {}

    def execute(self, step: Step) -> None:
        {StepKind.VERIFY_HOST: self.verify_host, StepKind.DETACH_LEFTOVER: self.detach_leftover,
         StepKind.SET_SCHEDULER: self.set_scheduler, StepKind.CREATE_VGPU: self.create_vgpu,
         StepKind.ATTACH: self.attach, StepKind.MEASURE: self.measure}[step.kind]()
        self.taken.append(step)

    def verify_host(self) -> None:
        for rep in self.todo:
            self.ctx.progress(f"{self.variant.name}: repetition {rep + 1}/{self.spec.repetitions} on this host")
            write_rep(self.out, self.variant, rep, guests.verify_here(self.ctx, self.gpus, self.options),
                      {"verify_settings": dict(self.spec.verify)}, self.gpus)

    def detach_leftover(self) -> None:
        self.ctx.progress(f"{self.variant.name}: detaching {self.request.name} left from an interrupted run")
        guests.detach(self.ctx, self.request.name, uri=self.uri, timeout=self.spec.stop_timeout)

    def set_scheduler(self) -> None:
        # Before the vGPU exists: NVML changes the policy only while no vGPU VM runs.
        gpu, policy = self.addresses[0], self.variant.scheduler
        applied = vgpu.set_scheduler(self.ctx, gpu, policy)
        if applied.result is vgpu.SchedulerOutcome.SET:  # teardown puts back this variant's change only
            self.scheduled = (gpu, applied.before, applied.journaled)
        self.ctx.progress(f"{self.variant.name}: vGPU scheduler of {gpu}: {applied.state.policy} "
                          f"({applied.result.value})")
        self.vgpu_record["scheduler"] = {"policy": applied.state.policy, "arr": applied.state.arr,
                                         "timeslice": applied.state.timeslice, "previous": applied.previous}

    def create_vgpu(self) -> None:
        made = vgpu.create_for_domain(self.ctx, self.request.name, self.addresses[0], self.variant.profile)
        self.instance = made.instance
        mig = vgpu.mig_backed(self.variant.profile)
        self.vgpu_record.update({"profile": self.variant.profile, "kind": made.kind, "type": made.type_id,
                                 "mig_backed": mig.to_json() if mig is not None else None})
        self.extra["vgpu"] = self.vgpu_record

    def attach(self) -> None:
        ctx, spec, variant = self.ctx, self.spec, self.variant
        ctx.progress(f"{variant.name}: attach")
        started = ctx.clock.monotonic()
        result = guests.attach(ctx, self.addresses, self.request, uri=self.uri,
                               ssh=ssh_for(spec, spec_boot_timeout(spec)), policy=policy_for(variant),
                               verify=self.options)
        took = ctx.clock.monotonic() - started
        self.extra["placement"] = placement(result.xml)
        write_rep(self.out, variant, self.todo[0], result.report,
                  {"metrics": {"time_to_verified_s": took}, "attach_steps": result.steps, **self.extra},
                  self.measured)

    @property
    def measured(self) -> list[PciAddress]:
        return self.addresses if self.variant.kind == "passthrough" else []

    def measure(self) -> None:
        for rep in self.todo[1:]:
            self.ctx.progress(f"{self.variant.name}: repetition {rep + 1}/{self.spec.repetitions}")
            report = guests.verify(self.ctx, ssh=ssh_for(self.spec, 60.0), domain=self.request.name, uri=self.uri,
                                   options=self.options)
            write_rep(self.out, self.variant, rep, report, self.extra, self.measured)

    def teardown(self) -> None:
        _teardown(self.ctx, self.variant, self.request.name, self.uri, self.instance, self.scheduled,
                  self.spec.stop_timeout)


def _teardown(ctx: Context, variant: Variant, name: str, uri: str | None, instance: str | None, scheduled,
              stop_timeout: float) -> None:
    """Guest (its ACPI shutdown given ``stop_timeout`` seconds), then vGPU, then scheduler policy
    (NVML changes it only with no vGPU VM running); every step is tried even when one before it
    failed."""
    failures = []
    try:
        if guests.exists(ctx, name, uri=uri):
            ctx.progress(f"{variant.name}: detach")
            guests.detach(ctx, name, uri=uri, timeout=stop_timeout)
    except GpuvfioError as exc:
        failures.append(f"detach {name}: {exc}")
    if instance is not None:
        try:
            vgpu.remove(ctx, instance)
        except GpuvfioError as exc:
            failures.append(f"vGPU {instance}: {exc}")
    if scheduled:
        address, before, journaled = scheduled
        failed = vgpu.undo_scheduler(ctx, address, before, journaled)
        failures += failed
        if not failed:
            ctx.progress(f"{variant.name}: vGPU scheduler put back")
    if failures:
        raise GpuvfioError(f"{variant.name}: teardown incomplete ({'; '.join(failures)}); gpuvfio restore "
                           "retries from the journal")


