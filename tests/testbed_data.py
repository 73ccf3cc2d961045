"""Synthetic testbed results (clearly not measured): the shapes a real run writes, with
numbers in the range of an H100/H200 on PCIe Gen5 x16 (one GPU: no peer copies, no NCCL).
identity.json says "synthetic": true, so the report labels its title and every plot.
"""

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
    # kind, h2d, d2h, bidir, d2d (GB/s), latency, copy overhead (µs), saxpy (ms), attach to verified (s)
    variants = {
        "baremetal": ("baremetal", 53.0, 51.0, 95.0, 1450.0, 1.9, 9.0, 0.19, None),
        "passthrough-1g": ("passthrough", 52.5, 50.6, 94.2, 1445.0, 1.95, 9.4, 0.19, 41.0),
        "passthrough-remote-4k": ("passthrough", 44.0, 42.0, 80.0, 1440.0, 2.6, 11.5, 0.19, 43.0),
        "vgpu-h100-40c": ("vgpu", 47.0, 45.5, 85.0, 700.0, 2.2, 14.0, 0.38, 48.0),
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "identity.json"), "w") as handle:
        json.dump({"synthetic": True, "host_cpu": "SYNTHETIC (not measured)", "host_kernel": "6.8.0",
                   "iommu": "intel", "iommu_mode": "pt", "numa_nodes": 2, "accelerator_count": 1,
                   "accelerators": "NVIDIA H100 PCIe, Gen5 x16 (synthetic)"}, handle)
    for name, (kind, h2d, d2h, bidir, d2d, lat, overhead, saxpy, boot) in variants.items():
        directory = os.path.join(out, "results", name)
        os.makedirs(directory, exist_ok=True)
        for rep in range(reps):
            jitter = lambda v, s=0.01: None if v is None else v * (1 + rng.gauss(0, s))  # noqa: E731
            metrics = {"h2d_gbps": jitter(h2d), "d2h_gbps": jitter(d2h), "bidir_gbps": jitter(bidir),
                       "d2d_gbps": jitter(d2d), "latency_us": jitter(lat, 0.03),
                       "copy_overhead_us": jitter(overhead, 0.03), "saxpy_ms": jitter(saxpy, 0.02),
                       "p2p_gbps": None, "nccl_busbw_gbps": None,
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
