"""Planning a bind: which endpoints move, the pre-checks, and the steps. No side effects.

The kernel facts this follows (the kernel's Documentation/ABI/testing/sysfs-bus-pci):
bind by address -- write ``driver_override``, unbind from the current driver, write the
address to ``drivers_probe``, then check the ``driver`` link. Never ``new_id`` (it takes
every card with that ID). VFIO hands out whole IOMMU groups, so every endpoint of the
group moves (bridges stay on pcieport; NVSwitches are endpoints).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.host import assignable
from gpuvfio.host.fabric import Decision
from gpuvfio.host.host_use import HostUseReader
from gpuvfio.names import is_driver_name
from gpuvfio.planning import Check, CheckStatus, Step, StepKind
from gpuvfio.text import printable
from gpuvfio.host.inventory import Inventory
from gpuvfio.host.kernel import KernelInfo
from gpuvfio.host.model import PciFunction
from gpuvfio.host.pcie_health import HealthRecords, Rating, plan_findings, read_records
from gpuvfio.host.nvidia import (FABRIC_MANAGER_UNIT, NVIDIA_SERVICES, SHARED_NVSWITCH, fabric_mode, holds_gpu,
                                 nvidia_holders, nvidia_minor, running_services)
from gpuvfio.host.root import HostRoot

VFIO_DRIVER = "vfio-pci"



OK, REFUSE, WARN, SKIP = CheckStatus.OK, CheckStatus.REFUSE, CheckStatus.WARN, CheckStatus.SKIP


class BindStatus(str, Enum):
    """How a bind ended (or would): moved, already there, refused, or only planned (dry run)."""

    APPLIED = "applied"
    NOTHING_TO_DO = "nothing_to_do"
    REFUSED = "refused"
    DRY_RUN = "dry_run"


@dataclass(slots=True)
class BindPlan:
    requested: list[PciAddress]
    devices: list[PciAddress]  # endpoints that will end on vfio-pci
    moving: list[PciAddress]  # the subset not there yet
    originals: dict[PciAddress, tuple[str | None, str | None]]  # driver, driver_override
    groups: dict[PciAddress, int | None]
    steps: list[Step] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    services: list[str] = field(default_factory=list)

    def refusals(self, force: bool) -> list[Check]:
        return [c for c in self.checks if c.status == REFUSE and not (force and c.overridable)]

    @property
    def nothing_to_do(self) -> bool:
        return not self.moving

    def to_json(self, root: str | None = None) -> dict:
        """``root``: show step paths as the host names them (for plans made on a recorded host)."""
        return {"devices": [str(d) for d in self.devices], "steps": [s.to_json(root) for s in self.steps],
                "checks": [c.to_json() for c in self.checks]}


@dataclass(slots=True)
class BindReport:
    """A bind as decided and carried out (gpuvfio bind, attach's bind step, a dry run, Ansible
    check mode, testbed plan): what ends on vfio-pci, the steps, every check, what moves, the
    checks that refuse, the HGX baseboard's decision, and how it ended (None: only planned, not
    yet judged as a run)."""

    devices: list[PciAddress]
    steps: list[Step]
    checks: list[Check]
    moving: list[PciAddress]
    refused: list[Check]
    root: str | None = None  # step paths are shown as the host beneath this root names them
    fabric: Decision | None = None
    status: BindStatus | None = None

    @classmethod
    def of(cls, plan: BindPlan, refused: list[Check], *, root: str | None = None,
           fabric: Decision | None = None) -> "BindReport":
        return cls(list(plan.devices), list(plan.steps), list(plan.checks), list(plan.moving), list(refused),
                   root, fabric, BindStatus.NOTHING_TO_DO if plan.nothing_to_do else None)

    def to_json(self) -> dict:
        out = {"devices": [str(d) for d in self.devices], "steps": [s.to_json(self.root) for s in self.steps],
               "checks": [c.to_json() for c in self.checks], "moving": [str(a) for a in self.moving],
               "refused": [c.to_json() for c in self.refused]}
        if self.fabric is not None:
            out["fabric"] = self.fabric.to_json()
        if self.status is not None:
            out["result"] = self.status.value
        return out


@dataclass(slots=True)
class ServicePlan:
    """The NVIDIA services a bind meets: the units it stops (--stop-services) and the ones kept
    running on purpose (the Fabric Manager in shared-NVSwitch mode)."""

    units: list[str] = field(default_factory=list)
    kept: set[str] = field(default_factory=set)


@dataclass(slots=True, frozen=True)
class LibvirtView:
    """What libvirt said about the devices: the domains using each (running or only defined),
    or why it was not asked (``not_asked``: a recorded host, ``--connect none``), or why it did
    not answer (``error``: the check could not run, so the bind is refused -- fail closed)."""

    users: dict[PciAddress, list[str]] | None = None
    not_asked: str | None = None
    error: str | None = None


@dataclass(slots=True, frozen=True)
class BindPolicy:
    """How a bind may proceed: the same for gpuvfio bind, attach, the testbed and Ansible."""

    force: bool = False  # override the checks marked overridable (foreign device in the group, boot VGA)
    stop_services: bool = False  # stop nvidia-persistenced / fabricmanager / DCGM (restore restarts them)
    allow_unsafe_host: bool = False  # ACS override, unsafe interrupts, no-IOMMU mode
    take_host_devices: bool = False  # take what the host itself uses: its disks, network, console


def plan_bind(host: HostRoot, inventory: Inventory, kernel: KernelInfo, addresses: list[PciAddress],
              policy: BindPolicy, libvirt: LibvirtView, records: HealthRecords | None = None) -> BindPlan:
    """Plan moving the IOMMU groups of ``addresses`` to vfio-pci; reads the host, changes nothing.
    ``records``: what the devices' health is rated on besides sysfs (the journal's marks of
    devices come back dead, refused until reset; the kernel log; the reset verdicts), read by
    the caller with its journal, else here without marks and with the default state directory."""
    if not addresses:
        raise InputError("no PCI address given")
    for address in addresses:
        assignable.endpoint(inventory, address)
    checks: list[Check] = []
    endpoints = _group_checks(inventory, kernel, addresses, checks)
    _unsafe_host_checks(kernel, checks, policy.allow_unsafe_host)
    devices = sorted(endpoints)
    fns = {a: inventory.functions[a] for a in devices}
    moving = [a for a in devices if fns[a].driver != VFIO_DRIVER]
    originals = {a: (fns[a].driver, fns[a].driver_override) for a in devices}
    services = _service_checks(host, [fns[a] for a in moving], checks, policy.stop_services)
    _holder_checks(host, [fns[a] for a in moving], checks, set(services.units), services.kept)
    _host_use_checks(host, inventory, moving, checks, policy.take_host_devices)
    for address in moving:
        _moving_checks(host, kernel, fns[address], address not in addresses, checks)
    _health_checks(host, inventory, fns, records or read_records(host, None, {}), checks)
    _domain_checks(libvirt, devices, checks)
    steps = _vfio_module_steps(host, kernel, moving, checks) + _move_steps(host, fns, moving, services.units)
    return BindPlan(requested=sorted(addresses), devices=devices, moving=moving, originals=originals,
                    groups=endpoints, steps=steps, checks=checks, services=services.units)


def _group_checks(inventory: Inventory, kernel: KernelInfo, addresses: list[PciAddress],
                  checks: list[Check]) -> dict[PciAddress, int | None]:
    """The endpoints that end on vfio-pci, each with its IOMMU group (None: the host has no
    groups), and the checks of the groups: what refuses an address (gpuvfio.host.assignable),
    each message once, and why a group may go (viable, or every device in it asked for)."""
    endpoints: dict[PciAddress, int | None] = {}
    if inventory.groups is not None:
        checks.append(Check("iommu", OK, f"{kernel.iommu_vendor or 'an'} IOMMU with "
                                f"{len(inventory.groups)} groups"))
    seen: set[str] = set()
    for address in addresses:
        group = inventory.group_of(address)
        if group is None:
            endpoints[address] = None
        else:
            for member in group.devices:
                if not inventory.functions[member].is_bridge:
                    endpoints[member] = group.group_id
        problems = assignable.problems(inventory, address, addresses)
        for problem in problems:
            if problem.message not in seen:
                seen.add(problem.message)
                checks.append(Check(problem.check_id, REFUSE, problem.message, problem.overridable))
        if group is not None and f"group {group.group_id}" not in seen:
            members = ", ".join(str(d) for d in group.devices)
            if group.viable:
                seen.add(f"group {group.group_id}")
                checks.append(Check("group_viable", OK, f"group {group.group_id} is viable: {members}"))
            elif assignable.whole_group(inventory, address, addresses):
                seen.add(f"group {group.group_id}")
                checks.append(Check("group_viable", OK, f"group {group.group_id} goes whole: every device "
                                        f"in it is asked for ({members})"))
    return endpoints


def _health_checks(host: HostRoot, inventory: Inventory, fns: dict[PciAddress, PciFunction], records: HealthRecords,
                   checks: list[Check]) -> None:
    """What ``gpuvfio health`` finds wrong with a device (host.pcie_health.plan_findings): a
    failed finding refuses the bind -- for its counters or its link --force overrides (the
    admin may bind a device to test it), not for a device that does not answer config space or
    that the journal marks as come back broken from its last guest (until gpuvfio reset: dead,
    not free) -- and a degraded one (a reset that failed qualification among them), or a
    reading that cannot be trusted, warns."""
    for address, fn in fns.items():
        for finding in plan_findings(host, inventory, fn, records):
            failed = finding.status is Rating.FAILED
            checks.append(Check("health", REFUSE if failed else WARN, f"{address}: {finding.message}",
                                overridable=failed and finding.overridable))


def _vfio_module_steps(host: HostRoot, kernel: KernelInfo, moving: list[PciAddress],
                       checks: list[Check]) -> list[Step]:
    """Loading vfio-pci when a device moves and it is not loaded yet, and its check: loaded,
    loadable (a module or built in), or refused (neither)."""
    steps: list[Step] = []
    vfio_loaded = host.is_dir(host.sys_path("bus", "pci", "drivers", VFIO_DRIVER))
    if moving and not vfio_loaded:
        if kernel.module_available("vfio_pci") or "vfio_pci" in kernel.builtin_modules:
            steps.append(Step(StepKind.MODPROBE, name="vfio-pci"))
        else:
            checks.append(Check("vfio_modules", REFUSE, "vfio-pci is neither loaded nor in this kernel's "
                                    "modules (see gpuvfio doctor)"))
    if moving:
        checks.append(Check("vfio_modules", OK, "vfio-pci " + ("loaded" if vfio_loaded else "loadable")))
    return steps


def _move_steps(host: HostRoot, fns: dict[PciAddress, PciFunction], moving: list[PciAddress],
                units: list[str]) -> list[Step]:
    """The steps that move the devices, in the order the module docstring gives: the services
    stopped, then driver_override written for every moving device, their unbinds from the
    drivers they are on, and their probes, each checked to end on vfio-pci."""
    steps: list[Step] = []
    for name in units:
        steps.append(Step(StepKind.STOP_SERVICE, name=name))
    for address in moving:
        path = host.sys_path("bus", "pci", "devices", str(address), "driver_override")
        steps.append(Step(StepKind.OVERRIDE, str(address), path, VFIO_DRIVER))
    for address in moving:
        driver = fns[address].driver
        if driver:
            path = host.sys_path("bus", "pci", "drivers", driver, "unbind")
            steps.append(Step(StepKind.UNBIND, str(address), path, str(address), expect=None, name=driver))
    for address in moving:
        steps.append(Step(StepKind.PROBE, str(address), host.sys_path("bus", "pci", "drivers_probe"), str(address),
                          expect=VFIO_DRIVER))
    return steps


def _moving_checks(host: HostRoot, kernel: KernelInfo, fn, companion: bool, checks: list[Check]) -> None:
    """What refuses moving one function: names the journal could not hold, the boot console,
    SR-IOV VFs on a function taken along (``companion``), no driver_override attribute."""
    address = fn.address
    _name_checks(fn, checks)
    if fn.boot_vga:
        fbs = ", ".join(kernel.framebuffers) or "no framebuffer listed"
        checks.append(Check("boot_vga", REFUSE, f"{address} drives the host console (boot_vga=1; {fbs}); "
                                "the host loses its display", overridable=True))
    if fn.sriov_num_vfs and companion:
        checks.append(Check("sriov", REFUSE, f"{address} has {fn.sriov_num_vfs} SR-IOV VFs enabled; "
                                "disable them first (echo 0 > sriov_numvfs)"))
    real = host.resolve_in_sys(host.sys_path("bus", "pci", "devices", str(address)))
    if not host.exists(os.path.join(real, "driver_override")):
        checks.append(Check("driver_override", REFUSE, f"{address} has no driver_override attribute "
                                "(kernel older than 3.16?): gpuvfio binds only by address"))


def _name_checks(fn, checks: list[Check]) -> None:
    """The driver and driver_override a bind journals and writes back must be names the journal
    takes and sysfs can be given again (gpuvfio.names): refused before the first write, never a
    journal gpuvfio cannot read back."""
    for what, value in (("driver", fn.driver), ("driver_override", fn.driver_override)):
        if value is not None and not is_driver_name(value):
            checks.append(Check("names", REFUSE, f"{fn.address}: its {what} is {printable(repr(value))}, not a "
                                    "kernel driver name: gpuvfio could not journal it and write it back"))


TAKE_HOST_DEVICES = "--take-host-devices"


def _host_use_checks(host: HostRoot, inventory: Inventory, moving: list[PciAddress], checks: list[Check],
                     take: bool) -> None:
    """What the host itself runs on (gpuvfio.host.host_use) refuses the bind of its function: its
    mounted disks and swap, the interfaces that carry its routes and addresses, its console. A
    function that is no GPU but that the host does not use stays plannable (NICs and disks go to
    guests beside GPUs), and the plan says it is no GPU. A tree that cannot answer refuses
    (fail closed). ``take``: the one override, the same flag everywhere."""
    if not moving:
        return
    taken = f" (taken anyway: {TAKE_HOST_DEVICES})"
    try:
        reader = HostUseReader(host)
    except GpuvfioError as exc:
        checks.append(Check("host_use", WARN if take else REFUSE, str(exc) + (taken if take else
                                f"; {TAKE_HOST_DEVICES} binds without knowing")))
        return
    clean = []
    for address in moving:
        try:
            uses = reader.uses(address)
        except GpuvfioError as exc:  # a link out of sys up the stack, an unreadable attribute: fail closed
            checks.append(Check("host_use", WARN if take else REFUSE, f"{address}: cannot tell what the host "
                                    f"uses on it: {exc}" + (taken if take else f" ({TAKE_HOST_DEVICES} binds "
                                                                               "without knowing)")))
            continue
        for use in uses:
            checks.append(Check("host_use", WARN, use.describe() + taken) if take else
                          Check("host_use", REFUSE, f"{use.describe()}: the host loses it "
                                    f"({TAKE_HOST_DEVICES} to take it anyway)"))
        if not uses:
            clean.append(address)
        if not uses and not _gpu_or_companion(inventory, address):
            fn = inventory.functions[address]
            checks.append(Check("host_use", OK, f"{address} is not a GPU ({fn.class_name or fn.class_id}); "
                                    "nothing on the host uses it"))
    if clean:
        checks.append(Check("host_use", OK, "the host itself does not use "
                                + ", ".join(str(a) for a in clean) + " (no mounted disk, swap, route, address "
                                "or console on them)"))


def _gpu_or_companion(inventory: Inventory, address: PciAddress) -> bool:
    """A display controller, an NVIDIA function (NVSwitch), or a function in a GPU's slot (its
    audio, USB-C and serial-bus functions)."""
    fn = inventory.functions[address]
    if fn.is_gpu or fn.is_nvidia:
        return True
    return any(other.is_gpu for other in inventory.functions.values() if other.address.device == address.device)


def _unsafe_host_checks(kernel: KernelInfo, checks: list[Check], allowed: bool) -> None:
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
            checks.append(Check(check_id, WARN, message + " (allowed by --allow-unsafe-host)"))
        else:
            checks.append(Check(check_id, REFUSE, message + flag))


def _service_checks(host: HostRoot, moving, checks: list[Check], stop: bool) -> ServicePlan:
    """Units to stop (with --stop-services), and units kept running on purpose: the Fabric
    Manager in shared-NVSwitch mode manages the NVSwitches for the guests' GPUs."""
    result = ServicePlan()
    if not any(fn.driver == "nvidia" for fn in moving):
        return result
    shared_nvswitch = fabric_mode(host) == SHARED_NVSWITCH
    for unit, pids in running_services(host).items():
        listed = ", ".join(map(str, pids))
        if unit == FABRIC_MANAGER_UNIT and shared_nvswitch:
            checks.append(Check("services", OK, f"{unit} (pid {listed}) runs in shared-NVSwitch mode "
                                    "(FABRIC_MODE=1): it manages the NVSwitches for the guests and keeps running"))
            result.kept.add(unit)
        elif stop:
            checks.append(Check("services", WARN, f"{unit} (pid {listed}) will be stopped and restarted by "
                                    "gpuvfio restore"))
            result.units.append(unit)
        else:
            checks.append(Check("services", REFUSE, f"{unit} is running (pid {listed}) and keeps the GPU open; "
                                    "--stop-services stops it now and restore restarts it"))
    return result


_UNIT_COMMS = {unit: comm for comm, unit in NVIDIA_SERVICES.items()}


def _holder_checks(host: HostRoot, moving, checks: list[Check], stopped: set[str], kept: set[str]) -> None:
    """Processes holding a moving GPU's /dev/nvidiaN refuse the bind. Services being stopped
    let go of it; a service kept running (the Fabric Manager in shared-NVSwitch mode) holds
    only the NVSwitch and control nodes, and refuses the bind like anyone else if it holds the GPU."""
    nvidia_fns = [fn for fn in moving if fn.driver == "nvidia"]
    if not nvidia_fns:
        return
    stopped_comms = {_UNIT_COMMS[u] for u in stopped if u in _UNIT_COMMS}
    kept_comms = {_UNIT_COMMS[u] for u in kept if u in _UNIT_COMMS}
    holders = [h for h in nvidia_holders(host) if h.comm not in stopped_comms]
    held_by: dict[str, list[str]] = {}  # the holders, described -> the functions they hold (said once)
    for fn in nvidia_fns:
        minor = nvidia_minor(host, fn.address)
        if minor is not None:
            wanted = {f"/dev/nvidia{minor}"}
            mine = [h for h in holders if wanted & set(h.device_nodes)]
        else:  # unknown minor: any per-GPU node may be this GPU
            mine = [h for h in holders if holds_gpu(h)]
        if mine:
            held_by.setdefault("; ".join(h.describe() for h in mine), []).append(str(fn.address))
    for described, addresses in held_by.items():
        checks.append(Check("holders", REFUSE, f"{', '.join(addresses)}: {described}"
                                " -- unbinding nvidia under them can hang in the kernel; stop them first"))
    shared = [h for h in holders if not holds_gpu(h) and h.comm not in kept_comms]
    if shared:
        checks.append(Check("holders", WARN, "open on the driver, not on this GPU: "
                                + "; ".join(h.describe() for h in shared)))
    elif not any(c.check_id == "holders" for c in checks):
        checks.append(Check("holders", OK, "no process holds the GPU's /dev/nvidia* node"))


def _domain_checks(libvirt: LibvirtView, devices: list[PciAddress], checks: list[Check]) -> None:
    if libvirt.error is not None:
        checks.append(Check("libvirt", REFUSE, f"cannot ask libvirt which domains use these devices: "
                                f"{libvirt.error} (start libvirtd, give --connect URI, or --connect none to bind "
                                "without asking)"))
        return
    if libvirt.users is None:
        checks.append(Check("libvirt", SKIP, libvirt.not_asked or "libvirt not consulted"))
        return
    busy = {a: names for a, names in libvirt.users.items() if names and a in devices}
    for address, names in sorted(busy.items()):
        checks.append(Check("libvirt", REFUSE, f"{address} is assigned to libvirt domain(s) "
                                f"{', '.join(sorted(names))}; detach it there first"))
    if not busy:
        checks.append(Check("libvirt", OK, "no libvirt domain uses these devices"))
