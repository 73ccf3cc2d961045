"""Guest services: attach, detach, verify -- the whole path, transactional.

attach: the domain is built (ops.domains), its passthrough devices bound (ops.binding, with
the domain-use check on the connection already open), the domain defined (keeping an
existing definition's UUID), started, reached over SSH (ops.targets) and verified. Every
step that changes something registers its undo, and an undo touches only what this run
did: a domain this run created is undefined, one it redefined gets its previous definition
back, one it found unchanged is left; devices go back by the one group-aware policy
(ops.binding.restore_groups). SR-IOV vGPU VFs are passed with managed='no' and never rebound: the
vGPU host driver keeps them.
detach: stop the guest (ACPI, then destroy after a timeout), undefine it if gpuvfio defined
it, give its devices back.
"""

from __future__ import annotations

import dataclasses
import posixpath
import sys
from dataclasses import dataclass, field
from typing import Callable

from gpuvfio.address import PciAddress
from gpuvfio.bind.plan import BindPolicy
from gpuvfio.domain.nccl_topo import GUEST_FILE
from gpuvfio.domain.request import DomainRequest
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.guest.checks import VerifyReport, judge
from gpuvfio.guest.nccl_conf import CONF_FILE as NCCL_CONF, ConfChange, merge as merge_conf
from gpuvfio.guest.expect import Expected, expectations, parse_expect  # noqa: F401 - parse_expect: for the CLI
from gpuvfio.guest.payload import PROBE, VERIFIER
from gpuvfio.guest.verify import parse_probe, parse_verifier, run_probe, verify_guest
from gpuvfio.host.inventory import Inventory, read_inventory
from gpuvfio.host.numa import cpu_vendor
from gpuvfio.host.fabric import read_fabric
from gpuvfio.ops import binding, fabric
from gpuvfio.ops.binding import RestorePlan
from gpuvfio.bind.fabric_manager import plan_detach as plan_partitions
from gpuvfio.ops.attach_plan import AttachPlan, plan_attach
from gpuvfio.ops.cloud_init import remove_seed, write_seed
from gpuvfio.ops.context import Context
from gpuvfio.ops.plans import CheckStatus, Plan, Step, StepKind
from gpuvfio.ops.domains import Provisioned, nccl_topology_file, run_define
from gpuvfio.ops.nccl_paths import expected_paths
# verify_options: for the CLI, the Ansible modules and the testbed, which reach it through here.
from gpuvfio.ops.verify_options import PROBE_TIMEOUT, VerifyOptions, verify_options  # noqa: F401
from gpuvfio.ops.targets import AddressUnknown, SshOptions, guest_target
from gpuvfio.numbers import shown
from gpuvfio.options import RUN, checked
from gpuvfio.virt import lifecycle
from gpuvfio.virt.connection import call


@dataclass(frozen=True)
class NcclConf:
    """What attach did to the guest's /etc/nccl.conf so that NCCL finds the topology file by
    itself (gpuvfio.guest.nccl_conf): ``change``, the admin's ``previous`` NCCL_TOPO_FILE where it
    was replaced, or why the file was left alone (``error``: a symbolic link, a failed write)."""

    path: str = NCCL_CONF
    change: ConfChange | None = None
    previous: str | None = None
    error: str | None = None

    def to_json(self) -> dict:
        return {"path": self.path, "change": self.change.value if self.change is not None else None,
                "previous": self.previous, "error": self.error}


@dataclass(frozen=True)
class NcclTopology:
    """The NCCL topology file attach wrote in the guest (``path``, its ``xml``) and what it did to
    /etc/nccl.conf to name it (``conf``), or why it wrote none (``error``: a warning, not a
    failed attach)."""

    path: str | None = None
    xml: str | None = None
    error: str | None = None
    conf: NcclConf | None = None

    @property
    def written(self) -> bool:
        return self.path is not None

    @property
    def named(self) -> bool:
        """Whether the guest's /etc/nccl.conf names the file, so that NCCL jobs find it."""
        return self.conf is not None and self.conf.change in (ConfChange.CREATED, ConfChange.ADDED,
                                                              ConfChange.REPLACED, ConfChange.UNCHANGED)

    @property
    def use(self) -> str | None:
        """How a job in the guest gets it: from /etc/nccl.conf, which NCCL reads at init, or,
        where that could not carry it, by setting NCCL_TOPO_FILE itself."""
        if self.path is None:
            return None
        if self.conf is not None and self.conf.change is ConfChange.KEPT:
            return (f"export NCCL_TOPO_FILE={self.path} ({self.conf.path} names the admin's own "
                    f"NCCL_TOPO_FILE={shown(self.conf.previous, 120)}, which NCCL reads and gpuvfio kept; "
                    "attach --replace-nccl-topo-file, or the domain module's replace_nccl_topo_file, makes it name "
                    "gpuvfio's)")
        if self.conf is not None and self.conf.change is not None:
            replaced = (f" (it replaced the admin's NCCL_TOPO_FILE={shown(self.conf.previous, 120)})"
                        if self.conf.change is ConfChange.REPLACED else "")
            return (f"{self.conf.path} carries NCCL_TOPO_FILE={self.path}: NCCL reads it at init, "
                    f"no export needed{replaced}")
        why = self.conf.error if self.conf is not None else "not merged"
        return f"export NCCL_TOPO_FILE={self.path} ({NCCL_CONF} does not carry it: {why})"

    def to_json(self) -> dict:
        if self.path is None:
            return {"written": False, "path": None, "error": self.error}
        return {"written": True, "path": self.path, "use": self.use, "xml": self.xml,
                "conf": self.conf.to_json() if self.conf is not None else None}


@dataclass
class AttachResult:
    name: str
    steps: list[dict] = field(default_factory=list)
    report: VerifyReport | None = None
    xml: str | None = None
    ssh: dict | None = None
    define: dict | None = None
    rolled_back: list[str] = field(default_factory=list)
    ok: bool = False
    start_to_ssh_s: float | None = None  # from libvirt's start until the guest's SSH answered
    nccl_topology: NcclTopology | None = None  # the NCCL topology file written in the guest, or why not
    notes: list[str] = field(default_factory=list)  # what the plan decided (layout, P2P cliques)
    placement: dict | None = None  # NUMA cells, CPUs, pages and the guest PCIe layout (attach_plan.placement_json)

    def to_json(self) -> dict:
        return {"name": self.name, "ok": self.ok, "steps": self.steps, "define": self.define,
                "verify": self.report.to_json() if self.report is not None else None, "ssh": self.ssh,
                "rolled_back": self.rolled_back, "xml": self.xml, "start_to_ssh_s": self.start_to_ssh_s,
                "nccl_topology": self.nccl_topology.to_json() if self.nccl_topology is not None else None,
                "notes": self.notes, "placement": self.placement}


class AttachFailed(GpuvfioError):
    """attach stopped at a step; carries what was done and undone (exit status of the cause)."""

    def __init__(self, message: str, result: AttachResult, exit_code: int = 1) -> None:
        super().__init__(message)
        self.result = result
        self.exit_code = exit_code


def attach(ctx: Context, addresses: list[PciAddress], request: DomainRequest, *, ssh: SshOptions,
           uri: str | None = None, policy: BindPolicy = BindPolicy(),
           verify: VerifyOptions | None = VerifyOptions(), keep_on_failure: bool = False,
           cloud_init: str | None = None) -> AttachResult:
    """Plan (gpuvfio.ops.attach_plan), then carry out the plan's steps in order: bind, define,
    start, wait for SSH, verify (``verify=None``: wait for SSH only); ``cloud_init``: the NoCloud
    seed image to write and attach first (gpuvfio.ops.cloud_init). The run lock is held from
    the plan to the verdict or the end of the undo: a bind, attach or vGPU create meanwhile
    waits, then is refused naming this run. A refused plan is the run's refusal, in its words."""
    with binding.operation_lock(ctx):
        plan = plan_attach(ctx, addresses, request, ssh=ssh, uri=uri, policy=policy, verify=verify,
                           cloud_init=cloud_init)
        plan.raise_if_refused()
        return run_attach(ctx, plan, keep_on_failure=keep_on_failure)


def run_attach(ctx: Context, plan: AttachPlan, *, keep_on_failure: bool = False) -> AttachResult:
    """Execute ``plan`` (made under the run lock the caller holds), step by step as planned."""
    run = _AttachRun(ctx, plan)
    try:
        try:
            for planned in plan.steps:
                _timed_step(ctx, run.result, planned.kind.value, run.actions[planned.kind])
        finally:
            if "session" in run.state:
                run.state["session"].close()
    except BaseException as exc:
        # Any failure -- also a libvirt error gpuvfio did not expect, Ctrl-C, a testbed's
        # SIGTERM -- undoes what this run did before it goes on.
        if not keep_on_failure:
            run.undo_all()
        if not isinstance(exc, GpuvfioError):
            raise
        rolled_back = run.result.rolled_back
        raise AttachFailed(f"attach {plan.target} failed: {exc}"
                           + (f"; rolled back: {', '.join(rolled_back)}" if rolled_back else
                              ("; kept as it is (--keep-on-failure)" if keep_on_failure and run.undo else "")),
                           run.result, exit_code=getattr(exc, "exit_code", 1)) from None
    run.result.ok = run.result.report is None or run.result.report.ok
    return run.result


class _AttachRun:
    """One attach being carried out: a method per kind of step, and the undo of each step done
    (run in reverse on failure)."""

    def __init__(self, ctx: Context, plan: AttachPlan) -> None:
        self.ctx, self.plan = ctx, plan
        self.conn = ctx.libvirt(plan.uri)
        self.result = AttachResult(plan.target, xml=plan.xml, notes=list(plan.notes), placement=plan.placement)
        self.undo: list[tuple[str, Callable[[], None]]] = []
        self.state: dict = {}
        self.actions = {StepKind.BIND: self.bind, StepKind.ACTIVATE_PARTITION: self.activate,
                        StepKind.SEED: self.seed, StepKind.DEFINE: self.define, StepKind.START: self.start,
                        StepKind.FIND_ADDRESS: self.find, StepKind.WAIT_FOR_SSH: self.wait_for_ssh,
                        StepKind.VERIFY: self.check_guest, StepKind.NCCL_TOPOLOGY: self.nccl}

    def undo_all(self) -> None:
        for what, action in reversed(self.undo):
            try:
                action()
                self.result.rolled_back.append(what)
            except Exception as undo_exc:  # noqa: BLE001 - every undo is tried
                self.result.rolled_back.append(f"{what} FAILED: {undo_exc}")

    def bind(self) -> None:
        ctx = self.ctx
        bound = binding.apply_operation(ctx, self.plan.bind, ctx.journal())
        moved = list(bound.moving) if bound.status is binding.BindStatus.APPLIED else []
        if moved:  # the undo gives back only what this bind moved
            self.undo.append(("restore devices", lambda: binding.restore(ctx, moved)))

    def activate(self) -> None:
        # HGX shared NVSwitch: bind, then activate the partition, then start (its undo runs
        # after the guest is stopped and before the devices go back).
        activated = fabric.activate(self.ctx, self.plan.provisioned.spec.fabric)
        self.undo.append(("deactivate partition", lambda: fabric.deactivate(self.ctx, partition_ids=activated)))

    def seed(self) -> None:
        write_seed(self.ctx, self.plan.seed)
        self.undo.append(("remove the cloud-init seed", lambda: remove_seed(self.plan.seed)))

    def define(self) -> None:
        name, conn = self.plan.target, self.conn
        defined = run_define(self.ctx, self.plan.define)
        self.result.define = defined.to_json()
        self.state["dom"] = dom = lifecycle.lookup(conn, name)
        if dom is None:  # undefined by someone else the moment after
            raise GpuvfioError(f"domain {name} is gone from libvirt right after its define")
        if defined.created:  # "unchanged": nothing to undo
            self.undo.append(("undefine", lambda: lifecycle.undefine(dom)))
        elif defined.previous_xml is not None:
            self.undo.append(("put back the previous definition",
                              lambda: call(f"redefining {name}", conn.defineXML, defined.previous_xml)))

    def start(self) -> None:
        self.state["started"] = self.ctx.clock.monotonic()
        lifecycle.start(self.state["dom"])
        self.undo.append(("destroy", lambda: lifecycle.stop(self.state["dom"], timeout=0, clock=self.ctx.clock)))

    def find(self) -> None:
        self.state["target"] = _discover(self.ctx, self.plan.ssh, self.conn, self.state["dom"])

    def wait_for_ssh(self) -> None:
        target = self.state.get("target") or guest_target(self.plan.ssh, run=self.ctx.run)
        self.result.ssh = {"host": target.host, "port": target.port, "user": target.user}
        self.state["session"] = self.ctx.ssh(target).connect()
        self.result.ssh["notes"] = list(target.notes)  # after the connect: a key trusted on first use is said there
        # Big-BAR guests took minutes to start before kernel huge-pfnmap and QEMU 9.2: say how long.
        self.result.start_to_ssh_s = round(self.ctx.clock.monotonic() - self.state["started"], 3)

    def check_guest(self) -> None:
        provisioned, verify = self.plan.provisioned, self.plan.verify
        expected = planned_expectations(provisioned, expectations(provisioned.inventory, provisioned.assigned))
        self.result.report = verify_guest(
            self.state["session"], expected, bandwidth=verify.bandwidth, timeout=verify.timeout,
            probe_timeout=verify.probe_timeout, gates=verify.gates, verifier_args=verify.verifier_args,
            nccl_paths=paths_expected(self.ctx, provisioned.inventory, expected),
            progress=self.ctx.progress, clock=self.ctx.clock)

    def nccl(self) -> None:
        verify = self.plan.verify
        self.result.nccl_topology = write_nccl_topology(
            self.ctx, self.state["session"], self.plan.provisioned,
            verify.probe_timeout if verify is not None else PROBE_TIMEOUT,
            replace=self.plan.provisioned.spec.asked.replace_nccl_topo_file)


def _timed_step(ctx: Context, result: AttachResult, name: str, func: Callable[[], None]) -> None:
    """One step of the run, recorded under the plan's name with its time and outcome."""
    started = ctx.clock.monotonic()
    ctx.progress(f"{name} ...")
    try:
        func()
    except BaseException as exc:
        result.steps.append({"step": name, "ok": False, "seconds": round(ctx.clock.monotonic() - started, 3),
                             "error": str(exc) or type(exc).__name__})
        raise
    seconds = ctx.clock.monotonic() - started
    result.steps.append({"step": name, "ok": True, "seconds": round(seconds, 3)})
    ctx.progress(f"{name}: done ({seconds:.1f}s)")


def with_cliques(expected: list[Expected], cliques: dict[PciAddress, int]) -> list[Expected]:
    """The P2P clique each GPU was given in a domain gpuvfio defined (its <qemu:override>), for
    verify on a running guest: its peer matrix must agree, as attach checks from its plan."""
    return [dataclasses.replace(e, clique=cliques[PciAddress.parse(e.address)])
            if e.kind == "gpu" and e.address is not None and PciAddress.parse(e.address) in cliques else e
            for e in expected]


def fabric_driver(ctx: Context, inventory, expected: list[Expected]) -> list[Expected]:
    """On an HGX host in shared-NVSwitch mode a baseboard GPU's guest needs the host Fabric
    Manager's driver version, as attach checks from its plan (read from the host: verify may
    come long after the plan)."""
    if not any(f.is_nvswitch for f in inventory.functions.values()):
        return expected
    fabric = read_fabric(ctx.host, inventory)
    if fabric.guest_driver_version is None:
        return expected
    return [dataclasses.replace(e, driver_version=fabric.guest_driver_version)
            if e.kind == "gpu" and e.address is not None and PciAddress.parse(e.address) in fabric.gpus else e
            for e in expected]


def planned_expectations(provisioned: Provisioned, expected: list[Expected]) -> list[Expected]:
    """What the plan adds to the checks: the P2P clique of each GPU (the guest's peer matrix
    must agree) and, on an HGX shared-NVSwitch host, the guest driver version the FM needs."""
    fabric = provisioned.spec.fabric
    version = fabric.guest_driver_version if fabric is not None else None
    out = []
    for e in expected:
        if e.kind == "gpu" and e.address is not None:
            e = dataclasses.replace(e, clique=provisioned.spec.p2p.clique_of(PciAddress.parse(e.address)),
                                    driver_version=version)
        out.append(e)
    return out


def write_nccl_topology(ctx: Context, session, provisioned: Provisioned, probe_timeout: float, *,
                        replace: bool = False) -> NcclTopology:
    """Write the guest's NCCL topology file from the bus ids the guest shows (the probe's view),
    mapped onto the planned devices, and name it in the guest's /etc/nccl.conf
    (``merge_nccl_conf``; an admin's own NCCL_TOPO_FILE there is kept unless ``replace``). A guest whose devices do not line up with the plan, or that cannot be
    written to (a user without root), gets no file: the answer says why, as a warning (the
    verifier judges the devices themselves)."""
    try:
        facts = run_probe(session, timeout=probe_timeout, progress=ctx.progress, clock=ctx.clock)
        text = nccl_topology_file(ctx, provisioned, facts["pci"])
        directory = posixpath.dirname(GUEST_FILE)
        # GPUVFIO_PROBE_ROOT: the stand-in guests of the tests keep their /etc under a root, as the probe does.
        script = 'R="${GPUVFIO_PROBE_ROOT:-}"; mkdir -p "$R$1" && cat > "$R$2.tmp" && mv "$R$2.tmp" "$R$2"'
        status, _out, err = session.run(["sh", "-c", script, "sh", directory, GUEST_FILE], stdin=text.encode(),
                                        timeout=probe_timeout)
    except (GpuvfioError, OSError) as exc:
        return NcclTopology(error=str(exc))
    if status:
        return NcclTopology(error=f"writing {GUEST_FILE} failed (exit {status}): {err.strip()[:200]}")
    return NcclTopology(path=GUEST_FILE, xml=text, conf=merge_nccl_conf(session, GUEST_FILE, probe_timeout,
                                                                        replace=replace))


# The guest's /etc/nccl.conf as it is: "LINK target", "OTHER" (not a regular file), "NONE", or
# "FILE" and its bytes.
READ_CONF = ('R="${GPUVFIO_PROBE_ROOT:-}"; c="$R$1"; if [ -L "$c" ]; then printf \'LINK %s\\n\' "$(readlink "$c")"; '
             'elif [ -f "$c" ]; then echo FILE && cat "$c"; elif [ -e "$c" ]; then echo OTHER; else echo NONE; fi')
# The merged file from stdin: a temporary file beside it (a copy of the old one first, so its
# mode and owner stay), renamed over it; never through a link, never a partial file.
WRITE_CONF = ('R="${GPUVFIO_PROBE_ROOT:-}"; c="$R$1"; t="$R$2"; '
              'if [ -L "$c" ]; then echo "$1 is a symbolic link: not written through" >&2; exit 3; fi; '
              'if [ -e "$c" ] && [ ! -f "$c" ]; then echo "$1 is not a regular file" >&2; exit 3; fi; '
              'rm -f "$t" && if [ -f "$c" ]; then cp -p "$c" "$t"; else (umask 022 && : > "$t"); fi '
              '&& cat > "$t" && mv -f "$t" "$c" || { s=$?; rm -f "$t"; exit $s; }')


def merge_nccl_conf(session, topology_file: str, timeout: float, *, replace: bool = False) -> NcclConf:
    """Make the guest's /etc/nccl.conf carry ``NCCL_TOPO_FILE=topology_file``: read it, merge
    (gpuvfio.guest.nccl_conf.merge: every other line kept byte for byte, an earlier
    NCCL_TOPO_FILE replaced and said), write it back atomically (a temporary file in /etc
    renamed over it). A symbolic link is refused: its target belongs to someone else (a
    configuration tool, a shared file), and replacing the link would cut it off from them."""
    def said(data: bytes) -> str:
        return data.decode("utf-8", "replace").strip()[:200]

    try:
        status, out, err = session.run_bytes(["sh", "-c", READ_CONF, "sh", NCCL_CONF], timeout=timeout)
        if status:
            return NcclConf(error=f"reading {NCCL_CONF} failed (exit {status}): {said(err)}")
        head, _, body = out.partition(b"\n")
        if head.startswith(b"LINK "):
            return NcclConf(error=f"{NCCL_CONF} is a symbolic link (to {said(head[5:])}): gpuvfio does not write "
                                  "through links, whose target another tool or file owns; add the line there")
        if head not in (b"FILE", b"NONE"):
            return NcclConf(error=f"{NCCL_CONF} is not a regular file" if head == b"OTHER"
                            else f"the guest's answer about {NCCL_CONF} is not recognisable")
        merged = merge_conf(body if head == b"FILE" else None, topology_file, replace=replace)
        if merged.changed:
            temp = posixpath.join(posixpath.dirname(NCCL_CONF), ".nccl.conf.gpuvfio-tmp")
            status, _out, err = session.run_bytes(["sh", "-c", WRITE_CONF, "sh", NCCL_CONF, temp],
                                                  stdin=merged.text, timeout=timeout)
            if status:
                return NcclConf(error=f"writing {NCCL_CONF} failed (exit {status}): {said(err)}")
    except (GpuvfioError, OSError) as exc:
        return NcclConf(error=str(exc))
    return NcclConf(change=merged.change, previous=merged.previous)


def _discover(ctx: Context, ssh: SshOptions, conn, dom):
    """The guest's address through libvirt. A DHCP lease, the guest agent and the ARP table only
    know it once the guest is up: ask again until the boot timeout."""
    deadline = ctx.clock.monotonic() + ssh.timeout
    while True:
        try:
            return guest_target(ssh, conn, dom, run=ctx.run)
        except AddressUnknown:
            if ctx.clock.monotonic() >= deadline:
                raise
            ctx.clock.sleep(1.0)


def exists(ctx: Context, name: str, *, uri: str | None = None) -> bool:
    return lifecycle.lookup(ctx.libvirt(uri), name) is not None


@dataclass
class DetachPlan(Plan):
    """A detach decided: the domain's recorded devices, whether it runs, the shutdown timeout,
    the partitions to deactivate and the restore of what gpuvfio holds in their groups."""

    uri: str | None = None
    devices: list[PciAddress] = field(default_factory=list)
    timeout: float = 60.0
    restore: RestorePlan | None = None

    def extra_json(self) -> dict:
        return {"devices": [str(d) for d in self.devices], "timeout": self.timeout,
                "restore": self.restore.to_json() if self.restore is not None else None}


def plan_detach(ctx: Context, name: str, *, uri: str | None = None, timeout: float = RUN["stop_timeout"].default,
                restore: bool = True) -> DetachPlan:
    """What ``detach`` will do: stop, undefine, deactivate the Fabric Manager partitions gpuvfio
    activated for the domain's devices, and give back what gpuvfio holds in their groups (by
    the one give-back policy). A domain gpuvfio did not define is refused; none is bad input."""
    timeout = float(checked(RUN["stop_timeout"], timeout))
    plan = DetachPlan("detach", name, uri=uri, timeout=timeout)
    dom = lifecycle.lookup(ctx.libvirt(uri), name)
    if dom is None:
        raise InputError(f"no domain named {name}")
    if not lifecycle.made_by_gpuvfio(dom):
        plan.refuse("domain", f"domain {name} was not created by gpuvfio; stop it with virsh")
        return plan
    plan.check("domain", CheckStatus.OK, f"gpuvfio defined {name}")
    plan.devices = devices = lifecycle.recorded_devices(dom)
    # Stopped whatever its state now: libvirt's domains are not under gpuvfio's run lock, and a
    # guest started meanwhile must not be left running, transient, on devices given back.
    how = f"ACPI shutdown, destroyed after {timeout:g}s" if timeout > 0 else "destroy"
    plan.step(StepKind.STOP, f"{how} (running now)" if lifecycle.is_active(dom) else
              f"not running now; {how} if it runs by then", name=name)
    plan.step(StepKind.UNDEFINE, f"undefine {name}", name=name)
    if devices and restore:
        # The give-back as restore_groups plans it (partitions first, then the devices), made now,
        # under the run lock the run holds, from the journal as it is.
        plan.restore = binding.plan_restore_groups(ctx, devices)
        if plan.restore.nothing_to_do:
            plan.notes.append("gpuvfio holds none of its devices: nothing to give back")
        plan.steps += plan.restore.steps
    elif devices:  # devices kept on vfio-pci; the partitions gpuvfio activated for them still go
        for step in plan_partitions(ctx.journal(), devices):
            plan.step(StepKind.DEACTIVATE_PARTITION, f"Fabric Manager partition {step.partition_id}",
                      name=str(step.partition_id))
    return plan


@dataclass
class DetachResult:
    name: str
    stopped: str  # how it ended: "not running", "shut down", "destroyed ..." (gpuvfio.virt.lifecycle.stop)
    devices: list[str]  # the host devices gpuvfio recorded in it
    partitions: list[str]  # Fabric Manager partitions deactivated
    restored: binding.RestoreResult | None  # None: devices left as they are (restore=False) or none held
    steps: list[Step]  # the plan's steps, as carried out
    undefined: bool = True

    def to_json(self) -> dict:
        return {"name": self.name, "stopped": self.stopped, "undefined": self.undefined, "devices": self.devices,
                "partitions": self.partitions, "restored": self.restored.to_json() if self.restored else None,
                "steps": [s.to_json() for s in self.steps]}


def detach(ctx: Context, name: str, *, uri: str | None = None, timeout: float = RUN["stop_timeout"].default,
           restore: bool = True) -> DetachResult:
    """Stop the guest, undefine it, give its devices back: the steps of its plan, in order. A
    domain gpuvfio did not define is not touched. Planned and carried out under the run lock, as
    attach is: another run that holds it (an attach binding these devices) is waited for, and on
    a timeout nothing is stopped."""
    with binding.operation_lock(ctx):
        return run_detach(ctx, plan_detach(ctx, name, uri=uri, timeout=timeout, restore=restore))


def run_detach(ctx: Context, plan: DetachPlan) -> DetachResult:
    """Carry out ``plan`` (made under the run lock the caller holds): stop, undefine, then the
    planned restore with the journal it was made from."""
    plan.raise_if_refused()
    name = plan.target
    dom = lifecycle.lookup(ctx.libvirt(plan.uri), name)
    taken: list[Step] = []
    how = "not running"
    for step in plan.steps:
        if step.kind is StepKind.STOP:
            how = lifecycle.stop(dom, timeout=plan.timeout, clock=ctx.clock)
            ctx.progress(f"{name}: {how}")
        elif step.kind is StepKind.UNDEFINE:
            lifecycle.undefine(dom)
            ctx.progress(f"{name}: undefined")
        elif plan.restore is None and step.kind is StepKind.DEACTIVATE_PARTITION:
            fabric.deactivate(ctx, partition_ids=[int(step.name)])
        else:
            break  # the restore's steps: carried out by its own run below
        taken.append(step)
    restored = None
    if plan.restore is not None and not plan.restore.nothing_to_do:
        restored = binding.run_restore(ctx, plan.restore, ctx.journal())
        taken += restored.steps
    partitions = [s.name for s in taken if s.kind is StepKind.DEACTIVATE_PARTITION]
    return DetachResult(name, how, [str(d) for d in plan.devices], partitions, restored, taken)


def verify(ctx: Context, *, ssh: SshOptions, domain: str | None = None, uri: str | None = None,
           expect: list[PciAddress] | None = None, expect_ids: list[Expected] | None = None,
           options: VerifyOptions = VerifyOptions()) -> VerifyReport:
    """Check a running guest against what the host assigned: the functions gpuvfio recorded in
    DOMAIN, else ``expect`` (host addresses) and ``expect_ids`` (--expect VENDOR:DEVICE[xN])."""
    dom = conn = None
    recorded: list[PciAddress] = []
    cliques: dict[PciAddress, int] = {}
    if domain is not None:
        conn = ctx.libvirt(uri)
        dom = lifecycle.lookup(conn, domain)
        if dom is None:
            raise InputError(f"no domain named {domain}")
        if lifecycle.made_by_gpuvfio(dom):
            recorded, cliques = lifecycle.recorded(dom)
    target = guest_target(ssh, conn, dom, run=ctx.run)
    given = expect is not None or expect_ids is not None
    inventory = read_inventory(ctx.host)
    expected = expectations(inventory, (expect or []) if given else recorded) + (expect_ids or [])
    expected = fabric_driver(ctx, inventory, with_cliques(expected, cliques))
    with ctx.ssh(target) as session:
        report = verify_guest(session, expected, bandwidth=options.bandwidth, timeout=options.timeout,
                              probe_timeout=options.probe_timeout, gates=options.gates,
                              verifier_args=options.verifier_args, nccl_paths=paths_expected(ctx, inventory, expected),
                              progress=ctx.progress, clock=ctx.clock)
    return dataclasses.replace(report, ssh_notes=list(target.notes))


def paths_expected(ctx: Context, inventory: Inventory, expected: list[Expected]) -> dict[tuple[str, str], str]:
    """NCCL's path type between each pair of the expected GPUs on this host (ops.nccl_paths), for
    the verifier to hold NCCL's view in the guest to."""
    addresses = [PciAddress.parse(exp.address) for exp in expected if exp.address]
    return expected_paths(inventory.functions, addresses, cpu_vendor(ctx.host))


def verify_here(ctx: Context, gpus: list[PciAddress], options: VerifyOptions = VerifyOptions()) -> VerifyReport:
    """The bare-metal baseline: the probe and the verifier on this host itself, measuring ``gpus``.
    The probe reads the host through its root (GPUVFIO_PROBE_ROOT, as every host path does); the
    verifier talks to the CUDA and NVML libraries of the machine it runs on."""
    inventory = read_inventory(ctx.host)
    expected = expectations(inventory, gpus)
    env = dict(ctx.host.settings.environ, GPUVFIO_PROBE_ROOT="" if ctx.live else ctx.host.root)
    probe = parse_probe(ctx.run(["sh", PROBE], options.probe_timeout, env=env))
    argv = [sys.executable, VERIFIER, *options.verifier_args, "--root", ctx.host.root] + (
        ["--devices", ",".join(str(g) for g in gpus)] if gpus else [])
    if not options.bandwidth:
        argv.append("--no-bandwidth")
    verifier = problem = None
    try:
        verifier = parse_verifier(ctx.run(argv, options.timeout))
    except GpuvfioError as exc:  # VerifyError among them
        problem = str(exc)
    report = judge(probe, verifier, expected, gates=options.gates, bandwidth=options.bandwidth,
                   verifier_problem=problem, nccl_paths=paths_expected(ctx, inventory, expected))
    return dataclasses.replace(report, expected=expected, host_root=ctx.host.root)
