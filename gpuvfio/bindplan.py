"""Planning a bind: which endpoints move, the pre-checks, and the steps. No side effects.

The kernel facts this follows (anchors.md; Documentation/ABI/testing/sysfs-bus-pci):
bind by address -- write ``driver_override``, unbind from the current driver, write the
address to ``drivers_probe``, then check the ``driver`` link. Never ``new_id`` (it takes
every card with that ID). VFIO hands out whole IOMMU groups, so every endpoint of the
group moves (bridges stay on pcieport; NVSwitches are endpoints).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError
from gpuvfio.hostroot import HostRoot
from gpuvfio.inventory import Inventory
from gpuvfio.kernel import Holder, KernelInfo, nvidia_holders

VFIO_DRIVER = "vfio-pci"
# comm names (15 chars, TASK_COMM_LEN) of the daemons that keep NVIDIA GPUs open, and
# their systemd units: nvidia-persistenced, nv-fabricmanager, DCGM's nv-hostengine.
NVIDIA_SERVICES = {
    "nvidia-persiste": "nvidia-persistenced",
    "nv-fabricmanage": "nvidia-fabricmanager",
    "nv-hostengine": "nvidia-dcgm",
}
_MINOR = re.compile(r"^Device Minor:\s*(\d+)", re.M)

OK, REFUSE, WARN, SKIP = "ok", "refuse", "warn", "skip"


@dataclass(slots=True)
class PlanCheck:
    check_id: str
    status: str
    message: str
    overridable: bool = False

    def to_json(self) -> dict:
        return {"id": self.check_id, "status": self.status, "message": self.message,
                "overridable": self.overridable}


@dataclass(slots=True)
class Step:
    kind: str  # modprobe | stop_service | override | unbind | probe
    address: str | None = None
    path: str | None = None
    value: str | None = None
    expect: str | None = None  # the driver the device must show after this step
    name: str | None = None  # module or service name

    def describe(self) -> str:
        if self.kind == "modprobe":
            return f"load module {self.name}"
        if self.kind == "stop_service":
            return f"stop service {self.name} (restarted by restore)"
        if self.kind == "override":
            return f"{self.address}: driver_override <- {self.value}"
        if self.kind == "unbind":
            return f"{self.address}: unbind from {self.name}"
        return f"{self.address}: drivers_probe, expect {self.expect}"

    def to_json(self, root: str | None = None) -> dict:
        path = self.path
        if root and path and path.startswith(root.rstrip("/") + "/"):
            path = path[len(root.rstrip("/")):]  # as the host itself names it
        return {"kind": self.kind, "address": self.address, "path": path, "value": self.value,
                "expect": self.expect, "name": self.name, "description": self.describe()}


@dataclass(slots=True)
class BindPlan:
    requested: list[PciAddress]
    devices: list[PciAddress]  # endpoints that will end on vfio-pci
    moving: list[PciAddress]  # the subset not there yet
    originals: dict[PciAddress, tuple[str | None, str | None]]  # driver, driver_override
    groups: dict[PciAddress, int | None]
    steps: list[Step] = field(default_factory=list)
    checks: list[PlanCheck] = field(default_factory=list)
    services: list[str] = field(default_factory=list)

    def refusals(self, force: bool) -> list[PlanCheck]:
        return [c for c in self.checks if c.status == REFUSE and not (force and c.overridable)]

    @property
    def nothing_to_do(self) -> bool:
        return not self.moving

    def to_json(self, root: str | None = None) -> dict:
        """``root``: show step paths as the host names them (for plans made on a recorded host)."""
        return {"devices": [str(d) for d in self.devices], "steps": [s.to_json(root) for s in self.steps],
                "checks": [c.to_json() for c in self.checks]}


def nvidia_minor(host: HostRoot, address: PciAddress) -> int | None:
    """/dev/nvidiaN of a GPU, from /proc/driver/nvidia/gpus/<addr>/information."""
    text = host.read(host.path("proc", "driver", "nvidia", "gpus", str(address), "information"))
    match = _MINOR.search(text or "")
    return int(match.group(1)) if match else None



def plan_bind(host: HostRoot, inventory: Inventory, kernel: KernelInfo, addresses: list[PciAddress], *,
              stop_services: bool = False, allow_unsafe_host: bool = False,
              domains_using=None) -> BindPlan:
    """Plan moving the IOMMU groups of ``addresses`` to vfio-pci.

    ``domains_using(addresses)`` returns, per address, the libvirt domains that use it,
    or None when no libvirt daemon could be asked (the check is then skipped).
    """
    if not addresses:
        raise InputError("no PCI address given")
    for address in addresses:
        fn = inventory.functions.get(address)
        if fn is None:
            raise InputError(f"no such PCI function on this host: {address}")
        if fn.is_bridge:
            raise InputError(f"{address} is a PCI bridge; give the address of a device behind it")
    checks: list[PlanCheck] = []
    endpoints: dict[PciAddress, int | None] = {}
    if inventory.groups is None:
        checks.append(PlanCheck("iommu", REFUSE, "the IOMMU is off: there are no IOMMU groups, vfio-pci cannot "
                                "isolate the device (see gpuvfio doctor)"))
        for address in addresses:
            endpoints[address] = None
    else:
        checks.append(PlanCheck("iommu", OK, f"{kernel.iommu_vendor or 'an'} IOMMU with "
                                f"{len(inventory.groups)} groups"))
        for address in addresses:
            group = inventory.group_of(address)
            if group is None:
                checks.append(PlanCheck("iommu", REFUSE, f"{address} has no IOMMU group"))
                endpoints[address] = None
                continue
            for member in group.devices:
                if not inventory.functions[member].is_bridge:
                    endpoints[member] = group.group_id
            if group.viable:
                checks.append(PlanCheck("group_viable", OK, f"group {group.group_id} is viable: "
                                        f"{', '.join(str(d) for d in group.devices)}"))
            else:
                checks.append(PlanCheck(
                    "group_viable", REFUSE,
                    f"group {group.group_id} is not viable: " + "; ".join(group.problems)
                    + " -- binding would take that device from the host (--force takes it anyway)",
                    overridable=True))
    _unsafe_host_checks(kernel, checks, allow_unsafe_host)
    devices = sorted(endpoints)
    fns = {a: inventory.functions[a] for a in devices}
    moving = [a for a in devices if fns[a].driver != VFIO_DRIVER]
    originals = {a: (fns[a].driver, fns[a].driver_override) for a in devices}
    services = _service_checks(host, [fns[a] for a in moving], checks, stop_services)
    _holder_checks(host, [fns[a] for a in moving], checks, excluded_comms=services["comms"])
    for address in moving:
        fn = fns[address]
        if fn.boot_vga:
            fbs = ", ".join(kernel.framebuffers) or "no framebuffer listed"
            checks.append(PlanCheck("boot_vga", REFUSE, f"{address} drives the host console (boot_vga=1; {fbs}); "
                                    "the host loses its display (--force to proceed)", overridable=True))
        if fn.sriov_num_vfs:
            checks.append(PlanCheck("sriov", REFUSE, f"{address} has {fn.sriov_num_vfs} SR-IOV VFs enabled; "
                                    f"disable them first (echo 0 > sriov_numvfs)"))
        real = host.resolve_in_sys(host.sys_path("bus", "pci", "devices", str(address)))
        if not os.path.exists(os.path.join(real, "driver_override")):
            checks.append(PlanCheck("driver_override", REFUSE, f"{address} has no driver_override attribute "
                                    "(kernel older than 3.16?): gpuvfio binds only by address"))
    _domain_checks(domains_using, devices, checks)
    steps: list[Step] = []
    vfio_loaded = os.path.isdir(host.sys_path("bus", "pci", "drivers", VFIO_DRIVER))
    if moving and not vfio_loaded:
        if kernel.module_available("vfio_pci") or "vfio_pci" in kernel.builtin_modules:
            steps.append(Step("modprobe", name="vfio-pci"))
        else:
            checks.append(PlanCheck("vfio_modules", REFUSE, "vfio-pci is neither loaded nor in this kernel's "
                                    "modules (see gpuvfio doctor)"))
    if moving:
        checks.append(PlanCheck("vfio_modules", OK, "vfio-pci " + ("loaded" if vfio_loaded else "loadable")))
    for name in services["units"]:
        steps.append(Step("stop_service", name=name))
    for address in moving:
        path = host.sys_path("bus", "pci", "devices", str(address), "driver_override")
        steps.append(Step("override", str(address), path, VFIO_DRIVER))
    for address in moving:
        driver = fns[address].driver
        if driver:
            path = host.sys_path("bus", "pci", "drivers", driver, "unbind")
            steps.append(Step("unbind", str(address), path, str(address), expect=None, name=driver))
    for address in moving:
        steps.append(Step("probe", str(address), host.sys_path("bus", "pci", "drivers_probe"), str(address),
                          expect=VFIO_DRIVER))
    return BindPlan(requested=sorted(addresses), devices=devices, moving=moving, originals=originals,
                    groups=endpoints, steps=steps, checks=checks, services=services["units"])


def _unsafe_host_checks(kernel: KernelInfo, checks: list[PlanCheck], allowed: bool) -> None:
    flag = " (--allow-unsafe-host to proceed anyway)"
    unsafe = []
    if kernel.param("pcie_acs_override") is not None:
        unsafe.append(("acs_override", "pcie_acs_override is on the command line: IOMMU groups may not "
                       "reflect real isolation"))
    if kernel.unsafe_interrupts:
        unsafe.append(("unsafe_interrupts", "vfio_iommu_type1 allow_unsafe_interrupts=Y: a guest can forge MSIs"))
    if kernel.unsafe_noiommu:
        unsafe.append(("noiommu", "vfio enable_unsafe_noiommu_mode=Y: no DMA isolation"))
    for check_id, message in unsafe:
        if allowed:
            checks.append(PlanCheck(check_id, WARN, message + " (allowed by --allow-unsafe-host)"))
        else:
            checks.append(PlanCheck(check_id, REFUSE, message + flag))


def _service_checks(host: HostRoot, moving, checks: list[PlanCheck], stop: bool) -> dict:
    result: dict = {"units": [], "comms": set()}
    if not any(fn.driver == "nvidia" for fn in moving):
        return result
    running: dict[str, list[int]] = {}
    proc = host.path("proc")
    for pid in host.listdir(proc):
        if pid.isdigit():
            comm = host.read(os.path.join(proc, pid, "comm"))
            if comm in NVIDIA_SERVICES:
                running.setdefault(comm, []).append(int(pid))
    for comm, pids in sorted(running.items()):
        unit = NVIDIA_SERVICES[comm]
        if stop:
            checks.append(PlanCheck("services", WARN, f"{unit} (pid {', '.join(map(str, pids))}) will be stopped "
                                    "and restarted by gpuvfio restore"))
            result["units"].append(unit)
            result["comms"].add(comm)
        else:
            checks.append(PlanCheck("services", REFUSE, f"{unit} is running (pid {', '.join(map(str, pids))}) and "
                                    "keeps the GPU open; --stop-services stops it now and restore restarts it"))
    return result


def _holder_checks(host: HostRoot, moving, checks: list[PlanCheck], excluded_comms: set[str]) -> None:
    nvidia_fns = [fn for fn in moving if fn.driver == "nvidia"]
    if not nvidia_fns:
        return
    holders: list[Holder] = [h for h in nvidia_holders(host) if h.comm not in excluded_comms]
    minors = {fn.address: nvidia_minor(host, fn.address) for fn in nvidia_fns}
    for fn in nvidia_fns:
        minor = minors[fn.address]
        if minor is not None:
            wanted = {f"/dev/nvidia{minor}"}
            mine = [h for h in holders if wanted & set(h.device_nodes)]
        else:  # unknown minor: any per-GPU node may be this GPU
            mine = [h for h in holders if any(re.fullmatch(r"/dev/nvidia\d+", n) for n in h.device_nodes)]
        if mine:
            checks.append(PlanCheck("holders", REFUSE, f"{fn.address}: " + "; ".join(h.describe() for h in mine)
                                    + " -- unbinding nvidia under them can hang in the kernel; stop them first"))
    shared = [h for h in holders if not any(re.fullmatch(r"/dev/nvidia\d+", n) for n in h.device_nodes)]
    if shared:
        checks.append(PlanCheck("holders", WARN, "open on the driver, not on this GPU: "
                                + "; ".join(h.describe() for h in shared)))
    elif not any(c.check_id == "holders" for c in checks):
        checks.append(PlanCheck("holders", OK, "no process holds the GPU's /dev/nvidia* node"))


def _domain_checks(domains_using, devices: list[PciAddress], checks: list[PlanCheck]) -> None:
    if domains_using is None:
        checks.append(PlanCheck("libvirt", SKIP, "libvirt not consulted"))
        return
    try:
        used = domains_using(devices)
    except Exception as exc:  # noqa: BLE001 - a broken daemon must not block binding
        checks.append(PlanCheck("libvirt", SKIP, f"libvirt not reachable ({exc}); domain check skipped"))
        return
    if used is None:
        checks.append(PlanCheck("libvirt", SKIP, "no libvirt daemon reachable; domain check skipped"))
        return
    busy = {a: names for a, names in used.items() if names}
    for address, names in sorted(busy.items()):
        checks.append(PlanCheck("libvirt", REFUSE, f"{address} is assigned to libvirt domain(s) "
                                f"{', '.join(sorted(names))}; detach it there first"))
    if not busy:
        checks.append(PlanCheck("libvirt", OK, "no libvirt domain uses these devices"))
