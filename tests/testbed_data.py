"""Synthetic testbed results (clearly not measured): the shapes a real run writes, with
numbers in the range anchors.md gives for an H100 on PCIe Gen5 x16."""

import json
import os
import random


PROVISIONING = {"passthrough-1g": {"hugepages": "1G", "numa": "auto"},
                "passthrough-remote-4k": {"hugepages": "none", "numa": "remote"},
                "vgpu-h100-40c": {"hugepages": "1G", "numa": "auto", "profile": "NVIDIA H100-40C",
                                  "scheduler": "equal-share"}}
VGPU = {"vgpu-h100-40c": {"profile": "NVIDIA H100-40C", "kind": "sriov", "type": 1054, "mig_backed": None,
                          "scheduler": {"policy": "equal-share", "arr": "disabled", "timeslice": 2000,
                                        "previous": "best-effort"}}}


def write_synthetic(out: str, reps: int = 5, seed: int = 7) -> None:
    rng = random.Random(seed)
    variants = {
        "baremetal": ("baremetal", 53.0, 51.0, 1450.0, 9.0, None),
        "passthrough-1g": ("passthrough", 52.5, 50.6, 1445.0, 9.4, 41.0),
        "passthrough-remote-4k": ("passthrough", 44.0, 42.0, 1440.0, 11.5, 43.0),
        "vgpu-h100-40c": ("vgpu", 47.0, 45.5, 700.0, 14.0, 48.0),
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "identity.json"), "w") as handle:
        json.dump({"host_cpu": "SYNTHETIC (not measured)", "host_kernel": "6.8.0", "iommu": "intel",
                   "iommu_mode": "pt", "numa_nodes": 2}, handle)
    for name, (kind, h2d, d2h, d2d, lat, boot) in variants.items():
        directory = os.path.join(out, "results", name)
        os.makedirs(directory, exist_ok=True)
        for rep in range(reps):
            jitter = lambda v, s=0.01: None if v is None else v * (1 + rng.gauss(0, s))  # noqa: E731
            metrics = {"h2d_gbps": jitter(h2d), "d2h_gbps": jitter(d2h), "d2d_gbps": jitter(d2d),
                       "latency_p50_us": jitter(lat, 0.03), "latency_p99_us": jitter(lat * 1.8, 0.05),
                       "saxpy_ms": jitter({"vgpu": 0.38}.get(kind, 0.19), 0.02),
                       "time_to_verified_s": jitter(boot, 0.05) if rep == 0 else None}
            record = {"variant": name, "kind": kind, "rep": rep, "metrics": metrics,
                      "provisioning": PROVISIONING.get(name, {}), "vgpu": VGPU.get(name),
                      "guest": {"virtualization_mode": {"baremetal": "None", "passthrough": "Pass-Through",
                                                        "vgpu": "VGPU"}[kind]}, "verify": {}}
            with open(os.path.join(directory, f"rep-{rep}.json"), "w") as handle:
                json.dump(record, handle)


def guest_toml(*, ssh: dict, **guest) -> str:
    """The [guest] and [guest.ssh] tables of a testbed spec (json.dumps writes valid TOML
    strings, integers and booleans)."""
    lines = ["[guest]", *(f"{k} = {json.dumps(v)}" for k, v in guest.items()),
             "[guest.ssh]", *(f"{k} = {json.dumps(v)}" for k, v in ssh.items())]
    return "\n".join(lines) + "\n"


def tiny_guest_toml(image, port: int, known_hosts) -> str:
    """The daemon lane's tiny guest (tests/lanes/guest.py) under TCG, its host key pinned."""
    from tests.lanes import guest as gl

    return guest_toml(kernel=image.kernel, initrd=image.initrd, cmdline=gl.KERNEL_CMDLINE, vcpus=1, memory="256M",
                      virt_type="qemu", firmware="bios",
                      ssh={"port": port, "key": image.client_key, "known_hosts": str(known_hosts)})
