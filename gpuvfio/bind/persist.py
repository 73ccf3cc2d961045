"""Binding that survives a reboot, by address (never by vendor:device ID).

Where driverctl is installed, its own store is the well-kept way: one file
``/etc/driverctl.d/pci-<addr>`` holding the driver name; its udev rule starts
``driverctl@pci-<addr>.service`` when the device appears, which sets driver_override
and reprobes. Without driverctl gpuvfio writes the equivalent itself: a udev rule
that sets ``driver_override`` on the device's add event (before 80-drivers.rules
loads the host driver), plus in both cases
  * ``/etc/modprobe.d/gpuvfio-vfio.conf``: ``softdep <host driver> pre: vfio-pci`` so
    vfio-pci is loaded (and claims the device) before nvidia/snd_hda_intel,
  * ``/etc/modules-load.d/gpuvfio-vfio.conf``: load vfio-pci at boot.
The files are written as one transaction: every new content goes to a temp file
(fsync) first, then the renames; a failing rename puts back what was renamed.
"""

from __future__ import annotations

import difflib
import re
import shlex
from dataclasses import dataclass
from enum import Enum

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.host.inventory import require_present
from gpuvfio.host.root import HostRoot
from gpuvfio.names import is_module_name
from gpuvfio.text import printable
from gpuvfio.planning import Step, StepKind

UDEV_RULES = ("etc", "udev", "rules.d", "61-gpuvfio-vfio-pci.rules")
SOFTDEP = ("etc", "modprobe.d", "gpuvfio-vfio.conf")
MODULES_LOAD = ("etc", "modules-load.d", "gpuvfio-vfio.conf")
UNIT = ("etc", "systemd", "system", "gpuvfio-vfio-pci.service")
UNIT_WANTS = ("etc", "systemd", "system", "multi-user.target.wants", "gpuvfio-vfio-pci.service")
# A device already bound when udev ran (a driver in the initramfs, a built-in driver) keeps
# its driver: this oneshot unit moves it, like driverctl@.service does. The addresses are
# separate arguments of the script (validated PciAddress values), never spliced into it.
UNIT_SCRIPT = ('SYS=/sys; for d in "$@"; do p=$SYS/bus/pci/devices/$d; [ -e "$p" ] || continue; '
               'cur=$(basename "$(readlink "$p/driver" 2>/dev/null)"); [ "$cur" = vfio-pci ] && continue; '
               'echo vfio-pci > "$p/driver_override"; [ -e "$p/driver" ] && echo "$d" > "$p/driver/unbind"; '
               'echo "$d" > $SYS/bus/pci/drivers_probe; done')
DRIVERCTL_DIR = ("etc", "driverctl.d")
DRIVERCTL_BINARIES = (("usr", "sbin", "driverctl"), ("usr", "bin", "driverctl"), ("sbin", "driverctl"))
HEADER = "# Managed by gpuvfio persist; edit with gpuvfio persist/unpersist.\n"
_RULE = re.compile(r'KERNEL=="([0-9a-f:.]+)"')
_SOFTDEP = re.compile(r"^softdep (\S+) pre: vfio-pci$", re.M)


class Mechanism(str, Enum):
    """How a boot-time override is kept: driverctl's store, or gpuvfio's own udev rule."""

    DRIVERCTL = "driverctl"
    UDEV = "udev"


class ChangeAction(str, Enum):
    CREATE = "create"
    UPDATE = "update"
    REMOVE = "remove"


class PersistStatus(str, Enum):
    """How a persist or unpersist ended: files written, nothing to change, or only planned."""

    APPLIED = "applied"
    NOTHING_TO_DO = "nothing_to_do"
    DRY_RUN = "dry_run"


@dataclass(slots=True)
class FileChange:
    rel: str  # beneath the host root (etc/udev/rules.d/...)
    old: str | None  # None: the file does not exist
    new: str | None  # None: the file is removed
    link: bool = False  # old/new are symlink targets (systemd's enablement link)

    @property
    def path(self) -> str:
        """As the host names it."""
        return "/" + self.rel

    @property
    def action(self) -> ChangeAction:
        if self.new is None:
            return ChangeAction.REMOVE
        return ChangeAction.CREATE if self.old is None else ChangeAction.UPDATE

    def diff(self) -> str:
        rel = self.path
        if self.link:
            return f"--- {rel}\n+++ {rel}\n-> {self.old or '(none)'}\n+> {self.new or '(removed)'}\n"
        return "".join(difflib.unified_diff((self.old or "").splitlines(True), (self.new or "").splitlines(True),
                                            f"a{rel}" if self.old is not None else "/dev/null",
                                            f"b{rel}" if self.new is not None else "/dev/null"))


@dataclass(frozen=True, slots=True)
class Override:
    """One boot-time driver override: the device, the driver it gets at boot, and by what."""

    address: PciAddress
    driver: str
    mechanism: Mechanism

    @property
    def source(self) -> str:
        """The mechanism as ``persist --list`` names it: driverctl's store holds anyone's
        overrides (any driver); the udev rules are gpuvfio's own."""
        return "udev (gpuvfio)" if self.mechanism is Mechanism.UDEV else self.mechanism.value

    def to_json(self) -> dict:
        return {"address": str(self.address), "driver": self.driver, "mechanism": self.source}


@dataclass(slots=True)
class PersistedOverrides:
    """``gpuvfio persist --list``: every boot-time override, and the mechanism persist uses here."""

    overrides: list[Override]
    mechanism: Mechanism

    def to_json(self) -> dict:
        return {"overrides": [o.to_json() for o in self.overrides], "mechanism": self.mechanism.value}


@dataclass(slots=True)
class PersistReport:
    """A persist or unpersist: the devices (whole IOMMU groups), the mechanism, each file it
    changes (or would), how it ended, and the step left to the user (rebuild the initramfs)."""

    devices: list[PciAddress]
    mechanism: Mechanism
    changes: list[FileChange]
    status: PersistStatus
    next_step: str | None = None

    @property
    def steps(self) -> list[Step]:
        """The changes as steps of the run (commit writes them all, or none)."""
        return [Step(StepKind.REMOVE_FILE if c.action is ChangeAction.REMOVE else StepKind.WRITE_FILE,
                     path=c.path, detail=f"{c.action.value} {c.path}") for c in self.changes]

    def to_json(self) -> dict:
        out = {"devices": [str(a) for a in self.devices], "mechanism": self.mechanism.value,
               "changes": [{"path": c.path, "action": c.action.value, "diff": c.diff()} for c in self.changes],
               "steps": [s.to_json() for s in self.steps], "result": self.status.value}
        if self.next_step is not None:
            out["next"] = self.next_step
        return out


def _read_link(host: HostRoot, rel: str) -> str | None:
    return host.tree.readlink(rel)


def unit_file(addresses: list[PciAddress]) -> str:
    args = " ".join(shlex.quote(str(a)) for a in addresses)
    return (HEADER + "[Unit]\nDescription=gpuvfio: keep persisted PCI devices on vfio-pci\n"
            "After=systemd-udev-settle.service systemd-modules-load.service\n"
            "Before=libvirtd.service virtqemud.service nvidia-persistenced.service\n"
            "ConditionPathExists=/sys/bus/pci/drivers/vfio-pci\n\n"
            "[Service]\nType=oneshot\nRemainAfterExit=yes\n"
            # systemd expands $VAR in ExecStart itself: $$ passes a literal $ to the shell.
            f"ExecStart=/bin/sh -c {shlex.quote(UNIT_SCRIPT).replace('$', '$$')} gpuvfio-vfio-pci {args}\n\n"
            "[Install]\nWantedBy=multi-user.target\n")


PERSIST_FILE_LIMIT = 1 << 20


def _read(host: HostRoot, rel: str) -> str | None:
    """A persist file as it is now (read through the file layer: a link, FIFO or device in its
    place, or a linked etc/ directory on the way, is refused, never read through; not UTF-8 is
    bad input, named)."""
    return host.tree.text(rel, PERSIST_FILE_LIMIT)


def _rel(*parts: str) -> str:
    return "/".join(parts)


def driver_module(host: HostRoot, driver: str) -> str | None:
    """The kernel module behind a PCI driver: modprobe's softdep names modules, and driver names
    differ from them (xhci_hcd is xhci_pci, nvidia-gpu is i2c_nvidia_gpu). The driver's
    ``module`` link names it (drivers/base/module.c); a built-in driver has none."""
    try:
        module = host.link_name(host.sys_path("bus", "pci", "drivers", driver, "module"))
    except GpuvfioError:
        return None
    if module is not None and not is_module_name(module):
        # It goes into modprobe.d: a newline there would be a line of modprobe's own (install X CMD).
        raise Refused(f"refused: driver {printable(driver)}'s module link names {printable(repr(module))}, not a "
                      "kernel module name: gpuvfio writes no softdep for it")
    return module


def uses_driverctl(host: HostRoot) -> bool:
    return any(host.exists(host.path(*parts)) for parts in DRIVERCTL_BINARIES)


def mechanism(host: HostRoot) -> Mechanism:
    """What persist writes on this host: driverctl's store where driverctl is installed."""
    return Mechanism.DRIVERCTL if uses_driverctl(host) else Mechanism.UDEV


def persisted(host: HostRoot) -> dict[str, set[PciAddress]]:
    """What is persisted now, by mechanism."""
    result = {"udev": set(), "driverctl": set()}
    for match in _RULE.finditer(_read(host, _rel(*UDEV_RULES)) or ""):
        addr = PciAddress.try_parse(match.group(1))
        if addr:
            result["udev"].add(addr)
    for name in host.tree.listdir(_rel(*DRIVERCTL_DIR)):
        if name.startswith("pci-"):
            addr = PciAddress.try_parse(name[4:])
            if addr and (_read(host, _rel(*DRIVERCTL_DIR, name)) or "").strip() == "vfio-pci":
                result["driverctl"].add(addr)
    return result


def overrides(host: HostRoot) -> list[Override]:
    """Every boot-time driver override, as ``driverctl list-overrides`` shows its own (any
    driver), and gpuvfio's udev rules (vfio-pci): address, driver, mechanism."""
    found = []
    for name in host.tree.listdir(_rel(*DRIVERCTL_DIR)):
        addr = PciAddress.try_parse(name[4:]) if name.startswith("pci-") else None
        driver = (_read(host, _rel(*DRIVERCTL_DIR, name)) or "").strip() if addr is not None else ""
        if addr is not None and driver and driver.isprintable() and len(driver) <= 64:
            found.append(Override(addr, driver, Mechanism.DRIVERCTL))
    for addr in sorted(persisted(host)["udev"]):
        found.append(Override(addr, "vfio-pci", Mechanism.UDEV))
    return sorted(found, key=lambda o: (str(o.address), o.mechanism.value))


def plan_persist(host: HostRoot, add: list[PciAddress], remove: list[PciAddress],
                 host_modules: set[str]) -> list[FileChange]:
    """Changes that make ``add`` persist on vfio-pci and drop ``remove``; pure reading."""
    driverctl = uses_driverctl(host)
    current = persisted(host)
    wanted = (current["udev"] | current["driverctl"] | set(add)) - set(remove)
    changes: list[FileChange] = []
    if driverctl:
        for addr in sorted(set(add) | set(remove) | current["udev"]):
            path = _rel(*DRIVERCTL_DIR, f"pci-{addr}")
            new = "vfio-pci\n" if addr in wanted else None
            changes.append(FileChange(path, _read(host, path), new))
        udev_set: set[PciAddress] = set()  # migrate our own rules to driverctl's store
    else:
        udev_set = wanted
        for addr in sorted(current["driverctl"] & set(remove)):
            path = _rel(*DRIVERCTL_DIR, f"pci-{addr}")
            changes.append(FileChange(path, _read(host, path), None))
    rules_path = _rel(*UDEV_RULES)
    rules = None
    if udev_set:
        rules = HEADER + "".join(
            f'ACTION=="add", SUBSYSTEM=="pci", KERNEL=="{addr}", ATTR{{driver_override}}="vfio-pci"\n'
            for addr in sorted(udev_set))
    changes.append(FileChange(rules_path, _read(host, rules_path), rules))
    unit_path = _rel(*UNIT)
    changes.append(FileChange(unit_path, _read(host, unit_path), unit_file(sorted(udev_set)) if udev_set else None))
    wants = _rel(*UNIT_WANTS)
    changes.append(FileChange(wants, _read_link(host, wants), "/" + "/".join(UNIT) if udev_set else None, link=True))
    softdep_path = _rel(*SOFTDEP)
    drivers = set(_SOFTDEP.findall(_read(host, softdep_path) or "")) | set(host_modules)
    drivers -= {"vfio-pci", "vfio_pci"}
    bad = sorted(d for d in drivers if not is_module_name(d))
    if bad:  # checked again where it is written (the file's own lines are the host's input too)
        raise Refused(f"refused: {printable(', '.join(map(repr, bad)))} in {softdep_path} or the drivers "
                      "is not a kernel module name: gpuvfio writes no softdep for it")
    softdep = HEADER + "".join(f"softdep {d} pre: vfio-pci\n" for d in sorted(drivers)) if wanted and drivers else None
    changes.append(FileChange(softdep_path, _read(host, softdep_path), softdep))
    load_path = _rel(*MODULES_LOAD)
    changes.append(FileChange(load_path, _read(host, load_path), HEADER + "vfio-pci\n" if wanted else None))
    return [c for c in changes if c.old != c.new]


def commit(host: HostRoot, changes: list[FileChange], fault=None) -> None:
    """Write all changes or none: temps first (each beside its target, through the file layer:
    no linked directory on the way is followed), then the renames; undo the renames on failure.
    ``fault(path)``, when given, runs before each rename (a test's injected failure)."""
    tree = host.tree
    temps: list[tuple[FileChange, str | None]] = []
    try:
        try:
            for change in changes:
                temps.append((change, None if change.new is None else
                              tree.stage(change.rel, None if change.link else change.new,
                                         link=change.new if change.link else None)))
        except GpuvfioError as exc:
            raise GpuvfioError(f"persisting failed while writing {change.path}: {exc}; nothing was changed") from None
        done: list[FileChange] = []
        try:
            for change, tmp in temps:
                if fault is not None:
                    fault(change.path)
                if tmp is None:
                    tree.remove(change.rel)
                else:
                    tree.replace_with(tmp, change.rel)
                done.append(change)
        except (OSError, GpuvfioError) as exc:
            for undone in reversed(done):
                _put_back(tree, undone)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise GpuvfioError(f"persisting failed at {change.path}: {reason}; earlier files were put back") from None
    finally:
        for _change, tmp in temps:
            if tmp:
                tree.remove(tmp)


def _put_back(tree, change: FileChange) -> None:
    if change.old is None:
        tree.remove(change.rel)
    elif change.link:
        tree.symlink(change.rel, change.old)
    else:
        tree.write(change.rel, change.old)


def initramfs_hint(host: HostRoot) -> str:
    os_release = host.read(host.config_path("etc", "os-release")) or ""
    ids = set()
    for line in os_release.splitlines():
        if line.startswith(("ID=", "ID_LIKE=")):
            ids.update(line.split("=", 1)[1].strip('"').split())
    if ids & {"debian", "ubuntu"}:
        command = "update-initramfs -u -k all"
    elif ids & {"arch"}:
        command = "mkinitcpio -P"
    elif ids & {"rhel", "fedora", "centos", "suse", "opensuse", "sles"}:
        command = "dracut -f --regenerate-all"
    else:
        command = "update-initramfs -u (Debian/Ubuntu), dracut -f (RHEL/Fedora/SUSE) or mkinitcpio -P (Arch)"
    return (f"rebuild the initramfs so vfio-pci loads before the GPU driver there too: {command}")


def check_addresses(known: set[PciAddress], addresses: list[PciAddress]) -> None:
    if not addresses:
        raise InputError("no PCI address given")
    require_present(known, addresses)
