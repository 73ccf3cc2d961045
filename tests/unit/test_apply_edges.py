"""Carrying out a bind and giving devices back, at their edges: what the journal says while a
step runs and after one fails or hangs, the pause hook of the kernel lane, rollbacks that
cannot finish, restore's choices (an override to put back, a driver no longer loaded, a device
that had no driver, one an admin gave back already), and the one write(2) of the real backend.

Everything runs on the HostBuilder tree of tests/unit/test_binding.py and its simulated kernel
(tests/simkernel.py), which answers the writes as drivers/base/bus.c and
drivers/pci/pci-driver.c do."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import time

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.bind.apply import BindError, Reconciled, _execute, apply_bind, current_override, reconcile
from gpuvfio.bind.journal import Journal
from gpuvfio.host.state import state_dir
from gpuvfio.bind.plan import BindStatus
from gpuvfio.bind.sysfs_write import SysfsWriteError, SysfsWriter, SysfsWriteTimeout, kernel_write
from gpuvfio.errors import GpuvfioError
from gpuvfio.host.root import HostRoot
from gpuvfio.ops import binding
from gpuvfio.ops.binding import BindPolicy, status
from gpuvfio.ops.unbind import unbind
from gpuvfio.planning import Step, StepKind
from tests.contexts import Services, sim_context
from tests.unit.test_binding import AUDIO, GPU, Host

A = PciAddress.parse


class Killed(BaseException):
    """The process ending between two steps: no rollback runs (not a GpuvfioError)."""


@pytest.fixture
def h(tmp_path):
    return Host(tmp_path / "host")


def journal_of(h) -> Journal:
    return Journal.load(state_dir(h.host))


def written(h) -> list[tuple[str, str]]:
    """Every write the simulated kernel received: (path below the root, the bytes as text)."""
    return [(path, value) for path, value in h.kernel.writes()]


class WatchingKernel:
    """The simulated kernel; its modprobe (the bind's first step, which gpuvfio runs itself, in
    this process) reads the journal on disk first: what a crash at that moment would leave."""

    def __init__(self, kernel, journal_path: str) -> None:
        self.kernel, self.journal_path = kernel, journal_path
        self.seen: dict | None = None

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, path, data, fd=None):
        self.kernel(path, data, fd)

    def modprobe(self, name):
        with open(self.journal_path) as handle:
            self.seen = json.load(handle)["operation"]
        self.kernel.modprobe(name)


class NoModule:
    """The simulated kernel with a modprobe that succeeds and loads nothing (an ``install vfio-pci
    /bin/true`` line in modprobe.d does that)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, path, data, fd=None):
        self.kernel(path, data, fd)

    def modprobe(self, name):
        pass


class FailingStart(Services):
    """systemctl, where starting one unit fails (its unit file broken, say)."""

    def __init__(self, broken: str) -> None:
        super().__init__()
        self.broken = broken

    def start(self, unit: str) -> None:
        self.calls.append(("start", unit))
        if unit == self.broken:
            raise GpuvfioError(f"systemctl start {unit} failed: Job for {unit}.service failed")


def test_the_journal_marks_the_running_step_and_the_operation_before_it_runs(h):
    """A crash in the middle of step 1 must leave a journal that names the bind, its process, when
    it started, what it was moving, and which step was running: restore and status go by it."""
    h.kernel = WatchingKernel(h.kernel, state_dir(h.host).path("journal.json"))
    started = time.time()
    h.bind(GPU)
    seen = h.kernel.seen
    assert seen is not None, "modprobe never ran: the test tested nothing"
    assert seen["kind"] == "bind" and seen["pid"] == os.getpid()
    assert started <= seen["started"] <= time.time() and "finished" not in seen
    assert seen["devices"] == [GPU, AUDIO]
    assert [s["state"] for s in seen["steps"]] == ["running"] + ["pending"] * 6
    assert [s["kind"] for s in seen["steps"]] == ["modprobe", "override", "override", "unbind", "unbind", "probe",
                                                  "probe"]
    done = journal_of(h).data["operation"]
    assert {s["state"] for s in done["steps"]} == {"done"} and done["finished"] >= seen["started"]


def test_after_step_runs_once_each_step_is_done_and_journaled(h):
    """The Context's after_step(N) is where a test stops a bind half-way (the kernel lane kills
    it there): it runs after step N is done and on disk, in order, and what it raises ends the
    bind with the journal as a crash leaves it."""
    seen: list = []
    said: list = []

    def after(number):
        steps = journal_of(h).data["operation"]["steps"]
        seen.append((number, [s["state"] for s in steps[:number + 1]], len(said)))
        if number == 2:
            raise Killed()

    with sim_context(h.root, h.kernel, progress=said.append, after_step=after) as ctx:
        with pytest.raises(Killed):
            binding.bind(ctx, [A(GPU)], BindPolicy(), uri="none")
    assert seen == [(1, ["done", "pending"], 1), (2, ["done", "done", "pending"], 2)]
    assert said[0].startswith("[1/7] load module vfio-pci") and said[1].startswith(f"[2/7] {GPU}: driver_override")
    with h.context() as ctx:
        pending = status(ctx).unfinished_operation
    assert pending["kind"] == "bind" and pending["pid"] == os.getpid()
    assert [s["state"] for s in pending["steps"]] == ["done", "done"] + ["pending"] * 5
    assert h.drivers()[GPU] == "nvidia"  # stopped before its unbind


def test_a_failed_step_and_a_rollback_that_fails_are_both_kept_for_restore(h):
    """vfio-pci refuses the audio function, then the GPU will not leave vfio-pci: the error names
    what went back and what did not, the journal keeps the failed step's reason and the GPU."""
    h.kernel.inject("probe", AUDIO, errno_=errno.EINVAL)
    h.kernel.inject("unbind", GPU, errno_=errno.EBUSY, driver="vfio-pci")
    said = []
    with sim_context(h.root, h.kernel, progress=said.append) as ctx:
        with pytest.raises(BindError) as info:
            binding.bind(ctx, [A(GPU)], BindPolicy(), uri="none")
    message = str(info.value)
    step, _, rollback = message.partition("; rolled back: ")
    assert step.startswith(f"step 7 ({AUDIO}: drivers_probe, expect vfio-pci) failed: ") and "EINVAL" in step
    assert rollback.startswith(f"{AUDIO} on snd_hda_intel; rollback incomplete ({GPU}: writing '{GPU}' to ")
    assert rollback.endswith("vfio-pci/unbind failed: Device or resource busy (EBUSY)); the journal keeps them "
                             "for gpuvfio restore")
    assert f"{AUDIO}:" not in rollback  # the function that went back is not listed as failed
    failed = [line for line in said if "restore failed" in line]
    assert failed == [f"{GPU}: restore failed: {rollback.split(f'({GPU}: ', 1)[1].split(')); ', 1)[0]})"]
    assert f"{AUDIO}: back on snd_hda_intel" in said
    journal = journal_of(h)
    assert set(journal.devices) == {GPU}
    steps = journal.data["operation"]["steps"]
    assert [s["state"] for s in steps] == ["done"] * 6 + ["failed"]
    assert steps[6]["detail"] == step.split(" failed: ", 1)[1] and steps[5]["detail"] == ""
    assert h.restore().restored == {GPU: "nvidia"}


def test_a_write_that_never_returns_is_marked_uncertain_not_failed(h):
    """A hung unbind may still complete in the kernel: the journal says uncertain, with why, so
    restore reconciles from what sysfs shows instead of trusting the step log."""
    h.kernel.inject("unbind", GPU, hang=True)
    with pytest.raises(BindError) as info:
        h.bind(GPU, write_timeout=0.3)
    steps = journal_of(h).data["operation"]["steps"]
    assert [s["state"] for s in steps] == ["done"] * 3 + ["uncertain"] + ["pending"] * 3
    assert steps[3]["detail"].startswith(f"writing '{GPU}' to ") and "did not return within 0.3s" in steps[3]["detail"]
    assert steps[3]["detail"] in str(info.value)
    assert f"{GPU} left as it is" in str(info.value)


def test_a_rollback_that_puts_everything_back_says_so_and_nothing_more(h):
    """With every device back and the stopped service restarted, the error ends with what went
    back: no "incomplete", nothing left for restore."""
    h.builder.holder(900, "nvidia-persiste", ["/dev/nvidiactl"])
    h.kernel.inject("unbind", AUDIO, errno_=errno.EBUSY)
    with pytest.raises(BindError) as info:
        h.bind(GPU, stop_services=True)
    assert str(info.value).endswith(f"(EBUSY); rolled back: {GPU} on nvidia, {AUDIO} on snd_hda_intel")
    assert h.services == [("stop", "nvidia-persistenced"), ("start", "nvidia-persistenced")]
    assert journal_of(h).data["operation"] is None


def test_a_rollback_where_nothing_went_back_does_not_claim_a_rollback(h):
    """drivers_probe fails for the bind and for both functions' way back: the error lists only
    failures, and both stay in the journal."""
    h.kernel.inject("probe", None, errno_=errno.EIO, times=3)
    with pytest.raises(BindError) as info:
        h.bind(GPU)
    message = str(info.value)
    assert "rolled back" not in message
    assert message.startswith(f"step 6 ({GPU}: drivers_probe, expect vfio-pci) failed: writing '{GPU}' to ")
    assert f"Input/output error (EIO); rollback incomplete ({GPU}: writing '{GPU}' to " in message
    assert message.endswith("Input/output error (EIO)); the journal keeps them for gpuvfio restore")
    assert set(journal_of(h).devices) == {GPU, AUDIO}


def test_apply_bind_returns_the_devices_it_bound_and_those_already_there(h):
    """The result lists every function that ends on vfio-pci, for a bind and for one with
    nothing left to do (which writes nothing)."""
    with h.context() as ctx, binding.operation_lock(ctx):
        plan = binding.plan_operation(ctx, [A(GPU)], BindPolicy(), uri="none").plan
        done = apply_bind(ctx.host, plan, ctx.journal(), ctx.writer(), ctx.host_actions())
        assert done.status is BindStatus.APPLIED and done.bound == [GPU, AUDIO]
        writes = len(h.kernel.writes())
        again = binding.plan_operation(ctx, [A(AUDIO)], BindPolicy(), uri="none").plan
        nothing = apply_bind(ctx.host, again, ctx.journal(), ctx.writer(), ctx.host_actions())
        assert nothing.status is BindStatus.NOTHING_TO_DO and nothing.bound == [GPU, AUDIO]
    assert len(h.kernel.writes()) == writes


def test_the_bind_writes_what_echo_would(h):
    """driver_override gets the driver with a newline (as echo writes it); unbind and
    drivers_probe get the bare address (drivers/base/bus.c looks the device up by that name)."""
    h.bind(GPU)
    assert written(h) == [
        (f"sys/bus/pci/devices/{GPU}/driver_override", "vfio-pci\n"),
        (f"sys/bus/pci/devices/{AUDIO}/driver_override", "vfio-pci\n"),
        ("sys/bus/pci/drivers/nvidia/unbind", GPU), ("sys/bus/pci/drivers/snd_hda_intel/unbind", AUDIO),
        ("sys/bus/pci/drivers_probe", GPU), ("sys/bus/pci/drivers_probe", AUDIO)]


def test_a_module_that_loads_without_its_driver_directory_stops_the_bind_before_any_write(h):
    """modprobe may succeed and load nothing (an install override): without
    sys/bus/pci/drivers/vfio-pci no write may follow, and the error says which directory is missing."""
    h.kernel = NoModule(h.kernel)
    with pytest.raises(BindError) as info:
        h.bind(GPU)
    assert "module vfio-pci loaded but sys/bus/pci/drivers/vfio-pci did not appear" in str(info.value)
    assert written(h) == [] and h.drivers()[GPU] == "nvidia"


def test_an_override_that_does_not_stick_stops_the_bind(h):
    """A driver_override that reads back other than written (a kernel that ignored the write)
    is a failed step, named with both values, before any unbind."""
    with pytest.raises(BindError) as info:
        h.bind(GPU, backend=lambda path, data, fd: None)
    assert f"step 2 ({GPU}: driver_override <- vfio-pci) failed: {GPU}: driver_override reads back None, " \
           "not 'vfio-pci'" in str(info.value)
    assert h.drivers()[GPU] == "nvidia"


def _set_override(h, address: str, value: str) -> None:
    """An admin's ``echo VALUE > driver_override``, through the simulated kernel."""
    h.kernel(h.builder.sys_path("bus", "pci", "devices", address, "driver_override"), (value + "\n").encode())


def test_restore_puts_back_the_override_a_device_had(h):
    """An admin who pinned the GPU to nvidia with driver_override gets that pin back: restore
    writes the recorded override, not an empty one."""
    _set_override(h, GPU, "nvidia")
    h.bind(GPU)
    assert journal_of(h).devices[GPU]["original_override"] == "nvidia"
    assert h.restore().restored == {GPU: "nvidia", AUDIO: "snd_hda_intel"}
    assert current_override(h.host, GPU) == "nvidia" and current_override(h.host, AUDIO) is None
    assert (f"sys/bus/pci/devices/{GPU}/driver_override", "nvidia\n") in written(h)


def test_restore_when_the_original_driver_is_no_longer_loaded_says_so_without_writing_to_it(h):
    """nvidia unloaded while the GPU was on vfio-pci: drivers_probe finds no driver, and with no
    sys/bus/pci/drivers/nvidia there is no bind file to write; restore names both drivers."""
    h.bind(GPU)
    h.kernel.unload("nvidia")
    with pytest.raises(GpuvfioError) as info:
        h.restore()
    assert f"{GPU}: on no driver, expected nvidia" in str(info.value)
    assert not any(path.endswith("/bind") for path, _value in written(h))
    assert set(journal_of(h).devices) == {GPU}  # kept for a later restore


def test_restore_of_a_hot_removed_device_names_it_and_keeps_it(h):
    """A function gone from sys/bus/pci/devices (hot-removed) cannot be given back: restore says
    which, and the journal keeps its record."""
    h.bind(GPU)
    os.unlink(h.builder.sys_path("bus", "pci", "devices", AUDIO))
    with pytest.raises(GpuvfioError) as info:
        h.restore()
    assert f"{AUDIO}: {AUDIO} is gone from sysfs (hot-removed?)" in str(info.value)
    assert set(journal_of(h).devices) == {AUDIO}


def test_a_device_already_back_on_its_driver_is_forgotten_even_if_it_no_longer_answers(h):
    """gpuvfio unbind gave the functions back without the journal; the GPU then stopped answering
    its config space. Restore hands it to no driver, so there is nothing to refuse or mark broken."""
    h.bind(GPU)
    unbind(h.context(), [A(GPU), A(AUDIO)])
    h.kernel.kill(GPU)
    assert h.restore().restored == {GPU: "nvidia", AUDIO: "snd_hda_intel"}
    journal = journal_of(h)
    assert journal.devices == {} and journal.data["broken"] == {}


def test_a_function_that_had_no_driver_is_left_without_one(h):
    """The audio function was unbound by the admin before the bind: restore takes it off
    vfio-pci and leaves it unbound; a drivers_probe would hand it to snd_hda_intel."""
    h.kernel(h.builder.sys_path("bus", "pci", "drivers", "snd_hda_intel", "unbind"), AUDIO.encode())
    h.bind(GPU)
    assert journal_of(h).devices[AUDIO]["original_driver"] is None
    before = len(written(h))
    assert h.restore().restored == {GPU: "nvidia", AUDIO: "no driver"}
    assert h.drivers()[AUDIO] is None
    assert ("sys/bus/pci/drivers_probe", AUDIO) not in written(h)[before:]


def test_reconcile_without_addresses_gives_back_every_journaled_device(h):
    """reconcile's default is everything the journal holds; one that fails is reported with the
    driver it should have gone back to, and stays."""
    h.bind(GPU)
    h.kernel.inject("unbind", AUDIO, errno_=errno.EBUSY, driver="vfio-pci")
    said = []
    with h.context() as ctx:
        journal = ctx.journal()
        results = reconcile(ctx.host, journal, ctx.writer(), ctx.host_actions(), progress=said.append)
    assert [r.address for r in results] == [GPU, AUDIO]
    assert results[0] == Reconciled(GPU, "nvidia")
    assert results[1].driver == "snd_hda_intel" and not results[1].ok and "EBUSY" in results[1].failure
    assert said == [f"{GPU}: back on nvidia", f"{AUDIO}: restore failed: {results[1].failure}"]
    assert set(journal.devices) == {AUDIO} and set(journal_of(h).devices) == {AUDIO}


def test_a_service_that_fails_to_restart_does_not_keep_the_others_stopped(h):
    """Both NVIDIA services were stopped for the bind; persistenced fails to start again: DCGM is
    still started, and only persistenced stays in the journal for the next restore."""
    h.builder.holder(900, "nvidia-persiste", ["/dev/nvidiactl"])
    h.builder.holder(901, "nv-hostengine", ["/dev/nvidiactl"])
    h.bind(GPU, stop_services=True)
    stopped = journal_of(h).data["services_stopped"]
    assert stopped == ["nvidia-dcgm", "nvidia-persistenced"] or stopped == ["nvidia-persistenced", "nvidia-dcgm"]
    services = FailingStart(stopped[0])
    said = []
    with sim_context(h.root, h.kernel, services=services, progress=said.append) as ctx:
        with pytest.raises(GpuvfioError, match=f"service {stopped[0]} not restarted"):
            binding.restore(ctx, [])
    assert services.calls == [("start", stopped[0]), ("start", stopped[1])]
    assert f"service {stopped[0]}: restart failed: systemctl start {stopped[0]} failed: Job for {stopped[0]}" \
           ".service failed" in said
    assert f"service {stopped[1]}: restarted" in said
    assert journal_of(h).data["services_stopped"] == [stopped[0]]


def test_driver_override_reads_none_for_every_way_sysfs_shows_no_override(h):
    """The kernel shows an unset override as "(null)"; a tree written by the plain backend holds
    an empty line: both mean no override, anything else is the driver named."""
    path = h.builder.sys_path("bus", "pci", "devices", GPU, "driver_override")
    for content, expected in (("(null)\n", None), ("\n", None), ("", None), ("vfio-pci\n", "vfio-pci")):
        with open(path, "w") as handle:
            handle.write(content)
        assert current_override(h.host, GPU) == expected, content


def test_restore_writes_nothing_to_a_device_whose_override_is_already_clear(h):
    """A bind that died after loading vfio-pci changed nothing: restore must not rewrite an
    override that reads "(null)" (each write to a device is a chance to block on it)."""

    def die_after_the_module(line: str) -> None:
        if "load module" in line:
            raise Killed()

    with sim_context(h.root, h.kernel, progress=die_after_the_module) as ctx:
        with pytest.raises(Killed):
            binding.bind(ctx, [A(GPU)], BindPolicy(), uri="none")
    assert set(journal_of(h).devices) == {GPU, AUDIO}
    assert h.restore().restored == {GPU: "nvidia", AUDIO: "snd_hda_intel"}
    assert written(h) == []


def _a_bound_function_of_this_machine() -> tuple[str, str] | None:
    """A PCI function of the machine running the tests that has a driver (read only), or None."""
    devices = "/sys/bus/pci/devices"
    for name in sorted(os.listdir(devices)) if os.path.isdir(devices) else []:
        link = os.path.join(devices, name, "driver")
        if os.path.islink(link):
            return name, os.path.basename(os.readlink(link))
    return None


def test_a_readback_on_the_live_host_does_not_ask_whether_it_is_live(h):
    """On / the readback is the kernel's own answer: a device still bound after its unbind is said
    plainly, without the "(is ROOT a live sysfs?)" hint meant for a recorded tree. Only this
    machine's sysfs is read; the write goes to the tree under tmp_path."""
    writer, actions = SysfsWriter(h.host, backend=kernel_write), h.context().host_actions()
    attribute = h.builder.sys_path("bus", "pci", "drivers", "nvidia", "unbind")
    with pytest.raises(GpuvfioError) as info:
        _execute(h.host, Step(StepKind.UNBIND, address=GPU, path=attribute, value=GPU, name="nvidia"), writer, actions)
    assert str(info.value) == f"{GPU}: still bound to nvidia after unbind (is {h.host.root} a live sysfs?)"
    found = _a_bound_function_of_this_machine()
    if found is None:
        pytest.skip("no PCI function bound to a driver on this machine")
    address, driver = found
    step = Step(StepKind.UNBIND, address=address, path=attribute, value=GPU, name=driver)
    with pytest.raises(GpuvfioError) as info:
        _execute(HostRoot("/"), step, writer, actions)
    assert str(info.value) == f"{address}: still bound to {driver} after unbind"


def test_the_real_backend_hands_the_whole_value_to_one_write(tmp_path):
    """sysfs hands each write(2) to the attribute's store() whole (fs/kernfs/file.c): the value
    must reach the file in one write, byte for byte, as echo sends it."""
    target = tmp_path / "driver_override"
    target.write_bytes(b"")
    fd = os.open(target, os.O_WRONLY)
    try:
        kernel_write(str(target), b"vfio-pci\n", fd)
    finally:
        os.close(fd)
    assert target.read_bytes() == b"vfio-pci\n"
    read_end, write_end = os.pipe()
    try:
        kernel_write("a pipe", GPU.encode(), write_end)
        assert os.read(read_end, 64) == GPU.encode()
    finally:
        os.close(read_end)
        os.close(write_end)


PTRACE_SEIZE = 0x4206  # linux/ptrace.h
PR_SET_PTRACER = 0x59616D61  # linux/prctl.h (Yama)


def _write_held_by_a_tracer(hold: float, pid_file: str | None = None):
    """A kernel side whose writer is held after it ends: a second process ptrace-seizes the writer
    and keeps it for ``hold`` seconds, so the ended writer is a zombie only its tracer may reap
    (kernel/exit.c, wait_consider_task), as a writer in uninterruptible sleep cannot be reaped
    until the kernel lets it go. With ``pid_file`` the write succeeds (the writer's pid noted
    there); without, it does not return and only SIGKILL ends the writer in time."""

    def backend(path, data, fd):
        libc = ctypes.CDLL(None, use_errno=True)
        go_in, go_out = os.pipe()
        said_in, said_out = os.pipe()
        tracer = os.fork()
        if tracer == 0:
            try:
                os.read(go_in, 1)
                seized = libc.ptrace(PTRACE_SEIZE, os.getppid(), None, None) == 0
                os.write(said_out, b"y" if seized else b"n")
                time.sleep(hold)
            finally:
                os._exit(0)
        libc.prctl(PR_SET_PTRACER, tracer, 0, 0, 0)  # Yama ptrace_scope 1: a descendant traces when let
        os.write(go_out, b"x")
        if os.read(said_in, 1) != b"y":
            raise OSError(errno.EPERM, "ptrace refused")
        if pid_file is not None:
            with open(pid_file, "w") as handle:
                handle.write(str(os.getpid()))
            return
        time.sleep(20)  # only SIGKILL ends it sooner; bounded, so that a writer nobody kills
        os._exit(1)  # (a mutant of the kill path, say) does not outlive the test run

    return backend


def test_a_writer_that_sigkill_does_not_end_is_left_behind_after_half_a_second(h):
    """A write stuck in the kernel (an unbind waiting in nvidia's remove()) ignores SIGKILL: the
    timeout error comes half a second after the kill, not later, and names the writer left behind."""
    writer = SysfsWriter(h.host, timeout=0.2, backend=_write_held_by_a_tracer(1.5))
    started = time.monotonic()
    try:
        writer.write(h.builder.sys_path("bus", "pci", "drivers_probe"), GPU)
    except SysfsWriteTimeout as exc:
        left = exc
    except SysfsWriteError as exc:
        if exc.errno == errno.EPERM:
            pytest.skip("ptrace is not allowed here")
        raise
    else:
        pytest.fail("the write returned")
    elapsed = time.monotonic() - started
    try:
        assert 0.2 + 0.45 <= elapsed < 0.2 + 1.0
        assert f"writer pid {left.pid} left behind" in str(left)
        assert (left.path, left.value) == (h.builder.sys_path("bus", "pci", "drivers_probe"), GPU)
        assert os.waitpid(left.pid, os.WNOHANG) == (0, 0)  # not reaped: still held
    finally:
        os.waitpid(left.pid, 0)  # reaped once its tracer lets go


def _refusing(exc: BaseException):
    """A kernel side whose write raises ``exc`` (in the writer process)."""

    def backend(path, data, fd):
        raise exc

    return backend


def _write_error(h, backend, value: str = GPU) -> SysfsWriteError:
    with pytest.raises(SysfsWriteError) as info:
        SysfsWriter(h.host, backend=backend).write(h.builder.sys_path("bus", "pci", "drivers_probe"), value)
    return info.value


def test_the_kernels_own_words_and_errno_name_reach_the_error(h):
    """What write(2) said comes back as the kernel said it: a driver's message with a colon in
    it, an errno Python has no name for (ENOTSUPP, 524, leaks out of sysfs stores), no words."""
    probe = h.builder.sys_path("bus", "pci", "drivers_probe")
    said = _write_error(h, _refusing(OSError(errno.EBUSY, "vfio-pci: device still in use")))
    assert (said.errno, said.path, said.value) == (errno.EBUSY, probe, GPU)
    assert str(said) == f"writing '{GPU}' to {probe} failed: vfio-pci: device still in use (EBUSY)"
    unnamed = _write_error(h, _refusing(OSError(524, "Unknown error 524")))
    assert unnamed.errno == 524 and str(unnamed).endswith("failed: Unknown error 524 (524)")
    wordless = _write_error(h, _refusing(OSError()))  # no errno, no text: EIO, in the kernel's words
    assert wordless.errno == errno.EIO and str(wordless).endswith(f"failed: {os.strerror(errno.EIO)} (EIO)")
    bare = _write_error(h, _refusing(OSError("the store returned nothing")))
    assert bare.errno == errno.EIO and str(bare).endswith("failed: the store returned nothing (EIO)")


def test_a_long_or_odd_message_is_cut_to_200_bytes_and_never_breaks_the_report(h):
    """The child reports through a pipe, at most 200 bytes of message: a longer one is cut there,
    even inside a UTF-8 character, and the error is still one readable line."""
    long = _write_error(h, _refusing(OSError(errno.EINVAL, "x" * 300)))
    assert str(long).endswith(" failed: " + "x" * 200 + " (EINVAL)")
    split = _write_error(h, _refusing(OSError(errno.EINVAL, "x" * 199 + "\u00e9" * 5)))  # byte 200 halves an é
    assert str(split).endswith(" failed: " + "x" * 199 + "\ufffd (EINVAL)")
    crashed = _write_error(h, _refusing(ValueError("y" * 300)))  # not an OSError: EIO and its repr
    assert crashed.errno == errno.EIO and str(crashed).endswith(" failed: " + ("ValueError('" + "y" * 300)[:200]
                                                                 + " (EIO)")


def test_a_writer_that_dies_without_answering_is_an_io_error(h):
    """A writer killed before it reports (the OOM killer, say) sends nothing through the pipe:
    that is EIO, not a crash of gpuvfio."""
    died = _write_error(h, lambda path, data, fd: os.kill(os.getpid(), signal.SIGKILL))
    assert died.errno == errno.EIO and str(died).endswith(f"failed: {os.strerror(errno.EIO)} (EIO)")


def test_a_missing_attribute_is_the_kernels_enoent_with_path_and_value(h):
    """The device (or its driver) gone between plan and write: the error is the kernel's
    ENOENT, naming the file and the value, as a write there would have said."""
    gone = h.builder.sys_path("bus", "pci", "drivers", "nouveau", "unbind")
    with pytest.raises(SysfsWriteError) as info:
        SysfsWriter(h.host).write(gone, GPU)
    assert (info.value.path, info.value.value, info.value.errno) == (gone, GPU, errno.ENOENT)
    assert str(info.value) == f"writing '{GPU}' to {gone} failed: No such file or directory (ENOENT)"


def test_each_writer_is_reaped_before_its_write_returns(h, tmp_path):
    """A write that answered has its process waited for, however long the kernel takes to let it
    go: a bind writes six times, an attach many more, and none may leave a zombie behind."""
    noted = str(tmp_path / "writer.pid")
    writer = SysfsWriter(h.host, backend=_write_held_by_a_tracer(0.4, noted))
    try:
        writer.write(h.builder.sys_path("bus", "pci", "drivers_probe"), GPU)
    except SysfsWriteError as exc:
        if exc.errno == errno.EPERM:
            pytest.skip("ptrace is not allowed here")
        raise
    with open(noted) as handle:
        pid = int(handle.read())
    try:
        with pytest.raises(ChildProcessError):  # reaped already: no such child
            os.waitpid(pid, os.WNOHANG)
    except BaseException:
        os.waitpid(pid, 0)
        raise


def test_the_writer_never_goes_on_as_a_second_copy_of_the_caller(h, tmp_path):
    """The forked writer ends in os._exit whatever happens in it. Were it to return from write()
    instead, a second copy of the caller would go on from there (a bind's remaining steps run
    twice); here that copy would note its pid in the trail before the parent does."""
    trail = tmp_path / "after-the-write"
    for backend in (None, _refusing(OSError(errno.EBUSY, "busy")), _refusing(ValueError("odd"))):
        writer = SysfsWriter(h.host) if backend is None else SysfsWriter(h.host, backend=backend)
        try:
            writer.write(h.builder.sys_path("bus", "pci", "drivers_probe"), GPU)
        except SysfsWriteError:
            pass
        with open(trail, "a") as handle:
            handle.write(f"{os.getpid()}\n")
    assert trail.read_text() == f"{os.getpid()}\n" * 3
