#!/usr/bin/python
# Apache-2.0, like gpuvfio.
"""gpuvfio.gpuvfio.domain: a libvirt guest with GPUs passed through: defined, running, or gone."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: domain
short_description: Define, attach (start) and detach libvirt guests with GPUs passed through
description:
  - C(state=defined) builds the domain with gpuvfio (q35, OVMF, one root port per device,
    NUMA cells, pinning, hugepages, MMIO window) and defines it idempotently; an existing
    domain is compared with what gpuvfio would set, and redefined under its UUID only when
    it differs and C(update) is true. The devices are not bound; use M(gpuvfio.gpuvfio.device).
  - C(state=running) is C(gpuvfio attach) - bind, define, start, wait for SSH, verify
    (C(verify=false) skips the checks, not the SSH wait), everything undone on failure.
    A guest that already runs with the same definition is left alone.
  - C(state=absent) is C(gpuvfio detach) - stop (ACPI, then destroy), undefine if gpuvfio
    defined it, and give the devices gpuvfio holds back to their drivers.
  - Check mode returns the plan (bind plan, define result, what would start or stop).
    With C(--diff) the domain XML before and after is shown.
options:
  root:
    description: The host as a directory that looks like C(/).
    type: str
    default: /
  state_dir:
    description: gpuvfio's state directory (journal, lock, known_hosts). Default C(<root>/var/lib/gpuvfio).
    type: path
  state:
    description: Where the guest should be.
    type: str
    choices: [defined, running, absent]
    default: defined
  devices:
    description:
      - The GPUs the guest gets (other functions of the same slot follow), as the gpuvfio command
        takes them - C(DDDD:BB:SS.F), an lspci slot (C(18:00)) or a libvirt node-device name.
        Quote them - YAML reads an unquoted C(18:00) as the number 1080.
    type: list
    elements: str
    default: []
  device_ids:
    description: GPUs by PCI ids, as C(lspci -d) (C(10de:2330)); with C(devices), only those both select.
    type: list
    elements: str
    default: []
  all_matched:
    description: With C(state=running), bind every device a slot or C(device_ids) matched when they are more than
      one physical device (the command's C(--yes)); without it such a task fails and names what matched.
    type: bool
    default: false
  update:
    description: Redefine an existing gpuvfio domain that differs (C(state=defined)).
    type: bool
    default: true
  verify:
    description: With C(state=running), run gpuvfio's in-guest checks after SSH answers.
    type: bool
    default: true
  keep_on_failure:
    description: With C(state=running), keep a failed attach for inspection instead of undoing it.
    type: bool
    default: false
  restore_devices:
    description: With C(state=absent), give the devices back to their host drivers.
    type: bool
    default: true
  # Generated from gpuvfio/options.py by python -m gpuvfio.cli.generate: edit the table there.
  name:
    description: >-
      Domain name.
    type: str
    required: true
  vcpus:
    description: >-
      Guest vCPUs.
    type: int
    default: 4
  memory:
    description: >-
      Guest memory: 64G, 64GiB, 65536M (a bare number in the spec: MiB).
    type: str
    default: "8G"
  hugepages:
    description: >-
      Backing pages: auto | none | 4K | 2M | 1G (also spelled 1g, 2MiB).
    type: str
    default: "auto"
  numa:
    description: >-
      auto | none | remote (a node without the devices) | a host NUMA node number.
    type: str
    default: "auto"
  firmware:
    description: >-
      efi (UEFI: libvirt picks it from QEMU's firmware descriptors) | bios
    type: str
    default: "efi"
    choices: ["efi", "bios"]
  virt_type:
    description: >-
      kvm | qemu (TCG, for hosts without KVM)
    type: str
    default: "kvm"
    choices: ["kvm", "qemu"]
  loader:
    description: >-
      UEFI code image by path instead of libvirt's choice (with C(nvram_template)).
    type: path
  nvram_template:
    description: >-
      UEFI variables template (with C(loader)).
    type: path
  rom_bar:
    description: >-
      Show the GPUs' ROM BAR to the guest or hide it (off: the usual fix for a GPU that drove the host
      console); default libvirt's (shown).
    type: str
    choices: ["on", "off"]
  rom_file:
    description: >-
      A ROM image (a dumped, clean VBIOS) the guest sees instead of the GPU's own.
    type: path
  hide_kvm:
    description: >-
      Hide the hypervisor from the guest driver.
    type: bool
    default: false
  mdev:
    description: >-
      Legacy mdev vGPU type instead of the whole GPU.
    type: str
  vgpu:
    description: >-
      SR-IOV vGPU type instead of the whole GPU.
    type: str
  uuid:
    description: >-
      mdev UUID (default: xml derives it from the domain name, GPU and type; vgpu create takes a random one).
    type: str
  disk:
    description: >-
      Boot disk image (absolute path).
    type: path
  kernel:
    description: >-
      Direct kernel boot (absolute path).
    type: path
  initrd:
    description: >-
      initrd for direct kernel boot (with C(kernel)).
    type: path
  cmdline:
    description: >-
      Kernel command line for direct kernel boot (one line).
    type: str
  network:
    description: >-
      libvirt network to attach.
    type: str
  user_net_ssh_port:
    description: >-
      QEMU user networking, 127.0.0.1:PORT -> guest:22.
    type: int
    aliases: ["ssh_forward_port"]
  console_log:
    description: >-
      Also write the guest's serial console to this host file.
    type: path
  force:
    description: >-
      Share cores / accept short hugepages; an attach also overrides the overridable bind checks.
    type: bool
    default: false
  topology:
    description: >-
      auto | mirror | flat: mirror the host's PCIe switches and root complexes in the guest (auto: for two or
      more devices).
    type: str
    default: "auto"
    choices: ["auto", "mirror", "flat"]
  p2p:
    description: >-
      auto | off | force: P2P cliques (x-nv-gpudirect-clique) for GPUs in IOMMU groups of their own, as far
      apart as NCCL's default P2P level allows on this CPU, of one architecture, never for GeForce or TITAN
      cards or device ids gpuvfio does not know; force: as far as the IOMMU groups allow, those cards too (the
      plan warns).
    type: str
    default: "auto"
    choices: ["auto", "off", "force"]
  qemu_version:
    description: >-
      QEMU version the domain will run on (default: asked from libvirt when a connection is used).
    type: str
  replace_nccl_topo_file:
    description: >-
      Let the guest's /etc/nccl.conf name gpuvfio's NCCL topology file where the admin's names another (which
      is kept and reported otherwise).
    type: bool
    default: false
  ssh_host:
    description: >-
      Guest address (default: discovered through libvirt).
    type: str
  ssh_port:
    description: >-
      Guest SSH port (default: discovered, else 22).
    type: int
  ssh_user:
    description: >-
      Guest user (default: the SSH config's User, else root).
    type: str
  ssh_key:
    description: >-
      Private key file.
    type: path
  ssh_private_key:
    description: >-
      Private key content (kept out of logs); written to a mode 0600 temp file for the task.
    type: str
  ssh_config:
    description: >-
      An ssh_config file instead of ~/.ssh/config (Host aliases, HostName, User, Port, IdentityFile,
      UserKnownHostsFile, ProxyJump).
    type: path
  known_hosts:
    description: >-
      Pinned host keys.
    type: path
  trust_on_first_use:
    description: >-
      Accept and record an unknown host key.
    type: bool
    default: false
  boot_timeout:
    description: >-
      Seconds from start until SSH answers.
    type: float
    default: 300.0
  bandwidth:
    description: >-
      Measure the copies (host to device, device to host, device to device).
    type: bool
    default: true
  link_efficiency:
    description: >-
      Share of the slot's raw link rate each copy must reach, instead of the default floors: 90% of what
      healthy cards of the slot's generation measure (Gen3 x16 10.8, Gen4 21.5, Gen5 47.7 GB/s).
    type: float
  min_gbps:
    description: >-
      Absolute bandwidth floor per direction in GB/s, instead of C(link_efficiency).
    type: float
  size_mib:
    description: >-
      Copy buffer in MiB (default 512, as nvbandwidth).
    type: int
  copies:
    description: >-
      Copies per sample (default 16).
    type: int
  samples:
    description: >-
      Samples, median reported (default 3).
    type: int
  probe_timeout:
    description: >-
      Allow the in-guest probe this long (slow, emulated guests).
    type: float
    default: 120.0
  verify_timeout:
    description: >-
      Allow the in-guest verifier (bandwidth runs) this long.
    type: float
    default: 600.0
  connect:
    description: >-
      The libvirt URI (default: libvirt's own, LIBVIRT_DEFAULT_URI or qemu:///system; for a testbed, its
      spec's [run] connect); one that would make libvirt run a program or skip a check (the ext and SSH
      transports, command=, netcat=, no_verify= and the like) is refused unless GPUVFIO_ALLOW_UNSAFE_URI=1.
      none asks no libvirt: what can do without it goes on without (bind, unbind, reset, vgpu list and the
      device module do not ask which domains use the devices; xml without --define, verify with --ssh-host),
      what needs it refuses none.
    type: str
    aliases: ["uri", "libvirt_uri"]
  stop_services:
    description: >-
      Stop NVIDIA services that hold the GPU while binding (nvidia-persistenced, fabricmanager, DCGM); restore
      restarts them.
    type: bool
    default: false
  take_host_devices:
    description: >-
      DANGEROUS: take from the host what it runs on (a mounted disk, swap, an interface with its routes or
      addresses, its console) when binding; the host loses it.
    type: bool
    default: false
  stop_timeout:
    description: >-
      Seconds for the guest's ACPI shutdown before it is destroyed (0: destroyed at once).
    type: float
    default: 60.0
  # End of the generated options.
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: "Returns the plan (the domain XML, the binds, the attach steps) and changes nothing; a refused plan fails as the real run would."
  diff_mode:
    support: full
    details: "The domain XML before and after."
  platform:
    platforms: posix
    details: "Linux hosts (sysfs, vfio-pci, libvirt)."
requirements:
  - gpuvfio and libvirt-python importable by the module's interpreter
author:
  - gpuvfio contributors (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Define train-0 with GPU 0
  gpuvfio.gpuvfio.domain:
    name: train-0
    devices: ["0000:18:00.0"]
    vcpus: 16
    memory: 64G
    disk: /var/lib/libvirt/images/train-0.qcow2

- name: Start it, wait for SSH and verify the GPU inside
  gpuvfio.gpuvfio.domain:
    name: train-0
    devices: ["0000:18:00.0"]
    state: running
    ssh_private_key: "{{ vault_guest_key }}"
    known_hosts: /etc/gpuvfio/known_hosts

- name: Detach it
  gpuvfio.gpuvfio.domain:
    name: train-0
    state: absent
"""

RETURN = r"""
selected:
  description: What a slot or C(device_ids) expanded to, when the task binds (C(state=running)).
  returned: when a selector was expanded for state=running
  type: list
  elements: str
xml:
  description: The domain XML gpuvfio builds.
  returned: when state is defined or running
  type: str
define:
  description: gpuvfio's define result (C(defined), C(unchanged), C(differs), C(updated), C(would_define)) and changes.
  returned: when state is defined
  type: dict
attach:
  description: gpuvfio's attach result (steps, verify report, SSH target, rollback).
  returned: when state is running and the guest was started
  type: dict
detach:
  description: gpuvfio's detach report.
  returned: when state is absent and the domain existed
  type: dict
plan:
  description: In check mode, what would happen.
  returned: in check mode when something would change
  type: dict
"""


from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpuvfio.gpuvfio.plugins.module_utils.common import (
    COMMON_ARGS, DEVICE_ARGS, HAS_GPUVFIO, GpuvfioError, check_devices, check_libvirt_uri, fail_gpuvfio,
    finish, guest_ssh, private_key_file, require_gpuvfio, resolve_devices, table_values, task_context,
)
from ansible_collections.gpuvfio.gpuvfio.plugins.module_utils.options import ARGUMENT_SPECS

if HAS_GPUVFIO:
    from gpuvfio.errors import Refused
    from gpuvfio.ops import attach_plan, binding, domains, guests


def domain_request(params):
    return domains.domain_request(**table_values(params, "domain"))


def build(module, ctx, addresses, existing, uri):
    provisioned = domains.provision_xml(ctx, addresses, domain_request(module.params), replacing=existing, uri=uri,
                                        ask_libvirt=True)
    for warning in provisioned.spec.warnings:
        module.warn(warning)
    return provisioned


def xml_diff(before: str, after: str, name: str) -> dict:
    return {"before_header": f"domain {name} (libvirt now)", "after_header": f"domain {name} (gpuvfio)",
            "before": before, "after": after}


def policy(params):
    return binding.BindPolicy(force=params["force"], stop_services=params["stop_services"],
                              take_host_devices=params["take_host_devices"])


def defined(module, ctx, uri, addresses) -> dict:
    name = module.params["name"]
    existing = domains.existing_domain(ctx, name, uri=uri)
    provisioned = build(module, ctx, addresses, existing, uri)
    before = existing.xml if existing is not None else ""
    # The define's own plan (gpuvfio.ops.domains.plan_define): check mode returns it, the run
    # carries it out; someone else's domain of that name is refused in the plan's words.
    plan = domains.plan_define(ctx, provisioned.xml, uri=uri, update=module.params["update"])
    if plan.refused and plan.held is None:
        raise plan.refusal()
    report = plan.to_json()["define"]
    outcome = report["result"]
    if not module.check_mode and not plan.refused:
        report = domains.run_define(ctx, plan).to_json()
    changed = report["result"] in ("defined", "updated", "would_define", "would_update")
    if outcome == "differs":
        module.warn(f"domain {name} differs from what gpuvfio would define and update=false: left as it is "
                    f"({len(report['changes'])} differences, see define.changes)")
    result = {"changed": changed, "xml": provisioned.xml, "define": report}
    if changed:
        result["diff"] = xml_diff(before, provisioned.xml, name)
    return result


def running(module, ctx, uri, addresses) -> dict:
    params = module.params
    name = params["name"]
    # checked first, in check mode too: a bad gate is bad input wherever it would be used
    checks = guests.verify_options(**table_values(params, "verify"))
    checks = checks if params["verify"] else None
    existing = domains.existing_domain(ctx, name, uri=uri)
    provisioned = build(module, ctx, addresses, existing, uri)
    before = existing.xml if existing is not None else ""
    if existing is not None and existing.active:
        changes = domains.differences(provisioned.xml, existing.xml)
        if changes:
            raise Refused(f"domain {name} is running with a different definition ({len(changes)} differences: "
                          f"{'; '.join(changes[:3])}); detach it (state=absent) first")
        return {"changed": False, "xml": provisioned.xml, "state": "running"}
    result = {"changed": True, "xml": provisioned.xml, "diff": xml_diff(before, provisioned.xml, name)}
    if module.check_mode:
        # attach's own plan (gpuvfio.ops.attach_plan), as attach --dry-run prints it: a refusal
        # in it fails the task here as the run would, in the run's words. The key is not
        # written out for a plan (ssh_private_key stays in memory).
        ssh = guest_ssh(module, params["ssh_key"], "boot_timeout")
        plan = attach_plan.plan_attach(ctx, addresses, domain_request(params), ssh=ssh, uri=uri,
                                       policy=policy(params), verify=checks)
        result["plan"] = plan.to_json()
        plan.raise_if_refused()
        return result
    with private_key_file(module) as key_file:
        ssh = guest_ssh(module, key_file, "boot_timeout")
        outcome = guests.attach(ctx, addresses, domain_request(params), uri=uri, ssh=ssh,
                                policy=policy(params), verify=checks, keep_on_failure=params["keep_on_failure"])
    result["attach"] = outcome.to_json()
    if not outcome.ok:
        failing = [c.check_id for c in outcome.report.failed] if outcome.report is not None else []
        module.fail_json(msg=f"{name} is running but verification failed: {', '.join(failing)}", **result)
    return result


def absent(module, ctx, uri) -> dict:
    name = module.params["name"]
    existing = domains.existing_domain(ctx, name, uri=uri)
    if existing is None:
        return {"changed": False}
    result = {"changed": True, "diff": xml_diff(existing.xml, "", name)}
    if module.check_mode:  # detach's own plan, as detach --dry-run prints it
        plan = guests.plan_detach(ctx, name, uri=uri, timeout=module.params["stop_timeout"],
                                  restore=module.params["restore_devices"])
        result["plan"] = plan.to_json()
        plan.raise_if_refused()
        return result
    result["detach"] = guests.detach(ctx, name, uri=uri, timeout=module.params["stop_timeout"],
                                     restore=module.params["restore_devices"]).to_json()
    return result


def main(context_factory=None) -> None:
    """``context_factory(host)``: the gpuvfio Context for the task (the live one by default)."""
    module = AnsibleModule(
        argument_spec=dict(
            COMMON_ARGS,
            **DEVICE_ARGS,
            **ARGUMENT_SPECS["gpuvfio.gpuvfio.domain"],  # the domain, SSH and verify options gpuvfio.options declares
            state=dict(type="str", choices=["defined", "running", "absent"], default="defined"),
            update=dict(type="bool", default=True),
            verify=dict(type="bool", default=True),
            keep_on_failure=dict(type="bool", default=False),
            restore_devices=dict(type="bool", default=True),
        ),
        mutually_exclusive=[("mdev", "vgpu"), ("ssh_key", "ssh_private_key"), ("disk", "kernel")],
        supports_check_mode=True,
    )
    require_gpuvfio(module)
    state = module.params["state"]
    uri = module.params["connect"]
    selected: list = []
    result = {}
    try:
        check_libvirt_uri(module, "connect")
        check_devices(module, required=False)
        with task_context(module, context_factory, writable=True) as ctx:
            if state != "absent":
                addresses = resolve_devices(module, ctx, changes=state == "running", selected=selected)
            if state == "defined":
                result = defined(module, ctx, uri, addresses)
            elif state == "running":
                result = running(module, ctx, uri, addresses)
            else:
                result = absent(module, ctx, uri)
    except GpuvfioError as exc:
        fail_gpuvfio(module, exc, selected=selected)
    finish(module, result, selected)


if __name__ == "__main__":
    main()
