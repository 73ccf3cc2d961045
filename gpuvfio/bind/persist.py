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
import os
import re
import shlex
from dataclasses import dataclass

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.host.root import HostRoot

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


@dataclass(slots=True)
class FileChange:
    path: str
    old: str | None  # None: the file does not exist
    new: str | None  # None: the file is removed
    link: bool = False  # old/new are symlink targets (systemd's enablement link)

    def diff(self, root: str) -> str:
        rel = "/" + os.path.relpath(self.path, root)
        if self.link:
            return f"--- {rel}\n+++ {rel}\n-> {self.old or '(none)'}\n+> {self.new or '(removed)'}\n"
        return "".join(difflib.unified_diff((self.old or "").splitlines(True), (self.new or "").splitlines(True),
                                            f"a{rel}" if self.old is not None else "/dev/null",
                                            f"b{rel}" if self.new is not None else "/dev/null"))


def _read_link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


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


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def driver_module(host: HostRoot, driver: str) -> str | None:
    """The kernel module behind a PCI driver: modprobe's softdep names modules, and driver names
    differ from them (xhci_hcd is xhci_pci, nvidia-gpu is i2c_nvidia_gpu). The driver's
    ``module`` link names it (drivers/base/module.c); a built-in driver has none."""
    try:
        return host.link_name(host.sys_path("bus", "pci", "drivers", driver, "module"))
    except GpuvfioError:
        return None


def uses_driverctl(host: HostRoot) -> bool:
    return any(os.path.exists(host.path(*parts)) for parts in DRIVERCTL_BINARIES)


def persisted(host: HostRoot) -> dict[str, set[PciAddress]]:
    """What is persisted now, by mechanism."""
    result = {"udev": set(), "driverctl": set()}
    for match in _RULE.finditer(_read(host.path(*UDEV_RULES)) or ""):
        addr = PciAddress.try_parse(match.group(1))
        if addr:
            result["udev"].add(addr)
    for name in host.listdir(host.path(*DRIVERCTL_DIR)):
        if name.startswith("pci-"):
            addr = PciAddress.try_parse(name[4:])
            if addr and (_read(host.path(*DRIVERCTL_DIR, name)) or "").strip() == "vfio-pci":
                result["driverctl"].add(addr)
    return result


def overrides(host: HostRoot) -> list[dict]:
    """Every boot-time driver override, as ``driverctl list-overrides`` shows its own (any
    driver), and gpuvfio's udev rules (vfio-pci): address, driver, mechanism."""
    found = []
    for name in sorted(host.listdir(host.path(*DRIVERCTL_DIR))):
        addr = PciAddress.try_parse(name[4:]) if name.startswith("pci-") else None
        driver = (_read(host.path(*DRIVERCTL_DIR, name)) or "").strip()
        if addr is not None and driver and driver.isprintable() and len(driver) <= 64:
            found.append({"address": str(addr), "driver": driver, "mechanism": "driverctl"})
    for addr in sorted(persisted(host)["udev"]):
        found.append({"address": str(addr), "driver": "vfio-pci", "mechanism": "udev (gpuvfio)"})
    return sorted(found, key=lambda o: (o["address"], o["mechanism"]))


def plan_persist(host: HostRoot, add: list[PciAddress], remove: list[PciAddress],
                 host_modules: set[str]) -> list[FileChange]:
    """Changes that make ``add`` persist on vfio-pci and drop ``remove``; pure reading."""
    driverctl = uses_driverctl(host)
    current = persisted(host)
    wanted = (current["udev"] | current["driverctl"] | set(add)) - set(remove)
    changes: list[FileChange] = []
    if driverctl:
        for addr in sorted(set(add) | set(remove) | current["udev"]):
            path = host.path(*DRIVERCTL_DIR, f"pci-{addr}")
            new = "vfio-pci\n" if addr in wanted else None
            changes.append(FileChange(path, _read(path), new))
        udev_set: set[PciAddress] = set()  # migrate our own rules to driverctl's store
    else:
        udev_set = wanted
        for addr in sorted(current["driverctl"] & set(remove)):
            path = host.path(*DRIVERCTL_DIR, f"pci-{addr}")
            changes.append(FileChange(path, _read(path), None))
    rules_path = host.path(*UDEV_RULES)
    rules = None
    if udev_set:
        rules = HEADER + "".join(
            f'ACTION=="add", SUBSYSTEM=="pci", KERNEL=="{addr}", ATTR{{driver_override}}="vfio-pci"\n'
            for addr in sorted(udev_set))
    changes.append(FileChange(rules_path, _read(rules_path), rules))
    unit_path = host.path(*UNIT)
    changes.append(FileChange(unit_path, _read(unit_path), unit_file(sorted(udev_set)) if udev_set else None))
    wants = host.path(*UNIT_WANTS)
    changes.append(FileChange(wants, _read_link(wants), "/" + "/".join(UNIT) if udev_set else None, link=True))
    softdep_path = host.path(*SOFTDEP)
    drivers = set(_SOFTDEP.findall(_read(softdep_path) or "")) | set(host_modules)
    drivers -= {"vfio-pci", "vfio_pci"}
    softdep = HEADER + "".join(f"softdep {d} pre: vfio-pci\n" for d in sorted(drivers)) if wanted and drivers else None
    changes.append(FileChange(softdep_path, _read(softdep_path), softdep))
    load_path = host.path(*MODULES_LOAD)
    changes.append(FileChange(load_path, _read(load_path), HEADER + "vfio-pci\n" if wanted else None))
    return [c for c in changes if c.old != c.new]


def commit(changes: list[FileChange], rename=os.replace) -> None:
    """Write all changes or none: temps first, then renames; undo renames on failure."""
    temps: list[tuple[FileChange, str | None]] = []
    try:
        try:
            for change in changes:
                temps.append((change, _temp_for(change)))
        except OSError as exc:
            raise GpuvfioError(f"persisting failed while writing {change.path}: {exc.strerror or exc}; "
                               "nothing was changed") from None
        done: list[FileChange] = []
        try:
            for change, tmp in temps:
                if tmp is None:
                    if os.path.lexists(change.path):
                        os.unlink(change.path)
                else:
                    rename(tmp, change.path)
                done.append(change)
        except OSError as exc:
            for change in reversed(done):
                _put_back(change)
            raise GpuvfioError(f"persisting failed at {change.path}: {exc.strerror or exc}; "
                               "earlier files were put back") from None
    finally:
        for _change, tmp in temps:
            if tmp and os.path.lexists(tmp):
                os.unlink(tmp)


def _temp_for(change: FileChange) -> str | None:
    """The new content in a temp file beside its target (None: the change removes the file)."""
    if change.new is None:
        return None
    os.makedirs(os.path.dirname(change.path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(change.path), f".{os.path.basename(change.path)}.gpuvfio-tmp")
    if change.link:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(change.new, tmp)
        return tmp
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(change.new)
        handle.flush()
        os.fsync(handle.fileno())
    return tmp


def _put_back(change: FileChange) -> None:
    if change.old is None or change.link:
        if os.path.lexists(change.path):
            os.unlink(change.path)
        if change.link and change.old is not None:
            os.symlink(change.old, change.path)
        return
    with open(change.path, "w", encoding="utf-8") as handle:
        handle.write(change.old)


def initramfs_hint(host: HostRoot) -> str:
    os_release = _read(host.config_path("etc", "os-release")) or ""
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
    unknown = [str(a) for a in addresses if a not in known]
    if unknown:
        raise InputError(f"no such PCI function on this host: {', '.join(unknown)}")
