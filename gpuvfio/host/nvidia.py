"""What the NVIDIA driver stack on the host is doing: who holds the GPUs, which NVIDIA daemons
run, and the Fabric Manager's mode. Read through the host root; nothing here changes the host.

Unbinding ``nvidia`` while a process holds ``/dev/nvidia*`` can hang in the kernel (GPU
Operator's vfio-manager waits for holders for this reason), so binding refuses while the
GPU's own node is open. nvidia-persistenced, nv-fabricmanager and DCGM's nv-hostengine keep
GPUs open by design; they are stopped for a bind only when asked (--stop-services). On an
HGX host in shared-NVSwitch mode (Fabric Manager ``FABRIC_MODE=1``) the Fabric Manager
manages the NVSwitches for the guests' partitions and must keep running while their GPUs are
on vfio-pci (NVIDIA Fabric Manager user guide, "Shared NVSwitch Virtualization Model").
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError, HostReadError
from gpuvfio.host.root import HostRoot
from gpuvfio.numbers import shown, uint

# Device nodes of the NVIDIA driver stack (nvidia.ko, nvidia-uvm, nvidia-modeset, the
# NVSwitch nodes that nv-fabricmanager opens, and the MIG capability nodes).
NVIDIA_DEVICE_NODE = re.compile(
    r"^/dev/nvidia([0-9]+|ctl|-uvm|-uvm-tools|-modeset|-nvswitch([0-9]+|ctl)|-nvlink|-caps/.*)$", re.ASCII)
GPU_NODE = re.compile(r"/dev/nvidia[0-9]+", re.ASCII)
# comm names (15 chars, TASK_COMM_LEN) of the daemons that keep NVIDIA GPUs open, and
# their systemd units: nvidia-persistenced, nv-fabricmanager, DCGM's nv-hostengine.
NVIDIA_SERVICES = {
    "nvidia-persiste": "nvidia-persistenced",
    "nv-fabricmanage": "nvidia-fabricmanager",
    "nv-hostengine": "nvidia-dcgm",
}
FABRIC_MANAGER_UNIT = "nvidia-fabricmanager"
# Where the Fabric Manager package installs its configuration (FABRIC_MODE: 0 bare metal or
# full passthrough, 1 shared NVSwitch, 2 vGPU).
FABRIC_MANAGER_CONFIG = ("usr", "share", "nvidia", "nvswitch", "fabricmanager.cfg")
SHARED_NVSWITCH = 1
_MINOR = re.compile(r"^Device Minor:\s*([0-9]+)", re.M | re.ASCII)
_FABRIC_MODE = re.compile(r"^\s*FABRIC_MODE\s*=\s*([0-9]+)\s*$", re.M | re.ASCII)
PID_MAX_LIMIT = 4 * 1024 * 1024  # include/linux/threads.h (64-bit): no pid is larger
MINOR_MAX = (1 << 20) - 1  # include/linux/kdev_t.h MINORBITS


@dataclass(slots=True)
class Holder:
    pid: int
    comm: str
    device_nodes: list[str]

    def describe(self) -> str:
        return f"{self.comm} (pid {self.pid}) holds {', '.join(self.device_nodes)}"

    def to_json(self) -> dict:
        return {"pid": self.pid, "comm": self.comm, "device_nodes": self.device_nodes}


def nvidia_holders(host: HostRoot) -> list[Holder]:
    """Processes with /dev/nvidia* open, from ``<root>/proc/*/fd`` (links read, not followed)."""
    holders = []
    proc = host.path("proc")
    for pid in host.listdir(proc):
        number = uint(pid, PID_MAX_LIMIT)
        if number is None:
            continue
        fd_dir = os.path.join(proc, pid, "fd")
        try:
            fds = host.listdir(fd_dir)
        except GpuvfioError:
            continue  # the process exited, or is not ours to see
        nodes = set()
        for fd in fds:
            target = host.raw_link(os.path.join(fd_dir, fd))  # read as data, never followed
            if target is not None and NVIDIA_DEVICE_NODE.match(target):
                nodes.add(target)
        if nodes:
            comm = host.read(os.path.join(proc, pid, "comm")) or "?"
            holders.append(Holder(number, comm, sorted(nodes)))
    return sorted(holders, key=lambda h: h.pid)


def nvidia_minor(host: HostRoot, address: PciAddress) -> int | None:
    """/dev/nvidiaN of a GPU, from /proc/driver/nvidia/gpus/<addr>/information."""
    text = host.read(host.path("proc", "driver", "nvidia", "gpus", str(address), "information"))
    match = _MINOR.search(text or "")
    return uint(match.group(1), MINOR_MAX) if match else None


def running_services(host: HostRoot) -> dict[str, list[int]]:
    """The NVIDIA daemons running on the host: systemd unit -> pids."""
    running: dict[str, list[int]] = {}
    proc = host.path("proc")
    for pid in host.listdir(proc):
        number = uint(pid, PID_MAX_LIMIT)
        if number is not None:
            comm = host.read(os.path.join(proc, pid, "comm"))
            if comm in NVIDIA_SERVICES:
                running.setdefault(NVIDIA_SERVICES[comm], []).append(number)
    return {unit: sorted(pids) for unit, pids in sorted(running.items())}


def fabric_mode(host: HostRoot) -> int | None:
    """FABRIC_MODE from the Fabric Manager's configuration; None when it is not installed."""
    text = host.read(host.config_path(*FABRIC_MANAGER_CONFIG))
    if text is None:
        return None
    match = _FABRIC_MODE.search(text)
    if not match:
        return 0  # the documented default: bare metal / full passthrough
    mode = uint(match.group(1), 0xFFFFFFFF)
    if mode is None:
        raise HostReadError(f"{host.config_path(*FABRIC_MANAGER_CONFIG)}: FABRIC_MODE {shown(match.group(1))} "
                            "is not a mode (0, 1 or 2)")
    return mode


def holds_gpu(holder: Holder) -> bool:
    """Does the holder have a per-GPU node (/dev/nvidiaN) open, rather than only the driver's?"""
    return any(GPU_NODE.fullmatch(n) for n in holder.device_nodes)
