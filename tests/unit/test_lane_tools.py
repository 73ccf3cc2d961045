"""The pure parts of the kernel/nested lanes and the demo, without booting anything.

The KVM decision, the silent-boot watch (on real ``sh`` processes standing in for
vng), the retry policy and the demo's phase table.  Each test runs in well under a
second; the processes they start are killed with their whole process group.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.lanes import demo
from tests.lanes import kernel as kl
from tests.lanes import nested

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What `qemu-system-x86_64 -accel kvm -cpu host` prints before aborting on a host whose KVM
# cannot set the MSRs QEMU asks for (seen inside a Firecracker microVM with a nested KVM).
ABORT_OUTPUT = (
    "qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69\n"
    "qemu-system-x86_64: ../../target/i386/kvm/kvm.c:3183: kvm_buf_set_msrs: "
    "Assertion `ret == cpu->kvm_msr_buf->nmsrs' failed.\n"
)
PANIC_OUTPUT = "[    0.61] Kernel panic - not syncing: VFS: Unable to mount root fs on unknown-block(0,0)\n"


# --- The KVM decision -----------------------------------------------------------------

class Probe:
    """A probe result to hand out, counting how often it was asked for."""

    def __init__(self, works: bool, detail: str = "seen") -> None:
        self.result = kl.KvmProbe(works, detail, 1.0)
        self.calls = 0

    def __call__(self) -> kl.KvmProbe:
        self.calls += 1
        return self.result


def test_kvm_only_when_the_probe_saw_a_kernel_run():
    works = Probe(True, "a test kernel booted under KVM in 0.8s")
    chosen = kl.choose_accelerator(None, None, works)
    assert (chosen.name, works.calls) == ("kvm", 1)
    assert "booted under KVM" in chosen.reason and chosen.probe is works.result

    hangs = Probe(False, "did not get through its boot in 10s: KVM hangs here")
    chosen = kl.choose_accelerator("auto", None, hangs)
    assert chosen.name == "tcg" and "KVM hangs here" in chosen.reason
    assert "TCG (KVM probe: " in chosen.describe()


def test_an_unusable_device_or_a_setting_skips_the_probe():
    probe = Probe(True)
    assert kl.choose_accelerator(None, "no /dev/kvm", probe).name == "tcg"
    assert kl.choose_accelerator("TCG", None, probe).name == "tcg"
    forced = kl.choose_accelerator("kvm", "no /dev/kvm", probe)
    assert forced.name == "kvm" and "not probed" in forced.reason
    assert probe.calls == 0
    with pytest.raises(ValueError, match="auto, kvm or tcg"):
        kl.choose_accelerator("yes", None, probe)


def test_kvm_device_problem(tmp_path):
    assert "no " in kl.kvm_device_problem(str(tmp_path / "kvm"))
    node = tmp_path / "kvm"
    node.write_text("")
    node.chmod(0o600)
    assert kl.kvm_device_problem(str(node)) is None  # accessible: only the probe can tell more


@pytest.mark.parametrize("output, returncode, timed_out, works, words", [
    (PANIC_OUTPUT, -9, False, True, ["booted under KVM"]),           # killed by us after the panic
    ("warning: host doesn't support pni\n" + PANIC_OUTPUT, None, True, True, ["booted"]),
    (ABORT_OUTPUT, -6, False, False, ["signal 6", "failed to set MSR 0x10a"]),
    ("qemu-system-x86_64: warning: host doesn't support requested feature\n", None, True, False,
     ["KVM hangs here", "last output: qemu-system-x86_64: warning"]),
    ("", 1, False, False, ["exited 1"]),
    ("SeaBIOS\nBooting from ROM...\n", 0, False, False, ["stopped before mounting its root", "Booting"]),
])
def test_classify_kvm_probe(output, returncode, timed_out, works, words):
    probe = kl.classify_kvm_probe(output, returncode=returncode, timed_out=timed_out, seconds=0.8)
    assert probe.works is works
    for word in words:
        assert word in probe.detail


def _fake_qemu(tmp_path, body: str) -> str:
    path = tmp_path / "qemu"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_probe_stops_at_the_panic_and_kills_qemu(tmp_path):
    pidfile = tmp_path / "pid"
    qemu = _fake_qemu(tmp_path, f"echo $$ > {pidfile}\necho '{PANIC_OUTPUT.strip()}'\nexec sleep 30")
    began = time.monotonic()
    probe = kl.run_kvm_probe("/nonexistent-kernel", qemu=qemu, timeout=10)
    assert probe.works, probe.detail
    assert time.monotonic() - began < 5
    assert not os.path.exists(f"/proc/{pidfile.read_text().strip()}/status") or \
        _state(int(pidfile.read_text())) in ("Z", "X")


def test_probe_gives_up_on_a_hang_within_its_timeout(tmp_path):
    qemu = _fake_qemu(tmp_path, "echo 'qemu: warning: something'\nexec sleep 30")
    began = time.monotonic()
    probe = kl.run_kvm_probe("/nonexistent-kernel", qemu=qemu, timeout=0.5)
    assert not probe.works and "KVM hangs here" in probe.detail
    assert time.monotonic() - began < 3


def test_probe_reports_qemu_failing(tmp_path):
    qemu = _fake_qemu(tmp_path, "echo 'qemu: error: boom' >&2\nexit 1")
    probe = kl.run_kvm_probe("/nonexistent-kernel", qemu=qemu, timeout=5)
    assert not probe.works and "exited 1" in probe.detail and "boom" in probe.detail


def test_probe_answer_is_cached_in_process_and_on_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(kl, "_kvm_probes", {})
    calls = []

    def probe(kernel):
        calls.append(kernel)
        return kl.KvmProbe(False, "hangs", 10.0)

    kernel = tmp_path / "vmlinux"
    kernel.write_bytes(b"\x7fELF")
    first = kl.cached_kvm_probe(str(kernel), cache_dir=str(tmp_path / "cache"), probe=probe)
    again = kl.cached_kvm_probe(str(kernel), cache_dir=str(tmp_path / "cache"), probe=probe)
    assert (first.cached, again.cached, len(calls)) == (False, True, 1)
    monkeypatch.setattr(kl, "_kvm_probes", {})  # a new process: only the file is left
    from_disk = kl.cached_kvm_probe(str(kernel), cache_dir=str(tmp_path / "cache"), probe=probe)
    assert len(calls) == 1 and from_disk.cached and from_disk.detail == "hangs"
    os.utime(kernel, ns=(1, 1))  # another kernel file: asked again
    monkeypatch.setattr(kl, "_kvm_probes", {})
    kl.cached_kvm_probe(str(kernel), cache_dir=str(tmp_path / "cache"), probe=probe)
    assert len(calls) == 2


def test_vng_command_disables_kvm_only_for_tcg():
    common = dict(kernel="/boot/vmlinuz-x", work="/tmp/gpuvfio-kl-x", devices=kl.GPU_HOST_DEVICES)
    tcg = kl.build_vng_command(**common, accel="tcg")
    kvm = kl.build_vng_command(**common, accel="kvm")
    assert "--disable-kvm" in tcg and "--disable-kvm" not in kvm
    assert "--verbose" in tcg  # the kernel console, for the silence watch and GuestError
    assert tcg[-1].startswith("--qemu-opts=") and kvm[-1].startswith("--qemu-opts=")
    with pytest.raises(ValueError):
        kl.build_vng_command(**common, accel="hvf")


def test_the_probe_boots_the_lanes_machine_under_kvm_alone():
    cmd = kl.kvm_probe_command("/k", "qemu")
    assert cmd[cmd.index("-accel") + 1] == "kvm"  # "kvm:tcg" would fall back and "work"
    assert cmd[cmd.index("-cpu") + 1] == "host"    # what virtme uses with KVM
    assert "q35,kernel-irqchip=split" in cmd and "-no-reboot" in cmd


# --- Silent boots -----------------------------------------------------------------------

def test_silence_watch_counts_from_start_then_from_the_last_output():
    watch = kl.SilenceWatch(limit=10, began=100)
    assert not watch.silent(109.9) and watch.silent(110)
    watch.saw_output(105)
    assert not watch.silent(114.9) and watch.silent(115)
    watch.saw_output(103)  # an older report does not move it back
    assert watch.silent(115)


def test_silence_never_counts_once_the_script_started():
    watch = kl.SilenceWatch(limit=10, began=0)
    watch.saw_script_start(5)
    assert not watch.silent(10_000)
    assert not kl.SilenceWatch(limit=None, began=0).silent(10_000)


def _start(tmp_path, script: str) -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", script], cwd=tmp_path, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def test_a_silent_boot_is_killed_with_its_whole_group(tmp_path):
    # "sleep; echo" keeps sh waiting on a child, as vng waits on QEMU.
    proc = _start(tmp_path, "sleep 30; echo never")
    began = time.monotonic()
    watched = kl.watch_guest(proc, timeout=20, silent_after=0.4, started_path=str(tmp_path / "started"),
                             poll=0.05)
    assert watched.outcome == "silent" and not watched.script_started
    assert 0.4 <= watched.silent_for and time.monotonic() - began < 5
    assert proc.returncode == -9
    assert kl._live_group_members(proc.pid) == []  # the sleep too: a retry overlaps nothing


def test_a_slow_boot_that_prints_is_not_killed(tmp_path):
    # Eight lines 0.1 s apart on stderr (where vng puts the kernel console): ~0.8 s in all,
    # longer than the silence limit, but never quiet for a sixth of it.
    proc = _start(tmp_path, "for i in 1 2 3 4 5 6 7 8; do echo tick $i >&2; sleep 0.1; done")
    watched = kl.watch_guest(proc, timeout=20, silent_after=0.6, started_path=str(tmp_path / "started"),
                             poll=0.05)
    assert watched.outcome == "exited", watched
    assert watched.seconds > 0.7 and watched.stderr.count("tick") == 8


def test_a_quiet_script_is_not_killed_and_its_start_is_timed(tmp_path):
    # Started 0.2 s in (well inside the limit, even on a busy machine), then quiet for
    # longer than the limit.
    proc = _start(tmp_path, "sleep 0.2; : > started; sleep 0.9; echo done > out")
    lines, starts = [], []
    watched = kl.watch_guest(proc, timeout=20, silent_after=0.6, started_path=str(tmp_path / "started"),
                             follow_path=str(tmp_path / "out"), follow=lines.append,
                             on_start=starts.append, poll=0.05)
    assert watched.outcome == "exited" and watched.script_started
    assert 0.1 < watched.boot_seconds < 0.9
    assert len(starts) == 1 and abs(starts[0] - watched.boot_seconds) < 0.1
    assert "".join(lines) == "done\n"


def test_a_timeout_after_the_script_started_says_so(tmp_path):
    proc = _start(tmp_path, ": > started; sleep 30; echo never")
    watched = kl.watch_guest(proc, timeout=0.5, silent_after=None, started_path=str(tmp_path / "started"),
                             poll=0.05)
    assert watched.outcome == "timeout" and watched.script_started
    assert kl._live_group_members(proc.pid) == []


# --- Retrying ---------------------------------------------------------------------------

def _result() -> kl.GuestResult:
    return kl.GuestResult(returncode=0, stdout="", stderr="", seconds=1.0)


class Boots:
    """Boots that fail as listed (an exception) or succeed (None), in order."""

    def __init__(self, *outcomes) -> None:
        self.outcomes = list(outcomes)
        self.calls = 0

    def __call__(self) -> kl.GuestResult:
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if outcome is not None:
            raise outcome
        return _result()


def test_a_boot_silent_before_the_script_is_retried_once_and_said():
    reported = []
    boots = Boots(kl.GuestSilent("the boot printed nothing for 240s"), None)
    result = kl.retry_unstarted(boots, attempts=2, report=reported.append)
    assert boots.calls == 2 and result.attempts == 2
    assert len(reported) == 1 and "printed nothing for 240s" in reported[0]
    assert "booting again" in reported[0] and result.notes == reported


def test_no_retry_once_the_script_started():
    reported = []
    boots = Boots(kl.GuestTimeout("guest did not finish within 900s", script_started=True), None)
    with pytest.raises(kl.GuestTimeout):
        kl.retry_unstarted(boots, attempts=2, report=reported.append)
    assert boots.calls == 1 and reported == []


def test_retries_end_and_other_failures_are_not_retried():
    boots = Boots(kl.GuestSilent("silent"), kl.GuestSilent("silent again"))
    with pytest.raises(kl.GuestSilent) as raised:
        kl.retry_unstarted(boots, attempts=2, report=lambda line: None)
    assert boots.calls == 2 and len(raised.value.notes) == 1
    boots = Boots(kl.GuestError("guest exited without running the script"), None)
    with pytest.raises(kl.GuestError):
        kl.retry_unstarted(boots, attempts=2, report=lambda line: None)
    assert boots.calls == 1


def test_guest_error_says_whether_the_script_started_and_the_accelerator():
    accel = kl.Accelerator("tcg", "no /dev/kvm")
    text = str(kl.GuestSilent("the boot printed nothing for 240s", accel=accel, vng_stderr="[ 1.0] Linux"))
    assert "script had not started" in text and "TCG (no /dev/kvm)" in text and "[ 1.0] Linux" in text


# --- The demo's phase table ---------------------------------------------------------------

TIMINGS = """\
  24.51 preload
  12.03 libvirtd start
   0.41 qemu capabilities
   1.20 list
 170.10 attach
   0.52   attach: bind
 598.00   attach: wait for ssh
  44.00   attach: verify
 not a timing line
 250.00 total in the guest
"""


def test_parse_timings_keeps_names_with_spaces_in_order():
    parsed = demo.parse_timings(TIMINGS)
    assert parsed[0] == ("preload", 24.51)
    assert ("attach: wait for ssh", 598.0) in parsed
    assert [name for name, _ in parsed][-1] == "total in the guest"
    assert len(parsed) == 9


def test_phase_lines_judge_against_the_usual_range():
    assert demo.Phase("boot", 30, "TCG").line() == \
        "booting the emulated GPU host (TCG): 30 s (usually 15-40 s)"
    slow = demo.Phase("boot", 41, "TCG").line()
    assert slow.endswith("-- " + demo.SLOWER + " (see gpu-host-console.log)")
    ssh = demo.Phase("attach: wait for ssh", 598).line()
    assert ssh.startswith("second-level guest to SSH: 598 s (usually 85-190 s) -- ")
    assert demo.FAR_SLOWER in ssh
    assert demo.Phase("list", 1.234).line() == "list: 1.2 s"  # no usual time: no judgement
    assert "see" not in demo.Phase("attach: wait for ssh", 598).line(available={"phases.txt"})


def test_a_slow_phase_says_whether_the_machine_was_busy():
    ssh = demo.Phase("attach: wait for ssh", 598)
    assert demo.FAR_SLOWER_BUSY in ssh.line(busy=True)
    assert demo.FAR_SLOWER_IDLE in ssh.line(busy=False) and "something is wrong" in ssh.line(busy=False)
    assert demo.SLOWER_IDLE in demo.Phase("boot", 41).line(busy=False)
    assert "--" not in demo.Phase("boot", 20).line(busy=True)


def test_phase_report_names_the_accelerator_and_the_notes():
    phases = [demo.Phase("build", 0.4)] + demo.guest_phases(TIMINGS)
    kvm = kl.Accelerator("kvm", "KVM probe: a test kernel booted under KVM in 0.8s")
    idle = demo.CpuUse(total=800, own=600, others=20, steal=4)
    text = demo.phase_report(phases, accel=kvm, cpu=idle, notes=["attempt 1 of 2: silent"])
    lines = text.splitlines()
    assert lines[0] == "accelerator of the GPU host: KVM (KVM probe: a test kernel booted under KVM in 0.8s)"
    assert "measured under TCG" in lines[1] and "note: attempt 1 of 2: silent" in lines
    assert idle.line() in lines
    assert lines[-len(phases):] == [p.line(busy=False) for p in phases]
    assert demo.FAR_SLOWER_IDLE in text  # the 598 s wait for SSH on an idle machine
    tcg = demo.phase_report(phases, accel=kl.Accelerator("tcg", "x"), cpu=None, notes=[]).splitlines()
    assert tcg[1] == "CPU during the run: unknown" and demo.FAR_SLOWER in "\n".join(tcg)


def test_every_usual_phase_is_one_the_lanes_write():
    """USUAL's names must match what nested_guest.py logs and gpuvfio's attach steps are
    called, or the demo silently stops judging them."""
    with open(os.path.join(REPO, "tests", "lanes", "nested_guest.py")) as f:
        guest_source = f.read()
    from gpuvfio.planning import StepKind

    # attach's steps by the names its plan gives them (and its run records them under)
    steps = {kind.value for kind in StepKind}
    for name in demo.USUAL:
        if name in ("build", "kvm probe", "boot", "emulated run", "demo"):
            continue  # measured by the host side
        if name.startswith("attach: "):
            assert name[len("attach: "):] in steps, f"attach has no step {name!r}: update demo.USUAL"
        else:
            assert re.search(r"[ \"']" + re.escape(name) + r"[\\\"']", guest_source), \
                f"nested_guest.py does not write {name!r}: update demo.USUAL"


def _cpu(total, busy, steal, own) -> demo.CpuSample:
    return demo.CpuSample(total=total, busy=busy, steal=steal, own=own, at=0.0)


def test_cpu_use_tells_the_demo_from_other_work():
    quiet = demo.cpu_use(_cpu(100, 50, 1, 10), _cpu(900, 670, 5, 610))
    assert (quiet.total, quiet.own, quiet.others, quiet.steal) == (800, 600, 20, 4)
    assert quiet.busy is False and "the demo used 600 (75%)" in quiet.line()
    assert "other processes 20 (2%)" in quiet.line() and "not busy" in quiet.line()
    loaded = demo.cpu_use(_cpu(0, 0, 0, 0), _cpu(800, 790, 0, 400))
    assert loaded.busy and "other processes 390 (49%)" in loaded.line() and "competed" in loaded.line()
    stolen = demo.cpu_use(_cpu(0, 0, 0, 0), _cpu(800, 500, 120, 500))
    assert stolen.busy and "hypervisor took 120 (15%)" in stolen.line()
    assert demo.cpu_use(None, _cpu(1, 1, 0, 0)) is None
    assert demo.cpu_use(_cpu(0, 0, 0, 0), _cpu(4, 4, 0, 1)).busy is None  # too short to tell


def test_cpu_sample_reads_this_machine():
    before = demo.cpu_sample()
    # CPU time of our own, enough for the kernel's clock ticks (/proc/self/stat counts in 10 ms
    # at USER_HZ 100) to see it: a fixed loop took under one tick on a loaded machine
    spin = time.process_time()
    while time.process_time() - spin < 0.05:
        pass
    after = demo.cpu_sample()
    assert before is not None and after.total >= before.total and after.own > before.own


# --- Outputs -------------------------------------------------------------------------------

def _nested_result(files: dict[str, str], vng_stderr: str = "") -> nested.NestedResult:
    from tests.lanes import guest as gl

    image = gl.GuestImage(kernel="k", kernel_version="v", initrd="i", host_key_line="ssh-ed25519 AAAA",
                          host_key_fingerprint="SHA256:x", client_key="c", client_key_type="ed25519",
                          directory="d")
    guest = kl.GuestResult(returncode=0, stdout="guest out\n", stderr="", seconds=300.0, files=files,
                           vng_stderr=vng_stderr, accel=kl.Accelerator("tcg", "no /dev/kvm"),
                           boot_seconds=31.5, attempts=2, notes=["attempt 1 of 2: silent"])
    return nested.NestedResult(guest, image, nested.ALL_PARTS, dict(files))


def test_write_outputs_keeps_both_consoles(tmp_path):
    console = "GPUVFIO-GUEST-INIT 6.1 up=40.1\n"
    written = demo.write_outputs(_nested_result({nested.NESTED_CONSOLE: console, "timings": TIMINGS},
                                                vng_stderr="[ 1.2] Linux version\n"), str(tmp_path))
    assert (tmp_path / "nested-console.log").read_text() == console
    assert (tmp_path / "gpu-host-console.log").read_text() == "[ 1.2] Linux version\n"
    assert {"nested-console.log", "gpu-host-console.log", "timings.txt"} <= set(written)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "nested-console.log" not in demo.write_outputs(_nested_result({}), str(empty))
    assert not (empty / "nested-console.log").exists()


def test_summary_shows_the_nested_console_tail_and_the_boot():
    console = "x" * 5000 + "\nGPUVFIO-GUEST-INIT up=250.3\n"
    summary = _nested_result({nested.NESTED_CONSOLE: console}).summary()
    assert "GPUVFIO-GUEST-INIT up=250.3" in summary and "x" * 3001 not in summary
    assert "TCG (no /dev/kvm)" in summary and "31.5s to the script" in summary
    assert "attempt 1 of 2: silent" in summary
    assert "(not captured)" in _nested_result({}).summary()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def _bzimage(payload: bytes, setup_sects: int = 3, offset: int = 0x40) -> bytes:
    """A bzImage as the x86 boot protocol lays it out (Documentation/arch/x86/boot.rst): the setup
    header's magic, setup_sects, payload_offset and payload_length, the payload after the setup."""
    data = bytearray(((setup_sects or 4) + 1) * 512 + offset)  # 0 setup sectors means 4
    data[0x1F1] = setup_sects
    data[0x202:0x206] = b"HdrS"
    data[0x248:0x250] = offset.to_bytes(4, "little") + len(payload).to_bytes(4, "little")
    return bytes(data) + payload + b"trailing bytes the boot protocol does not count"


def test_the_payload_is_where_the_setup_header_says_xz_and_zstd():
    import lzma

    elf = b"\x7fELF" + bytes(range(256)) * 64
    xz = lzma.compress(elf, format=lzma.FORMAT_XZ)
    found = kl._payload(_bzimage(xz))
    assert found == ("xz", xz) and kl._decompress(*found) == elf
    zstd = subprocess.run(["zstd", "-c"], input=elf, capture_output=True, check=True).stdout
    # Debian 13's kernels: zstd, the uncompressed size appended (4 bytes) inside payload_length.
    found = kl._payload(_bzimage(zstd + len(elf).to_bytes(4, "little"), setup_sects=0))
    assert found == ("zstd", zstd) and kl._decompress(*found) == elf
    assert kl._payload(b"MZ" + bytes(0x400)) is None  # no "HdrS": not a bzImage
    assert kl._payload(_bzimage(b"gzip or lz4: booted as it is")) is None


def test_the_kernel_named_is_booted_only_with_its_modules(tmp_path, monkeypatch):
    """GPUVFIO_KL_KERNEL (make test-current: Debian 13's kernel) wins over /boot, but only as an
    absolute vmlinuz-<ver> whose modules virtme-ng can load; else the lane does not run on it."""
    version = sorted(os.listdir("/lib/modules"))[0]  # linux-image-amd64 is among make's packages
    image = tmp_path / f"vmlinuz-{version}"
    image.write_bytes(b"kernel")
    monkeypatch.setenv(kl.KERNEL_ENV, str(image))
    assert kl.find_kernel() == str(image)
    for wrong in (tmp_path / "vmlinuz-0.0.0-none", tmp_path / "bzImage", f"vmlinuz-{version}",
                  tmp_path / f"vmlinuz-{version}-gone"):
        monkeypatch.setenv(kl.KERNEL_ENV, str(wrong))
        assert kl.find_kernel() is None
        assert kl.KERNEL_ENV in (kl.skip_reason() or "") or not kl.vng_available()


def test_compressed_modules_go_into_the_guest_plain(tmp_path):
    """Debian 13 ships its modules xz-compressed (Debian 12: plain): the daemon lane's guest gets
    them decompressed, under the plain name its init insmods, dependencies first."""
    import gzip
    import lzma

    from tests.lanes import guest

    base = tmp_path / "9.9.9-test"
    (base / "kernel").mkdir(parents=True)
    dep = {"kernel/failover.ko.xz": [], "kernel/net_failover.ko.gz": ["kernel/failover.ko.xz"],
           "kernel/virtio_net.ko.xz": ["kernel/net_failover.ko.gz", "kernel/failover.ko.xz"]}
    (base / "modules.dep").write_text("".join(f"{k}: {' '.join(v)}\n".replace(": \n", ":\n") for k, v in dep.items()))
    for name in dep:
        body = f"ELF module {name}".encode()
        (base / name).write_bytes(lzma.compress(body) if name.endswith(".xz") else gzip.compress(body))
    order = guest.module_load_order("9.9.9-test", ["virtio_net"], modules_root=str(tmp_path))
    assert order == ["kernel/failover.ko.xz", "kernel/net_failover.ko.gz", "kernel/virtio_net.ko.xz"]
    assert [guest.plain_module(m) for m in order] == ["kernel/failover.ko", "kernel/net_failover.ko",
                                                      "kernel/virtio_net.ko"]
    assert guest._module_bytes(str(base / order[1])) == b"ELF module kernel/net_failover.ko.gz"
    assert "for m in kernel/failover.ko kernel/net_failover.ko kernel/virtio_net.ko; do" in guest._init_script(order)
    (base / "modules.dep").write_text("kernel/virtio_net.ko.zst:\n")
    with pytest.raises(guest.GuestBuildError, match="neither plain nor xz or gzip"):
        guest.module_load_order("9.9.9-test", ["virtio_net"], modules_root=str(tmp_path))


def test_the_current_kernel_is_the_one_debian_13s_meta_package_names():
    from tests.lanes import current

    shown = ("Package: linux-image-amd64\nVersion: 6.12.117-1\n"
             "Depends: linux-image-6.12.117+deb13-amd64 (= 6.12.117-1)\nDescription: Linux for 64-bit PCs\n")
    assert current.kernel_package(shown) == ("linux-image-6.12.117+deb13-amd64", "6.12.117+deb13-amd64")
    with pytest.raises(current.FetchError, match="names no kernel package"):
        current.kernel_package(shown.replace("linux-image-6.12.117+deb13-amd64", "linux-image-6.12.117+deb13-cloud"))
    with pytest.raises(current.FetchError):
        current.kernel_package("Package: linux-image-amd64\n")


def test_the_debian_13_root_takes_the_declared_dependencies_and_the_lanes_test_tools():
    """The root's virtual environment gets pyproject.toml's dependencies as declared (libvirt-python
    is then Debian's python3-libvirt, which satisfies it) and only the test tools the daemon lane
    imports; a changed requirement makes another root (the cache key)."""
    from tests.lanes import current

    wanted = current._requirements()
    assert "libvirt-python>=9.0" in wanted and any(r.startswith("typer>=") for r in wanted)
    assert any(r.startswith("pytest>=") for r in wanted) and not any(r.startswith("ansible") for r in wanted)
    assert "python3-libvirt" in current.ROOT_PACKAGES and "linux-image-amd64" in current.ROOT_PACKAGES


# --- Several parts in one boot --------------------------------------------------------

def _run_parts_here(tmp_path, parts) -> dict[str, kl.GuestResult]:
    """The parts runner as the guest's wrapper runs it (cwd the work directory, $OUT empty),
    on this machine; its $OUT read back as run_in_guest_once reads it."""
    script, programs, names = kl.parts_runner(parts)
    for name, text in {"script": script, **programs}.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    (tmp_path / "out").mkdir()
    proc = subprocess.run(["./script"], cwd=tmp_path, env=dict(os.environ, OUT=str(tmp_path / "out")),
                          capture_output=True, text=True, timeout=60)
    whole = kl.GuestResult(returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr, seconds=9.0,
                           files=kl._read_out(str(tmp_path / "out")), boot_seconds=4.0)
    return {name: kl.part_result(whole, name) for name in names}


def test_parts_share_a_boot_each_with_its_own_out_status_and_output(tmp_path):
    changer = kl.Part("binding", '#!/bin/sh\nseen=$(ls -A "$OUT"); echo "[$seen]" >"$OUT/seen"\n'
                      'cat "$OUT/../reader/note" >"$OUT/after"\necho bound; echo oops >&2; exit 3\n',
                      timeout=5, changes_host=True)
    reader = kl.Part("reader", "echo read >\"$OUT/note\"; mkdir \"$OUT/sub\"; echo x >\"$OUT/sub/deep\"; echo hi\n",
                     timeout=5)
    results = _run_parts_here(tmp_path, [changer, reader])
    assert list(results) == ["reader", "binding"]  # the part that changes the host runs last
    assert results["reader"].returncode == 0 and results["reader"].stdout == "hi\n"
    assert results["reader"].files == {"note": "read\n", "sub/deep": "x\n"}
    binding = results["binding"]
    assert (binding.returncode, binding.stdout, binding.stderr) == (3, "bound\n", "oops\n")
    assert binding.files == {"seen": "[]\n", "after": "read\n"}  # an empty $OUT of its own, after the reader
    assert 0 <= binding.seconds < 9.0 and binding.boot_seconds == 4.0


def test_a_part_that_never_ran_fails_and_names_must_be_distinct_words(tmp_path):
    whole = kl.GuestResult(returncode=137, stdout="", stderr="killed", seconds=9.0, files={})
    with pytest.raises(kl.GuestError, match="part smoke did not finish"):
        kl.part_result(whole, "smoke")
    for names in (["a", "a"], ["../x"], ["Smoke"], []):
        with pytest.raises(kl.GuestError, match="distinct names"):
            kl.parts_runner([kl.Part(name, "true", timeout=1) for name in names])
