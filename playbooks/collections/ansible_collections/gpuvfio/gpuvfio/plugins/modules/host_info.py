#!/usr/bin/python
# Apache-2.0, like gpuvfio.
"""gpuvfio.gpuvfio.host_info: what host-prep needs to know about a host, before gpuvfio is installed."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: host_info
short_description: Distribution, CPU vendor, kernel, command line, modules and NUMA nodes of a host root
description:
  - Reads C(etc/os-release), C(proc/cmdline), C(proc/sys/kernel/osrelease), C(proc/modules),
    C(proc/cpuinfo) and C(sys/devices/system/node) under C(root) in one call, with the
    standard library only, so host-prep can run before gpuvfio is installed.
  - Changes nothing; runs the same in check mode.
options:
  root:
    description: The host as a directory that looks like C(/).
    type: str
    default: /
  paths:
    description: Paths under C(root) whose existence is reported in C(exists).
    type: list
    elements: str
    default: []
  machine_paths:
    description: Paths on the machine itself (not under C(root)), such as gpuvfio's interpreter, reported in C(exists).
    type: list
    elements: str
    default: []
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: "Reads the host and changes nothing, the same in check mode."
  diff_mode:
    support: none
  platform:
    platforms: posix
    details: "Linux hosts (sysfs, vfio-pci, libvirt)."
author:
  - gpuvfio contributors (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Read the host
  gpuvfio.gpuvfio.host_info:
    root: /
    paths: [/etc/systemd/system/gpuvfio-hugepages.service]
    machine_paths: [/opt/gpuvfio/bin/python]
  register: host
"""

RETURN = r"""
os_family:
  description: C(debian), C(redhat) or C(unsupported), from ID and ID_LIKE.
  returned: always
  type: str
os_ids:
  description: ID and ID_LIKE words of os-release.
  returned: always
  type: list
  elements: str
cpu_vendor:
  description: vendor_id of the first CPU (GenuineIntel, AuthenticAMD).
  returned: always
  type: str
kernel_release:
  description: The running kernel's release.
  returned: always
  type: str
cmdline:
  description: The running kernel's command line, split into words.
  returned: always
  type: list
  elements: str
loaded_modules:
  description: Names of the loaded modules.
  returned: always
  type: list
  elements: str
numa_nodes:
  description: NUMA node numbers.
  returned: always
  type: list
  elements: int
nvidia_driver:
  description: Whether the host runs the nvidia driver (loaded, or in the running kernel's modules.dep).
  returned: always
  type: bool
exists:
  description: For each of C(paths) (under C(root)) and C(machine_paths), whether it exists.
  returned: always
  type: dict
"""

import os
import re

from ansible.module_utils.basic import AnsibleModule

DEBIAN = {"debian", "ubuntu"}
REDHAT = {"rhel", "fedora", "centos", "rocky", "almalinux", "ol"}


def _read(path: str, limit: int = 1 << 20) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(limit)
    except FileNotFoundError:
        return ""


def host_info(root: str, paths: list[str], machine_paths: list[str] = ()) -> dict:
    def under(*parts: str) -> str:
        return os.path.join(root, *(p.strip("/") for p in parts))

    ids: list[str] = []
    for line in _read(under("etc/os-release")).splitlines():
        if line.startswith(("ID=", "ID_LIKE=")):
            ids.extend(line.split("=", 1)[1].strip().strip('"').split())
    family = "debian" if DEBIAN & set(ids) else "redhat" if REDHAT & set(ids) else "unsupported"
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", _read(under("proc/cpuinfo"), 1 << 16), re.M)
    modules = [line.split()[0] for line in _read(under("proc/modules")).splitlines() if line.strip()]
    node_dir = under("sys/devices/system/node")
    nodes = sorted(int(name[4:]) for name in (os.listdir(node_dir) if os.path.isdir(node_dir) else [])
                   if re.fullmatch(r"node\d+", name))
    release = _read(under("proc/sys/kernel/osrelease")).strip()
    dep = _read(under("lib/modules", release, "modules.dep"), 1 << 24) if release else ""
    nvidia = "nvidia" in modules or re.search(r"(^|/)nvidia\.ko(\.[a-z]+)?:", dep, re.M) is not None
    return {"os_family": family, "os_ids": ids, "cpu_vendor": vendor.group(1) if vendor else "unknown",
            "kernel_release": release, "nvidia_driver": nvidia,
            "cmdline": _read(under("proc/cmdline")).split(), "loaded_modules": modules, "numa_nodes": nodes,
            "exists": {**{path: os.path.lexists(under(path)) for path in paths},
                       **{path: os.path.exists(path) for path in machine_paths}}}


def main() -> None:
    module = AnsibleModule(argument_spec=dict(root=dict(type="str", default="/"),
                                              paths=dict(type="list", elements="str", default=[]),
                                              machine_paths=dict(type="list", elements="str", default=[])),
                           supports_check_mode=True)
    root = module.params["root"]
    if not os.path.isdir(root):
        module.fail_json(msg=f"host root is not a directory: {root}")
    if not os.path.isfile(os.path.join(root, "proc", "cmdline")):
        module.fail_json(msg=f"{root} does not look like a host root: no proc/cmdline")
    module.exit_json(changed=False, **host_info(root, module.params["paths"], module.params["machine_paths"]))


if __name__ == "__main__":
    main()
