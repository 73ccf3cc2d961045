"""The end-to-end demo: GPU passthrough with gpuvfio on an emulated GPU host, watched live.

    python -m tests.lanes.demo [--out DIR]      (from the repository root, as root)

1. builds the tiny second-level guest on this machine (busybox + dropbear, cached);
2. boots the "GPU host": this machine's kernel under QEMU (KVM where it really
   works, else TCG: tests/lanes/kernel.py probes it) with an emulated Intel IOMMU and
   a GPU-shaped PCI topology, where QEMU ``edu`` devices 1234:11e8 stand in for GPUs
   (0000:02:00.0 alone; 0000:41:00.0 on NUMA node 0; 0000:84:00.0 and 0000:85:00.0
   behind an emulated PCIe switch on node 1, 0000:88:00.0 behind a second switch
   cascaded below it);
3. inside it, starts libvirtd and runs, printing each command and its output as it
   happens: ``gpuvfio list --all``, ``gpuvfio doctor``, the bind plan (``gpuvfio bind
   0000:02:00.0 --dry-run``), the domain XML (``gpuvfio xml ...``, also defined and
   undefined in that libvirtd), then ``gpuvfio attach ...`` of the node-0 edu and the
   three behind the switches with the host's topology mirrored (bind to vfio-pci, define,
   start the second-level guest, wait for SSH, verify -- progress and the verification
   report), the PCI tree the second-level guest sees, and ``gpuvfio detach ...``;
4. says how long each phase took against what it usually takes (USUAL), and how
   busy the machine was meanwhile;
5. leaves the JSON outputs (attach report, verification report, plan, inventory,
   doctor, detach, status), the transcript, the phase table (phases.txt) and the
   consoles of both guests under ``demo-out/``, also when the run fails.

Takes ~4-7 minutes on 2 cores on a quiet machine (the second-level guest boots
under two layers of emulation), twice that or more when other work loads it.
Exit status 0 when the device was verified in the second-level guest and given
back afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

from tests.lanes import guest as gl
from tests.lanes import kernel as kl
from tests.lanes import nested

REPO = nested.REPO


# --- What each phase usually takes ------------------------------------------------
#
# phase -> (what a person calls it, usual (low, high) seconds or None where nobody has
# measured it, the output file to look at when it is slow).  The names past "boot" are
# the ones tests/lanes/nested_guest.py writes to its "timings" file ("attach: STEP" are
# the steps of gpuvfio's attach report).  All numbers: 2 cores, QEMU TCG, a quiet
# machine; under KVM the first-level phases are faster, the second-level guest is
# emulated (TCG) either way.  Sources:
#   [doc]  nested.py's docstring: boot ~20-40 s, imports over 9p ~20-30 s, libvirtd
#          ~10-15 s, QEMU capability probe ~7 s (then cached), attach ~150 s of which
#          the second-level guest to SSH ~85 s and verify ~45 s, detach ~7 s, ~4-4.5 min
#          in all; kernel.py's docstring: a bare boot+run 13-17 s; earlier runs of `make demo`
#          (logs not kept): 6.6 min quiet, 14.4 min loaded (SSH after 598 s), once no SSH within 900 s.
#   [run]  one demo run, 2026-11, machine otherwise idle (other processes 8% of the CPU,
#          steal 2%): build 0.0 s (cached), boot 18 s, preload 38 s, libvirtd 21 s,
#          capabilities 3.1 s (cached), attach 210 s, to SSH 182 s, verify 7.6 s (the
#          probe is faster now than nested_guest.PROBE_TIMEOUT's 43-120 s), detach 8.1 s,
#          in the guest 311 s, the emulated run 337 s, the whole demo 337 s.
#   build: measured 2026-11: 0.03 s cached, 0.5 s fresh, + 0.9 s the first time for
#          extracting the kernel (kernel.uncompressed_kernel).
# Each range spans [doc] and [run]; "far slower" starts at three times its top.
USUAL: dict[str, tuple[str, tuple[float, float] | None, str]] = {
    "build": ("building the tiny second-level guest", (0, 5), ""),
    "kvm probe": ("probing KVM (once per host boot)", None, ""),
    "boot": ("booting the emulated GPU host", (15, 40), "gpu-host-console.log"),
    "preload": ("importing gpuvfio in the GPU host (9p)", (20, 40), ""),
    "libvirtd start": ("starting libvirtd in the GPU host", (10, 25), "libvirtd.json"),
    "qemu capabilities": ("libvirt's QEMU capability probe", (0, 10), "libvirtd.json"),
    "attach": ("gpuvfio attach, in all", (130, 280), "attach.json"),
    "attach: wait for ssh": ("second-level guest to SSH", (85, 190), "nested-console.log"),
    "attach: verify": ("verifying the device in the second-level guest", (5, 120), "verify.json"),
    "detach": ("gpuvfio detach", (5, 10), "detach.json"),
    "total in the guest": ("everything in the GPU host", (180, 320), ""),
    "emulated run": ("the emulated run, boot to power-off", (210, 350), "transcript.txt"),
    "demo": ("the whole demo", (240, 420), ""),
}
# Phases in the "timings" file without a measured usual time (gpuvfio commands that take
# seconds, the other attach steps) are listed with their time alone.

# What a slow phase may mean, by whether other work competed for the CPUs (CpuUse.busy;
# unknown for a run too short to tell).
SLOWER = "slower than usual: the machine may be loaded"
FAR_SLOWER = "far slower than usual: the machine is loaded, or something is wrong"
SLOWER_BUSY = "slower than usual: other work loaded the machine"
FAR_SLOWER_BUSY = "far slower than usual: the machine was loaded, or something is wrong"
SLOWER_IDLE = "slower than usual, though nothing else loaded the machine"
FAR_SLOWER_IDLE = "far slower than usual, though nothing else loaded the machine: something is wrong"


@dataclass(frozen=True)
class Phase:
    name: str          # a key of USUAL, or a name from the "timings" file
    seconds: float
    note: str = ""     # e.g. "TCG", "cached", "after a silent first boot"

    @property
    def label(self) -> str:
        return USUAL.get(self.name, (self.name, None, ""))[0]

    @property
    def usual(self) -> tuple[float, float] | None:
        return USUAL.get(self.name, ("", None, ""))[1]

    def verdict(self, available: set[str] | None = None, busy: bool | None = None) -> str:
        """'' within (or below) the usual range, else how much slower, why that may be
        (``busy``: CpuUse.busy), and where to look (only a file in ``available``, when
        given: the outputs that were written)."""
        if self.usual is None:
            return ""
        high = self.usual[1]
        if self.seconds <= high:
            return ""
        far = self.seconds > 3 * high
        text = (FAR_SLOWER if far else SLOWER) if busy is None else (
            (FAR_SLOWER_BUSY if far else SLOWER_BUSY) if busy else (FAR_SLOWER_IDLE if far else SLOWER_IDLE))
        look = USUAL[self.name][2]
        return text + (f" (see {look})" if look and (available is None or look in available) else "")

    def line(self, available: set[str] | None = None, busy: bool | None = None) -> str:
        """'booting the emulated GPU host (TCG): 41 s (usually 15-40 s) -- slower than usual: ...'"""
        text = f"{self.label}{f' ({self.note})' if self.note else ''}: {_secs(self.seconds)}"
        if self.usual is not None:
            text += f" (usually {self.usual[0]:g}-{self.usual[1]:g} s)"
        verdict = self.verdict(available, busy)
        return text + (f" -- {verdict}" if verdict else "")


def _secs(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def parse_timings(text: str) -> list[tuple[str, float]]:
    """The guest's "timings" file ("%7.2f NAME" per line, NAME may hold spaces) in order."""
    found = []
    for line in text.splitlines():
        seconds, _, name = line.strip().partition(" ")
        try:
            found.append((name.strip(), float(seconds)))
        except ValueError:
            continue  # not a timing line
    return found


def guest_phases(timings: str) -> list[Phase]:
    return [Phase(name, seconds) for name, seconds in parse_timings(timings) if name]


@dataclass(frozen=True)
class CpuSample:
    """/proc/stat's CPU line and this process's CPU time (its reaped children -- vng, QEMU --
    included), in seconds, at one moment."""
    total: float
    busy: float
    steal: float
    own: float
    at: float


def cpu_sample() -> CpuSample | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal (guest time is inside user)
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    own = sum(os.times()[:4])
    return CpuSample(total=(user + nice + system + idle + iowait + irq + softirq + steal) / tick,
                     busy=(user + nice + system + irq + softirq) / tick, steal=steal / tick,
                     own=own, at=time.monotonic())


@dataclass(frozen=True)
class CpuUse:
    """Who had the CPUs during the run, in CPU-seconds: the demo (with QEMU), other
    processes, the hypervisor (steal).  The usual times assume the demo had the machine
    to itself; this says whether it did, so a slow phase can be told apart: loaded
    machine, or something wrong."""
    total: float
    own: float
    others: float
    steal: float

    @property
    def busy(self) -> bool | None:
        """Did other work compete?  None for a run too short to tell (a failure at once)."""
        if self.total < 30:
            return None
        return self.others > 0.25 * self.total or self.steal > 0.10 * self.total

    def line(self) -> str:
        def share(x: float) -> str:
            return f"{x:.0f} ({100 * x / self.total:.0f}%)"

        text = (f"CPU during the run: {self.total:.0f} CPU-s available; the demo used {share(self.own)}, "
                f"other processes {share(self.others)}, the hypervisor took {share(self.steal)}")
        if self.busy:
            text += " -- other work competed with the emulation: expect slower phases"
        elif self.busy is False:
            text += " -- the machine was not busy otherwise"
        return text


def cpu_use(before: CpuSample | None, after: CpuSample | None) -> CpuUse | None:
    if before is None or after is None or after.total <= before.total:
        return None
    own = max(0.0, after.own - before.own)
    return CpuUse(total=after.total - before.total, own=own,
                  others=max(0.0, (after.busy - before.busy) - own),
                  steal=max(0.0, after.steal - before.steal))


def phase_report(phases: list[Phase], *, accel: kl.Accelerator | None, cpu: CpuUse | None,
                 notes: list[str], available: set[str] | None = None) -> str:
    """The phase table as text: the transcript's last section and demo-out/phases.txt.
    ``available``: the output files a slow phase may point to."""
    head = [f"accelerator of the GPU host: {accel.describe() if accel else 'unknown'}"]
    if accel is not None and accel.name == "kvm":
        head.append("(the usual times of the GPU host's own phases were measured under TCG)")
    head += [f"note: {n}" for n in notes]
    head.append(cpu.line() if cpu else "CPU during the run: unknown")
    busy = cpu.busy if cpu else None
    return "\n".join(head + [p.line(available, busy) for p in phases]) + "\n"


# --- The run ------------------------------------------------------------------------

class Transcript:
    """What the demo prints, kept for demo-out/transcript.txt."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        self.parts.append(text)

    def say(self, text: str = "") -> None:
        self.write(text + "\n")

    def text(self) -> str:
        return "".join(self.parts)


def _json(files: dict[str, str], name: str):
    try:
        return json.loads(files.get(name + ".out", ""))
    except ValueError:
        return None


def _put(out: str, written: list[str], name: str, text: str) -> None:
    with open(os.path.join(out, name), "w") as f:
        f.write(text if text.endswith("\n") or not text else text + "\n")
    written.append(name)


def write_outputs(result: nested.NestedResult, out: str) -> list[str]:
    """The JSON outputs and logs of the run under ``out``; returns the file names.
    (The transcript and phases.txt are main()'s: they also cover what ran outside the guest.)"""
    files = result.files
    written: list[str] = []

    def put(name: str, text: str) -> None:
        _put(out, written, name, text)

    for source, target in (("list_json", "list.json"), ("doctor_json", "doctor.json"),
                           ("plan_json", "bind-plan.json"), ("define", "define.json"),
                           ("attach", "attach.json"), ("attached_status", "status-attached.json"),
                           ("detach", "detach.json"), ("detached_status", "status-detached.json")):
        data = _json(files, source)
        if data is not None:
            put(target, json.dumps(data, indent=2))
    attach = _json(files, "attach")
    if attach:
        if attach.get("verify") is not None:
            put("verify.json", json.dumps(attach["verify"], indent=2))
        if attach.get("xml"):
            put("attach-domain.xml", attach["xml"])
    for source, target in (("xml.out", "domain.xml"), ("timings", "timings.txt"),
                           ("nested.qemu.log", "nested-qemu.log"), ("libvirtd.json", "libvirtd.json"),
                           ("errors", "errors.txt"), (nested.NESTED_CONSOLE, "nested-console.log"),
                           ("host.lspci_t", "gpu-host-lspci-t.txt"), ("nested.tree", "nested-pci-tree.txt")):
        if files.get(source):
            put(target, files[source])
    if result.guest.vng_stderr:
        put("gpu-host-console.log", result.guest.vng_stderr)
    if result.guest.stderr.strip():
        put("guest-stderr.txt", result.guest.stderr)
    return written


def verdict(result: nested.NestedResult) -> tuple[bool, list[str]]:
    """Did the device reach the second-level guest and come back? (ok, reasons)"""
    files = result.files
    problems = []
    attach = _json(files, "attach") or {}
    if not attach.get("ok"):
        problems.append("attach did not succeed")
    present = [c for c in (attach.get("verify") or {}).get("checks", []) if c["id"] == "pci_present"]
    if not present or any(c.get("status") != "pass" for c in present):
        problems.append("an edu device was not seen in the second-level guest")
    detach = _json(files, "detach") or {}
    if not detach.get("undefined") or (detach.get("restored") or {}).get("failed"):
        problems.append("detach did not undefine the guest and restore the device")
    drivers = [line.split("|") for line in files.get("detached.drivers", "").splitlines() if line.strip()]
    if not drivers or any(fields[1:] != ["-", "(null)"] for fields in drivers):
        problems.append(f"edu devices not back to no driver: {files.get('detached.drivers', '?').strip()}")
    if files.get("errors"):
        problems.append("the guest script reported errors (errors.txt)")
    return not problems, problems


def _clear(out: str) -> None:
    if os.path.isdir(out):
        for entry in os.listdir(out):  # only our own outputs: plain files
            path = os.path.join(out, entry)
            if os.path.isfile(path) and not os.path.islink(path):
                os.unlink(path)
    os.makedirs(out, exist_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.lanes.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "demo-out"), help="where the outputs go")
    parser.add_argument("--timeout", type=int, default=nested.DEFAULT_TIMEOUT,
                        help="seconds for the whole emulated run")
    args = parser.parse_args(argv)
    log = Transcript()
    say = log.say

    reason = nested.skip_reason()
    if reason:
        say(f"demo: cannot run the emulated GPU host here: {reason}")
        return 2
    if os.geteuid() != 0:
        say("demo: needs root (libvirt and QEMU, as in `make test`)")
        return 2
    out = os.path.abspath(args.out)
    _clear(out)
    shown_out = os.path.relpath(out, os.getcwd()) if out.startswith(os.getcwd()) else out

    began = time.monotonic()
    cpu_before = cpu_sample()
    phases: list[Phase] = []
    say("== gpuvfio end to end: GPU passthrough on an emulated GPU host")
    say(f"   the 'GPUs' are QEMU's edu devices (1234:11e8): {nested.EDU} for the plan and the domain XML; "
        f"{', '.join(nested.ATTACH_DEVICES)} (node 0, then three behind the switches on node 1, one two levels down) passed through")
    say("\n== building the tiny second-level guest (busybox + dropbear; cached)")
    t = time.monotonic()
    image = gl.build_guest()
    phases.append(Phase("build", time.monotonic() - t))
    say(f"kernel {image.kernel}\ninitrd {image.initrd}\nhost key {image.host_key_fingerprint} (pinned), "
        f"client key {image.client_key}  [{phases[-1].seconds:.1f}s]")

    t = time.monotonic()
    accel = kl.select_accelerator()
    if accel.probe is not None and not accel.probe.cached:
        phases.append(Phase("kvm probe", time.monotonic() - t, "KVM works" if accel.probe.works else "no KVM"))
    usual_boot = USUAL["boot"][1]
    say(f"\n== booting the emulated GPU host: this machine's kernel under QEMU {accel.name.upper()}, "
        f"emulated Intel IOMMU (usually {usual_boot[0]:g}-{usual_boot[1]:g} s under TCG) ...")
    say(f"   accelerator: {accel.describe()}")
    notes: list[str] = []

    def report(line: str) -> None:
        if line.startswith("accelerator:"):
            return  # said above
        say(f"   [kernel lane] {line}")

    result = None
    failure = None
    try:
        result = nested.run(nested.ALL_PARTS, timeout=args.timeout, image=image, follow=log.write,
                            report=report, accel=accel)
    except Exception as exc:  # noqa: BLE001 - tell the person, leave what there is
        failure = exc
        say(f"\ndemo: the emulated run failed: {exc}")

    written: list[str] = []
    if result is not None:
        guest = result.guest
        notes = list(guest.notes)
        if guest.boot_seconds is not None:
            phases.append(Phase("boot", guest.boot_seconds, _boot_note(accel, guest.attempts)))
        phases += guest_phases(result.files.get("timings", ""))
        phases.append(Phase("emulated run", guest.seconds))
        written = write_outputs(result, out)
        ok, problems = verdict(result)
    else:
        ok, problems = False, ["the emulated run did not complete"]
        if isinstance(failure, kl.GuestError):
            notes = list(failure.notes)
            if failure.boot_seconds is not None:
                phases.append(Phase("boot", failure.boot_seconds, _boot_note(accel, len(notes) + 1)))
            if failure.seconds is not None:
                phases.append(Phase("emulated run", failure.seconds, "failed"))
            if failure.vng_stderr:
                _put(out, written, "gpu-host-console.log", failure.vng_stderr)
    phases.append(Phase("demo", time.monotonic() - began))
    table = phase_report(phases, accel=accel, cpu=cpu_use(cpu_before, cpu_sample()), notes=notes,
                         available=set(written) | {"transcript.txt"})
    _put(out, written, "phases.txt", table)

    say("\n== how long each phase took (usual times: 2 cores, quiet machine; see demo.py USUAL)")
    for line in table.splitlines():
        say(f"   {line}")
    say(f"\n== outputs in {shown_out}/: " + ", ".join(sorted(written + ["transcript.txt"])))
    say(f"== {'PASS' if ok else 'FAIL'}: "
        + ("the edu devices were passed through, seen in the second-level guest, and given back"
           if ok else "; ".join(problems))
        + f" ({time.monotonic() - began:.0f}s in all)")
    _put(out, [], "transcript.txt", log.text())
    return 0 if ok else 1


def _boot_note(accel: kl.Accelerator, attempts: int) -> str:
    note = accel.name.upper()
    if attempts > 1:
        note += f", attempt {attempts}: the first boot went silent or timed out and was killed"
    return note


if __name__ == "__main__":
    sys.exit(main())
