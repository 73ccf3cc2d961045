#!/usr/bin/python
# Apache-2.0, like gpuvfio.
"""gpuvfio_domain: a libvirt guest with GPUs passed through: defined, running, or gone."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpuvfio_domain
short_description: Define, attach (start) and detach libvirt guests with GPUs passed through
description:
  - C(state=defined) builds the domain with gpuvfio (q35, OVMF, one root port per device,
    NUMA cells, pinning, hugepages, MMIO window) and defines it idempotently; an existing
    domain is compared with what gpuvfio would set, and redefined under its UUID only when
    it differs and C(update) is true. The devices are not bound; use M(gpuvfio_device).
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
  name:
    description: Domain name.
    type: str
    required: true
  state:
    description: Where the guest should be.
    type: str
    choices: [defined, running, absent]
    default: defined
  devices:
    description: PCI addresses of the GPUs the guest gets (other functions of the same slot follow).
    type: list
    elements: str
    default: []
  uri:
    description: libvirt URI. Default C($LIBVIRT_DEFAULT_URI) or C(qemu:///system).
    type: str
  update:
    description: Redefine an existing gpuvfio domain that differs (C(state=defined)).
    type: bool
    default: true
  vcpus:
    description: Guest vCPUs.
    type: int
    default: 4
  memory:
    description: Guest memory (C(64G), C(65536M)).
    type: str
    default: 8G
  hugepages:
    description: Backing pages.
    type: str
    choices: [auto, 1G, 2M, none]
    default: auto
  numa:
    description: C(auto), C(none) or a host NUMA node number.
    type: str
    default: auto
  firmware:
    description: Guest firmware.
    type: str
    choices: [efi, bios]
    default: efi
  virt_type:
    description: C(kvm), or C(qemu) (TCG) on hosts without KVM.
    type: str
    choices: [kvm, qemu]
    default: kvm
  hide_kvm:
    description: Hide the hypervisor from the guest driver.
    type: bool
    default: false
  mdev:
    description: Legacy mdev vGPU type instead of the whole GPU.
    type: str
  vgpu:
    description: SR-IOV vGPU type instead of the whole GPU.
    type: str
  uuid:
    description: mdev UUID (default derived from name, GPU and type).
    type: str
  disk:
    description: Boot disk image (absolute path).
    type: path
  kernel:
    description: Direct kernel boot (absolute path).
    type: path
  initrd:
    description: initrd for direct kernel boot.
    type: path
  cmdline:
    description: Kernel command line for direct kernel boot.
    type: str
  network:
    description: libvirt network to attach.
    type: str
  ssh_forward_port:
    description: QEMU user networking with host C(127.0.0.1:PORT) forwarded to the guest's port 22.
    type: int
  force:
    description: Share cores or accept short hugepages; with C(state=running) also overridable bind refusals.
    type: bool
    default: false
  stop_services:
    description: With C(state=running), stop NVIDIA services that hold the GPU while binding.
    type: bool
    default: false
  verify:
    description: With C(state=running), run gpuvfio's in-guest checks after SSH answers.
    type: bool
    default: true
  keep_on_failure:
    description: With C(state=running), keep a failed attach for inspection instead of undoing it.
    type: bool
    default: false
  boot_timeout:
    description: Seconds to wait for the guest's SSH.
    type: float
    default: 300.0
  stop_timeout:
    description: With C(state=absent), seconds of ACPI shutdown before destroy.
    type: float
    default: 60.0
  restore_devices:
    description: With C(state=absent), give the devices back to their host drivers.
    type: bool
    default: true
  ssh_host:
    description: Guest address (default discovered through libvirt).
    type: str
  ssh_port:
    description: Guest SSH port.
    type: int
  ssh_user:
    description: Guest user.
    type: str
    default: root
  ssh_key:
    description: Private key file on the managed host.
    type: path
  ssh_private_key:
    description: Private key content (kept out of logs); written to a mode 0600 temp file for the task.
    type: str
  known_hosts:
    description: Pinned guest host keys.
    type: path
  trust_on_first_use:
    description: Accept and record an unknown guest host key.
    type: bool
    default: false
requirements:
  - gpuvfio and libvirt-python importable by the module's interpreter
author:
  - gpuvfio contributors
"""

EXAMPLES = r"""
- name: Define train-0 with GPU 0
  gpuvfio_domain:
    name: train-0
    devices: ["0000:18:00.0"]
    vcpus: 16
    memory: 64G
    disk: /var/lib/libvirt/images/train-0.qcow2

- name: Start it, wait for SSH and verify the GPU inside
  gpuvfio_domain:
    name: train-0
    devices: ["0000:18:00.0"]
    state: running
    ssh_private_key: "{{ vault_guest_key }}"
    known_hosts: /etc/gpuvfio/known_hosts

- name: Detach it
  gpuvfio_domain:
    name: train-0
    state: absent
"""

RETURN = r"""
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
from ansible.module_utils.gpuvfio_common import (COMMON_ARGS, GpuvfioError, actions_for, fail_gpuvfio,
                                                 known_hosts_file, parse_addresses, private_key_file,
                                                 require_gpuvfio, state_dir, write_host, writer_for)


def domain_options(params):
    from gpuvfio.domainspec import DomainOptions
    from gpuvfio.sizes import parse_size_kib

    return DomainOptions(name=params["name"], vcpus=params["vcpus"], memory_kib=parse_size_kib(params["memory"]),
                         hugepages=params["hugepages"], numa=params["numa"], firmware=params["firmware"],
                         hide_kvm=params["hide_kvm"], mdev=params["mdev"], vgpu=params["vgpu"], uuid=params["uuid"],
                         disk=params["disk"], kernel=params["kernel"], initrd=params["initrd"],
                         cmdline=params["cmdline"], network=params["network"], virt_type=params["virt_type"],
                         ssh_forward_port=params["ssh_forward_port"], force=params["force"])


def build_xml(module, host, addresses, options):
    from gpuvfio.domainspec import build_spec
    from gpuvfio.domainxml import domain_xml
    from gpuvfio.inventory import read_inventory
    from gpuvfio.numa import read_numa
    from gpuvfio.pciids import PciIds

    inventory = read_inventory(host, names=PciIds.load(host.root))
    spec = build_spec(host, inventory, read_numa(host), addresses, options)
    for warning in spec.warnings:
        module.warn(warning)
    return domain_xml(spec), spec


def current_xml(dom) -> str:
    from gpuvfio import guests

    libvirt = guests._libvirt()
    return dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)


def xml_diff(before: str, after: str, name: str) -> dict:
    return {"before_header": f"domain {name} (libvirt now)", "after_header": f"domain {name} (gpuvfio)",
            "before": before, "after": after}


def ensure_ours(dom, name: str) -> None:
    from gpuvfio import guests
    from gpuvfio.errors import InputError

    if dom is not None and not guests.made_by_gpuvfio(dom):
        raise InputError(f"domain {name} exists and was not created by gpuvfio; pick another name")


def bind_step_for(module, host, uri, name):
    """Bind for attach: nothing to do is fine even when our own domain already names the devices."""
    from gpuvfio import bindcmd
    from gpuvfio.libvirt_domains import domain_lookup

    lookup = domain_lookup(uri) if uri else None

    def others_using(addresses):
        used = lookup(addresses) if lookup else None
        if used is None:
            return None
        return {a: [n for n in names if n != name] for a, names in used.items()}

    def bind_step(devices):
        kwargs = dict(writer=writer_for(host, 10.0), actions=actions_for(host), force=module.params["force"],
                      stop_services=module.params["stop_services"],
                      domains_using=others_using if lookup else None)
        plan = bindcmd.bind(host, devices, dry_run=True, **kwargs)
        if plan.get("result") == "nothing_to_do":
            return plan
        return bindcmd.bind(host, devices, **kwargs)

    return bind_step


def restore_step_for(module, host):
    """Give back only what gpuvfio's journal holds (devices on vfio-pci before stay)."""
    from gpuvfio import bindcmd
    from gpuvfio.journal import Journal

    def restore(addresses):
        held = set(Journal.load(state_dir(host)).devices)
        mine = [a for a in addresses if str(a) in held]
        if not mine:
            return {"restored": {}}
        return bindcmd.restore(host, mine, writer=writer_for(host, 10.0), actions=actions_for(host))

    return restore


def ssh_target(module, key_file):
    from gpuvfio.ssh import SshTarget

    params = module.params
    if not params["ssh_host"]:
        if params["ssh_forward_port"]:
            return SshTarget("127.0.0.1", params["ssh_forward_port"], params["ssh_user"], key_file,
                             params["known_hosts"], params["trust_on_first_use"])
        return None
    return SshTarget(params["ssh_host"], params["ssh_port"] or 22, params["ssh_user"], key_file,
                     params["known_hosts"], params["trust_on_first_use"])


def defined(module, host, conn, uri, addresses) -> dict:
    from gpuvfio import guests
    from gpuvfio.define import define

    name = module.params["name"]
    xml, _spec = build_xml(module, host, addresses, domain_options(module.params))
    dom = guests.lookup(conn, name)
    ensure_ours(dom, name)
    before = current_xml(dom) if dom is not None else ""
    report = define(xml, uri, update=module.params["update"], dry_run=module.check_mode)
    outcome = report["result"]
    changed = outcome in ("defined", "updated", "would_define") or (
        outcome == "differs" and module.params["update"] and module.check_mode)
    if outcome == "differs" and not module.params["update"]:
        module.warn(f"domain {name} differs from what gpuvfio would define and update=false: left as it is "
                    f"({len(report['changes'])} differences, see define.changes)")
    result = {"changed": changed, "xml": xml, "define": report}
    if changed:
        result["diff"] = xml_diff(before, xml, name)
    return result


def running(module, host, conn, uri, addresses) -> dict:
    from gpuvfio import bindcmd, guests
    from gpuvfio.attach import attach
    from gpuvfio.define import difference
    from gpuvfio.errors import InputError

    params = module.params
    name = params["name"]
    options = domain_options(params)
    xml, spec = build_xml(module, host, addresses, options)
    dom = guests.lookup(conn, name)
    ensure_ours(dom, name)
    before = current_xml(dom) if dom is not None else ""
    if dom is not None and dom.isActive():
        changes = difference(xml, before)
        if changes:
            raise InputError(f"domain {name} is running with a different definition ({len(changes)} differences: "
                             f"{'; '.join(changes[:3])}); detach it (state=absent) first")
        return {"changed": False, "xml": xml, "state": "running"}
    result = {"changed": True, "xml": xml, "diff": xml_diff(before, xml, name)}
    if module.check_mode:
        assigned = parse_addresses(spec.host_devices)
        plan = {"define": "redefine" if dom is not None else "define", "start": True,
                "wait_for_ssh": True, "verify": params["verify"]}
        if assigned:
            plan["bind"] = bindcmd.bind(host, assigned, writer=writer_for(host, 10.0), actions=actions_for(host),
                                        force=params["force"], stop_services=params["stop_services"],
                                        dry_run=True)
        result["plan"] = plan
        return result
    with private_key_file(module) as key_file:
        outcome = attach(host, addresses, options, conn=conn, ssh=ssh_target(module, key_file),
                         bind_step=bind_step_for(module, host, uri, name),
                         restore_step=restore_step_for(module, host), verify=params["verify"],
                         keep_on_failure=params["keep_on_failure"], boot_timeout=params["boot_timeout"],
                         known_hosts_default=known_hosts_file(host))
    result["attach"] = outcome.to_json()
    if not outcome.ok:
        failing = [c["id"] for c in (outcome.report or {}).get("checks", []) if c["status"] == "fail"]
        module.fail_json(msg=f"{name} is running but verification failed: {', '.join(failing)}", **result)
    return result


def absent(module, host, conn) -> dict:
    from gpuvfio import guests
    from gpuvfio.attach import detach, domain_devices

    name = module.params["name"]
    dom = guests.lookup(conn, name)
    if dom is None:
        return {"changed": False}
    ensure_ours(dom, name)
    before = current_xml(dom)
    result = {"changed": True, "diff": xml_diff(before, "", name)}
    if module.check_mode:
        result["plan"] = {"stop": bool(dom.isActive()), "undefine": True,
                          "restore": [str(a) for a in domain_devices(dom)] if module.params["restore_devices"]
                          else []}
        return result
    restore = restore_step_for(module, host) if module.params["restore_devices"] else None
    result["detach"] = detach(conn, name, restore_step=restore, timeout=module.params["stop_timeout"])
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            COMMON_ARGS,
            name=dict(type="str", required=True),
            state=dict(type="str", choices=["defined", "running", "absent"], default="defined"),
            devices=dict(type="list", elements="str", default=[]),
            uri=dict(type="str"),
            update=dict(type="bool", default=True),
            vcpus=dict(type="int", default=4),
            memory=dict(type="str", default="8G"),
            hugepages=dict(type="str", choices=["auto", "1G", "2M", "none"], default="auto"),
            numa=dict(type="str", default="auto"),
            firmware=dict(type="str", choices=["efi", "bios"], default="efi"),
            virt_type=dict(type="str", choices=["kvm", "qemu"], default="kvm"),
            hide_kvm=dict(type="bool", default=False),
            mdev=dict(type="str"),
            vgpu=dict(type="str"),
            uuid=dict(type="str"),
            disk=dict(type="path"),
            kernel=dict(type="path"),
            initrd=dict(type="path"),
            cmdline=dict(type="str"),
            network=dict(type="str"),
            ssh_forward_port=dict(type="int"),
            force=dict(type="bool", default=False),
            stop_services=dict(type="bool", default=False),
            verify=dict(type="bool", default=True),
            keep_on_failure=dict(type="bool", default=False),
            boot_timeout=dict(type="float", default=300.0),
            stop_timeout=dict(type="float", default=60.0),
            restore_devices=dict(type="bool", default=True),
            ssh_host=dict(type="str"),
            ssh_port=dict(type="int"),
            ssh_user=dict(type="str", default="root"),
            ssh_key=dict(type="path"),
            ssh_private_key=dict(type="str", no_log=True),
            known_hosts=dict(type="path"),
            trust_on_first_use=dict(type="bool", default=False),
        ),
        mutually_exclusive=[("mdev", "vgpu"), ("ssh_key", "ssh_private_key"), ("disk", "kernel")],
        supports_check_mode=True,
    )
    require_gpuvfio(module)
    from gpuvfio import guests
    from gpuvfio.define import default_uri

    state = module.params["state"]
    uri = module.params["uri"] or default_uri()
    try:
        addresses = parse_addresses(module.params["devices"])
        host = write_host(module)
        conn = guests.connect(uri)
        try:
            if state == "defined":
                result = defined(module, host, conn, uri, addresses)
            elif state == "running":
                result = running(module, host, conn, uri, addresses)
            else:
                result = absent(module, host, conn)
        finally:
            conn.close()
    except GpuvfioError as exc:
        fail_gpuvfio(module, exc)
    if not module._diff:
        result.pop("diff", None)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
