"""gpuvfio testbed plan: what each variant provisions, without touching anything.

Built from the same services the run uses (ops.domains for the domain, ops.binding for the
bind plan with the variant's policy), so a plan refuses exactly what the run would refuse.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from typing import Callable

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.ops import binding, domains, guests, vgpu
from gpuvfio.ops.binding import BindPolicy
from gpuvfio.ops.attach_plan import AttachPlan, plan_attach
from gpuvfio.ops.context import Context
from gpuvfio.ops.health import plan_health
from gpuvfio.ops.plans import Plan, StepKind
from gpuvfio.ops.targets import SshOptions, ssh_options
from gpuvfio.ops.verify_options import verify_options
from gpuvfio.ops.selection import resolve, the_gpu
from gpuvfio.testbed.spec import Spec, Variant, boot_timeout, guest_request_args, in_spec_words

DOMAIN_PREFIX = "gpuvfio-tb-"
DIGEST = re.compile(r"digest='sha256:[0-9a-f]{64}'")


def domain_name(variant_name: str) -> str:
    return f"{DOMAIN_PREFIX}{variant_name}"


def gpus_on(ctx: Context, spec: Spec, *, yes: bool = False, tell: Callable[[str], None] = lambda line: None
            ) -> list[PciAddress]:
    """The GPUs ``[run] gpus`` and ``gpu_ids`` mean on the hypervisor, as every device argument
    (ops.selection): what a slot or an id filter expanded to is told, and more than one physical
    device needs ``yes`` (testbed plan/run --yes; the plan refuses what the run would)."""
    return resolve(ctx, spec.gpus, spec.gpu_ids, changes=True, yes=yes, tell=tell)


def request_for(ctx: Context, spec: Spec, variant: Variant, gpus: list[PciAddress]) -> domains.DomainRequest:
    """The variant's domain request: the spec's guest (every domain option [guest] declares,
    topology, p2p, hide_kvm and console_log among them), the variant's pages, NUMA and profile
    (a legacy mdev type or an SR-IOV vGPU type, as the GPU offers them)."""
    profile = {}
    if variant.kind == "vgpu":
        legacy = vgpu.types(ctx, addresses_for(ctx, gpus, variant)[0]).kind is vgpu.TypesKind.MDEV
        profile = {"mdev": variant.profile} if legacy else {"vgpu": variant.profile}
    return domains.domain_request(domain_name(variant.name), hugepages=variant.hugepages, numa=variant.numa,
                                  **guest_request_args(spec.guest, spec.ssh), **profile)


def addresses_for(ctx: Context, gpus: list[PciAddress], variant: Variant) -> list[PciAddress]:
    """The devices a variant's guest gets: a passthrough guest every selected function (a slot
    brings its audio function along), a vGPU guest an instance on the one GPU selected (as
    gpuvfio vgpu takes one), a bare-metal variant none (it runs on the host)."""
    if variant.kind == "passthrough":
        return list(gpus)
    if variant.kind != "vgpu":
        return []
    try:
        return [the_gpu(ctx, gpus)]
    except InputError as exc:
        raise InputError(f"variant {variant.name}: {in_spec_words(exc)}") from None


def ssh_for(spec: Spec, timeout: float | None = None) -> SshOptions:
    """The guest's SSH target as [ssh] names it (``timeout``: until SSH answers; the boot
    timeout of the spec by default)."""
    ssh = spec.ssh
    return ssh_options(host=ssh.get("host", "127.0.0.1" if "port" in ssh else None), port=ssh.get("port"),
                       user=ssh.get("user", "root"), key=ssh.get("key"), known_hosts=ssh.get("known_hosts"),
                       trust_on_first_use=ssh.get("trust_on_first_use", False),
                       timeout=boot_timeout(spec) if timeout is None else timeout, wait="boot_timeout")


def policy_for(variant: Variant) -> BindPolicy:
    return BindPolicy(force=variant.force, stop_services=variant.stop_services,
                      take_host_devices=variant.take_host_devices)


@dataclass
class VariantPlan(Plan):
    """One variant of a testbed run, decided: its steps in the run's order (a leftover guest
    detached, the vGPU scheduler and instance, the attach, the repetitions, the teardown),
    the attach's own plan, and how its domain differs from the first variant's."""

    kind: str = ""
    attach: AttachPlan | None = None
    vgpu: dict | None = None
    xml_diff: str | None = None

    def extra_json(self) -> dict:
        out: dict = {"name": self.target, "kind": self.kind}
        if self.attach is not None:
            out["plan"] = self.attach.to_json()
            out["refused"] = [c.message for c in self.refusals]
        provisioned = self.attach.provisioned if self.attach is not None else None
        if provisioned is not None:
            out.update({"domain": self.attach.target, "hugepages_kib": provisioned.spec.hugepage_kib,
                        "numa_nodes": [c.node for c in provisioned.spec.cells],
                        "warnings": provisioned.spec.warnings, "xml": provisioned.xml})
            if self.attach.bind is not None:
                out["bind"] = self.attach.bind.report
        if self.vgpu is not None:
            out["vgpu"] = self.vgpu
        if self.xml_diff is not None:
            out["xml_diff"] = self.xml_diff
        return out


@dataclass
class TestbedPlan:
    """``testbed plan``, and what ``testbed run`` carries out variant by variant."""

    spec: str
    repetitions: int
    gpus: list[PciAddress]
    selected: list[str]
    variants: list[VariantPlan] = field(default_factory=list)
    host: str | None = None  # the hypervisor, when planned from its recording over SSH

    @property
    def refused(self) -> list[str]:
        return [v.target for v in self.variants if v.refused]

    def to_json(self) -> dict:
        out = {"spec": self.spec, "repetitions": self.repetitions, "gpus": [str(g) for g in self.gpus],
               "selected": list(self.selected), "variants": [v.to_json() for v in self.variants],
               "refused": self.refused}
        if self.host is not None:
            out["host"] = self.host
        return out


def plan(ctx: Context, spec: Spec, *, uri: str | None = None, yes: bool = False) -> TestbedPlan:
    """Each variant's plan (plan_variant); the domains' differences against the first one's. The
    variants' questions to libvirt share one listing of its domains (Context.one_listing); the run
    plans each variant afresh when it comes to it."""
    selected: list[str] = []
    gpus = gpus_on(ctx, spec, yes=yes, tell=selected.append)
    out = TestbedPlan(spec.path, spec.repetitions, gpus, selected)
    with ctx.one_listing():
        for variant in spec.variants:
            out.variants.append(plan_variant(ctx, spec, variant, gpus, uri=uri))
    _compare_domains(out)
    return out


def _compare_domains(out: TestbedPlan) -> None:
    """Each planned domain's differences against the first one's (VariantPlan.xml_diff)."""
    first = None
    for planned in out.variants:
        attach = planned.attach
        if attach is not None and attach.provisioned is not None:
            if first is None:
                first = (attach.xml, planned.target)
            else:
                planned.xml_diff = "".join(difflib.unified_diff(
                    _comparable(first[0], domain_name(first[1])), _comparable(attach.xml, attach.target),
                    first[1], planned.target))


def plan_variant(ctx: Context, spec: Spec, variant: Variant, gpus: list[PciAddress], *,
                 uri: str | None = None, todo: int | None = None) -> VariantPlan:
    """A variant's steps as the run takes them. ``todo``: the repetitions left to measure (the
    run's resume; all of them for a plan)."""
    todo = spec.repetitions if todo is None else todo
    planned = VariantPlan("testbed variant", variant.name, kind=variant.kind)
    if todo == 0:
        planned.notes.append(f"done already ({spec.repetitions} repetitions)")
        return planned
    if variant.kind == "baremetal":  # the verifier runs on the host's GPUs as they are: judged as a bind judges
        plan_health(ctx, planned, gpus, force=variant.force)
        planned.step(StepKind.VERIFY_HOST, f"run the verifier on this host (the baseline), {todo} time(s)",
                     name=variant.name)
        return planned
    addresses = addresses_for(ctx, gpus, variant)
    try:
        request = request_for(ctx, spec, variant, gpus)
    except InputError as exc:
        raise InputError(f"variant {variant.name}: {in_spec_words(exc)}") from None
    except GpuvfioError as exc:
        planned.refuse("variant", str(exc))
        return planned
    leftover = binding.libvirt_not_asked(ctx, uri) is None and guests.exists(ctx, request.name, uri=uri)
    if leftover:
        planned.step(StepKind.DETACH_LEFTOVER, f"detach {request.name}, left from an interrupted run",
                     name=request.name)
    try:  # the run's own attach plan: the same libvirt, the same bind checks, the same steps
        planned.attach = plan_attach(ctx, addresses, request, ssh=ssh_for(spec), uri=uri, policy=policy_for(variant),
                                     verify=verify_options(**spec.verify),
                                     ask_libvirt=binding.libvirt_not_asked(ctx, uri) is None)
    except InputError as exc:
        raise InputError(f"variant {variant.name}: {in_spec_words(exc)}") from None
    # With a leftover guest the attach is judged again once it is detached: its own domain check
    # (running, or redefined) is about the leftover, not the variant (detach refuses a domain
    # gpuvfio did not define).
    planned.checks += [c for c in planned.attach.checks if not (leftover and c.check_id == "domain")]
    if variant.kind == "vgpu":
        _plan_vgpu(planned, variant, addresses[0])
    planned.step(StepKind.ATTACH, f"attach {request.name}: {len(planned.attach.steps)} steps, the first repetition "
                                  "measured by its verify", name=request.name)
    if todo > 1:
        planned.step(StepKind.MEASURE, f"{todo - 1} more repetition(s): verify {request.name}", name=request.name)
    stop = f"ACPI shutdown, destroyed after {spec.stop_timeout:g}s" if spec.stop_timeout > 0 else "destroyed"
    planned.step(StepKind.TEARDOWN, f"detach {request.name} ({stop}; devices given back)"
                 + (", remove the vGPU" if variant.kind == "vgpu" else "")
                 + (", put the scheduler back" if variant.scheduler else ""), name=request.name)
    return planned


def _plan_vgpu(planned: VariantPlan, variant: Variant, gpu: PciAddress) -> None:
    """Before the attach, as the run: the scheduler (NVML changes it only with no vGPU VM
    running), then the instance the domain names."""
    if variant.scheduler:
        planned.step(StepKind.SET_SCHEDULER, f"{variant.scheduler} through NVML on {gpu}, put back after",
                     address=str(gpu), value=variant.scheduler)
    planned.step(StepKind.CREATE_VGPU, f"a {variant.profile} instance on {gpu}", address=str(gpu))
    mig = vgpu.mig_backed(variant.profile)
    planned.vgpu = {"profile": variant.profile, "mig_backed": mig.to_json() if mig is not None else None,
                    "scheduler": variant.scheduler,
                    "scheduler_note": (f"set to {variant.scheduler} through NVML before the variant, the previous "
                                       "policy put back after" if variant.scheduler else
                                       "left as the host driver has it")}


def _comparable(xml: str, name: str) -> list[str]:
    """Lines to diff between variants: without their names and gpuvfio's digest of each."""
    return DIGEST.sub("digest='...'", xml.replace(name, "NAME")).splitlines(True)
