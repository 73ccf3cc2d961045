"""Kernel lane: boot a real distribution kernel under QEMU (TCG) with virtme-ng.

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

Environment knobs: GPUVFIO_KL_VERBOSE=1 (kernel console on vng's stdout,
shown in GuestError), GPUVFIO_KL_KEEP=1 (keep the work directory),
GPUVFIO_KL_COMPRESSED=1 (boot /boot/vmlinuz-* as is).

Only the kernel in /boot whose modules are installed is bootable this way
(virtme-ng loads modules from the host's /lib/modules/<version>); the kernel
the host is running may not be installed at all.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

# --- Guest topology -------------------------------------------------------------
#
# q35 puts its own functions at 00:00.0 and 00:1f.{0,2,3}; vng adds ~9 virtio /
# watchdog functions that QEMU auto-places from 00:01.0 upwards.  Our root ports
# sit at fixed slots 0x10-0x12 well clear of those, and each has a fixed
# chassis/slot.  Bus numbers are assigned by the firmware in depth-first order of
# the root bus (00:10.0 -> bus 01, 00:11.0 -> bus 02); the expander bridge has
# its own fixed bus range starting at bus_nr=0x80 (its root port is 80:00.0, the
# device behind it is on bus 0x81).  Verified inside the guest with lspci.
#
#   00:10.0 pcie-root-port rp_gpu
#     01:00.0 e1000e          (fn0, multifunction=on; stands in for the GPU)
#     01:00.1 ich9-intel-hda  (fn1; stands in for the GPU's HDMI audio)
#   00:11.0 pcie-root-port rp_edu
#     02:00.0 edu             (no driver; alone in its IOMMU group)
#   00:12.0 pxb-pcie numa_node=1, bus_nr=0x80
#     80:00.0 pcie-root-port rp_numa1
#       81:00.0 edu           (NUMA node 1)
#
# Functions in one slot without ACS share an IOMMU group; every root port here
# gets its own group (QEMU's pcie-root-port exposes ACS).

GPU_ROOT_PORT = "0000:00:10.0"
GPU_FN0 = "0000:01:00.0"  # e1000e, driver e1000e
GPU_FN1 = "0000:01:00.1"  # ich9-intel-hda, driver snd_hda_intel
EDU_ROOT_PORT = "0000:00:11.0"
EDU = "0000:02:00.0"  # QEMU edu 1234:11e8, no driver
NUMA1_EXPANDER = "0000:00:12.0"  # pxb-pcie host bridge (class 0600)
NUMA1_ROOT_PORT = "0000:80:00.0"
NUMA1_EDU = "0000:81:00.0"  # edu on NUMA node 1

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
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_./-]+$")


class GuestError(RuntimeError):
    """The guest did not run the script to completion (boot failure, timeout)."""

    def __init__(self, message: str, *, vng_stdout: str = "", vng_stderr: str = "",
                 command: Sequence[str] = ()):
        tail_out = vng_stdout[-4000:]
        tail_err = vng_stderr[-4000:]
        super().__init__(
            f"{message}\ncommand: {shlex.join(command)}\n"
            f"--- vng stdout (tail) ---\n{tail_out}\n--- vng stderr (tail) ---\n{tail_err}\n"
            "(set GPUVFIO_KL_VERBOSE=1 to get the kernel console on vng's stdout)"
        )
        self.vng_stdout = vng_stdout
        self.vng_stderr = vng_stderr
        self.command = list(command)


class GuestTimeout(GuestError):
    pass


@dataclass
class GuestResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    files: dict[str, str] = field(default_factory=dict)  # $OUT/<name> -> text
    vng_stdout: str = ""
    vng_stderr: str = ""


# --- Discovery --------------------------------------------------------------------

def _version_key(version: str) -> tuple:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"[.\-+~_]", version))


def find_kernel() -> str | None:
    """Newest /boot/vmlinuz-<ver> whose /lib/modules/<ver> exists, else None."""
    found = []
    for path in glob.glob("/boot/vmlinuz-*"):
        version = os.path.basename(path)[len("vmlinuz-"):]
        if os.path.isdir(os.path.join("/lib/modules", version)) and os.access(path, os.R_OK):
            found.append((_version_key(version), path))
    if not found:
        return None
    return max(found)[1]


def uncompressed_kernel(kernel: str) -> str:
    """An ELF vmlinux extracted from a bzImage's xz payload, cached; else ``kernel``.

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
            data = f.read()
        start = data.find(b"\xfd7zXZ\x00")
        if start < 0:
            return kernel
        elf = lzma.LZMADecompressor().decompress(data[start:])
        if not elf.startswith(b"\x7fELF"):
            return kernel
        os.makedirs(cache, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(elf)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)  # atomic: concurrent runs see all or nothing
        return target
    except (OSError, lzma.LZMAError):
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
        return "kernel lane needs a /boot/vmlinuz-<ver> with /lib/modules/<ver> (apt-get install linux-image-amd64)"
    return None


# --- Running ----------------------------------------------------------------------

_WRAPPER = """#!/bin/sh
# Written by tests/lanes/kernel.py; runs inside the guest.
W={work}
OUT=$W/out
export OUT
cd "$W" || exit 99
chmod +x "$W/script"
"$W/script" >"$W/stdout" 2>"$W/stderr" </dev/null
echo $? >"$W/rc.tmp"
mv "$W/rc.tmp" "$W/rc"
sync
"""


def _numa_needed(devices: Iterable[str]) -> int:
    nodes = [int(m.group(1)) for d in devices for m in re.finditer(r"\bnuma_node=(\d+)", d)]
    return max(nodes) + 1 if nodes else 1


def build_vng_command(*, kernel: str, work: str, devices: Sequence[str],
                      extra_qemu: Sequence[str] = (), numa_nodes: int = 1,
                      memory_mib: int = DEFAULT_MEMORY_MIB, cpus: int = 2,
                      verbose: bool = False) -> list[str]:
    vng = _which("vng") or "vng"
    cpus = max(cpus, numa_nodes)
    qemu = list(IOMMU_QEMU_ARGS)
    for spec in devices:
        qemu += ["-device", spec]
    qemu += list(extra_qemu)
    cmd = [
        vng, "--run", kernel,
        "--disable-kvm",        # /dev/kvm exists here but KVM does not work
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


def run_in_guest(script_text: str, *, devices: Sequence[str], timeout: int = 300, attempts: int = 2,
                 **kwargs) -> "GuestResult":
    """run_in_guest_once, retried after a GuestTimeout: on this machine a TCG boot very
    occasionally hangs before the script starts (seen once in CI: the smoke test's guest
    printed nothing for 300 s, the next boot was fine). A real test failure is not a
    timeout and is never retried."""
    for attempt in range(1, attempts + 1):
        try:
            return run_in_guest_once(script_text, devices=devices, timeout=timeout, **kwargs)
        except GuestTimeout:
            if attempt == attempts:
                raise
            sys.stderr.write(f"[kernel lane] guest timed out after {timeout}s; booting again "
                             f"(attempt {attempt + 1} of {attempts})\n")
    raise AssertionError("unreachable")


def run_in_guest_once(script_text: str, *, devices: Sequence[str], timeout: int = 300,
                 extra_qemu: Sequence[str] = (), numa_nodes: int | None = None,
                 memory_mib: int = DEFAULT_MEMORY_MIB, cpus: int = 2,
                 kernel: str | None = None,
                 follow: Callable[[str], None] | None = None) -> GuestResult:
    """Boot the guest with the emulated IOMMU and ``devices``; run the script as root.

    ``script_text`` is written to a file and executed directly, so it may start
    with a ``#!`` line; without one it runs under /bin/sh.  It runs with cwd set
    to the per-run work directory and ``$OUT`` pointing at an empty directory
    whose files are returned in ``GuestResult.files``.  ``numa_nodes`` defaults
    to what the device specs' ``numa_node=`` properties need.

    ``follow``: called with each new piece of the script's stdout while the
    guest runs (the file is on the shared 9p directory, mounted sync), for
    callers that show progress live; the result still carries all of it.

    Raises GuestError if the guest never reports the script's exit status,
    GuestTimeout if it runs past ``timeout`` seconds.
    """
    kernel = kernel or find_kernel()
    if kernel is None:
        raise GuestError("no bootable kernel found (see find_kernel())")
    if os.environ.get("GPUVFIO_KL_COMPRESSED") != "1":
        kernel = uncompressed_kernel(kernel)
    if numa_nodes is None:
        numa_nodes = _numa_needed(devices)
    verbose = os.environ.get("GPUVFIO_KL_VERBOSE") == "1"
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
        os.chmod(os.path.join(work, "script"), 0o755)
        os.chmod(os.path.join(work, "run.sh"), 0o755)

        cmd = build_vng_command(kernel=kernel, work=work, devices=devices,
                                extra_qemu=extra_qemu, numa_nodes=numa_nodes,
                                memory_mib=memory_mib, cpus=cpus, verbose=verbose)
        env = dict(os.environ, PATH=_tool_path())
        start = time.monotonic()
        # Own session so a timeout can take down vng *and* the QEMU it started.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, cwd=work, text=True,
                                errors="replace", start_new_session=True)
        try:
            if follow is None:
                vng_out, vng_err = proc.communicate(timeout=timeout)
            else:
                vng_out, vng_err, timed_out = _communicate_following(
                    proc, timeout, os.path.join(work, "stdout"), follow)
                if timed_out:
                    raise GuestTimeout(f"guest did not finish within {timeout}s",
                                       vng_stdout=vng_out, vng_stderr=vng_err, command=cmd)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            vng_out, vng_err = proc.communicate()
            raise GuestTimeout(f"guest did not finish within {timeout}s",
                               vng_stdout=vng_out, vng_stderr=vng_err, command=cmd)
        seconds = time.monotonic() - start

        def read(name: str) -> str | None:
            try:
                with open(os.path.join(work, name), errors="replace") as f:
                    return f.read()
            except FileNotFoundError:
                return None

        rc = read("rc")
        if rc is None or not rc.strip().lstrip("-").isdigit():
            raise GuestError(f"guest exited (vng rc={proc.returncode}) without running the "
                             "script to completion", vng_stdout=vng_out, vng_stderr=vng_err,
                             command=cmd)
        files = {}
        outdir = os.path.join(work, "out")
        for name in sorted(os.listdir(outdir)):
            path = os.path.join(outdir, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, errors="replace") as f:
                    files[name] = f.read()
        return GuestResult(returncode=int(rc), stdout=read("stdout") or "",
                           stderr=read("stderr") or "", seconds=seconds, files=files,
                           vng_stdout=vng_out, vng_stderr=vng_err)
    finally:
        if keep:
            print(f"kernel lane: kept work dir {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _communicate_following(proc: subprocess.Popen, timeout: float, path: str,
                           follow: Callable[[str], None]) -> tuple[str, str, bool]:
    """``proc.communicate(timeout)`` that also hands ``follow`` what the guest adds to ``path``.

    Returns (stdout, stderr, timed_out); on a timeout the process group is killed here.
    """
    import threading

    collected: dict[str, str] = {}

    def drain(name: str, stream) -> None:
        collected[name] = stream.read()

    readers = [threading.Thread(target=drain, args=(n, s), daemon=True)
               for n, s in (("out", proc.stdout), ("err", proc.stderr))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    offset = 0

    def pump(whole_lines: bool = True) -> None:
        nonlocal offset
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return
        # Whole lines only while it runs (a multi-byte character may be split mid-write).
        cut = data.rfind(b"\n") + 1 if whole_lines else len(data)
        if cut:
            offset += cut
            follow(data[:cut].decode(errors="replace"))

    timed_out = False
    while proc.poll() is None:
        pump()
        if time.monotonic() > deadline:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            break
        time.sleep(0.3)
    pump(whole_lines=False)
    for reader in readers:
        reader.join(timeout=10)
    return collected.get("out", ""), collected.get("err", ""), timed_out


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
