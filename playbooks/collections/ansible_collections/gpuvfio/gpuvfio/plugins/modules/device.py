#!/usr/bin/python
# Apache-2.0, like gpuvfio.
"""gpuvfio.gpuvfio.device: PCI devices on vfio-pci or back on their host drivers, now or across reboots."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: device
short_description: Bind GPUs to vfio-pci, give them back, or make the binding survive reboots
description:
  - C(state=vfio) moves the whole IOMMU group of each device to vfio-pci with gpuvfio's
    planner and executor (pre-checks, journal, rollback on failure), as C(gpuvfio bind).
  - C(state=host) returns the devices gpuvfio holds (and the other members of their IOMMU
    groups that gpuvfio moved) to exactly their recorded drivers, as C(gpuvfio restore).
  - C(state=persisted) and C(state=unpersisted) keep or stop keeping the devices on
    vfio-pci across reboots (driverctl, or a udev rule + softdep), as C(gpuvfio persist).
  - C(changed) is true only when a device moved or a file changed. In check mode the
    plan is returned (C(plan)) and nothing is written; a refused plan fails in check
    mode too. With C(--diff) the drivers before and after are shown, and for
    persistence the file changes.
options:
  root:
    description: The host as a directory that looks like C(/).
    type: str
    default: /
  state_dir:
    description: gpuvfio's state directory (journal, lock). Default C(<root>/var/lib/gpuvfio).
    type: path
  devices:
    description:
      - The devices, normally the GPUs, as the gpuvfio command takes them - C(DDDD:BB:SS.F),
        an lspci slot (C(18:00) is every function of the slot, C(0000:18:00.1) one), or a
        libvirt node-device name (C(pci_0000_18_00_0)). Quote them - YAML reads an unquoted
        C(18:00) as the number 1080.
      - C(devices) or C(device_ids) is required.
    type: list
    elements: str
    default: []
  device_ids:
    description:
      - Devices by PCI ids, as C(lspci -d) - C(VENDOR:[DEVICE][:CLASS]) in hex, C(x) a wildcard
        digit (C(10de:) is every NVIDIA function, NVSwitches too; C(10de::03xx) every NVIDIA
        display function). With C(devices), only the devices both select.
    type: list
    elements: str
    default: []
  all_matched:
    description: Act on every device a slot or C(device_ids) matched when they are more than one physical
      device (the command's C(--yes)); without it such a task fails and names what matched.
    type: bool
    default: false
  state:
    description: Where the devices should be.
    type: str
    choices: [vfio, host, persisted, unpersisted]
    default: vfio
  # Generated from gpuvfio/options.py by python -m gpuvfio.cli.generate: edit the table there.
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
  force:
    description: >-
      Override the checks marked overridable: a foreign device in the group, the console GPU (boot VGA).
    type: bool
    default: false
  allow_unsafe_host:
    description: >-
      DANGEROUS: bind even with ACS override, unsafe interrupts or no-IOMMU mode.
    type: bool
    default: false
  take_host_devices:
    description: >-
      DANGEROUS: take from the host what it runs on (a mounted disk, swap, an interface with its routes or
      addresses, its console) when binding; the host loses it.
    type: bool
    default: false
  write_timeout:
    description: >-
      Give up on a sysfs write the kernel does not return from after this many seconds.
    type: float
    default: 10.0
  lock_timeout:
    description: >-
      Wait this long for another gpuvfio run to finish.
    type: float
    default: 30.0
  # End of the generated options.
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: "Returns gpuvfio's bind, restore or persist plan and changes nothing; a refused plan fails as the real run would."
  diff_mode:
    support: full
    details: "The drivers before and after, or the persistence files' changes."
  platform:
    platforms: posix
    details: "Linux hosts (sysfs, vfio-pci, libvirt)."
requirements:
  - gpuvfio (Python package) importable by the module's interpreter
author:
  - gpuvfio contributors (!UNKNOWN)
"""

EXAMPLES = r"""
- name: GPU 0 and its audio function to vfio-pci
  gpuvfio.gpuvfio.device:
    devices: ["0000:18:00.0"]
    state: vfio

- name: Keep it there after a reboot
  gpuvfio.gpuvfio.device:
    devices: ["0000:18:00.0"]
    state: persisted

- name: Give it back to nvidia
  gpuvfio.gpuvfio.device:
    devices: ["0000:18:00.0"]
    state: host

- name: Every H100 SXM5 of an HGX board to vfio-pci (its NVSwitches come along)
  gpuvfio.gpuvfio.device:
    device_ids: ["10de:2330"]
    all_matched: true
"""

RETURN = r"""
selected:
  description: What a slot or C(device_ids) expanded to (C(selected SELECTORS -> ADDRESSES)).
  returned: when a selector was expanded
  type: list
  elements: str
devices:
  description: The devices the request covers (whole IOMMU groups for vfio and persistence).
  returned: always
  type: list
  elements: str
plan:
  description: gpuvfio's bind plan (checks and steps) for C(state=vfio).
  returned: when state is vfio
  type: dict
drivers:
  description: Driver of each device before (C(before)) and after (C(after)) the task.
  returned: when state is vfio or host
  type: dict
restore:
  description: gpuvfio's restore report for C(state=host).
  returned: when state is host and something was restored
  type: dict
persist:
  description: gpuvfio's persist report (mechanism, files, next step).
  returned: when state is persisted or unpersisted
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpuvfio.gpuvfio.plugins.module_utils.common import (
    COMMON_ARGS, DEVICE_ARGS, HAS_GPUVFIO, GpuvfioError, check_devices, check_libvirt_uri, driver_diff,
    fail_gpuvfio, finish, require_gpuvfio, resolve_devices, task_context,
)
from ansible_collections.gpuvfio.gpuvfio.plugins.module_utils.options import ARGUMENT_SPECS

if HAS_GPUVFIO:
    from gpuvfio.ops import binding
    from gpuvfio.ops.uris import NO_LIBVIRT

VFIO = "vfio-pci"


def to_vfio(module, ctx, addresses) -> dict:
    params = module.params
    policy = binding.BindPolicy(force=params["force"], stop_services=params["stop_services"],
                                allow_unsafe_host=params["allow_unsafe_host"],
                                take_host_devices=params["take_host_devices"])
    # The plan of the real run: a refusal fails the task in check mode exactly as it would for real.
    plan = binding.plan_operation(ctx, addresses, policy, uri=params["connect"]).shown()
    devices = [str(a) for a in plan.devices]
    result = {"devices": devices, "plan": plan.to_json()}
    before = binding.current_drivers(ctx, devices)
    if plan.status is binding.BindStatus.NOTHING_TO_DO:
        # Already there: the pre-checks guard a move, and nothing moves (a domain that uses
        # the devices, as after attach.yml, is the expected state, not a refusal).
        result.update(changed=False, drivers={"before": before, "after": before})
        return result
    after = {a: VFIO for a in devices}
    result.update(changed=True, drivers={"before": before, "after": after},
                  diff=driver_diff(before, after, "IOMMU group(s) of " + ", ".join(map(str, addresses))))
    if module.check_mode:
        return result
    report = binding.bind(ctx, addresses, policy, uri=params["connect"])
    result["plan"] = report.to_json()
    result["drivers"]["after"] = binding.current_drivers(ctx, report.devices)
    result["changed"] = report.status is binding.BindStatus.APPLIED
    return result


def to_host(module, ctx, addresses) -> dict:
    """gpuvfio's one give-back policy: what gpuvfio holds in the devices' IOMMU groups goes back;
    check mode returns restore_groups' own plan (gpuvfio.ops.binding.plan_restore_groups)."""
    held = binding.held(ctx, addresses)
    before = binding.current_drivers(ctx, held)
    for address, driver in binding.current_drivers(ctx, addresses).items():
        if address not in held and driver == VFIO:
            module.warn(f"{address} is on vfio-pci but gpuvfio does not hold it (bound before or by another "
                        "tool); left as it is")
    result = {"devices": sorted(held), "changed": bool(held)}
    if not held:
        result["drivers"] = {"before": {}, "after": {}}
        return result
    after = {a: device.original_driver for a, device in held.items()}
    result.update(drivers={"before": before, "after": after},
                  diff=driver_diff(before, after, "devices held by gpuvfio"))
    if module.check_mode:
        result["plan"] = binding.plan_restore_groups(ctx, addresses).to_json()
        return result
    result["restore"] = binding.restore_groups(ctx, addresses).to_json()
    result["drivers"]["after"] = binding.current_drivers(ctx, held)
    return result


def persistence(module, ctx, addresses, remove: bool) -> dict:
    report = (binding.plan_persist if module.check_mode else binding.persist)(
        ctx, addresses, remove=remove, force=module.params["force"],
        take_host_devices=module.params["take_host_devices"] and not remove)
    changed = bool(report.changes)
    result = {"devices": [str(a) for a in report.devices], "persist": report.to_json(), "changed": changed}
    if changed:
        result["diff"] = {"prepared": "".join(c.diff() for c in report.changes)}
        if report.next_step:
            module.warn(report.next_step)
    return result


def main(context_factory=None) -> None:
    """``context_factory(host)``: the gpuvfio Context for the task (the live one by default)."""
    module = AnsibleModule(
        argument_spec=dict(COMMON_ARGS, **DEVICE_ARGS,
                           state=dict(type="str", choices=["vfio", "host", "persisted", "unpersisted"],
                                      default="vfio"),
                           **ARGUMENT_SPECS["gpuvfio.gpuvfio.device"]),  # what gpuvfio.options declares
        supports_check_mode=True,
    )
    require_gpuvfio(module)
    state = module.params["state"]
    selected: list = []
    result = {}
    try:
        check_libvirt_uri(module, "connect", keywords=(NO_LIBVIRT,))
        check_devices(module, required=True)
        with task_context(module, context_factory, writable=True, write_timeout=module.params["write_timeout"],
                          lock_timeout=module.params["lock_timeout"]) as ctx:
            addresses = resolve_devices(module, ctx, changes=True, selected=selected)
            if state == "vfio":
                result = to_vfio(module, ctx, addresses)
            elif state == "host":
                result = to_host(module, ctx, addresses)
            else:
                result = persistence(module, ctx, addresses, remove=state == "unpersisted")
    except GpuvfioError as exc:
        fail_gpuvfio(module, exc, selected=selected)
    finish(module, result, selected)


if __name__ == "__main__":
    main()
