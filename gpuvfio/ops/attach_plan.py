"""attach's plan: everything attach decides, before it changes anything.

One function decides, for ``attach --dry-run``, Ansible's check mode, ``testbed plan`` and
the run itself (which makes it under the run lock and then executes its steps in order):

* the domain of that name: none (the run defines it), gpuvfio's and stopped (redefined, keeping its
  UUID), gpuvfio's and running, or someone else's (both refused);
* the domain, built from the same libvirt the run uses: the QEMU version from that
  connection, the other domains' vCPU pins (gpuvfio.ops.domains.provision_xml);
* the bind, with the run's checks (``require_unused``: a domain using the devices refuses,
  a broken device refuses) -- the very BindOperation the run applies;
* with ``--cloud-init``, the seed (gpuvfio.ops.cloud_init): written and its host key pinned
  before the define, so the first SSH connection meets a pinned key;
* the define (new, unchanged, or the differences against libvirt's definition), the start,
  the SSH target, the verification and the NCCL topology file.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuvfio.address import PciAddress
from gpuvfio.bind.plan import BindPolicy
from gpuvfio.domain.request import DomainRequest
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.ops import binding
from gpuvfio.ops.binding import BindOperation
from gpuvfio.ops.cloud_init import SeedPlan, plan_seed
from gpuvfio.ops.context import Context
from gpuvfio.ops.domains import DefinePlan, Existing, Provisioned, existing_domain, plan_define, provision_xml
from gpuvfio.ops.health import plan_health
from gpuvfio.ops.plans import CheckStatus, Plan, StepKind
from gpuvfio.ops.reach import reach_checks
from gpuvfio.ops.targets import SshOptions
from gpuvfio.ops.verify_options import VerifyOptions
from gpuvfio.ops.uris import NO_LIBVIRT
from gpuvfio.virt.connection import default_uri

__all__ = ["AttachPlan", "plan_attach", "placement_json", "verify_json"]


@dataclass
class AttachPlan(Plan):
    provisioned: Provisioned | None = None
    bind: BindOperation | None = None
    existing: Existing | None = None
    uri: str | None = None
    ssh: SshOptions | None = None
    verify: VerifyOptions | None = None
    seed: SeedPlan | None = None  # --cloud-init: the seed the run writes before the define
    define: DefinePlan | None = None  # the define step's own plan (None: libvirt not asked, a preview)

    @property
    def gpus(self) -> list[PciAddress]:
        """The GPUs passed through whole (function 0 of each NVIDIA GPU): NCCL's devices."""
        if self.provisioned is None:
            return []
        functions = self.provisioned.inventory.functions
        return [a for a in self.provisioned.passthrough if functions[a].is_nvidia_gpu and a.function == 0]

    @property
    def placement(self) -> dict | None:
        return placement_json(self.provisioned) if self.provisioned is not None else None

    def extra_json(self) -> dict:
        out: dict = {}
        if self.provisioned is not None:
            out["placement"] = self.placement
            out["versions"] = [{"feature": r.feature, "needed": r.needed, "have": r.have, "status": r.status}
                               for r in self.provisioned.spec.versions]
        if self.bind is not None:
            out["bind"] = self.bind.report
        if self.seed is not None:
            out["cloud_init"] = self.seed.to_json()
        if self.verify is not None and self.provisioned is not None:
            out["verify"] = verify_json(self.verify)
        return out


def plan_attach(ctx: Context, addresses: list[PciAddress], request: DomainRequest, *, ssh: SshOptions,
                uri: str | None = None, policy: BindPolicy = BindPolicy(),
                verify: VerifyOptions | None = None, ask_libvirt: bool = True,
                cloud_init: str | None = None) -> AttachPlan:
    """What ``attach`` will do and every refusal it will meet; reads only (bad input raises).
    ``ask_libvirt=False`` (a preview of a recorded host without --connect): the plan says
    what it could not ask (an existing domain, the QEMU version, the other domains' pins).
    ``cloud_init``: where the cloud-init seed goes (gpuvfio.ops.cloud_init). libvirt's domains
    are listed once for the plan's questions (Context.one_listing)."""
    with ctx.one_listing():
        return _plan_attach(ctx, addresses, request, ssh=ssh, uri=uri, policy=policy, verify=verify,
                            ask_libvirt=ask_libvirt, cloud_init=cloud_init)


def _plan_attach(ctx: Context, addresses: list[PciAddress], request: DomainRequest, *, ssh: SshOptions,
                 uri: str | None, policy: BindPolicy, verify: VerifyOptions | None, ask_libvirt: bool,
                 cloud_init: str | None) -> AttachPlan:
    plan = AttachPlan("attach", request.name, uri=uri, ssh=ssh, verify=verify)
    if cloud_init is not None:  # bad input first; the seed's own refusals join the plan's checks
        plan.seed = plan_seed(ctx, request.name, cloud_init, ssh=ssh, forward_port=request.user_net_ssh_port)
    name = request.name
    existing = None
    if not ask_libvirt:
        plan.check("libvirt", CheckStatus.WARN, binding.libvirt_not_asked(ctx, uri) or "libvirt not asked")
        return _plan_build(ctx, plan, addresses, request, policy, ssh, verify, asked=False)
    try:
        existing = existing_domain(ctx, name, uri=uri, ours_only=False)
    except InputError:
        raise
    except GpuvfioError as exc:  # libvirt did not answer: the run would stop at the same place
        plan.refuse("libvirt", str(exc))
        return plan
    if existing is not None and not existing.ours:
        plan.refuse("domain", f"domain {name} exists and was not created by gpuvfio; pick another --name")
    elif existing is not None and existing.active:
        plan.refuse("domain", f"domain {name} is running; gpuvfio detach {name} first")
    else:
        plan.check("domain", CheckStatus.OK, f"gpuvfio's domain {name} exists, stopped: redefined with its UUID"
                   if existing is not None else f"no domain {name} yet: the run defines it")
    plan.existing = existing
    return _plan_build(ctx, plan, addresses, request, policy, ssh, verify, asked=True)


def _plan_build(ctx: Context, plan: AttachPlan, addresses: list[PciAddress], request: DomainRequest,
                policy: BindPolicy, ssh: SshOptions, verify: VerifyOptions | None, *, asked: bool) -> AttachPlan:
    name, uri, existing = request.name, plan.uri, plan.existing
    try:
        provisioned = provision_xml(ctx, addresses, request, uri=uri, ask_libvirt=asked,
                                    seed_iso=plan.seed.path if plan.seed is not None else None)
    except InputError:
        raise
    except GpuvfioError as exc:  # the domain cannot be built here (pages, NUMA, address space, fabric)
        plan.refuse("domain_spec", str(exc))
        return plan
    plan.provisioned = provisioned
    spec = provisioned.spec
    plan.xml = provisioned.xml
    plan.notes = list(spec.notes)
    for warning in spec.warnings:
        plan.check("domain_spec", CheckStatus.WARN, warning)
    # A guest that can boot and be reached, known before the bind changes anything.
    plan.checks += reach_checks(ctx, request, ssh, uri=uri, asked=asked)
    if provisioned.passthrough:
        bind_uri = (uri or default_uri(ctx.host.settings)) if asked else NO_LIBVIRT
        _plan_bind(ctx, plan, provisioned, policy, bind_uri, name)
    # a vGPU's GPU stays on its host driver: no bind judges it, so its health is judged here
    plan_health(ctx, plan, [a for a in addresses if a not in provisioned.passthrough], force=policy.force,
                inventory=provisioned.inventory)
    if spec.fabric is not None and spec.fabric.partition is not None:
        plan.step(StepKind.ACTIVATE_PARTITION, f"Fabric Manager partition {spec.fabric.partition} for the GPUs, after the bind")
    if plan.seed is not None:
        plan.checks += list(plan.seed.checks)
        plan.step(StepKind.SEED, plan.seed.describe())
    if asked:
        # The define as xml --define plans it (redefined under its UUID when it differs): the
        # run carries out this very plan after the bind.
        plan.define = plan_define(ctx, provisioned.xml, uri=uri, update=True)
        plan.checks += [c for c in plan.define.checks if c.check_id != "domain"]  # attach judged the domain
        plan.changes = list(plan.define.changes or [])
        plan.step(StepKind.DEFINE, plan.define.steps[0].detail if plan.define.steps else
                  f"{name} is defined so already (unchanged)", name=name)
    else:
        plan.step(StepKind.DEFINE, f"define {name} (new, or redefined if gpuvfio's; libvirt not asked)", name=name)
    plan.step(StepKind.START, f"start {name}")
    if ssh.host is None:
        plan.step(StepKind.FIND_ADDRESS, "the guest's address from libvirt (DHCP lease, guest agent, ARP), until "
                             f"{ssh.timeout:g}s")
        where = "the address found"
    else:
        where = f"{ssh.host}:{ssh.port or 22}"
    plan.step(StepKind.WAIT_FOR_SSH, f"{where} as {ssh.user or 'the SSH config User, else root'}, host key "
                        f"{'trusted on first use' if ssh.trust_on_first_use else 'pinned'}, until {ssh.timeout:g}s")
    if len(plan.gpus) >= 2:  # NCCL's topology matters where there are GPUs to talk to each other
        # Before verify: verify's all-reduce runs with the file and shows NCCL's view of it.
        plan.step(StepKind.NCCL_TOPOLOGY, "write NCCL's topology file in the guest from the devices it shows, and "
                             "NCCL_TOPO_FILE into its /etc/nccl.conf")
    if verify is not None:
        plan.step(StepKind.VERIFY, "in the guest: devices, driver, CUDA, PCIe link"
                  + (", copy bandwidth" if verify.bandwidth else " (no bandwidth)")
                  + (", P2P" if len(plan.gpus) >= 2 else ""))
    return plan


def _plan_bind(ctx: Context, plan: AttachPlan, provisioned: Provisioned, policy: BindPolicy, uri: str | None,
               name: str) -> None:
    # The domain-use check asks the connection this attach defines on, leaving its own domain
    # out (it is about to be redefined); devices already on vfio-pci must not be in use by
    # another domain either (require_unused).
    operation = binding.plan_operation(ctx, provisioned.passthrough, policy, uri=uri, exclude=name,
                                       require_unused=True)
    plan.bind = operation
    refusing = set(operation.refusals)
    for check in operation.plan.checks:
        if check.message in refusing:
            verdict = CheckStatus.REFUSE
        elif check.status == "ok":
            verdict = CheckStatus.OK
        else:  # a warning, a refusal --force overrides, or one that does not hold for devices already there
            verdict = CheckStatus.WARN
        plan.check(f"bind.{check.check_id}", verdict, check.message)
    moving = [str(a) for a in operation.plan.moving]
    plan.step(StepKind.BIND, f"move {', '.join(moving)} to vfio-pci (with their IOMMU groups)" if moving
              else f"nothing to move: {', '.join(map(str, provisioned.passthrough))} already on vfio-pci")


def verify_json(verify: VerifyOptions) -> dict:
    """verify's thresholds and limits as the run applies them (attach's plan shows them)."""
    return {"bandwidth": verify.bandwidth, "bandwidth_floor": verify.gates.to_json() if verify.bandwidth else None,
            "link": "each GPU's link at least what its host slot allows, never above it",
            "probe_timeout_s": verify.probe_timeout, "verify_timeout_s": verify.timeout,
            "size_mib": verify.size_mib, "copies": verify.copies, "samples": verify.samples}


def placement_json(provisioned: Provisioned) -> dict:
    """Where the guest sits on the host: per NUMA cell its vCPUs, host CPUs, emulator CPUs and
    memory, the hugepage size, and the guest's PCIe layout (attach's result carries it)."""
    spec = provisioned.spec
    return {"cells": [{"node": c.node, "vcpus": list(c.vcpus), "host_cpus": list(c.host_cpus),
                       "emulator_cpus": list(c.emulator_cpus), "memory_kib": c.memory_kib,
                       "avoided": list(c.avoided)} for c in spec.cells],
            "hugepage_kib": spec.hugepage_kib, "guest_numa": spec.guest_cells,
            "layout": provisioned.layout_json()}
