"""Nested lane, host side: real passthrough end to end, inside the kernel lane.

One kernel-lane boot (tests/lanes/kernel.py: this machine's kernel under QEMU
TCG with an emulated Intel IOMMU and a GPU-host-shaped topology) is the
"GPU host".  In it tests/lanes/nested_guest.py starts a libvirtd and runs gpuvfio
for real: ``xml --define`` of a domain with the edu device EDU, then ``attach`` of
ATTACH_DEVICES -- the edu on NUMA node 0's expander, the two edus behind the
emulated PCIe switch on node 1's and the edu behind the switch cascaded below it --
with ``--topology mirror``: it binds them to vfio-pci, starts a second-level guest
(QEMU TCG inside QEMU TCG, the tiny busybox+dropbear guest of tests/lanes/guest.py,
built here on the host before the boot and read by the guest through its 9p root)
with two NUMA cells, one pxb-pcie per host root complex bound to the cell of its
host node and the switch edus behind emulated switches, level for level as on the
host, waits for its SSH and verifies that the
devices are in it; the lane then records the PCI tree the second-level guest sees
(its lspci -t where it has one, and every device's sysfs path and numa_node), and
``detach``.

Cost, measured on 2 cores (TCG; tests/lanes/demo.py USUAL holds these as the demo's
yardstick): the boot ~20-40 s, imports over 9p ~20-30 s, libvirtd
start ~10-15 s, QEMU capability probe ~7 s (then cached, see QEMU_CAPS_CACHE),
attach ~150 s (the second-level guest's boot to SSH ~85 s, the verify probe ~45 s:
see nested_guest.PROBE_TIMEOUT), detach ~7 s: ~4-4.5 min in all on a quiet machine,
twice that when other jobs load it.  With three devices, two guest cells and 2 vCPUs
(2026-12, other test jobs loading the machine, load average 4-6): the whole run 645 s,
of which preload 114 s, attach 383 s (the second-level guest to SSH 328 s: its init
ran 208 s after its kernel started), the second-level tree 12 s.  ``shared_run()`` caches one run per test
process, so tests/nested/test_kernel_domain.py and tests/nested/test_nested_lane.py share a boot.

What the second-level guest needed, found on this machine (Debian 12, libvirt 9.0,
QEMU 7.2, kernel 6.1): nothing in qemu.conf.  The guest's libvirtd runs QEMU as
libvirt-qemu with dynamic ownership and its mount namespace (it chowns the vfio
group node in QEMU's own /dev), reads the kernel and initrd from the 9p root
through the guest's /tmp overlay (the chown copies them up), and cgroup v2 as
virtme mounts it is enough.  The kernel command line adds options that shorten the
second-level boot under double emulation by ~30 % (no crypto self-tests, no
mitigations, no KASLR, no audit).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Callable

from tests.lanes import daemon as dl
from tests.lanes import guest as gl
from tests.lanes import kernel as kl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EDU = kl.EDU  # parts "plan" and "domain"
EDU_IDS = kl.EDU_IDS
# Part "attach": devices from both NUMA nodes (so the second-level guest gets two cells:
# gpuvfio makes one per host node its devices are on; EDU has no node, q35's own root bus
# has no _PXM), two of them under one host switch and one under a switch cascaded below
# it (issue 37: every switch level mirrored).  Host order, as gpuvfio lists them.
ATTACH_DEVICES = (kl.NUMA0_EDU, *kl.SWITCH_EDUS, kl.CASCADE_EDU)
ATTACH_VCPUS = 2  # a multiple of the two cells; one per node of the emulated host
ATTACH_MEMORY = "256M"  # divides between the cells
ATTACH_TOPOLOGY = "mirror"
DOMAIN_NAME = "gpuvfio-edu"        # part "domain": defined, then undefined
NESTED_NAME = "gpuvfio-nested"     # part "attach": the second-level guest
NESTED_CMDLINE = gl.KERNEL_CMDLINE + " cryptomgr.notests mitigations=off nokaslr audit=0 random.trust_cpu=on"
QEMU_CAPS_CACHE = "/tmp/gpuvfio-nested-cache/qemu-capabilities"
# The second-level guest's serial console, when nested_guest.py gets one from
# ``gpuvfio attach --console-log`` and returns it: the only way to tell a guest that
# booted slowly from one that hung when SSH never answers.
NESTED_CONSOLE = "nested.console.log"
ALL_PARTS = ("inventory", "plan", "domain", "attach")
TEST_PARTS = ("plan", "domain", "attach")
DEFAULT_TIMEOUT = 1800


def skip_reason() -> str | None:
    for reason in (kl.skip_reason(), gl.skip_reason()):
        if reason:
            return reason
    missing = [p for p in (dl.LIBVIRTD, dl.VIRTLOGD) if not os.access(p, os.X_OK)]
    if missing:
        return "nested lane needs " + ", ".join(missing) + " (apt-get install libvirt-daemon-system)"
    try:
        import libvirt  # noqa: F401
        import paramiko  # noqa: F401
    except ImportError as exc:
        return f"nested lane needs libvirt-python and paramiko in this interpreter ({exc})"
    return None


@dataclass
class NestedResult:
    guest: kl.GuestResult
    image: gl.GuestImage
    parts: tuple[str, ...]
    files: dict[str, str] = field(default_factory=dict)

    # -- reading the record ----------------------------------------------------------

    def text(self, name: str) -> str:
        if name not in self.files:
            raise AssertionError(f"the guest did not write {name}\n{self.summary()}")
        return self.files[name]

    def rc(self, name: str) -> int:
        return int(self.text(name + ".rc").strip())

    def json(self, name: str) -> dict:
        try:
            return json.loads(self.text(name + ".out"))
        except ValueError:
            raise AssertionError(f"not JSON:\n{self.run(name)}") from None

    def run(self, name: str) -> str:
        return (f"[{name}] rc={self.files.get(name + '.rc', '?').strip()}\n"
                f"stdout: {self.files.get(name + '.out', '')[:3000]}\n"
                f"stderr: {self.files.get(name + '.err', '')[-3000:]}")

    def drivers(self, snap: str) -> dict[str, tuple[str | None, str]]:
        """address -> (driver or None, driver_override text) of each watched device at ``snap``."""
        out = {}
        for line in self.text(snap + ".drivers").splitlines():
            if line.strip():
                addr, drv, override = line.strip().split("|", 2)
                out[addr] = (None if drv == "-" else drv, override)
        return out

    def driver(self, snap: str, address: str = EDU) -> tuple[str | None, str]:
        """(driver or None, driver_override text) of ``address`` (default EDU) at snapshot ``snap``."""
        return self.drivers(snap)[address]

    def nested_tree(self) -> dict[str, "PciNode"]:
        """The second-level guest's PCI devices as it sees them, by its own address."""
        return parse_tree(self.text("nested.tree"))

    def host_tree(self) -> dict[str, "PciNode"]:
        """The emulated GPU host's PCI devices, read as the second-level guest's are."""
        return parse_tree(self.text("host.tree"))

    def vfio_nodes(self, snap: str) -> set[str]:
        return set(self.files.get(snap + ".vfio", "").split())

    def boot_line(self) -> str:
        """How the emulated GPU host was booted: accelerator, boot time, retries."""
        guest = self.guest
        boot = f"{guest.boot_seconds:.1f}s to the script" if guest.boot_seconds is not None else "boot time unknown"
        line = (f"GPU host booted under {guest.accel.describe() if guest.accel else '?'}; {boot}, "
                f"{guest.seconds:.1f}s in all")
        if guest.notes:  # a boot that was killed and booted again
            line += "; " + " / ".join(guest.notes)
        return line

    def summary(self) -> str:
        """What to show when an assertion fails: errors, timings, the tail of the guest's output."""
        console = self.files.get(NESTED_CONSOLE)
        return ("--- " + self.boot_line() + " ---"
                + "\n--- errors ---\n" + self.files.get("errors", "(none)")
                + "\n--- timings ---\n" + self.files.get("timings", "(none)")
                + "\n--- second-level guest's QEMU log (tail) ---\n" + self.files.get("nested.qemu.log", "")[-2000:]
                + "\n--- second-level guest's console (tail) ---\n"
                + (console[-3000:] if console is not None else "(not captured)")
                + "\n--- guest stdout (tail) ---\n" + self.guest.stdout[-4000:]
                + "\n--- guest stderr (tail) ---\n" + self.guest.stderr[-3000:])


@dataclass(frozen=True)
class PciNode:
    """One line of nested_guest's tree: a device's sysfs path and attributes."""

    path: tuple[str, ...]  # below /sys/devices: ("pci0000:a0", "0000:a0:00.0", ..., address)
    numa_node: int
    vendor: str  # "1234" (no 0x)
    device: str
    class_id: str  # "00ff00"

    @property
    def address(self) -> str:
        return self.path[-1]

    @property
    def root_bus(self) -> str:
        """'0000:a0' from 'pci0000:a0'."""
        return self.path[0][len("pci"):]

    @property
    def bridges(self) -> tuple[str, ...]:
        """The bridges above it, nearest the root first."""
        return self.path[1:-1]


def parse_tree(text: str) -> dict[str, PciNode]:
    """'/sys/devices/pci0000:00/0000:00:1c.0|-1|0x1af4|0x1041|0x020000' lines, by address."""
    nodes = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 5 or not parts[0].startswith("/sys/devices/"):
            continue
        path = tuple(p for p in parts[0][len("/sys/devices/"):].split("/") if p)
        if not path or not path[0].startswith("pci"):
            continue
        numa = int(parts[1]) if parts[1].lstrip("-").isdigit() else -1
        nodes[path[-1]] = PciNode(path, numa, parts[2].lower().removeprefix("0x"),
                                  parts[3].lower().removeprefix("0x"), parts[4].lower().removeprefix("0x"))
    return nodes


def guest_script(image: gl.GuestImage, parts: tuple[str, ...], *, boot_timeout: int = 900) -> str:
    config = {
        "repo": REPO, "edu": EDU, "parts": list(parts), "domain_name": DOMAIN_NAME,
        "attach_devices": list(ATTACH_DEVICES), "attach_vcpus": ATTACH_VCPUS, "attach_memory": ATTACH_MEMORY,
        "topology": ATTACH_TOPOLOGY, "switch_port": kl.SWITCH_DOWNSTREAM[0],
        "nested_name": NESTED_NAME, "cmdline": NESTED_CMDLINE, "boot_timeout": boot_timeout,
        "qemu_caps_cache": QEMU_CAPS_CACHE,
        "image": {"kernel": image.kernel, "initrd": image.initrd, "client_key": image.client_key,
                  "host_key_line": image.host_key_line},
    }
    return (f"#!{sys.executable}\n"
            "import json, sys\n"
            "sys.dont_write_bytecode = True\n"
            f"sys.path.insert(0, {REPO!r})\n"
            "from tests.lanes.nested_guest import main\n"
            f"sys.exit(main(json.loads({json.dumps(config)!r})))\n")


def _store_qemu_caps(files: dict[str, str]) -> None:
    """Keep the capabilities libvirt probed in the guest for the next boot (libvirt re-probes
    by itself if they no longer match the binary, libvirt or the guest's kernel)."""
    caps = {k[len("qemucaps--"):]: v for k, v in files.items() if k.startswith("qemucaps--")}
    if not caps:
        return
    try:
        os.makedirs(QEMU_CAPS_CACHE, mode=0o755, exist_ok=True)
        for name, text in caps.items():
            if "/" in name or not name.endswith(".xml"):
                continue
            tmp = os.path.join(QEMU_CAPS_CACHE, f".{name}.tmp-{os.getpid()}")
            with open(tmp, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o600)
            os.replace(tmp, os.path.join(QEMU_CAPS_CACHE, name))
    except OSError:
        pass


def clear_qemu_caps_cache() -> None:
    shutil.rmtree(QEMU_CAPS_CACHE, ignore_errors=True)


def run(parts: tuple[str, ...] = TEST_PARTS, *, timeout: int = DEFAULT_TIMEOUT,
        follow: Callable[[str], None] | None = None, image: gl.GuestImage | None = None,
        report: Callable[[str], None] | None = None,
        accel: kl.Accelerator | None = None) -> NestedResult:
    """Build the tiny guest (cached), boot the emulated GPU host, run ``parts`` in it.

    ``report`` gets the kernel lane's notes (accelerator, boot time, a retried silent
    boot); ``accel`` default: kl.select_accelerator()."""
    image = image or gl.build_guest()
    script = guest_script(image, parts)
    result = kl.run_in_guest(script, devices=kl.GPU_HOST_DEVICES, timeout=timeout, follow=follow,
                             report=report, accel=accel)
    _store_qemu_caps(result.files)
    return NestedResult(result, image, tuple(parts), dict(result.files))


_shared: dict[tuple, NestedResult | BaseException] = {}


def shared_run(parts: tuple[str, ...] = TEST_PARTS) -> NestedResult:
    """``run(parts)`` once per process (test modules that share one boot)."""
    key = tuple(parts)
    if key not in _shared:
        try:
            _shared[key] = run(key)
        except BaseException as exc:  # noqa: BLE001 - the second module gets the same failure
            _shared[key] = exc
    value = _shared[key]
    if isinstance(value, BaseException):
        raise value
    return value


def checked_shared_run() -> NestedResult:
    """The shared run for a test module's fixture: its timings shown, a failed guest an error."""
    result = shared_run()
    print(f"nested lane run: {result.guest.seconds:.1f}s; {result.boot_line()}\n"
          + result.files.get("timings", ""))
    assert result.guest.returncode == 0, result.summary()
    return result
