"""gpuvfio qualify: cycle each reset method the kernel offers for a device, before its first
tenant, and record per model and method whether the device came back each time.

A device is qualified while gpuvfio holds it on vfio-pci and no domain uses it (as ``reset``
requires). For each method its ``reset_method`` lists (Linux 5.15 and later: device_specific,
acpi, flr, af_flr, pm, bus, cxl_bus; drivers/pci/pci.c reset_method_store), the run selects
that method alone by writing its name there, writes 1 to ``reset`` N times, and after each reset
checks config space, the BARs and the link (gpuvfio.host.reset_check). It then writes the
original list back, and adds each method's run to the verdicts (gpuvfio.host.reset_verdicts),
which health, every plan that hands a device out, doctor and the Ansible facts read.

A method that breaks a check fails for the model, and the next method is tried only while the
device still answers; one that no longer answers is marked broken in the journal (bind refuses
it, ``gpuvfio reset`` is the way back). A method an admin took out of ``reset_method`` is not
tried. The original list is written back whatever happened.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.bind.journal import Journal
from gpuvfio.bind.sysfs_write import SysfsWriteTimeout
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.host.inventory import Inventory, read_inventory
from gpuvfio.host.reset_check import ResetSnapshot, after_reset, snapshot
from gpuvfio.host.reset_verdicts import (LIMIT, MAX_MESSAGE, Outcome, ResetVerdicts, Run, location, model_of,
                                         parse, read_verdicts, valid_host)
from gpuvfio.ops.context import Context
from gpuvfio.ops.health import plan_health
from gpuvfio.ops.plans import Plan, Step, StepKind
from gpuvfio.ops.reset import check_held, check_unused, kernel_file
from gpuvfio.text import printable

__all__ = ["QualifyPlan", "QualifyResult", "MethodResult", "plan_qualify", "qualify", "run_qualify"]


@dataclass
class QualifyPlan(Plan):
    cycles: int = 0
    methods: dict[str, list[str]] = field(default_factory=dict)  # device -> methods, in the kernel's order
    original: dict[str, str] = field(default_factory=dict)  # device -> its reset_method as found
    models: dict[str, str] = field(default_factory=dict)  # device -> vendor:device
    verdicts: str = ""  # the verdicts file, as messages name it

    def extra_json(self) -> dict:
        return {"cycles": self.cycles, "methods": dict(self.methods), "original": dict(self.original),
                "models": dict(self.models), "verdicts": self.verdicts}


def plan_qualify(ctx: Context, addresses: list[PciAddress], *, cycles: int, uri: str | None = None) -> QualifyPlan:
    """What ``qualify`` will write and every refusal it will meet; reads only."""
    return _plan(ctx, addresses, cycles=cycles, uri=uri)[0]


def _plan(ctx: Context, addresses: list[PciAddress], *, cycles: int, uri: str | None) -> tuple[QualifyPlan, Journal]:
    if not addresses:
        raise InputError("no PCI address given")
    inventory = read_inventory(ctx.host)
    for fn in inventory.require(*addresses):
        if fn.is_bridge:
            raise InputError(f"{fn.address} is a PCI bridge: qualify resets the devices below it, one by one")
    tree, name = location(ctx.host, ctx.state)
    plan = QualifyPlan("qualify", ", ".join(map(str, addresses)), root=ctx.host.root, cycles=cycles,
                       verdicts=tree.path(name))
    journal = ctx.journal()
    for check_id, check in (("ours", lambda: check_held(ctx, journal, sorted(addresses), None)),
                            ("libvirt", lambda: check_unused(ctx, sorted(addresses), uri))):
        try:
            check()
        except Refused as exc:
            plan.refuse(check_id, str(exc))
    verdicts = read_verdicts(ctx.host, ctx.state)
    if verdicts.error is not None:
        plan.refuse("verdicts", f"the reset verdicts cannot be read, so none can be added: {verdicts.error} (move "
                                "the file away)")
    plan_health(ctx, plan, sorted(addresses), inventory=inventory, broken=journal.data["broken"])
    for address in sorted(addresses):
        _device_steps(ctx, plan, inventory, address)
    plan.step(StepKind.WRITE_FILE, "add each method's run to the reset verdicts", path=tree.path(name))
    return plan, journal


def _device_steps(ctx: Context, plan: QualifyPlan, inventory: Inventory, address: PciAddress) -> None:
    fn = inventory.functions[address]
    methods = fn.reset_method
    if methods is None or not methods:
        plan.refuse("reset_method", f"{address}: " + ("the kernel lists no reset method for it (reset_method "
                    "is empty)" if methods == [] else "no reset_method file (Linux 5.15 and later select reset "
                    "methods there; the kernel offers none for it otherwise)"))
        return
    try:
        select = kernel_file(ctx, address, "reset_method", "no reset_method file")
        reset = kernel_file(ctx, address, "reset", "the kernel offers no reset for it")
    except Refused as exc:
        plan.refuse("reset_method", str(exc))
        return
    key = str(address)
    plan.methods[key], plan.original[key] = list(methods), " ".join(methods)
    plan.models[key] = model_of(fn.vendor_id, fn.device_id)
    for method in methods:
        plan.step(StepKind.SELECT_RESET, f"{address}: {method} alone", address=key, path=select,
                  value=f"{method}\n", name=method)
        for cycle in range(1, plan.cycles + 1):
            plan.step(StepKind.RESET, f"{address} by {method}, {cycle} of {plan.cycles}; then config space, BARs "
                      "and link are checked", address=key, path=reset, value="1\n", name=method)
    plan.step(StepKind.SELECT_RESET, f"{address}: put back {plan.original[key]}", address=key, path=select,
              value=plan.original[key] + "\n", name="")
    plan.notes.append(f"{address} ({plan.models[key]}): the methods its reset_method lists, in the kernel's order: "
                      f"{', '.join(methods)}; one taken out of it is not tried")


def qualify(ctx: Context, addresses: list[PciAddress], *, cycles: int, uri: str | None = None) -> QualifyResult:
    """Qualify the devices' reset methods: the plan made under the run lock, then carried out."""
    with ctx.lock():
        plan, journal = _plan(ctx, addresses, cycles=cycles, uri=uri)
        return run_qualify(ctx, plan, journal)


@dataclass
class MethodResult:
    address: str
    method: str
    outcome: Outcome | None  # None: not tried, or not to be judged (the kernel never ran it, it hung)
    cycles: int = 0  # resets that passed their checks
    failure: str | None = None
    dead: bool = False  # the device no longer answers after it

    def to_json(self) -> dict:
        return {"address": self.address, "method": self.method,
                "outcome": self.outcome.value if self.outcome else "not tried", "cycles": self.cycles,
                "failure": self.failure}


@dataclass
class QualifyResult:
    methods: list[MethodResult]
    verdicts: str
    steps: list[Step] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what the run could not do, undo or record
    root: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems and all(m.outcome is Outcome.PASSED for m in self.methods)

    def to_json(self) -> dict:
        return {"ok": self.ok, "methods": [m.to_json() for m in self.methods], "verdicts": self.verdicts,
                "problems": list(self.problems), "steps": [s.to_json(self.root) for s in self.steps]}


def run_qualify(ctx: Context, plan: QualifyPlan, journal: Journal) -> QualifyResult:
    """Carry out ``plan`` (made under the run lock the caller holds, from ``journal``), device by
    device; what was found is added to the verdicts whatever stops the run, and the result
    returned (its ``ok`` says whether every method passed)."""
    plan.raise_if_refused()
    result = QualifyResult([], plan.verdicts, root=ctx.host.root)
    try:
        for address in plan.methods:
            _run_device(ctx, plan, journal, address, result)
    finally:
        _record(ctx, plan, result)
        result.steps += [s for s in plan.steps if s.kind is StepKind.WRITE_FILE]
    return result


def _run_device(ctx: Context, plan: QualifyPlan, journal: Journal, address: str, result: QualifyResult) -> None:
    steps = [s for s in plan.steps if s.address == address]
    before = snapshot(ctx.host, PciAddress.parse(address))
    current, settled, stop = MethodResult(address, "", None), True, None
    try:
        for step in steps[:-1]:  # the last puts the original list back, whatever happened
            if step.kind is StepKind.SELECT_RESET:
                current, settled = MethodResult(address, step.name, None), stop is not None
                result.methods.append(current)
            if settled:
                continue
            problem, dead, hung = _take(ctx, step, result, before)
            if hung or (problem and step.kind is StepKind.SELECT_RESET):  # not the method's verdict
                current.failure, settled = problem, True
                result.problems.append(f"{address}: {problem}")
                stop = problem if hung else stop
            elif problem:
                current.outcome, current.failure, current.dead, settled = Outcome.FAILED, problem, dead, True
                stop = problem if dead else stop
            else:
                current.cycles += step.kind is StepKind.RESET
                if current.cycles == plan.cycles:
                    current.outcome, settled = Outcome.PASSED, True
    finally:
        _put_back(ctx, steps[-1], result)
    if stop:  # dead, or a reset that did not return: no host driver and no guest gets it
        journal.data["broken"][address] = {"reason": f"qualify: {stop}", "since": journal.clock.time()}
        journal.save()


def _take(ctx: Context, step: Step, result: QualifyResult, before: ResetSnapshot) -> tuple[str | None, bool, bool]:
    """Write one step: (what it broke, whether the device is dead, whether the write hung)."""
    ctx.progress(f"qualify: {step.detail}")
    result.steps.append(step)
    try:
        ctx.writer().write(step.path, step.value)
    except SysfsWriteTimeout as exc:  # the kernel may still be resetting it: the device is left alone
        return _short(f"the reset did not return: {exc}"), False, True
    except GpuvfioError as exc:
        what = "select the method" if step.kind is StepKind.SELECT_RESET else "reset"
        return _short(f"the kernel refused to {what}: {exc}"), False, False
    if step.kind is not StepKind.RESET:
        return None, False, False
    after = after_reset(ctx.host, before)
    return (_short(after.problem) if after.problem else None), after.dead, False


def _put_back(ctx: Context, step: Step, result: QualifyResult) -> None:
    result.steps.append(step)
    try:
        ctx.writer().write(step.path, step.value)
    except GpuvfioError as exc:
        result.problems.append(f"{step.address}: its reset_method could not be put back to "
                               f"{step.value.strip()!r}: {exc}")


def _record(ctx: Context, plan: QualifyPlan, result: QualifyResult) -> None:
    """Add the runs judged to the verdicts as they are now, read again under the run lock of the
    file's directory (the state dir's is the one this run holds; hosts of a fleet that share a
    file take its directory's), written atomically; never a file the reader would refuse."""
    tree, name = location(ctx.host, ctx.state)
    host = printable(ctx.host.read(ctx.host.path("proc", "sys", "kernel", "hostname")) or "").strip()
    at = ctx.clock.utc()
    runs = [m for m in result.methods if m.outcome is not None]
    if not runs:
        return
    try:
        with ctx.lock(tree):
            data = tree.read(name, LIMIT)
            verdicts = parse(data) if data is not None else ResetVerdicts()
            for method in runs:
                verdicts.add(plan.models[method.address], method.method,
                             Run(method.outcome, method.address, host if valid_host(host) else "", at, method.cycles,
                                 method.failure))
            tree.write(name, verdicts.render(), 0o644)
    except GpuvfioError as exc:
        result.problems.append(f"the reset verdicts could not be recorded in {tree.path(name)}: {exc}")


def _short(text: str) -> str:
    """A failure as the verdicts keep it: one printable line of at most MAX_MESSAGE characters."""
    line = printable(" ".join(text.split()))
    return line if len(line) <= MAX_MESSAGE else line[:MAX_MESSAGE - 3] + "..."
