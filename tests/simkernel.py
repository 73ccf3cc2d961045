"""A small, honest model of the Linux PCI driver core for the unit lane.

It reacts to writes in a HostBuilder tree the way drivers/pci/pci-driver.c and
drivers/base/bus.c do:
  * ``<dev>/driver_override``: stored; an empty write (just "\\n") clears it to "(null)".
  * ``drivers/<drv>/unbind``: the device must be bound to <drv> (else ENODEV); removes the
    ``driver`` link and the driver's device link. A device held open blocks or refuses.
  * ``drivers_probe``: an unbound device gets the driver its override names, if that
    driver is loaded; without override, its native driver (the one it had when the
    tree was built). No loaded match: stays unbound, the write still succeeds.
  * ``drivers/<drv>/bind``: binds if the device is unbound and the override allows.
  * Binding vfio-pci creates ``/dev/vfio/<group>``; the last unbind in a group removes it.
  * A driver is loaded when ``sys/bus/pci/drivers/<drv>`` exists; ``modprobe`` creates it.
Failure injection (``inject``) is kept in a state file in the tree, because writes are
performed in gpuvfio's forked writer processes.
"""

from __future__ import annotations

import errno
import json
import os
import time

from tests.hostbuilder import write_uevent

STATE = ".simkernel.json"


class SimKernel:
    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.sys = os.path.join(self.root, "sys")
        if not os.path.exists(self.state_path):
            native = {}
            devices = os.path.join(self.sys, "bus", "pci", "devices")
            for addr in os.listdir(devices):
                link = os.path.join(devices, addr, "driver")
                native[addr] = os.path.basename(os.readlink(link)) if os.path.islink(link) else None
            self._save({"native": native, "faults": [], "writes": [], "modules": ["vfio-pci"]})

    # -- state -----------------------------------------------------------------------------
    @property
    def state_path(self) -> str:
        return os.path.join(self.root, STATE)

    def _load(self) -> dict:
        with open(self.state_path) as handle:
            return json.load(handle)

    def _save(self, state: dict) -> None:
        tmp = self.state_path + ".tmp"
        with open(tmp, "w") as handle:
            json.dump(state, handle)
        os.replace(tmp, self.state_path)

    def inject(self, op: str, address: str | None = None, *, errno_: int | None = None, hang: bool = False,
               wrong_driver: str | None = None, times: int = 1, driver: str | None = None,
               unclaimed: bool = False, effect: str | None = None) -> None:
        """Make the next ``times`` matching operations fail (op: override|unbind|probe|bind|reset;
        for reset, ``driver`` is the reset method and ``effect`` what it leaves, see _reset).
        ``unclaimed`` (probe): the write succeeds and no driver takes the device, as a real
        kernel's drivers_probe does when no driver matches it (drivers/base/bus.c
        drivers_probe_store -> device_attach: only a driver whose id table, dynamic ids or the
        device's driver_override match probes it; one that had it by an explicit bind does not)."""
        state = self._load()
        state["faults"].append({"op": op, "address": address, "errno": errno_, "hang": hang,
                                "wrong_driver": wrong_driver, "times": times, "driver": driver,
                                "unclaimed": unclaimed, "effect": effect})
        self._save(state)

    def writes(self) -> list[list[str]]:
        return self._load()["writes"]

    def _fault(self, state: dict, op: str, address: str, driver: str | None = None) -> dict | None:
        for fault in state["faults"]:
            if fault["op"] == op and fault["address"] in (None, address) and fault["times"] > 0 \
                    and fault.get("driver") in (None, driver):
                fault["times"] -= 1
                return fault
        return None

    # -- helpers ---------------------------------------------------------------------------
    def _dev(self, address: str) -> str:
        path = os.path.join(self.sys, "bus", "pci", "devices", address)
        if not os.path.lexists(path):
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        return os.path.realpath(path)

    def driver_of(self, address: str) -> str | None:
        link = os.path.join(self._dev(address), "driver")
        return os.path.basename(os.readlink(link)) if os.path.islink(link) else None

    def _override(self, dev: str) -> str | None:
        with open(os.path.join(dev, "driver_override")) as handle:
            value = handle.read().strip()
        return None if value in ("", "(null)") else value

    def _group(self, dev: str) -> str | None:
        link = os.path.join(dev, "iommu_group")
        return os.path.basename(os.readlink(link)) if os.path.islink(link) else None

    def _bind(self, address: str, dev: str, driver: str) -> None:
        ddir = os.path.join(self.sys, "bus", "pci", "drivers", driver)
        os.symlink(os.path.relpath(ddir, dev), os.path.join(dev, "driver"))
        os.symlink(os.path.relpath(dev, ddir), os.path.join(ddir, address))
        write_uevent(dev)
        if driver == "vfio-pci":
            group = self._group(dev)
            if group is not None:
                os.makedirs(os.path.join(self.root, "dev", "vfio"), exist_ok=True)
                open(os.path.join(self.root, "dev", "vfio", group), "a").close()

    def _unbind(self, address: str, dev: str, driver: str) -> None:
        os.unlink(os.path.join(dev, "driver"))
        os.unlink(os.path.join(self.sys, "bus", "pci", "drivers", driver, address))
        write_uevent(dev)
        if driver == "vfio-pci":
            group = self._group(dev)
            members = os.path.join(self.sys, "kernel", "iommu_groups", str(group), "devices")
            still = [m for m in os.listdir(members) if os.path.islink(os.path.join(members, m, "driver"))
                     and os.path.basename(os.readlink(os.path.join(members, m, "driver"))) == "vfio-pci"]
            node = os.path.join(self.root, "dev", "vfio", str(group))
            if not still and os.path.exists(node):
                os.unlink(node)

    def _loaded(self, driver: str) -> bool:
        return os.path.isdir(os.path.join(self.sys, "bus", "pci", "drivers", driver))

    @staticmethod
    def _fail(fault: dict) -> None:
        if fault["hang"]:
            while True:  # the kernel never returns from this write
                time.sleep(60)
        if fault["errno"]:
            raise OSError(fault["errno"], os.strerror(fault["errno"]))

    # -- the write(2) entry point (gpuvfio's SysfsWriter backend) ---------------------------
    def __call__(self, path: str, data: bytes, fd: int | None = None) -> None:
        state = self._load()
        value = data.decode()
        state["writes"].append([os.path.relpath(path, self.root), value])
        self._save(state)
        rel = os.path.relpath(path, self.sys).split(os.sep)
        try:
            self._dispatch(state, rel, value.strip(), path)
        finally:
            self._save(state)

    def _dispatch(self, state: dict, rel: list[str], value: str, path: str) -> None:
        name = rel[-1]
        if not os.path.exists(path):
            raise OSError(errno.ENOENT, os.strerror(errno.ENOENT))
        if name == "driver_override":
            address = os.path.basename(os.path.dirname(path))
            fault = self._fault(state, "override", address)
            if fault:
                self._fail(fault)
            with open(path, "w") as handle:
                handle.write((value or "(null)") + "\n")
            return
        if rel[:3] == ["bus", "pci", "drivers"] and name == "unbind":
            driver, dev = rel[3], self._dev(value)
            if self.driver_of(value) != driver:
                raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
            fault = self._fault(state, "unbind", value, driver)
            if fault:
                self._fail(fault)
            self._unbind(value, dev, driver)
            return
        if rel[:3] == ["bus", "pci", "drivers"] and name == "bind":
            driver, dev = rel[3], self._dev(value)
            if self.driver_of(value) is not None:
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
            override = self._override(dev)
            if override is not None and override != driver:
                raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
            fault = self._fault(state, "bind", value, driver)
            if fault:
                self._fail(fault)
            self._bind(value, dev, driver)
            return
        if rel == ["bus", "pci", "drivers_probe"]:
            dev = self._dev(value)
            if self.driver_of(value) is not None:
                return
            override = self._override(dev)
            driver = override if override is not None else state["native"].get(value)
            fault = self._fault(state, "probe", value, driver)
            if fault:
                if fault.get("unclaimed"):
                    return
                if fault["wrong_driver"]:
                    driver = fault["wrong_driver"]
                else:
                    self._fail(fault)
            if driver and self._loaded(driver):
                self._bind(value, dev, driver)
            return
        if name == "reset_method":
            self._select_reset(state, os.path.dirname(path), value)
            return
        if name == "reset" and os.path.exists(os.path.join(os.path.dirname(path), "config")):
            self._reset(state, os.path.dirname(path))
            return
        if name == "reset_subordinate":  # everything below the bridge
            bridge = os.path.dirname(path)
            self._recover(state, [os.path.join(bridge, n) for n in os.listdir(bridge) if ":" in n and "." in n])
            return
        if name == "create" and len(rel) >= 3 and rel[-3] == "mdev_supported_types":
            self._mdev_create(state, os.path.dirname(path), value)
            return
        if name == "remove" and os.path.islink(os.path.join(os.path.dirname(path), "mdev_type")):
            self._mdev_remove(os.path.dirname(path))
            return
        if name == "current_vgpu_type" and rel[-2] == "nvidia":
            self._set_vgpu_type(state, os.path.dirname(path), value)
            return
        # Any other attribute: a plain store.
        with open(path, "w") as handle:
            handle.write(value + "\n")

    # -- reset methods (drivers/pci/pci.c reset_method_store, __pci_reset_function_locked) -------
    def _select_reset(self, state: dict, dev: str, value: str) -> None:
        """``reset_method``: "" disables every method, "default" brings back all the device
        supports, else each name must be one it supports (EINVAL, nothing changed, otherwise)."""
        key = os.path.realpath(dev)
        with open(os.path.join(dev, "reset_method")) as handle:
            supported = state.setdefault("supported", {}).setdefault(key, handle.read().split())
        names = supported if value == "default" else value.split()
        if any(name not in supported for name in names):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        with open(os.path.join(dev, "reset_method"), "w") as handle:
            handle.write(" ".join(names) + "\n")

    def _reset(self, state: dict, dev: str) -> None:
        """``reset``: the first selected method runs (ENOTTY when none is) and the link trains as it
        first did; an injected fault of op "reset" for that method fails the write (``errno_``)
        or leaves the device ``effect``:
        dead (config space 0xffff), gone (its config attribute removed), bars (BAR registers
        left as sizing leaves them), narrow (link at x1), slow (link at 2.5 GT/s)."""
        listed = os.path.join(dev, "reset_method")  # a kernel before 5.15 has none: its reset is one method
        methods = open(listed).read().split() if os.path.exists(listed) else ["?"]
        if not methods:
            raise OSError(errno.ENOTTY, os.strerror(errno.ENOTTY))
        fault = self._fault(state, "reset", os.path.basename(dev), methods[0])
        if fault and (fault["errno"] or fault["hang"]):
            self._fail(fault)
        self._recover(state, [dev])
        self._retrain(state, dev)
        effect = (fault or {}).get("effect")
        if effect in ("dead", "bars"):
            with open(os.path.join(dev, "config"), "rb") as handle:
                config = bytearray(handle.read())
            if effect == "dead":
                state.setdefault("dead", {})[os.path.realpath(dev)] = {
                    "file": "config", "original": bytes(config).hex(), "recovers": False}
                config = bytearray(b"\xff" * len(config))
            else:
                config[0x10:0x28] = b"\xff" * 0x18  # left as BAR sizing leaves them
            with open(os.path.join(dev, "config"), "wb") as handle:
                handle.write(bytes(config))
        elif effect == "gone":  # removed from the bus (surprise removal): its attributes go
            os.unlink(os.path.join(dev, "config"))
        elif effect in ("narrow", "slow"):
            name, text = ("current_link_width", "1") if effect == "narrow" else ("current_link_speed", "2.5 GT/s PCIe")
            with open(os.path.join(dev, name), "w") as handle:
                handle.write(text + "\n")

    @staticmethod
    def _retrain(state: dict, dev: str) -> None:
        """The link's current speed and width as they were at the device's first reset."""
        first = state.setdefault("links", {}).setdefault(os.path.realpath(dev), {})
        for name in ("current_link_speed", "current_link_width"):
            path = os.path.join(dev, name)
            if not os.path.exists(path):
                continue
            if name not in first:
                first[name] = open(path).read()
            with open(path, "w") as handle:
                handle.write(first[name])

    # -- a device that does not come back (config space 0xffff, BARs unassigned) ----------------
    def kill(self, address: str, *, bars: bool = False, recovers: bool = True) -> None:
        """Make the function read 0xffff (or, with ``bars``, lose its BAR assignments), as a GPU
        that a guest left hung; the kernel's reset brings it back when ``recovers``."""
        state = self._load()
        dev = self._dev(address)
        name = "resource" if bars else "config"
        with open(os.path.join(dev, name), "rb") as handle:
            original = handle.read()
        state.setdefault("dead", {})[dev] = {"file": name, "original": original.hex(), "recovers": recovers}
        if bars:  # include/linux/ioport.h IORESOURCE_UNSET, start 0 (pci-sysfs.c resource_show)
            lines = []
            for line in original.decode().splitlines():
                start, end, flags = (int(f, 16) for f in line.split())
                if flags & 0x300 and end > start:
                    start, end, flags = 0, end - start, flags | 0x20000000
                lines.append(f"0x{start:016x} 0x{end:016x} 0x{flags:016x}\n")
            damaged = "".join(lines).encode()
        else:
            damaged = b"\xff" * len(original)
        with open(os.path.join(dev, name), "wb") as handle:
            handle.write(damaged)
        self._save(state)

    def _recover(self, state: dict, devices: list[str]) -> None:
        for dev in devices:
            dead = state.get("dead", {}).get(os.path.realpath(dev))
            if dead and dead["recovers"]:
                with open(os.path.join(dev, dead["file"]), "wb") as handle:
                    handle.write(bytes.fromhex(dead["original"]))
                del state["dead"][os.path.realpath(dev)]

    # -- mediated devices (drivers/vfio/mdev/mdev_sysfs.c) and NVIDIA SR-IOV vGPU types ---------
    def _mdev_create(self, state: dict, type_dir: str, uuid: str) -> None:
        fault = self._fault(state, "mdev_create", None)
        if fault:
            self._fail(fault)
        avail_path = os.path.join(type_dir, "available_instances")
        with open(avail_path) as handle:
            available = int(handle.read())
        bus = os.path.join(self.sys, "bus", "mdev", "devices")
        if os.path.lexists(os.path.join(bus, uuid)):
            raise OSError(errno.EEXIST, os.strerror(errno.EEXIST))
        if available < 1:
            raise OSError(errno.EUSERS, os.strerror(errno.EUSERS))
        parent = os.path.dirname(os.path.dirname(type_dir))
        mdev = os.path.join(parent, uuid)
        os.makedirs(mdev)
        os.symlink(os.path.relpath(type_dir, mdev), os.path.join(mdev, "mdev_type"))
        open(os.path.join(mdev, "remove"), "w").close()
        os.makedirs(bus, exist_ok=True)
        os.symlink(os.path.relpath(mdev, bus), os.path.join(bus, uuid))
        os.symlink(os.path.relpath(mdev, os.path.join(type_dir, "devices")), os.path.join(type_dir, "devices", uuid))
        with open(avail_path, "w") as handle:
            handle.write(f"{available - 1}\n")

    def _mdev_remove(self, mdev: str) -> None:
        uuid = os.path.basename(mdev)
        type_dir = os.path.realpath(os.path.join(mdev, "mdev_type"))
        os.unlink(os.path.join(self.sys, "bus", "mdev", "devices", uuid))
        os.unlink(os.path.join(type_dir, "devices", uuid))
        import shutil
        shutil.rmtree(mdev)
        avail_path = os.path.join(type_dir, "available_instances")
        with open(avail_path) as handle:
            available = int(handle.read())
        with open(avail_path, "w") as handle:
            handle.write(f"{available + 1}\n")

    def _set_vgpu_type(self, state: dict, nvidia_dir: str, value: str) -> None:
        current_path = os.path.join(nvidia_dir, "current_vgpu_type")
        creatable_path = os.path.join(nvidia_dir, "creatable_vgpu_types")
        with open(current_path) as handle:
            current = int(handle.read().strip() or 0)
        wanted = int(value)
        saved = state.setdefault("creatable", {})
        if wanted and current:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        with open(creatable_path) as handle:
            creatable = handle.read()
        if wanted:
            ids = {int(line.split(":")[0]) for line in creatable.splitlines()[1:] if ":" in line}
            if wanted not in ids:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            saved[nvidia_dir] = creatable
            creatable = creatable.splitlines(True)[0]  # a VF with a type offers no other
        elif nvidia_dir in saved:
            creatable = saved.pop(nvidia_dir)
        with open(creatable_path, "w") as handle:
            handle.write(creatable)
        with open(current_path, "w") as handle:
            handle.write(f"{wanted}\n")

    # -- actions gpuvfio runs outside sysfs -------------------------------------------------
    def modprobe(self, name: str) -> None:
        state = self._load()
        if name not in state["modules"]:
            from gpuvfio.errors import GpuvfioError
            raise GpuvfioError(f"modprobe: FATAL: Module {name} not found")
        ddir = os.path.join(self.sys, "bus", "pci", "drivers", name)
        os.makedirs(ddir, exist_ok=True)
        for attr in ("bind", "unbind", "new_id", "remove_id"):
            open(os.path.join(ddir, attr), "a").close()

    def unload(self, name: str) -> None:
        ddir = os.path.join(self.sys, "bus", "pci", "drivers", name)
        if os.path.isdir(ddir) and not [n for n in os.listdir(ddir) if ":" in n]:
            import shutil
            shutil.rmtree(ddir)
