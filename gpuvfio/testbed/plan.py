"""gpuvfio testbed plan: what each variant provisions, without touching anything.

Built from the same services the run uses (ops.domains for the domain, ops.binding for the
bind plan with the variant's policy), so a plan refuses exactly what the run would refuse.
"""

from __future__ import annotations

import difflib
import re

from typing import Callable

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.ops import binding, domains, vgpu
from gpuvfio.ops.binding import BindPolicy
from gpuvfio.ops.attach_plan import plan_attach
from gpuvfio.ops.context import Context
from gpuvfio.ops.plans import PlannedStep
from gpuvfio.ops.targets import SshOptions, ssh_options
from gpuvfio.ops.verify_options import verify_options
from gpuvfio.ops.selection import resolve, the_gpu
from gpuvfio.testbed.spec import Spec, Variant, boot_timeout, guest_request_args

DOMAIN_PREFIX = "gpuvfio-tb-"
DIGEST = re.compile(r"digest='sha256:[0-9a-f]{64}'")


def domain_name(variant_name: str) -> str:
    return f"{DOMAIN_PREFIX}{variant_name}"


def gpus_on(ctx: Context, spec: Spec, *, yes: bool = False, tell: Callable[[str], None] = lambda line: None
            ) -> list[PciAddress]:
    """The GPUs ``[run] gpus`` and ``gpu_ids`` mean on the hypervisor, as every device argument
    (ops.selection): what a slot or an id filter expanded to is told, and more than one physical
    device needs ``yes`` (testbed plan/run --yes; the plan refuses what the run would)."""
    return resolve(ctx.host, spec.gpus, spec.gpu_ids, changes=True, yes=yes, tell=tell)


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
        return [the_gpu(ctx.host, gpus)]
    except InputError as exc:
        raise InputError(f"variant {variant.name}: {exc}") from None


def ssh_for(spec: Spec, timeout: float | None = None) -> SshOptions:
    """The guest's SSH target as [ssh] names it (``timeout``: until SSH answers; the boot
    timeout of the spec by default)."""
    ssh = spec.ssh
    return ssh_options(host=ssh.get("host", "127.0.0.1" if "port" in ssh else None), port=ssh.get("port"),
                       user=ssh.get("user", "root"), key=ssh.get("key"), known_hosts=ssh.get("known_hosts"),
                       trust_on_first_use=ssh.get("trust_on_first_use", False),
                       timeout=boot_timeout(spec) if timeout is None else timeout)


def policy_for(variant: Variant) -> BindPolicy:
    return BindPolicy(force=variant.force, stop_services=variant.stop_services,
                      take_host_devices=variant.take_host_devices)


def plan(ctx: Context, spec: Spec, *, uri: str | None = None, yes: bool = False) -> dict:
    """Each variant: its domain (XML, and its difference to the first variant's), its bind plan
    with the checks that refuse it, its vGPU. ``refused``: the variants the run would refuse."""
    selected: list[str] = []
    gpus = gpus_on(ctx, spec, yes=yes, tell=selected.append)
    out = {"spec": spec.path, "repetitions": spec.repetitions, "gpus": [str(g) for g in gpus],
           "selected": selected, "variants": [], "refused": []}
    first_xml = first_name = None
    for variant in spec.variants:
        entry = {"name": variant.name, "kind": variant.kind}
        if variant.kind == "baremetal":
            entry["action"] = "run the verifier on this host (the baseline)"
            out["variants"].append(entry)
            continue
        addresses = addresses_for(ctx, gpus, variant)
        try:
            request = request_for(ctx, spec, variant, gpus)
        except GpuvfioError as exc:
            if isinstance(exc, InputError):
                raise InputError(f"variant {variant.name}: {exc}") from None
            entry["refused"] = [str(exc)]
            out["refused"].append(variant.name)
            out["variants"].append(entry)
            continue
        # The run's own plan: the same libvirt, the same bind checks, the same steps.
        try:
            attach = plan_attach(ctx, addresses, request, ssh=ssh_for(spec), uri=uri, policy=policy_for(variant),
                                 verify=verify_options(**spec.verify),
                                 ask_libvirt=binding.libvirt_not_asked(ctx, uri) is None)
        except InputError as exc:
            raise InputError(f"variant {variant.name}: {exc}") from None
        if variant.kind == "vgpu":
            # Before the attach, as the run: the scheduler (NVML changes it only with no vGPU
            # VM running), then the instance the domain names.
            before = [PlannedStep("vgpu scheduler", f"{variant.scheduler} through NVML, put back after")] \
                if variant.scheduler else []
            attach.steps[:0] = before + [PlannedStep("vgpu create", f"a {variant.profile} instance on "
                                                                    f"{addresses[0]}")]
        entry["plan"] = attach.to_json()
        entry["refused"] = [c.message for c in attach.refusals]
        if attach.provisioned is None:
            out["refused"].append(variant.name)
            out["variants"].append(entry)
            continue
        provisioned = attach.provisioned
        spec_ = provisioned.spec
        entry.update({"domain": request.name, "hugepages_kib": spec_.hugepage_kib,
                      "numa_nodes": [c.node for c in spec_.cells], "warnings": spec_.warnings,
                      "xml": provisioned.xml})
        if variant.kind == "vgpu":
            mig = vgpu.mig_backed(variant.profile)
            entry["vgpu"] = {"profile": variant.profile, "mig_backed": mig.to_json() if mig is not None else None,
                             "scheduler": variant.scheduler,
                             "scheduler_note": (f"set to {variant.scheduler} through NVML before the variant, the "
                                                "previous policy put back after" if variant.scheduler else
                                                "left as the host driver has it")}
        if attach.bind is not None:
            entry["bind"] = attach.bind.report
        if entry["refused"]:
            out["refused"].append(variant.name)
        if first_xml is None:
            first_xml, first_name = provisioned.xml, variant.name
        else:
            entry["xml_diff"] = "".join(difflib.unified_diff(
                _comparable(first_xml, domain_name(first_name)), _comparable(provisioned.xml, request.name),
                first_name, variant.name))
        out["variants"].append(entry)
    return out


def _comparable(xml: str, name: str) -> list[str]:
    """Lines to diff between variants: without their names and gpuvfio's digest of each."""
    return DIGEST.sub("digest='...'", xml.replace(name, "NAME")).splitlines(True)
