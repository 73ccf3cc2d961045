"""Kernel lane: boot a real distribution kernel under QEMU (TCG; KVM where it works) with virtme-ng.

The guest gets an emulated Intel IOMMU (so ``/sys/kernel/iommu_groups`` is real)
plus whatever emulated PCI devices a test asks for, runs one script as root and
powers off.  The guest's root filesystem is this machine's ``/`` over 9p,
read-only with writable tmpfs overlays on /etc, /usr, /tmp, ... (virtme-ng's
layout), so the project's virtualenv and checkout are visible inside at the same
paths.  Nothing the guest writes comes back, except in the per-run work
directory, which is shared read-write (``vng --rwdir``).

How output comes back, and why: the script's stdout and stderr are redirected
*inside the guest* to files in that shared directory, its exit status is written
to a file last, and the host reads the files after vng exits.  vng's own
stdout/stderr carry other things too (its progress output, QEMU warnings such as
"nic e1000e.0 has no peer", and, with verbose, the kernel console), and a guest
that dies mid-boot looks the same on stdout as a script that printed nothing.
Files give byte-exact output, and the presence of the status file tells "the
script ran and exited N" apart from "the guest never got there".  Scripts may
also write extra result files into ``$OUT``; they come back in
``GuestResult.files``.

Boot speed: the bzImage's payload is extracted once to an ELF vmlinux that
QEMU boots directly, and modules no test needs are blocked (FAST_BOOT_BLACKLIST);
together that took a run from ~34 s to ~13-17 s on 2 cores.

Accelerator: KVM where it really works, TCG elsewhere (select_accelerator).  A
/dev/kvm that opens and answers ioctls is not enough: on this project's machines
it does (KVM_GET_API_VERSION, KVM_CREATE_VM and KVM_CREATE_VCPU all succeed), yet
QEMU aborts with ``-cpu host`` and hangs without it.  So the probe boots this
kernel under ``-accel kvm`` for a few seconds and asks for proof that it ran:
its panic for want of a root file system, printed at the end of its init.  The
answer is cached per host boot; on any doubt the lane uses TCG.

Silent boots: the kernel console is always captured (on vng's stderr; it cost
nothing measurable, 639 lines in a ~16 s boot), so a boot that stops printing
before the script starts is seen: after SILENT_BOOT_S without a byte it is
killed and, like a boot that times out before its script starts, booted once
more.  Once the script has started, nothing is retried: its output has been
streamed to ``follow`` already, and a script may be quiet for minutes.

Environment knobs: GPUVFIO_KL_ACCEL=auto|kvm|tcg (default auto: probe),
GPUVFIO_KL_SILENT_S=SECONDS (see SILENT_BOOT_S; 0 turns the check off),
GPUVFIO_KL_VERBOSE=1 (also echo the kernel console to stderr as it comes),
GPUVFIO_KL_KEEP=1 (keep the work directory), GPUVFIO_KL_COMPRESSED=1 (boot
/boot/vmlinuz-* as is), GPUVFIO_KL_KERNEL=/path/vmlinuz-<ver> (boot that kernel: make
test-current boots Debian 13's, tests/lanes/current.py).

Only the kernel in /boot whose modules are installed is bootable this way
(virtme-ng loads modules from the host's /lib/modules/<version>); the kernel
the host is running may not be installed at all.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import select
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

# --- Guest topology -------------------------------------------------------------
#
# q35 puts its own functions at 00:00.0 and 00:1f.{0,2,3}; vng adds ~9 virtio /
# watchdog functions that QEMU auto-places from 00:01.0 upwards.  Our root ports
# sit at fixed slots 0x10-0x13 well clear of those, and each port has a fixed
# chassis/slot.  Bus numbers are assigned by the firmware (SeaBIOS) in depth-first
# order of the root bus (00:10.0 -> bus 01, 00:11.0 -> bus 02); each expander
# bridge (pxb-pcie) is a root bus of its own starting at its bus_nr, and the buses
# below it are numbered depth-first from there.  Verified inside the guest with
# lspci -t.
#
#   00:10.0 pcie-root-port rp_gpu
#     01:00.0 e1000e          (fn0, multifunction=on; stands in for the GPU)
#     01:00.1 ich9-intel-hda  (fn1; stands in for the GPU's HDMI audio)
#   00:11.0 pcie-root-port rp_edu
#     02:00.0 edu             (no driver; alone in its IOMMU group; NUMA node -1)
#   00:12.0 pxb-pcie numa_node=1, bus_nr=0x80           (root bus 80, NUMA node 1)
#     80:00.0 pcie-root-port rp_numa1
#       81:00.0 edu           (NUMA node 1)
#     80:01.0 pcie-root-port rp_sw                      (a GPU host's PCIe switch:)
#       82:00.0 x3130-upstream sw_up
#         83:00.0 xio3130-downstream sw_dn0
#           84:00.0 edu       (NUMA node 1, behind the switch)
#         83:01.0 xio3130-downstream sw_dn1
#           85:00.0 edu       (NUMA node 1, behind the switch)
#         83:02.0 xio3130-downstream sw_dn2                (a cascaded switch below it:)
#           86:00.0 x3130-upstream sw2_up
#             87:00.0 xio3130-downstream sw2_dn0
#               88:00.0 edu   (NUMA node 1, two switch levels below the root port)
#   00:13.0 pxb-pcie numa_node=0, bus_nr=0x40           (root bus 40, NUMA node 0)
#     40:00.0 pcie-root-port rp_numa0
#       41:00.0 edu           (NUMA node 0: the only device with a node-0 _PXM)
#
# Functions in one slot without ACS share an IOMMU group.  QEMU's pcie-root-port
# exposes ACS, so every root port gets its own group; QEMU 7.2's xio3130-downstream
# has none (lspci -vvv: no Access Control Services capability, only AER at 0x100),
# so each switch edu shares its group with its downstream port -- {83:00.0, 84:00.0}
# and {83:01.0, 85:00.0}: still one edu per group, and a viable one (the port is a
# bridge and stays on pcieport).  The node-0 expander exists so a guest can get
# devices from both NUMA nodes (the nested lane's mirrored topology needs two guest
# cells; EDU has no node: q35's own root bus has no _PXM).

GPU_ROOT_PORT = "0000:00:10.0"
GPU_FN0 = "0000:01:00.0"  # e1000e, driver e1000e
GPU_FN1 = "0000:01:00.1"  # ich9-intel-hda, driver snd_hda_intel
EDU_ROOT_PORT = "0000:00:11.0"
EDU = "0000:02:00.0"  # QEMU edu 1234:11e8, no driver
NUMA1_EXPANDER = "0000:00:12.0"  # pxb-pcie host bridge (class 0600)
NUMA1_ROOT_PORT = "0000:80:00.0"
NUMA1_EDU = "0000:81:00.0"  # edu on NUMA node 1
SWITCH_ROOT_PORT = "0000:80:01.0"  # on the node-1 expander, above the switch
SWITCH_UPSTREAM = "0000:82:00.0"  # x3130-upstream
SWITCH_DOWNSTREAM = ("0000:83:00.0", "0000:83:01.0")  # xio3130-downstream, one per edu
SWITCH_EDUS = ("0000:84:00.0", "0000:85:00.0")  # edus behind the switch, NUMA node 1
CASCADE_PORT = "0000:83:02.0"  # the switch's third downstream port, above a second switch
CASCADE_UPSTREAM = "0000:86:00.0"  # x3130-upstream of the second level
CASCADE_DOWNSTREAM = "0000:87:00.0"
CASCADE_EDU = "0000:88:00.0"  # edu two switch levels below the root port, NUMA node 1
NUMA0_EXPANDER = "0000:00:13.0"
NUMA0_ROOT_PORT = "0000:40:00.0"
NUMA0_EDU = "0000:41:00.0"  # edu on NUMA node 0

GPU_FN0_DRIVER = "e1000e"
GPU_FN1_DRIVER = "snd_hda_intel"
EDU_IDS = ("1234", "11e8")

# QEMU -device specs (the part after "-device"), in creation order: a bus must
# exist before a device names it.
GPU_HOST_DEVICES: list[str] = [
    "pcie-root-port,id=rp_gpu,bus=pcie.0,chassis=1,slot=1,addr=0x10.0",
    "e1000e,id=gpu_fn0,bus=rp_gpu,addr=0x0.0,multifunction=on",
    "ich9-intel-hda,id=gpu_fn1,bus=rp_gpu,addr=0x0.1",
    "pcie-root-port,id=rp_edu,bus=pcie.0,chassis=2,slot=2,addr=0x11.0",
    "edu,id=edu0,bus=rp_edu,addr=0x0.0",
    "pxb-pcie,id=pxb_numa1,bus=pcie.0,addr=0x12.0,bus_nr=0x80,numa_node=1",
    "pcie-root-port,id=rp_numa1,bus=pxb_numa1,chassis=3,slot=3,addr=0x0.0",
    "edu,id=edu_numa1,bus=rp_numa1,addr=0x0.0",
    "pcie-root-port,id=rp_sw,bus=pxb_numa1,chassis=4,slot=4,addr=0x1.0",
    "x3130-upstream,id=sw_up,bus=rp_sw,addr=0x0.0",
    "xio3130-downstream,id=sw_dn0,bus=sw_up,chassis=5,slot=5,port=0,addr=0x0.0",
    "edu,id=edu_sw0,bus=sw_dn0,addr=0x0.0",
    "xio3130-downstream,id=sw_dn1,bus=sw_up,chassis=6,slot=6,port=1,addr=0x1.0",
    "edu,id=edu_sw1,bus=sw_dn1,addr=0x0.0",
    "xio3130-downstream,id=sw_dn2,bus=sw_up,chassis=8,slot=8,port=2,addr=0x2.0",
    "x3130-upstream,id=sw2_up,bus=sw_dn2,addr=0x0.0",
    "xio3130-downstream,id=sw2_dn0,bus=sw2_up,chassis=9,slot=9,port=0,addr=0x0.0",
    "edu,id=edu_sw2,bus=sw2_dn0,addr=0x0.0",
    "pxb-pcie,id=pxb_numa0,bus=pcie.0,addr=0x13.0,bus_nr=0x40,numa_node=0",
    "pcie-root-port,id=rp_numa0,bus=pxb_numa0,chassis=7,slot=7,addr=0x0.0",
    "edu,id=edu_numa0,bus=rp_numa0,addr=0x0.0",
]
GPU_HOST_NUMA_NODES = 2

# The emulated IOMMU.  intel-iommu must come before the PCI devices it should
# translate for; kernel-irqchip=split is required by intremap=on.
IOMMU_QEMU_ARGS: list[str] = [
    "-machine", "q35,kernel-irqchip=split",
    "-device", "intel-iommu,intremap=on,caching-mode=on",
]
# Modules that udev would load for the emulated CPU/chipset but no test needs.
# Loading kvm_amd alone costs ~9 s under TCG (SVM probing); the crypto, cdrom
# and input ones another ~6 s.  Blocking them took the whole run from ~34 s to
# ~17 s.  Do not add irqbypass (vfio_pci_core needs it) or anything vfio.
FAST_BOOT_BLACKLIST = [
    "kvm", "kvm_amd", "kvm_intel", "powernow_k8", "aesni_intel", "ghash_clmulni_intel",
    "sr_mod", "cdrom", "sg", "pcspkr", "psmouse", "iTCO_wdt",
]
KERNEL_ARGS: list[str] = ["intel_iommu=on", "iommu=pt",
                          "module_blacklist=" + ",".join(FAST_BOOT_BLACKLIST)]

DEFAULT_MEMORY_MIB = 2048
WORK_PARENT = "/tmp"  # must be visible on the guest's root; /tmp is (overlaid)

# vng pastes some arguments (e.g. --rwdir, --exec) into a shell command line
# without quoting, so anything of ours that reaches it must be shell-inert.
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_.+/-]+$")  # Debian 13's kernels are 6.12.N+deb13


class GuestError(RuntimeError):
    """The guest did not run the script to completion (boot failure, timeout)."""

    def __init__(self, message: str, *, vng_stdout: str = "", vng_stderr: str = "",
                 command: Sequence[str] = (), script_started: bool = False,
                 boot_seconds: float | None = None, seconds: float | None = None,
                 accel: "Accelerator | None" = None):
        tail_out = vng_stdout[-4000:]
        tail_err = vng_stderr[-4000:]
        where = ("the script had started" if script_started
                 else "the script had not started: the guest never finished booting")
        super().__init__(
            f"{message} ({where}; accelerator {accel.describe() if accel else '?'})\n"
            f"command: {shlex.join(command)}\n"
            f"--- vng stdout (tail) ---\n{tail_out}\n"
            f"--- vng stderr: QEMU and the kernel console (tail) ---\n{tail_err}\n"
        )
        self.headline = message
        self.vng_stdout = vng_stdout
        self.vng_stderr = vng_stderr
        self.command = list(command)
        self.script_started = script_started
        self.boot_seconds = boot_seconds
        self.seconds = seconds
        self.accel = accel
        self.notes: list[str] = []  # retries before this failure (run_in_guest)


class GuestTimeout(GuestError):
    pass


class GuestSilent(GuestTimeout):
    """The boot sent nothing for SILENT_BOOT_S before the script started, and was killed."""


@dataclass
class GuestResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    files: dict[str, str] = field(default_factory=dict)  # $OUT/<name> -> text
    vng_stdout: str = ""
    vng_stderr: str = ""  # QEMU's warnings and the kernel console
    accel: "Accelerator | None" = None
    boot_seconds: float | None = None  # from starting vng to the script starting
    attempts: int = 1
    notes: list[str] = field(default_factory=list)  # what run_in_guest retried, and why


# --- Discovery --------------------------------------------------------------------

def _version_key(version: str) -> tuple:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"[.\-+~_]", version))


KERNEL_ENV = "GPUVFIO_KL_KERNEL"


def find_kernel() -> str | None:
    """The kernel image GPUVFIO_KL_KERNEL names (tests/lanes/current.py fetches Debian 13's),
    else the newest /boot/vmlinuz-<ver>; either only where /lib/modules/<ver> exists, else None."""
    named = os.environ.get(KERNEL_ENV)
    if named:
        version = os.path.basename(named)[len("vmlinuz-"):]
        ok = named.startswith("/") and os.path.basename(named).startswith("vmlinuz-") and os.access(named, os.R_OK)
        return named if ok and os.path.isdir(os.path.join("/lib/modules", version)) else None
    found = []
    for path in glob.glob("/boot/vmlinuz-*"):
        version = os.path.basename(path)[len("vmlinuz-"):]
        if os.path.isdir(os.path.join("/lib/modules", version)) and os.access(path, os.R_OK):
            found.append((_version_key(version), path))
    if not found:
        return None
    return max(found)[1]


def _payload(data: bytes) -> tuple[str, bytes] | None:
    """(format, bytes) of a bzImage's compressed kernel: where the x86 boot protocol's setup
    header puts it (Documentation/arch/x86/boot.rst: setup_sects at 0x1f1, payload_offset and
    payload_length at 0x248, from the protected-mode code after the setup sectors). Debian 12
    compresses with xz, Debian 13 with zstd, whose payload ends with the size, 4 bytes
    (scripts/Makefile.lib cmd_zstd22_with_size)."""
    if len(data) < 0x250 or data[0x202:0x206] != b"HdrS":
        return None
    offset, length = struct.unpack_from("<II", data, 0x248)
    start = ((data[0x1F1] or 4) + 1) * 512 + offset
    payload = data[start:start + length]
    if payload.startswith(b"\xfd7zXZ\x00"):
        return "xz", payload
    if payload.startswith(b"\x28\xb5\x2f\xfd") and len(payload) > 4:
        return "zstd", payload[:-4]
    return None


def _decompress(kind: str, payload: bytes) -> bytes:
    if kind == "xz":
        import lzma

        return lzma.LZMADecompressor().decompress(payload)
    # Python 3.11 has no zstd; Debian's zstd tool does it (package zstd).
    proc = subprocess.run(["zstd", "-dc"], input=payload, capture_output=True, timeout=120, check=True)
    return proc.stdout


def uncompressed_kernel(kernel: str) -> str:
    """An ELF vmlinux extracted from a bzImage's payload (xz or zstd), cached; else ``kernel``.

    QEMU boots the ELF directly (PVH entry), which skips the guest-side
    decompression: ~4.5 s less per boot under TCG.  Cached under
    WORK_PARENT/gpuvfio-kl-cache, keyed by the source's name, size and mtime.
    """
    import lzma

    try:
        st = os.stat(kernel)
        cache = os.path.join(WORK_PARENT, "gpuvfio-kl-cache")
        target = os.path.join(cache, f"{os.path.basename(kernel).replace('vmlinuz', 'vmlinux')}"
                                     f"-{st.st_size}-{int(st.st_mtime)}")
        if os.path.exists(target):
            return target
        with open(kernel, "rb") as f:
            found = _payload(f.read())
        if found is None:
            return kernel
        elf = _decompress(*found)
        if not elf.startswith(b"\x7fELF"):
            return kernel
        os.makedirs(cache, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(elf)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)  # atomic: concurrent runs see all or nothing
        return target
    except (OSError, lzma.LZMAError, subprocess.SubprocessError):
        return kernel


def _tool_path() -> str:
    """PATH with this interpreter's bin dir first: vng runs virtme-run by name."""
    bindir = os.path.dirname(os.path.abspath(sys.executable))
    return os.pathsep.join([bindir, os.environ.get("PATH", os.defpath)])


def _which(name: str) -> str | None:
    return shutil.which(name, path=_tool_path())


def vng_available() -> bool:
    return all(_which(t) for t in ("vng", "virtme-run", "qemu-system-x86_64"))


def skip_reason() -> str | None:
    """Why the kernel lane cannot run here, or None if it can."""
    missing = [t for t in ("vng", "virtme-run", "qemu-system-x86_64") if not _which(t)]
    if missing:
        return ("kernel lane needs virtme-ng and QEMU: missing " + ", ".join(missing)
                + " (pip install virtme-ng into this venv; apt-get install qemu-system-x86)")
    if find_kernel() is None:
        if os.environ.get(KERNEL_ENV):
            return f"{KERNEL_ENV}={os.environ[KERNEL_ENV]!r} is no absolute vmlinuz-<ver> with /lib/modules/<ver>"
        return "kernel lane needs a /boot/vmlinuz-<ver> with /lib/modules/<ver> (apt-get install linux-image-amd64)"
    return None


# --- Accelerator --------------------------------------------------------------------
#
# What tells "KVM works" from "KVM hangs" on these machines is only a real boot: the
# ioctls succeed, QEMU's accelerator set-up succeeds, even SeaBIOS runs; the guest
# kernel then either makes QEMU abort ("failed to set MSR 0x10a" with -cpu host) or
# hangs silently (without it).  The probe therefore boots the same kernel, machine
# and CPU model the lane will use, with no root file system, and waits for the
# kernel's "VFS: Unable to mount root fs" panic: by then it has brought up its CPUs,
# paging, timers, interrupts and the emulated IOMMU.  Under a working KVM that takes
# ~1 s (the same probe takes ~2.6 s under TCG here), so KVM_PROBE_TIMEOUT is generous
# and a slow host only costs a fall-back to TCG, never a wrong choice.  It must run
# with -accel kvm alone: "kvm:tcg" would fall back to TCG and then boot fine.

ACCEL_ENV = "GPUVFIO_KL_ACCEL"
KVM_DEVICE = "/dev/kvm"
KVM_PROBE_TIMEOUT = 10.0
KVM_PROBE_MARKER = "VFS: Unable to mount root fs"
KVM_PROBE_VERSION = "1"  # bump when the probe changes: old cached answers no longer count
KVM_PROBE_CACHE = os.path.join(WORK_PARENT, "gpuvfio-kl-cache")


@dataclass(frozen=True)
class KvmProbe:
    works: bool
    detail: str         # one line, for people: what the probe saw
    seconds: float
    cached: bool = False


@dataclass(frozen=True)
class Accelerator:
    name: str           # "kvm" or "tcg"
    reason: str         # why, in one line
    probe: KvmProbe | None = None

    def describe(self) -> str:
        return f"{self.name.upper()} ({self.reason})"


def kvm_probe_command(kernel: str, qemu: str = "qemu-system-x86_64") -> list[str]:
    """QEMU booting ``kernel`` under KVM with the lane's machine and vng's KVM CPU model."""
    return [qemu, "-accel", "kvm", "-cpu", "host", *IOMMU_QEMU_ARGS, "-smp", "2", "-m", "256",
            "-nodefaults", "-display", "none", "-monitor", "none", "-no-reboot",
            "-serial", "stdio", "-kernel", kernel,
            "-append", "console=ttyS0 panic=-1 quiet"]


def classify_kvm_probe(output: str, *, returncode: int | None, timed_out: bool,
                       seconds: float, timeout: float = KVM_PROBE_TIMEOUT) -> KvmProbe:
    """What a probe run's output and ending say about KVM (only the kernel's panic is proof)."""
    if KVM_PROBE_MARKER in output:
        return KvmProbe(True, f"a test kernel booted under KVM in {seconds:.1f}s", seconds)
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    # QEMU's own "error:" line says more than the assertion or warnings around it.
    said = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "")
    said = f": {said[:200]}" if said else ""
    if timed_out:
        last = f" (last output: {lines[-1][:200]})" if lines else ""
        return KvmProbe(False, f"a test kernel under KVM did not get through its boot in "
                               f"{timeout:g}s: KVM hangs here{last}", seconds)
    if returncode:
        how = (f"was killed by signal {-returncode}" if returncode < 0 else f"exited {returncode}")
        return KvmProbe(False, f"QEMU with -accel kvm {how}{said}", seconds)
    return KvmProbe(False, f"a test kernel under KVM stopped before mounting its root{said}", seconds)


def run_kvm_probe(kernel: str, *, qemu: str | None = None,
                  timeout: float = KVM_PROBE_TIMEOUT) -> KvmProbe:
    """Boot ``kernel`` under KVM for at most ``timeout`` seconds (see the section comment)."""
    qemu = qemu or _which("qemu-system-x86_64") or "qemu-system-x86_64"
    began = time.monotonic()
    try:
        proc = subprocess.Popen(kvm_probe_command(kernel, qemu), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
    except OSError as exc:
        return KvmProbe(False, f"cannot start QEMU: {exc}", 0.0)
    output = b""
    timed_out = False
    try:
        fd = proc.stdout.fileno()
        while KVM_PROBE_MARKER.encode() not in output:
            remaining = began + timeout - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            if not select.select([fd], [], [], remaining)[0]:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:  # QEMU exited
                break
            output = (output + chunk)[-65536:]
    finally:
        with contextlib.suppress(ProcessLookupError):  # exited by itself
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass  # stuck in the kernel: better a leftover process than a hung test run
        proc.stdout.close()
    seconds = time.monotonic() - began
    return classify_kvm_probe(output.decode(errors="replace"), returncode=proc.returncode,
                              timed_out=timed_out, seconds=seconds, timeout=timeout)


def _identity(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return f"{path}:missing"
    return f"{path}:{st.st_size}:{st.st_mtime_ns}:{st.st_rdev}"


def _kvm_probe_key(kernel: str, qemu: str) -> str:
    """Everything the answer depends on: this boot of the host (KVM modules and their
    parameters only change across boots), QEMU, the kernel booted and the probe itself."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "unknown"
    parts = [KVM_PROBE_VERSION, boot_id, _identity(qemu), _identity(kernel), _identity(KVM_DEVICE)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


_kvm_probes: dict[str, KvmProbe] = {}


def cached_kvm_probe(kernel: str, *, cache_dir: str = KVM_PROBE_CACHE,
                     probe: Callable[[str], KvmProbe] = run_kvm_probe) -> KvmProbe:
    """``probe(kernel)``, remembered in this process and on disk for this host boot.

    A hang is remembered too: that is the case that costs KVM_PROBE_TIMEOUT per try.
    Delete the cache file (or set GPUVFIO_KL_ACCEL) to decide again.
    """
    qemu = _which("qemu-system-x86_64") or "qemu-system-x86_64"
    key = _kvm_probe_key(kernel, qemu)
    if key in _kvm_probes:
        return replace(_kvm_probes[key], cached=True)
    path = os.path.join(cache_dir, f"kvm-probe-{key}.json")
    try:
        with open(path) as f:
            data = json.load(f)
        found = KvmProbe(bool(data["works"]), str(data["detail"]), float(data["seconds"]), cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        found = None
    if found is None:
        found = probe(kernel)
        try:
            os.makedirs(cache_dir, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                json.dump({"works": found.works, "detail": found.detail, "seconds": found.seconds}, f)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except OSError:
            pass  # unwritable cache: probe again next time
    _kvm_probes[key] = found
    return found


def kvm_device_problem(path: str = KVM_DEVICE) -> str | None:
    """Why ``path`` cannot be used at all, or None (which does not mean KVM works)."""
    if not os.path.exists(path):
        return f"no {path}"
    if not os.access(path, os.R_OK | os.W_OK):
        return f"{path} is not readable and writable by this user"
    return None


def choose_accelerator(setting: str | None, device_problem: str | None,
                       probe: Callable[[], KvmProbe]) -> Accelerator:
    """The accelerator for ``setting`` (GPUVFIO_KL_ACCEL: auto, kvm or tcg; unset = auto).

    ``probe`` is only called when the answer depends on it.  Anything short of a probe
    that saw the kernel run under KVM means TCG: a TCG boot is slow, a wrong KVM choice
    hangs or aborts every boot.
    """
    setting = (setting or "auto").strip().lower()
    if setting == "tcg":
        return Accelerator("tcg", f"{ACCEL_ENV}=tcg")
    if setting == "kvm":
        return Accelerator("kvm", f"{ACCEL_ENV}=kvm, not probed")
    if setting != "auto":
        raise ValueError(f"{ACCEL_ENV}={setting!r}: use auto, kvm or tcg")
    if device_problem:
        return Accelerator("tcg", device_problem)
    result = probe()
    label = "KVM probe (cached)" if result.cached else "KVM probe"
    return Accelerator("kvm" if result.works else "tcg", f"{label}: {result.detail}", result)


def select_accelerator(kernel: str | None = None) -> Accelerator:
    """The accelerator for booting ``kernel`` (the file vng will boot; default: as run_in_guest)."""
    kernel = _boot_kernel(kernel)
    return choose_accelerator(os.environ.get(ACCEL_ENV), kvm_device_problem(),
                              lambda: cached_kvm_probe(kernel))


def _boot_kernel(kernel: str | None) -> str:
    """The file to boot: ``kernel`` (default find_kernel()), uncompressed unless disabled."""
    kernel = kernel or find_kernel()
    if kernel is None:
        raise GuestError("no bootable kernel found (see find_kernel())")
    if os.environ.get("GPUVFIO_KL_COMPRESSED") != "1":
        kernel = uncompressed_kernel(kernel)
    return kernel


# --- Running ----------------------------------------------------------------------

# The wrapper marks the script's start first thing: the host takes it as the end of
# the boot (GuestResult.boot_seconds) and as the point after which nothing is retried.
_WRAPPER = """#!/bin/sh
# Written by tests/lanes/kernel.py; runs inside the guest.
W={work}
: >"$W/started"
OUT=$W/out
export OUT
cd "$W" || exit 99
chmod +x "$W/script"
"$W/script" >"$W/stdout" 2>"$W/stderr" </dev/null
echo $? >"$W/rc.tmp"
mv "$W/rc.tmp" "$W/rc"
sync
"""

# How long a boot may go without printing anything before its script starts.  The
# kernel console, captured from the first line, printed its first line ~1.2 s after
# vng started and never paused for more than ~2 s in a ~16 s boot (2 cores, quiet,
# 2026-11); nested.py gives ~20-40 s for a whole boot, about twice that
# under load, "up to a few minutes" at worst.  240 s is longer than a whole loaded
# boot, so even a boot whose console were lost is not killed while healthy, and still
# far shorter than the timeouts callers give a run (300-1800 s).
SILENT_BOOT_S = 240.0
WATCH_POLL_S = 0.3


def _numa_needed(devices: Iterable[str]) -> int:
    nodes = [int(m.group(1)) for d in devices for m in re.finditer(r"\bnuma_node=(\d+)", d)]
    return max(nodes) + 1 if nodes else 1


def build_vng_command(*, kernel: str, work: str, devices: Sequence[str],
                      extra_qemu: Sequence[str] = (), numa_nodes: int = 1,
                      memory_mib: int = DEFAULT_MEMORY_MIB, cpus: int = 2,
                      verbose: bool = True, accel: str = "tcg") -> list[str]:
    """The vng command line.  ``verbose``: the kernel console on vng's stderr (run_in_guest
    always asks for it).  ``accel``: "tcg", or "kvm" only where select_accelerator said so."""
    if accel not in ("tcg", "kvm"):
        raise ValueError(f"accelerator {accel!r}: kvm or tcg")
    vng = _which("vng") or "vng"
    cpus = max(cpus, numa_nodes)
    qemu = list(IOMMU_QEMU_ARGS)
    for spec in devices:
        qemu += ["-device", spec]
    qemu += list(extra_qemu)
    cmd = [vng, "--run", kernel]
    if accel == "tcg":
        # Without it virtme uses KVM whenever /dev/kvm is accessible, working or not.
        cmd.append("--disable-kvm")
    cmd += [
        "--disable-microvm",    # q35: PCIe, root ports, intel-iommu
        "--force-9p",           # no virtiofsd
        "--cpus", str(cpus),
    ]
    if numa_nodes > 1:
        per = memory_mib // numa_nodes
        cmd += ["--memory", f"{per * numa_nodes}M"]
        share, extra = divmod(cpus, numa_nodes)
        first = 0
        for node in range(numa_nodes):
            n = share + (1 if node < extra else 0)
            cmd += ["--numa", f"{per}M,cpus={first}-{first + n - 1}" if n > 1 else f"{per}M,cpus={first}"]
            first += n
    else:
        cmd += ["--memory", f"{memory_mib}M"]
    cmd += [
        "--rwdir", work,
        "--cwd", work,
        "--append", " ".join(KERNEL_ARGS),
        "--exec", os.path.join(work, "run.sh"),
    ]
    if verbose:
        cmd.append("--verbose")
    # vng joins --qemu-opts values with spaces and hands them through a shell;
    # quoting each element keeps one list element one QEMU argument.
    # It must be the last option (virtme-run's --qemu-opts swallows the rest).
    cmd.append("--qemu-opts=" + shlex.join(qemu))
    return cmd


def _report_to_stderr(line: str) -> None:
    sys.stderr.write(f"[kernel lane] {line}\n")
    sys.stderr.flush()


def silent_boot_limit() -> float | None:
    """SILENT_BOOT_S, or GPUVFIO_KL_SILENT_S (seconds; 0 turns the check off)."""
    value = os.environ.get("GPUVFIO_KL_SILENT_S")
    if not value:
        return SILENT_BOOT_S
    seconds = float(value)
    return seconds if seconds > 0 else None


def run_in_guest(script_text: str, *, devices: Sequence[str], timeout: int = 300, attempts: int = 2,
                 report: Callable[[str], None] | None = None, **kwargs) -> "GuestResult":
    """run_in_guest_once, booted again when the guest timed out or went silent BEFORE its
    script started: on this machine a TCG boot very occasionally hangs there (seen once in
    CI: the smoke test's guest printed nothing for 300 s, the next boot was fine).  A
    failure after the script started -- a timeout included -- is never retried: the
    script's output has already gone to ``follow``, and it would only run twice.

    ``report`` gets one-line notes for people (accelerator, boot time, retries);
    default: stderr, which pytest shows with a failing test.  Notes also land in
    GuestResult.notes, or GuestError.notes.
    """
    report = report or _report_to_stderr
    accel = kwargs.pop("accel", None) or select_accelerator(kwargs.get("kernel"))
    report(f"accelerator: {accel.describe()}")
    return retry_unstarted(
        lambda: run_in_guest_once(script_text, devices=devices, timeout=timeout, accel=accel,
                                  report=report, **kwargs),
        attempts=attempts, report=report)


def retry_unstarted(boot: Callable[[], "GuestResult"], *, attempts: int,
                    report: Callable[[str], None]) -> "GuestResult":
    """``boot()``, called again (up to ``attempts`` calls in all) after a GuestTimeout --
    GuestSilent included -- that came before the script started."""
    notes: list[str] = []
    for attempt in range(1, attempts + 1):
        try:
            result = boot()
        except GuestTimeout as exc:
            if exc.script_started or attempt == attempts:
                exc.notes = notes + exc.notes
                raise
            note = (f"attempt {attempt} of {attempts}: {exc.headline}, before the script started; "
                    f"killed it and booting again")
            report(note)
            notes.append(note)
            continue
        result.attempts = attempt
        result.notes = notes + result.notes
        return result
    raise AssertionError("unreachable")


def run_in_guest_once(script_text: str, *, devices: Sequence[str], timeout: int = 300,
                 extra_qemu: Sequence[str] = (), numa_nodes: int | None = None,
                 memory_mib: int = DEFAULT_MEMORY_MIB, cpus: int = 2,
                 kernel: str | None = None,
                 follow: Callable[[str], None] | None = None,
                 accel: Accelerator | None = None,
                 silent_after: float | None = None,
                 report: Callable[[str], None] | None = None,
                 programs: dict[str, str] | None = None) -> GuestResult:
    """Boot the guest with the emulated IOMMU and ``devices``; run the script as root.

    ``script_text`` is written to a file and executed directly, so it may start
    with a ``#!`` line; without one it runs under /bin/sh.  It runs with cwd set
    to the per-run work directory and ``$OUT`` pointing at an empty directory
    whose files are returned in ``GuestResult.files`` (a file in a subdirectory as
    ``dir/name``).  ``numa_nodes`` defaults to what the device specs' ``numa_node=``
    properties need.  ``programs``: more executables (name -> text) written beside
    the script, for it to run as ``./name``.

    ``follow``: called with each new piece of the script's stdout while the
    guest runs (the file is on the shared 9p directory, mounted sync), for
    callers that show progress live; the result still carries all of it.

    ``accel``: default select_accelerator().  ``silent_after``: seconds a boot may
    print nothing before its script starts (default silent_boot_limit(); 0: no limit).

    Raises GuestError if the guest never reports the script's exit status,
    GuestTimeout if it runs past ``timeout`` seconds, GuestSilent if it went silent
    before the script started.
    """
    kernel = _boot_kernel(kernel)
    accel = accel or select_accelerator(kernel)
    if silent_after is None:
        silent_after = silent_boot_limit()
    elif silent_after <= 0:
        silent_after = None
    report = report or _report_to_stderr
    if numa_nodes is None:
        numa_nodes = _numa_needed(devices)
    echo = os.environ.get("GPUVFIO_KL_VERBOSE") == "1"
    keep = os.environ.get("GPUVFIO_KL_KEEP") == "1"

    work = tempfile.mkdtemp(prefix="gpuvfio-kl-", dir=WORK_PARENT)
    try:
        os.chmod(work, 0o755)
        if not _SAFE_PATH.match(work) or not _SAFE_PATH.match(kernel):
            raise GuestError(f"unsafe path for vng: {work!r} / {kernel!r}")
        os.mkdir(os.path.join(work, "out"))
        with open(os.path.join(work, "script"), "w") as f:
            f.write(script_text)
        with open(os.path.join(work, "run.sh"), "w") as f:
            f.write(_WRAPPER.format(work=work))
        for name, text in (programs or {}).items():
            if not re.fullmatch(r"[a-z][a-z0-9_-]*", name) or name in ("script", "run.sh", "out"):
                raise GuestError(f"bad program name {name!r}")
            with open(os.path.join(work, name), "w") as f:
                f.write(text)
            os.chmod(os.path.join(work, name), 0o755)
        os.chmod(os.path.join(work, "script"), 0o755)
        os.chmod(os.path.join(work, "run.sh"), 0o755)

        cmd = build_vng_command(kernel=kernel, work=work, devices=devices,
                                extra_qemu=extra_qemu, numa_nodes=numa_nodes,
                                memory_mib=memory_mib, cpus=cpus, verbose=True, accel=accel.name)
        env = dict(os.environ, PATH=_tool_path())
        # Own session so a timeout can take down vng *and* the QEMU it started.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, cwd=work, start_new_session=True)
        watched = watch_guest(proc, timeout=timeout, silent_after=silent_after,
                              started_path=os.path.join(work, "started"),
                              follow_path=os.path.join(work, "stdout"), follow=follow,
                              echo=sys.stderr.write if echo else None,
                              on_start=lambda seconds: report(
                                  f"guest script started {seconds:.1f}s after the boot began "
                                  f"({accel.name.upper()})"))
        vng_out, vng_err = watched.stdout, watched.stderr
        failure = dict(vng_stdout=vng_out, vng_stderr=vng_err, command=cmd,
                       script_started=watched.script_started, boot_seconds=watched.boot_seconds,
                       seconds=watched.seconds, accel=accel)
        if watched.outcome == "silent":
            raise GuestSilent(f"the boot printed nothing for {watched.silent_for:.0f}s "
                              f"({watched.seconds:.0f}s after it began)", **failure)
        if watched.outcome == "timeout":
            raise GuestTimeout(f"guest did not finish within {timeout}s", **failure)

        def read(name: str) -> str | None:
            try:
                with open(os.path.join(work, name), errors="replace") as f:
                    return f.read()
            except FileNotFoundError:
                return None

        rc = read("rc")
        if rc is None or not rc.strip().lstrip("-").isdigit():
            raise GuestError(f"guest exited (vng rc={proc.returncode}) without running the "
                             "script to completion", **failure)
        files = _read_out(os.path.join(work, "out"))
        return GuestResult(returncode=int(rc), stdout=read("stdout") or "",
                           stderr=read("stderr") or "", seconds=watched.seconds, files=files,
                           vng_stdout=vng_out, vng_stderr=vng_err, accel=accel,
                           boot_seconds=watched.boot_seconds)
    finally:
        if keep:
            print(f"kernel lane: kept work dir {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _read_out(outdir: str) -> dict[str, str]:
    """Every regular file under ``outdir``, named by its path below it ("part/name")."""
    files = {}
    for parent, dirs, names in os.walk(outdir):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(parent, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, errors="replace") as f:
                    files[os.path.relpath(path, outdir)] = f.read()
    return files


# --- Several scripts in one boot -----------------------------------------------------
#
# A boot costs 15-45 s under TCG before any script runs, and each Python script then
# imports what it needs again; modules that need the same devices share one boot.

@dataclass(frozen=True)
class Part:
    """One module's script in a shared boot.  ``changes_host``: it binds or unbinds
    drivers, so it runs after every part that only reads."""
    name: str
    script: str
    timeout: int
    changes_host: bool = False


_PARTS_RUNNER = """#!/bin/sh
# Written by tests/lanes/kernel.py: runs each part with its own $OUT, one after another.
TOP=$OUT
mkdir -p "$TOP/.parts"
for name in {names}; do
  mkdir -p "$TOP/$name"
  date +%s.%N >"$TOP/.parts/$name.start"
  OUT=$TOP/$name "./part-$name" >"$TOP/.parts/$name.stdout" 2>"$TOP/.parts/$name.stderr" </dev/null
  echo $? >"$TOP/.parts/$name.rc"
  date +%s.%N >"$TOP/.parts/$name.end"
done
"""


def parts_runner(parts: Sequence[Part]) -> tuple[str, dict[str, str], list[str]]:
    """The script that runs ``parts`` in one boot (read-only ones first, then in the order
    given), the programs it runs, and the part names in that order."""
    ordered = sorted(parts, key=lambda part: part.changes_host)
    names = [part.name for part in ordered]
    if not names or len(set(names)) != len(names) \
            or not all(re.fullmatch(r"[a-z][a-z0-9_]*", name) for name in names):
        raise GuestError(f"parts need distinct names of lower-case letters, digits and _: {names}")
    programs = {f"part-{part.name}": part.script for part in ordered}
    return _PARTS_RUNNER.format(names=" ".join(names)), programs, names


def run_parts_in_guest(parts: Sequence[Part], *, devices: Sequence[str],
                       **kwargs) -> dict[str, GuestResult]:
    """One boot for several parts (parts_runner); each part's GuestResult carries its own
    exit status, output, files and seconds.  A boot that fails fails every part: the
    error is raised."""
    script, programs, names = parts_runner(parts)
    whole = run_in_guest(script, devices=devices, timeout=sum(part.timeout for part in parts),
                         programs=programs, **kwargs)
    return {name: part_result(whole, name) for name in names}


def part_result(whole: GuestResult, name: str) -> GuestResult:
    """Part ``name``'s share of a shared boot's result."""
    meta = {key[len(f".parts/{name}."):]: text for key, text in whole.files.items()
            if key.startswith(f".parts/{name}.")}
    rc = meta.get("rc", "").strip()
    if not rc.lstrip("-").isdigit():
        raise GuestError(f"part {name} did not finish (the boot's script exited {whole.returncode}): "
                         f"{whole.stderr[-2000:]}")
    try:
        seconds = float(meta["end"]) - float(meta["start"])
    except (KeyError, ValueError):
        seconds = whole.seconds
    prefix = name + "/"
    files = {key[len(prefix):]: text for key, text in whole.files.items() if key.startswith(prefix)}
    return replace(whole, returncode=int(rc), stdout=meta.get("stdout", ""),
                   stderr=meta.get("stderr", ""), seconds=seconds, files=files)


# --- Watching a running guest -------------------------------------------------------

@dataclass
class SilenceWatch:
    """When a boot counts as silent; pure bookkeeping over times, fed by watch_guest.

    Before the script starts, every byte from vng (QEMU, the kernel console, virtme's
    init) is a sign of life, and a boot that has sent nothing for ``limit`` seconds --
    since it began or since its last output -- is silent.  Once the script has
    started it never is: scripts may be quiet for minutes (the nested lane waits for
    a second-level guest), and killing one would have to run it again.
    """
    limit: float | None
    began: float
    last_output: float | None = None
    script_started_at: float | None = None

    def saw_output(self, now: float) -> None:
        self.last_output = now if self.last_output is None else max(self.last_output, now)

    def saw_script_start(self, now: float) -> None:
        if self.script_started_at is None:
            self.script_started_at = now

    def quiet_for(self, now: float) -> float:
        return now - (self.began if self.last_output is None else self.last_output)

    def silent(self, now: float) -> bool:
        return (self.limit is not None and self.script_started_at is None
                and self.quiet_for(now) >= self.limit)


@dataclass
class Watched:
    outcome: str                 # "exited", "timeout" or "silent" (the last two: killed)
    stdout: str
    stderr: str
    seconds: float
    script_started: bool
    boot_seconds: float | None   # start to the script starting (None: it did not)
    silent_for: float            # at the end: how long nothing had come


class _Drain(threading.Thread):
    """Reads one pipe to its end, noting when data last arrived."""

    def __init__(self, stream, echo: Callable[[str], None] | None) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.echo = echo
        self.chunks: list[bytes] = []
        self.last_data: float | None = None

    def run(self) -> None:
        while True:
            chunk = self.stream.read1(65536)
            if not chunk:
                return
            self.chunks.append(chunk)
            self.last_data = time.monotonic()
            if self.echo is not None:
                self.echo(chunk.decode(errors="replace"))

    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")


def watch_guest(proc: subprocess.Popen, *, timeout: float, silent_after: float | None,
                started_path: str, follow_path: str | None = None,
                follow: Callable[[str], None] | None = None,
                echo: Callable[[str], None] | None = None,
                on_start: Callable[[float], None] | None = None,
                poll: float = WATCH_POLL_S) -> Watched:
    """Wait for ``proc`` (binary stdout/stderr pipes, its own process group) to exit.

    Kills the whole group when it runs past ``timeout`` or goes silent (SilenceWatch)
    before ``started_path`` exists, and returns only once nothing of it runs any more,
    so a retry never overlaps the boot it replaces.  ``follow`` gets what is added to
    ``follow_path`` (whole lines while it runs); ``echo`` what arrives on the pipes;
    ``on_start`` the boot's seconds when the script is seen to start (before ``follow``
    gets any of its output).
    """
    began = time.monotonic()
    watch = SilenceWatch(silent_after, began)
    drains = [_Drain(stream, echo) for stream in (proc.stdout, proc.stderr)]
    for drain in drains:
        drain.start()
    offset = 0

    def pump(whole_lines: bool = True) -> None:
        nonlocal offset
        if follow is None or follow_path is None:
            return
        try:
            with open(follow_path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return
        # Whole lines only while it runs (a multi-byte character may be split mid-write).
        cut = data.rfind(b"\n") + 1 if whole_lines else len(data)
        if cut:
            offset += cut
            follow(data[:cut].decode(errors="replace"))

    outcome = "exited"
    while proc.poll() is None:
        now = time.monotonic()
        for drain in drains:
            if drain.last_data is not None:
                watch.saw_output(drain.last_data)
        if watch.script_started_at is None and os.path.exists(started_path):
            watch.saw_script_start(now)
            if on_start is not None:
                on_start(_started_after(started_path, began, now))
        pump()
        if now - began > timeout:
            outcome = "timeout"
        elif watch.silent(now):
            outcome = "silent"
        if outcome != "exited":
            _kill_group(proc)
            break
        time.sleep(poll)
    end = time.monotonic()
    pump(whole_lines=False)
    for drain in drains:
        drain.join(timeout=10)
    started = watch.script_started_at is not None or os.path.exists(started_path)
    return Watched(outcome=outcome, stdout=drains[0].text(), stderr=drains[1].text(),
                   seconds=end - began, script_started=started,
                   boot_seconds=_started_after(started_path, began, watch.script_started_at),
                   silent_for=watch.quiet_for(end))


def _started_after(path: str, began: float, seen_at: float | None) -> float | None:
    """Seconds from ``began`` to the script starting: from the marker's mtime (the host's
    clock, written through 9p) where it exists, else when the watch saw it, else None."""
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return None if seen_at is None else seen_at - began
    # Both clocks measured now: wall-clock time of ``began``.
    began_wall = time.time() - (time.monotonic() - began)
    return max(0.0, mtime - began_wall)


def _kill_group(proc: subprocess.Popen, wait: float = 15.0) -> None:
    """SIGKILL ``proc``'s process group and wait until none of its members is left
    running (zombies, which PID 1 here may never reap, do not count)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=wait)
    deadline = time.monotonic() + wait
    while _live_group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)


def _live_group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


# --- Parsing helpers for tests ------------------------------------------------------

def parse_lspci_vmm(text: str) -> dict[str, dict[str, str]]:
    """``lspci -D -nn -k -vmm`` records, keyed by Slot.  Repeated keys keep the first."""
    records: dict[str, dict[str, str]] = {}
    for block in re.split(r"\n\s*\n", text.strip()):
        rec: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":\t")
            if sep:
                rec.setdefault(key.strip(), value.strip())
        if "Slot" in rec:
            records[rec["Slot"]] = rec
    return records


def bracket_id(value: str | None) -> str | None:
    """'Intel Corporation [8086]' -> '8086' (the last [hex] group), lowercased."""
    if value is None:
        return None
    found = re.findall(r"\[([0-9A-Fa-f]{4})\]", value)
    return found[-1].lower() if found else None


def iommu_groups_script() -> str:
    """Shell fragment: print 'GROUP ADDRESS' per device from /sys/kernel/iommu_groups."""
    return ('for d in /sys/kernel/iommu_groups/*/devices/*; do '
            '[ -e "$d" ] || continue; g=${d#/sys/kernel/iommu_groups/}; '
            'echo "${g%%/*} ${d##*/}"; done')


def parse_groups(text: str) -> dict[int, set[str]]:
    groups: dict[int, set[str]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            groups.setdefault(int(parts[0]), set()).add(parts[1])
    return groups
