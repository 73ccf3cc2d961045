#!/usr/bin/python
# Apache-2.0, like gpuvfio.
"""gpuvfio.gpuvfio.facts: the host's GPUs, IOMMU groups and readiness, as facts."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: facts
short_description: GPU inventory, IOMMU groups and passthrough readiness of a KVM host
description:
  - Reads the host through gpuvfio's Python API (the data of C(gpuvfio list --json),
    C(gpuvfio doctor --json) and C(gpuvfio status --json)) and returns it as the fact
    C(ansible_facts.gpuvfio), with a summary (GPU count and models, viable and
    non-viable IOMMU groups, failed readiness checks).
  - Changes nothing; runs the same in check mode.
options:
  root:
    description:
      - The host as a directory that looks like C(/), or a gpuvfio host fixture file.
    type: str
    default: /
  state_dir:
    description:
      - gpuvfio's state directory (journal, lock). Default C(<root>/var/lib/gpuvfio).
    type: path
  gather:
    description: What to collect.
    type: list
    elements: str
    choices: [devices, doctor, status]
    default: [devices, doctor, status]
  all_functions:
    description: Every PCI function and group (C(gpuvfio list --all)), not only NVIDIA devices.
    type: bool
    default: false
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.facts
attributes:
  check_mode:
    support: full
    details: "Reads the host and changes nothing, the same in check mode."
  diff_mode:
    support: none
  platform:
    platforms: posix
    details: "Linux hosts (sysfs, vfio-pci, libvirt)."
  facts:
    support: full
requirements:
  - gpuvfio (Python package) importable by the module's interpreter
author:
  - gpuvfio contributors (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Collect GPU facts
  gpuvfio.gpuvfio.facts:

- name: Facts of a recorded host
  gpuvfio.gpuvfio.facts:
    root: /srv/fixtures/dgx-h100.host

- name: Show the GPUs
  ansible.builtin.debug:
    msg: "{{ ansible_facts.gpuvfio.summary.gpu_models }}"
"""

RETURN = r"""
ansible_facts:
  description: C(gpuvfio) fact.
  returned: always
  type: complex
  contains:
    gpuvfio:
      description: devices, groups, doctor, status and summary.
      type: dict
      returned: always
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpuvfio.gpuvfio.plugins.module_utils.common import (
    COMMON_ARGS, HAS_GPUVFIO, GpuvfioError, fail_gpuvfio, require_gpuvfio, task_context,
)

if HAS_GPUVFIO:
    from gpuvfio.ops import binding
    from gpuvfio.ops.inventory import ListReport, list_report
    from gpuvfio.ops.readiness import DoctorReport, doctor_report
    from gpuvfio.ops.health import first_reset_verdict, reset_verdicts


def summarize(listing: ListReport, doctor: DoctorReport | None, verdicts) -> dict:
    """The numbers a fleet report wants without walking every device."""
    gpus = [fn for fn in listing.devices if fn.is_nvidia_gpu and fn.physfn is None]
    groups = {g.group_id: g for g in listing.groups or []}
    models: dict[str, int] = {}
    for gpu in gpus:
        name = gpu.device_name or f"{gpu.vendor_id}:{gpu.device_id}"
        models[name] = models.get(name, 0) + 1
    gpu_groups = sorted({g.iommu_group for g in gpus if g.iommu_group is not None})
    summary = {
        "gpu_count": len(gpus),
        "gpu_models": models,
        "gpus": [{"address": str(g.address), "model": g.device_name, "driver": g.driver,
                  "iommu_group": g.iommu_group, "numa_node": g.numa_node,
                  "viable": groups[g.iommu_group].viable if g.iommu_group in groups else None,
                  "reset": first_reset_verdict(verdicts, g)}
                 for g in gpus],
        "drivers": sorted({g.driver or "none" for g in gpus}),
        "iommu_groups_present": listing.groups is not None,
        "viable_groups": [gid for gid in gpu_groups if gid in groups and groups[gid].viable],
        "non_viable_groups": [{"id": gid, "devices": [str(d) for d in groups[gid].devices],
                               "problems": list(groups[gid].problems)}
                              for gid in gpu_groups if gid in groups and not groups[gid].viable],
    }
    if doctor is not None:
        summary["doctor_failed"] = [c.check_id for c in doctor.failed]
        summary["doctor_warned"] = [c.check_id for c in doctor.warned]
        summary["ready"] = not summary["doctor_failed"]
    return summary


def main(context_factory=None) -> None:
    module = AnsibleModule(
        argument_spec=dict(COMMON_ARGS,
                           gather=dict(type="list", elements="str", choices=["devices", "doctor", "status"],
                                       default=["devices", "doctor", "status"]),
                           all_functions=dict(type="bool", default=False)),
        supports_check_mode=True,
    )
    require_gpuvfio(module)
    gather = set(module.params["gather"]) | {"devices"}  # the summary needs the listing
    facts: dict = {"root": module.params["root"]}
    try:
        with task_context(module, context_factory) as ctx:
            listing = list_report(ctx, show_all=module.params["all_functions"])
            facts.update(listing.to_json())
            doctor = doctor_report(ctx) if "doctor" in gather else None
            if doctor is not None:
                facts["doctor"] = doctor.to_json()
            if "status" in gather:
                status = binding.status(ctx).to_json()
                status.pop("state_dir", None)  # a temp dir for fixture files: not a fact
                facts["status"] = status
            verdicts = reset_verdicts(ctx)
            facts["reset_verdicts"] = verdicts.to_json()["models"]
            facts["reset_verdicts_error"] = verdicts.error
            facts["summary"] = summarize(listing, doctor, verdicts)
    except GpuvfioError as exc:
        fail_gpuvfio(module, exc)
    module.exit_json(changed=False, ansible_facts={"gpuvfio": facts})


if __name__ == "__main__":
    main()
