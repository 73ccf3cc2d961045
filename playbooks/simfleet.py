#!/usr/bin/env python3
"""A simulated fleet for the playbooks: gpuvfio's sample hosts loaded into directories,
and an inventory that runs every play against them on this machine.

    python playbooks/simfleet.py /tmp/fleet --hosts 8
    cd playbooks && ansible-playbook -i /tmp/fleet/hosts.yml inventory.yml
    ansible-playbook -i /tmp/fleet/hosts.yml host-prep.yml --check --diff

Each host is ``ansible_connection=local`` with its own ``gpuvfio_root`` (a loaded
fixture) and ``gpuvfio_state_dir``; the gpuvfio modules run with this interpreter. The
four samples are used in turn (dgx-h100, epyc-mixed, iommu-off, workstation), so 8 hosts
are each sample twice. Guests for attach.yml: one or two H100s per DGX, the A100 (already
on vfio-pci) on the EPYC host; libvirt is its test driver (test:///default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SAMPLES = ("dgx-h100", "epyc-mixed", "iommu-off", "workstation")

# Per sample: the variables a real inventory would hold for such a host.
SAMPLE_VARS = {
    "dgx-h100": {
        "gpuvfio_hugepage_size": "1G", "gpuvfio_hugepages_per_node": 256, "gpuvfio_stop_services": True,
        "gpuvfio_health_textfile": "/var/lib/node_exporter/textfile_collector/gpuvfio.prom",
        "gpuvfio_guests": [{"name": "train-0", "gpus": ["0000:1b:00.0"], "vcpus": 8, "memory": "16G"},
                           {"name": "train-1", "gpus": ["0000:9d:00.0"], "vcpus": 8, "memory": "16G"}],
    },
    "epyc-mixed": {
        "gpuvfio_hugepage_size": "2M", "gpuvfio_hugepages_nodes": {0: 40960, 1: 24576},
        "gpuvfio_guests": [{"name": "a100-0", "gpus": ["0000:81:00.0"], "vcpus": 8, "memory": "16G",
                            "hugepages": "2M"}],
    },
    "iommu-off": {"gpuvfio_hugepages_per_node": 0, "gpuvfio_guests": []},
    "workstation": {"gpuvfio_hugepages_per_node": 0, "gpuvfio_guests": []},
}


def sample_dir() -> str:
    import gpuvfio

    return os.path.join(os.path.dirname(gpuvfio.__file__), "samples")


def make_fleet(out: str, hosts: int, python: str | None = None, extra_vars: dict | None = None) -> dict:
    """Load ``hosts`` simulated hosts under ``out``/roots and write ``out``/hosts.yml.

    Returns {host name: {"sample": name, "root": dir, "state_dir": dir}}."""
    from gpuvfio.host.fixture import load_fixture

    python = python or sys.executable
    texts = {}
    fleet = {}
    inventory_hosts = {}
    for index in range(hosts):
        sample = SAMPLES[index % len(SAMPLES)]
        if sample not in texts:
            with open(os.path.join(sample_dir(), f"{sample}.host"), encoding="utf-8") as handle:
                texts[sample] = handle.read()
        name = f"{sample}-{index // len(SAMPLES)}"
        root = os.path.join(out, "roots", name)
        state = os.path.join(out, "state", name)
        os.makedirs(root, exist_ok=True)
        os.makedirs(state, exist_ok=True)
        if not os.path.isdir(os.path.join(root, "sys")):
            load_fixture(texts[sample], root)
        fleet[name] = {"sample": sample, "root": root, "state_dir": state}
        # Each guest boots from a disk image on this machine and takes the test driver's network
        # (it leases addresses): an attach plan refuses a guest that could not boot or be reached.
        guests = []
        for guest in SAMPLE_VARS[sample]["gpuvfio_guests"]:
            image = os.path.join(out, "images", f"{name}-{guest['name']}.qcow2")
            os.makedirs(os.path.dirname(image), exist_ok=True)
            with open(image, "wb") as handle:
                handle.write(b"QFI\xfb")
            guests.append({**guest, "disk": image, "network": "default"})
        inventory_hosts[name] = {
            "ansible_connection": "local",
            "ansible_python_interpreter": python,
            "gpuvfio_python": python,
            "gpuvfio_root": root,
            "gpuvfio_state_dir": state,
            "gpuvfio_libvirt_uri": "test:///default",
            **SAMPLE_VARS[sample],
            "gpuvfio_guests": guests,
            **(extra_vars or {}),
        }
    inventory = {"all": {"children": {"gpu_hosts": {"hosts": inventory_hosts}}},
                 # The controller's report plays run with this interpreter too.
                 }
    # JSON is YAML: no PyYAML needed to write it.
    with open(os.path.join(out, "hosts.yml"), "w", encoding="utf-8") as handle:
        json.dump(inventory, handle, indent=1, sort_keys=True)
    return fleet


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory for the roots, state dirs and hosts.yml")
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--python", help="interpreter with gpuvfio (default: this one)")
    args = parser.parse_args(argv)
    fleet = make_fleet(os.path.abspath(args.out), args.hosts, args.python)
    print(f"{len(fleet)} hosts; inventory: {os.path.join(os.path.abspath(args.out), 'hosts.yml')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
