"""``gpuvfio testbed plan``: what each variant provisions, without touching anything."""

from __future__ import annotations

import difflib

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError
from gpuvfio.hostroot import HostRoot
from gpuvfio.testbed.spec import Spec, Variant


def options_for(spec: Spec, variant: Variant, inventory, nodes):
    from gpuvfio.domainspec import DomainOptions
    from gpuvfio.sizes import parse_size_kib

    guest = spec.guest
    numa = variant.numa
    if numa == "remote":
        gpu_nodes = {inventory.functions[PciAddress.parse(g)].numa_node for g in spec.gpus
                     if PciAddress.parse(g) in inventory.functions}
        others = [n.node_id for n in nodes if n.node_id not in gpu_nodes]
        if not others:
            raise InputError(f"variant {variant.name}: numa = 'remote' needs a NUMA node without the GPUs")
        numa = str(others[0])
    options = DomainOptions(name=f"gpuvfio-tb-{variant.name}", vcpus=guest.get("vcpus", 4),
                            memory_kib=parse_size_kib(str(guest.get("memory", "8G"))), hugepages=variant.hugepages,
                            numa=numa, firmware=guest.get("firmware", "efi"), virt_type=guest.get("virt_type", "kvm"),
                            disk=guest.get("disk"), kernel=guest.get("kernel"), initrd=guest.get("initrd"),
                            cmdline=guest.get("cmdline"), network=guest.get("network"),
                            ssh_forward_port=spec.ssh.get("port"))
    if variant.kind == "vgpu":
        fn = inventory.functions.get(PciAddress.parse(spec.gpus[0]))
        if fn is not None and fn.mdev_types:
            options.mdev = variant.profile
        else:
            options.vgpu = variant.profile
    return options


def addresses_for(spec: Spec, variant: Variant) -> list[PciAddress]:
    return [PciAddress.parse(g) for g in spec.gpus] if variant.kind in ("passthrough", "vgpu") else []


def plan(host: HostRoot, spec: Spec) -> dict:
    from gpuvfio.bindplan import plan_bind
    from gpuvfio.domainspec import build_spec
    from gpuvfio.domainxml import domain_xml
    from gpuvfio.inventory import read_inventory
    from gpuvfio.kernel import read_kernel
    from gpuvfio.numa import read_numa
    from gpuvfio.pciids import PciIds

    inventory = read_inventory(host, names=PciIds.load(host.root))
    nodes = read_numa(host)
    kernel = read_kernel(host)
    out = {"spec": spec.path, "repetitions": spec.repetitions, "variants": []}
    first_xml = first_name = None
    for variant in spec.variants:
        entry = {"name": variant.name, "kind": variant.kind}
        if variant.kind == "baremetal":
            entry["action"] = "run the verifier on this host (the baseline)"
            out["variants"].append(entry)
            continue
        options = options_for(spec, variant, inventory, nodes)
        addresses = addresses_for(spec, variant)
        try:
            domain = build_spec(host, inventory, nodes, addresses, options)
        except InputError as exc:
            raise InputError(f"variant {variant.name}: {exc}") from None
        xml = domain_xml(domain)
        entry.update({"domain": options.name, "hugepages_kib": domain.hugepage_kib,
                      "numa_nodes": [c.node for c in domain.cells], "warnings": domain.warnings, "xml": xml})
        if variant.kind == "vgpu":
            from gpuvfio.vgpu import mig_backed

            entry["vgpu"] = {"profile": variant.profile, "mig_backed": mig_backed(variant.profile),
                             "scheduler": variant.scheduler,
                             "scheduler_note": (f"set to {variant.scheduler} through NVML before the variant, the "
                                                "previous policy put back after" if variant.scheduler else
                                                "left as the host driver has it")}
        if variant.kind == "passthrough" and addresses:
            entry["bind"] = plan_bind(host, inventory, kernel, addresses).to_json(host.root)
        if first_xml is None:
            first_xml, first_name = xml, variant.name
        else:
            entry["xml_diff"] = "".join(difflib.unified_diff(
                first_xml.replace(f"gpuvfio-tb-{first_name}", "NAME").splitlines(True),
                xml.replace(options.name, "NAME").splitlines(True), first_name, variant.name))
        out["variants"].append(entry)
    return out
