#!/usr/bin/python
# Apache-2.0, like gpuvfio.
"""gpuvfio.gpuvfio.verify: in-guest checks of a guest with GPUs passed through."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: verify
short_description: Check a guest over SSH - devices present, driver, CUDA, PCIe link, bandwidth
description:
  - Runs gpuvfio's verifier in the guest (as C(gpuvfio verify)) and returns its report.
    The expectations (vendor:device of each assigned device, the host's PCIe link) come
    from the host root. Fails when a check fails, with the failing checks in C(msg).
  - Changes nothing on the host, and leaves nothing in the guest (the probe runs as an argument of C(sh -c)); runs the same in check mode.
options:
  root:
    description: The host as a directory that looks like C(/), or a gpuvfio host fixture file.
    type: str
    default: /
  state_dir:
    description: gpuvfio's state directory (known_hosts of guests). Default C(<root>/var/lib/gpuvfio).
    type: path
  domain:
    description: Find the guest's address through libvirt (forwarded port, DHCP lease, agent, ARP).
    type: str
  expect_devices:
    description:
      - Host devices that must be in the guest, as the gpuvfio command takes them (C(DDDD:BB:SS.F),
        an lspci slot such as C(18:00) for every function, a libvirt node-device name). Default,
        with C(domain), the devices gpuvfio recorded in the domain (an empty list too).
    type: list
    elements: str
  # Generated from gpuvfio/options.py by python -m gpuvfio.cli.generate: edit the table there.
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
  ssh_timeout:
    description: >-
      Seconds to wait for SSH.
    type: float
    default: 60.0
    aliases: ["timeout"]
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
  # End of the generated options.
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: "The checks only read the guest: they run the same in check mode."
  diff_mode:
    support: none
  platform:
    platforms: posix
    details: "Linux hosts (sysfs, vfio-pci, libvirt)."
requirements:
  - gpuvfio and paramiko importable by the module's interpreter (libvirt-python with C(domain))
author:
  - gpuvfio contributors (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Verify train-0
  gpuvfio.gpuvfio.verify:
    domain: train-0
    known_hosts: /etc/gpuvfio/known_hosts
"""

RETURN = r"""
report:
  description: gpuvfio's verify report (checks, facts, bandwidth_gbps, ok, expected).
  returned: when the guest answered
  type: dict
"""


from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpuvfio.gpuvfio.plugins.module_utils.common import (
    COMMON_ARGS, HAS_GPUVFIO, GpuvfioError, check_devices, check_libvirt_uri, fail_gpuvfio, guest_ssh,
    private_key_file, require_gpuvfio, resolve_devices, table_values, task_context,
)
from ansible_collections.gpuvfio.gpuvfio.plugins.module_utils.options import ARGUMENT_SPECS

if HAS_GPUVFIO:
    from gpuvfio.ops import guests


def main(context_factory=None) -> None:
    """``context_factory(host)``: the gpuvfio Context for the task (the live one by default)."""
    module = AnsibleModule(
        argument_spec=dict(
            COMMON_ARGS,
            **ARGUMENT_SPECS["gpuvfio.gpuvfio.verify"],  # the SSH and verify options gpuvfio.options declares
            domain=dict(type="str"),
            expect_devices=dict(type="list", elements="str"),
        ),
        required_one_of=[("domain", "ssh_host")],
        mutually_exclusive=[("ssh_key", "ssh_private_key")],
        supports_check_mode=True,
    )
    require_gpuvfio(module)
    params = module.params
    try:
        check_libvirt_uri(module, "connect")
        check_devices(module, required=False, key="expect_devices", ids_key=None)
        # Writable as the command's verify is: libvirt opened read-write, which asking the guest
        # agent for the guest's address takes (a read-only connection is refused it), and a host
        # key trusted on first use recorded.
        with private_key_file(module) as key_file, task_context(module, context_factory, writable=True) as ctx:
            # an empty list is not given (as an empty --expect-device): the domain's record then, never
            # "expect nothing", which would pass a guest without looking
            expect = (resolve_devices(module, ctx, changes=False, key="expect_devices", ids_key=None)
                      if params["expect_devices"] else None)
            ssh = guest_ssh(module, key_file, "ssh_timeout")
            report = guests.verify(ctx, ssh=ssh, domain=params["domain"], uri=params["connect"], expect=expect,
                                   options=guests.verify_options(**table_values(params, "verify")))
    except GpuvfioError as exc:
        fail_gpuvfio(module, exc)
    if not report.ok:
        failing = [f"{c.check_id} ({c.reason or c.observed})" for c in report.failed]
        module.fail_json(msg="verification failed: " + "; ".join(failing), report=report.to_json())
    module.exit_json(changed=False, report=report.to_json())


if __name__ == "__main__":
    main()
