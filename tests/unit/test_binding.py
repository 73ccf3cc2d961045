"""Binding on the unit lane: a HostBuilder tree driven by the simulated kernel."""

import errno
import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.bind.apply import BindError, current_driver
from gpuvfio.bind.journal import CorruptJournal, Journal, LockTimeout, RunLock
from gpuvfio.host.state import state_dir
from gpuvfio.bind.sysfs_write import kernel_write
from gpuvfio.errors import GpuvfioError, Refused
from gpuvfio.host.root import HostRoot
from gpuvfio.ops.binding import BindPolicy, BindStatus, CheckStatus, bind, plan_operation, restore, restore_groups, status
from gpuvfio.ops.unbind import unbind
from tests.conftest import REPO
from tests.contexts import Services, sim_context, libvirt_test_uri
from tests.hostbuilder import BAR32, BAR64_PREF, GiB, HostBuilder, KiB, MiB
from tests.simkernel import SimKernel

GPU, AUDIO, PORT, NIC = "0000:01:00.0", "0000:01:00.1", "0000:00:01.0", "0000:03:00.0"
A = PciAddress.parse


class Host:
    def __init__(self, root):
        b = HostBuilder(str(root))
        b.iommu("intel", 1)
        cpus = b.cpu_topology(1, 4, 2)
        b.numa_node(0, cpus[0], 32)
        rb = b.root_bus(numa=0)
        group = b.new_group()
        port = b.bridge(rb, PORT, "8086", "a70d", secondary_bus=1, group=group)
        b.function(port, GPU, "10de", "2684", "030000", driver="nvidia", group=group, multifunction=True,
                   bars=[(0, 16 * MiB, BAR32), (1, 32 * GiB, BAR64_PREF)], boot_vga=False)
        b.function(port, AUDIO, "10de", "22ba", "040300", driver="snd_hda_intel", group=group,
                   bars=[(0, 16 * KiB, BAR32)])
        nic_port = b.bridge(rb, "0000:00:1c.0", "8086", "7a38", secondary_bus=3)
        b.function(nic_port, NIC, "8086", "15f3", "020000", driver="igc")
        b.modules(["nvidia", "snd_hda_intel", "igc"])
        self.builder = b
        self.group = group
        self.root = b.root
        self.host = HostRoot(b.root)
        self.kernel = SimKernel(b.root)
        self.recorded = Services()

    @property
    def services(self):
        return self.recorded.calls

    def context(self, **kw):
        return sim_context(self.root, self.kernel, services=self.recorded, **kw)

    def bind(self, *addresses, dry_run=False, uri=None, write_timeout=5.0, lock_timeout=30.0, backend=None,
             **policy):
        with self.context(write_timeout=write_timeout, lock_timeout=lock_timeout) as ctx:
            if backend is not None:
                ctx.backend = backend
            if dry_run:  # the plan as the CLI's dry run shows it
                return plan_operation(ctx, [A(a) for a in addresses], BindPolicy(**policy), uri=uri).shown()
            return bind(ctx, [A(a) for a in addresses], BindPolicy(**policy), uri=uri)

    def restore(self, *addresses):
        with self.context() as ctx:
            return restore(ctx, [A(a) for a in addresses])

    def drivers(self):
        return {a: self.kernel.driver_of(a) for a in (GPU, AUDIO, PORT, NIC)}

    def snapshot(self):
        """Everything a bind may touch: drivers, overrides."""
        out = {}
        for a in (GPU, AUDIO, PORT, NIC):
            dev = os.path.join(self.root, "sys", "bus", "pci", "devices", a)
            with open(os.path.join(dev, "driver_override")) as handle:
                out[a] = (self.kernel.driver_of(a), handle.read().strip())
        return out


ORIGINAL = {GPU: "nvidia", AUDIO: "snd_hda_intel", PORT: "pcieport", NIC: "igc"}


@pytest.fixture
def h(tmp_path):
    return Host(tmp_path / "host")


def test_whole_group_moves_bridge_untouched(h):
    report = h.bind(GPU)
    assert report.status is BindStatus.APPLIED
    assert report.devices == [A(GPU), A(AUDIO)]  # the audio function goes too; the root port does not
    assert h.drivers() == {GPU: "vfio-pci", AUDIO: "vfio-pci", PORT: "pcieport", NIC: "igc"}
    assert os.path.exists(os.path.join(h.root, "dev", "vfio", str(h.group)))
    kinds = [s.kind for s in report.steps]
    assert kinds == ["modprobe", "override", "override", "unbind", "unbind", "probe", "probe"]
    journal = Journal.load(state_dir(h.host))
    assert journal.devices[GPU]["original_driver"] == "nvidia"
    assert journal.devices[AUDIO]["original_driver"] == "snd_hda_intel"
    assert all(s["state"] == "done" for s in journal.data["operation"]["steps"])


def test_restore_returns_exactly(h):
    before = h.snapshot()
    h.bind(GPU)
    assert h.restore().restored == {GPU: "nvidia", AUDIO: "snd_hda_intel"}
    assert h.snapshot() == before
    assert Journal.load(state_dir(h.host)).devices == {}
    assert status(h.context()).devices == []


def test_already_bound_is_a_noop(h):
    h.bind(GPU)
    writes = len(h.kernel.writes())
    report = h.bind(AUDIO)
    assert report.status is BindStatus.NOTHING_TO_DO and report.steps == []
    assert len(h.kernel.writes()) == writes


def test_dry_run_changes_nothing(h):
    before = h.snapshot()
    report = h.bind(GPU, dry_run=True)
    assert report.status is BindStatus.DRY_RUN and report.devices == [A(GPU), A(AUDIO)]
    assert h.snapshot() == before and h.kernel.writes() == []
    assert not os.path.exists(state_dir(h.host).path())


def test_dry_run_refuses_exactly_when_the_real_run_would(h):
    """A plan that shows a refusal is a refusal: the dry run raises it, with the plan attached."""
    h.builder.holder(900, "nvidia-persiste", ["/dev/nvidiactl"])
    with pytest.raises(Refused) as dry:
        h.bind(GPU, dry_run=True)
    with pytest.raises(Refused) as real:
        h.bind(GPU)
    assert str(dry.value) == str(real.value) and "nvidia-persistenced is running" in str(dry.value)
    assert dry.value.report["result"] == "refused" and dry.value.report["refused"]
    assert h.kernel.writes() == []
    assert h.bind(GPU, dry_run=True, stop_services=True).status is BindStatus.DRY_RUN


@pytest.mark.parametrize("err", [errno.EBUSY, errno.ENODEV])
def test_unbind_fails_rolls_back(h, err):
    before = h.snapshot()
    h.kernel.inject("unbind", AUDIO, errno_=err)
    with pytest.raises(BindError) as info:
        h.bind(GPU)
    message = str(info.value)
    assert "unbind from snd_hda_intel" in message and errno.errorcode[err] in message
    assert "drivers/snd_hda_intel/unbind" in message  # the path the kernel refused
    assert "rolled back" in message
    assert h.snapshot() == before
    assert Journal.load(state_dir(h.host)).devices == {}


def test_unbind_never_returns(h):
    """A hung unbind holds the device in the kernel: the rollback leaves that device alone (a write
    to its driver_override would block on the same device lock) and puts the others back."""
    h.kernel.inject("unbind", GPU, hang=True)
    started = time.monotonic()
    with pytest.raises(BindError) as info:
        h.bind(GPU, write_timeout=0.5)
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert "did not return within 0.5s" in message
    assert f"{GPU} left as it is" in message and f"{AUDIO} on snd_hda_intel" in message
    writes = [path for path, _value in h.kernel.writes()]
    hung = writes.index(f"sys/bus/pci/drivers/nvidia/unbind")
    assert not any(GPU in path for path in writes[hung + 1:])  # nothing more for the stuck device
    assert h.drivers()[AUDIO] == "snd_hda_intel"
    assert set(Journal.load(state_dir(h.host)).devices) == {GPU}  # kept for gpuvfio restore
    assert h.restore().restored == {GPU: "nvidia"}  # once the kernel let go
    assert h.drivers() == ORIGINAL


def test_vfio_bind_fails_after_unbind_restores_and_restarts_services(h):
    h.builder.holder(900, "nvidia-persiste", ["/dev/nvidiactl"])
    h.kernel.inject("probe", AUDIO, errno_=errno.EINVAL)
    before = h.snapshot()
    with pytest.raises(BindError) as info:
        h.bind(GPU, stop_services=True)
    assert "EINVAL" in str(info.value)
    assert h.snapshot() == before
    assert h.services == [("stop", "nvidia-persistenced"), ("start", "nvidia-persistenced")]


def test_probe_binds_wrong_driver(h):
    h.kernel.inject("probe", GPU, wrong_driver="nouveau")
    h.builder.driver("nouveau")
    with pytest.raises(BindError) as info:
        h.bind(GPU)
    assert "bound to nouveau after drivers_probe, expected vfio-pci" in str(info.value)
    assert h.drivers() == ORIGINAL


def test_foreign_endpoint_refused(h):
    nic = h.builder.functions[A(NIC)]
    # Put the NIC into the GPU's group, as a chipset without ACS would.
    os.unlink(os.path.join(nic.path, "iommu_group"))
    os.symlink(os.path.relpath(os.path.join(h.root, "sys", "kernel", "iommu_groups", str(h.group)), nic.path),
               os.path.join(nic.path, "iommu_group"))
    with pytest.raises(Refused) as info:
        h.bind(GPU)
    assert "shares IOMMU group" in str(info.value) and "(igc)" in str(info.value)
    assert h.kernel.writes() == [] and h.drivers() == ORIGINAL


def test_missing_driver_override(h):
    os.unlink(os.path.join(h.builder.functions[A(AUDIO)].path, "driver_override"))
    with pytest.raises(Refused) as info:
        h.bind(GPU)
    assert "no driver_override attribute" in str(info.value)
    assert h.kernel.writes() == []


def test_holder_refused_and_named(h):
    os.makedirs(os.path.join(h.root, "proc", "driver", "nvidia", "gpus", GPU))
    with open(os.path.join(h.root, "proc", "driver", "nvidia", "gpus", GPU, "information"), "w") as f:
        f.write("Model: NVIDIA GeForce RTX 4090\nDevice Minor: 3\n")
    h.builder.holder(4242, "python3", ["/dev/nvidia3", "/dev/nvidiactl"])
    h.builder.holder(4343, "other", ["/dev/nvidia0"])  # another GPU: not a reason to refuse
    with pytest.raises(Refused) as info:
        h.bind(GPU, force=True)  # holders cannot be forced
    assert "python3 (pid 4242)" in str(info.value) and "4343" not in str(info.value)
    assert h.kernel.writes() == []


def test_services_refused_unless_asked(h):
    h.builder.holder(900, "nvidia-persiste", ["/dev/nvidiactl"])
    with pytest.raises(Refused) as info:
        h.bind(GPU)
    assert "nvidia-persistenced is running" in str(info.value)
    report = h.bind(GPU, stop_services=True)
    assert report.status is BindStatus.APPLIED and h.services == [("stop", "nvidia-persistenced")]
    h.restore()
    assert h.services[-1] == ("start", "nvidia-persistenced")


def test_boot_vga_refused_unless_forced(h):
    with open(os.path.join(h.builder.functions[A(GPU)].path, "boot_vga"), "w") as f:
        f.write("1\n")
    with pytest.raises(Refused):
        h.bind(GPU)
    assert h.bind(GPU, force=True).status is BindStatus.APPLIED


def test_sriov_enabled_refused(h):
    gpu = h.builder.functions[A(GPU)].path
    for name, value in (("sriov_totalvfs", "16"), ("sriov_numvfs", "2")):
        with open(os.path.join(gpu, name), "w") as f:
            f.write(value + "\n")
    with pytest.raises(Refused) as info:
        h.bind(GPU, force=True)
    assert "SR-IOV VFs enabled" in str(info.value)


def test_unsafe_host_needs_loud_flag(h):
    h.builder.cmdline("ro intel_iommu=on pcie_acs_override=downstream")
    with pytest.raises(Refused) as info:
        h.bind(GPU, force=True)
    assert "--allow-unsafe-host" in str(info.value)
    assert h.bind(GPU, allow_unsafe_host=True).status is BindStatus.APPLIED


def test_iommu_off_refused(tmp_path):
    b = HostBuilder(str(tmp_path))
    b.iommu(None)
    rb = b.root_bus()
    b.function(rb, GPU, "10de", "1db4", "030200", driver="nvidia")
    with pytest.raises(Refused) as info:
        bind(sim_context(b.root), [A(GPU)], BindPolicy(force=True))
    assert "IOMMU is off" in str(info.value)


HOSTDEV_DOMAIN = """<domain type='test'><name>{name}</name><memory>1048576</memory><os><type>hvm</type></os>
<devices><hostdev mode='subsystem' type='pci' managed='no'><source>
<address domain='0x0000' bus='0x01' slot='0x00' function='0x1'/></source></hostdev></devices></domain>"""


def test_libvirt_domain_refuses(h, tmp_path):
    """libvirt's test driver knows a domain with the audio function: the group cannot move."""
    uri = libvirt_test_uri(str(tmp_path))
    with h.context() as ctx:
        ctx.libvirt(uri).defineXML(HOSTDEV_DOMAIN.format(name="win11"))
        with pytest.raises(Refused) as info:
            bind(ctx, [A(GPU)], BindPolicy(), uri=uri)
    assert "libvirt domain(s) win11" in str(info.value) and h.kernel.writes() == []


def test_libvirt_that_does_not_answer_refuses(h):
    """Fail closed: a libvirt that was asked and did not answer is a refusal, not a skipped check;
    --connect none binds without asking, and says so."""
    with pytest.raises(Refused) as info:
        h.bind(GPU, uri="qemu+unix:///system?socket=/nonexistent/libvirt-sock")
    assert "cannot ask libvirt" in str(info.value) and "--connect none" in str(info.value)
    report = h.bind(GPU, uri="none")
    assert report.status is BindStatus.APPLIED
    assert any(c.check_id == "libvirt" and c.status is CheckStatus.SKIP and "--connect none" in c.message
               for c in report.checks)


def test_recorded_root_does_not_ask_this_machines_libvirt(h):
    report = h.bind(GPU, dry_run=True)
    (check,) = [c for c in report.checks if c.check_id == "libvirt"]
    assert check.status is CheckStatus.SKIP and "not this machine" in check.message


@pytest.mark.parametrize("stop_after", range(1, 8))
def test_crash_between_steps_then_restore(h, stop_after):
    """Run the bind in a child process and SIGKILL it after step N; restore must undo."""
    before = h.snapshot()
    child = multiprocessing.get_context("fork").Process(target=_bind_in_child, args=(h, stop_after))
    child.start()
    journal_path = state_dir(h.host).path("journal.json")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with open(journal_path) as handle:
                steps = json.load(handle)["operation"]["steps"]
            if steps[stop_after - 1]["state"] == "done":
                break
        except (OSError, ValueError, TypeError, KeyError):
            pass
        time.sleep(0.02)
    child.kill()
    child.join()
    assert h.snapshot() != before or stop_after == 1  # the crash left the host half-way
    h.restore()
    assert h.snapshot() == before
    assert status(h.context()).devices == []


def _bind_in_child(h, stop_after):
    def pause(number):  # the Context's hook: wait here to be killed
        if number == stop_after:
            time.sleep(60)

    with h.context(after_step=pause) as ctx:
        bind(ctx, [A(GPU)], BindPolicy())


def _hold_lock(directory: str) -> subprocess.Popen:
    """Another gpuvfio process holding the run lock (as an attach does for its whole run)."""
    code = ("import sys, time\nfrom gpuvfio.bind.journal import RunLock\n"
            "with RunLock(sys.argv[1], command='gpuvfio attach lab-vm 01:00'):\n"
            "    print('held', flush=True)\n    time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code, directory], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": REPO})
    assert child.stdout.readline().strip() == "held"
    return child


def test_concurrent_runs(h):
    directory = state_dir(h.host).path()
    child = _hold_lock(directory)
    try:
        started = time.monotonic()
        with pytest.raises(LockTimeout) as info:
            h.bind(GPU, lock_timeout=0.5)
        assert time.monotonic() - started >= 0.5
    finally:
        child.kill()
        child.wait()
    message = str(info.value)
    assert f"pid {child.pid}" in message and "gpuvfio attach lab-vm 01:00" in message and "since 20" in message
    assert h.bind(GPU, lock_timeout=0.5).status is BindStatus.APPLIED  # free again: flock went with the process


def test_the_lock_is_reentrant_in_one_process_and_a_dead_holder_is_taken_over(h):
    directory = state_dir(h.host).path()
    with RunLock(directory, 1):  # attach holds it; its bind takes it again without waiting
        assert h.bind(GPU, lock_timeout=0.5).status is BindStatus.APPLIED
    h.restore()
    with open(os.path.join(directory, "lock"), "w") as handle:
        handle.write("4194303 2026-12-01T10:00:00+0000 gpuvfio attach killed-vm 01:00\n")  # no such pid
    said = []
    with RunLock(directory, 1, progress=said.append) as lock:
        assert lock.taken_over == said[0]
    assert "pid 4194303, gpuvfio attach killed-vm 01:00, since 2026-12-01T10:00:00+0000" in said[0]
    assert "is gone" in said[0]


def test_corrupt_journal_refused_and_kept(h):
    directory = state_dir(h.host).path()
    os.makedirs(directory)
    path = os.path.join(directory, "journal.json")
    with open(path, "w") as f:
        f.write("{not json")
    for action in (lambda: h.bind(GPU), lambda: h.restore(), lambda: status(h.context()),
                   lambda: h.bind(GPU, dry_run=True)):
        with pytest.raises(CorruptJournal):
            action()
    with open(path) as f:
        assert f.read() == "{not json"
    assert h.kernel.writes() == []
    with open(path, "w") as f:
        f.write(json.dumps({"version": 99, "devices": {}}))
    with pytest.raises(CorruptJournal, match="newer gpuvfio"):
        h.restore()


def test_unbind_gives_back_without_journal(h):
    h.bind(GPU)
    result = unbind(h.context(), [A(GPU), A(AUDIO)])
    assert result.drivers == {GPU: "nvidia", AUDIO: "snd_hda_intel"}
    assert h.drivers() == ORIGINAL


def test_restore_unknown_address(h):
    with pytest.raises(GpuvfioError, match="not held by gpuvfio"):
        h.restore(NIC)


def test_bind_on_non_live_tree_rolls_back(h):
    """The real kernel backend against a plain directory tree: nothing binds, all is undone."""
    before = h.snapshot()
    with pytest.raises(BindError) as info:
        h.bind(GPU, backend=kernel_write)  # real write(2), no kernel behind it
    assert "still bound to nvidia after unbind" in str(info.value) and "live sysfs" in str(info.value)
    assert {a: d for a, (d, _o) in h.snapshot().items()} == {a: d for a, (d, _o) in before.items()}


def test_device_behind_a_switch(tmp_path):
    """Deep devices (root port -> switch upstream -> downstream -> GPU): the driver link is
    relative to the real device directory, several levels below sys/devices."""
    b = HostBuilder(str(tmp_path / "deep"))
    b.iommu("intel", 1)
    rb = b.root_bus()
    rp = b.bridge(rb, "0000:00:01.0", "8086", "352a", secondary_bus=0x10)
    up = b.bridge(rp, "0000:10:00.0", "1000", "c030", secondary_bus=0x11)
    down = b.bridge(up, "0000:11:00.0", "1000", "c030", secondary_bus=0x12)
    b.function(down, "0000:12:00.0", "10de", "2330", "030200", driver="nvidia")
    kernel = SimKernel(b.root)
    ctx = sim_context(b.root, kernel)
    assert bind(ctx, [A("0000:12:00.0")], BindPolicy()).status is BindStatus.APPLIED
    assert kernel.driver_of("0000:12:00.0") == "vfio-pci"
    assert current_driver(ctx.host, "0000:12:00.0") == "vfio-pci"
    # already bound: nothing to do, even when a libvirt domain uses it (that is the point)
    uri = libvirt_test_uri(str(tmp_path))
    ctx.libvirt(uri).defineXML(HOSTDEV_DOMAIN.format(name="guest").replace("bus='0x01'", "bus='0x12'")
                               .replace("function='0x1'", "function='0x0'"))
    again = bind(ctx, [A("0000:12:00.0")], BindPolicy(), uri=uri)
    assert again.status is BindStatus.NOTHING_TO_DO
    restore(ctx, [])
    assert kernel.driver_of("0000:12:00.0") == "nvidia"


def test_release_gives_back_the_whole_group_gpuvfio_holds(h):
    """detach, attach's rollback and the testbed give back by IOMMU group, as bind took them:
    naming the GPU gives its audio function back too."""
    h.bind(GPU)
    with h.context() as ctx:
        report = restore_groups(ctx, [A(GPU)])
    assert report.restored == {GPU: "nvidia", AUDIO: "snd_hda_intel"}
    assert h.drivers() == ORIGINAL
    with h.context() as ctx:
        assert restore_groups(ctx, [A(GPU)]).restored == {}  # nothing held: nothing to do


def test_release_leaves_devices_gpuvfio_does_not_hold(h):
    """A device already on vfio-pci before gpuvfio stays there."""
    with h.context() as ctx:
        unbind(ctx, [A(NIC)])
    h.kernel.modprobe("vfio-pci")
    h.bind(GPU)
    with h.context() as ctx:
        assert restore_groups(ctx, [A(NIC)]).restored == {}


def _fabric_mode(h, mode: int) -> None:
    path = os.path.join(h.root, "usr", "share", "nvidia", "nvswitch")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "fabricmanager.cfg"), "w") as f:
        f.write(f"# Fabric Manager\nLOG_LEVEL=4\nFABRIC_MODE={mode}\n")


def test_fabric_manager_in_shared_nvswitch_mode_keeps_running(h):
    """HGX shared-NVSwitch mode (FABRIC_MODE=1): the Fabric Manager manages the guests' NVSwitch
    partitions and must keep running; it is neither a refusal nor stopped by --stop-services."""
    h.builder.holder(700, "nv-fabricmanage", ["/dev/nvidia-nvswitchctl", "/dev/nvidia-nvswitch0",
                                              "/dev/nvidiactl"])
    h.builder.holder(900, "nvidia-persiste", ["/dev/nvidiactl"])
    with pytest.raises(Refused) as info:  # full-passthrough mode (no config: FABRIC_MODE 0)
        h.bind(GPU, dry_run=True)
    assert "nvidia-fabricmanager is running" in str(info.value)
    _fabric_mode(h, 1)
    with pytest.raises(Refused) as info:
        h.bind(GPU, dry_run=True)
    assert "nvidia-fabricmanager" not in str(info.value) and "nvidia-persistenced is running" in str(info.value)
    report = h.bind(GPU, stop_services=True)
    assert report.status is BindStatus.APPLIED
    assert h.services == [("stop", "nvidia-persistenced")]  # the Fabric Manager kept running
    (kept,) = [c for c in report.checks if c.check_id == "services" and "shared-NVSwitch" in c.message]
    assert kept.status is CheckStatus.OK


def test_fabric_manager_holding_the_gpu_itself_still_refuses(h):
    _fabric_mode(h, 1)
    os.makedirs(os.path.join(h.root, "proc", "driver", "nvidia", "gpus", GPU))
    with open(os.path.join(h.root, "proc", "driver", "nvidia", "gpus", GPU, "information"), "w") as f:
        f.write("Device Minor: 0\n")
    h.builder.holder(700, "nv-fabricmanage", ["/dev/nvidia0", "/dev/nvidiactl"])
    with pytest.raises(Refused) as info:
        h.bind(GPU, stop_services=True)
    assert "nv-fabricmanage (pid 700) holds /dev/nvidia0" in str(info.value)


def test_release_of_one_group_keeps_the_services_stopped_for_the_others(tmp_path):
    """Two GPUs bound with the NVIDIA services stopped: giving one back is a success, and the
    services are restarted only with the last one (on main the first release failed, exit 1)."""
    b = HostBuilder(str(tmp_path / "host"))
    b.iommu("intel", 1)
    rb = b.root_bus()
    for bus in (1, 2):
        group = b.new_group()
        port = b.bridge(rb, f"0000:00:0{bus}.0", "8086", "a70d", secondary_bus=bus, group=group)
        b.function(port, f"0000:0{bus}:00.0", "10de", "2330", "030200", driver="nvidia", group=group)
    b.modules(["nvidia"])
    b.holder(900, "nvidia-persiste", ["/dev/nvidiactl"])
    services = Services()
    ctx = sim_context(b.root, services=services)
    bind(ctx, [A("0000:01:00.0"), A("0000:02:00.0")], BindPolicy(stop_services=True))
    first = restore_groups(ctx, [A("0000:01:00.0")])
    assert first.restored == {"0000:01:00.0": "nvidia"} and first.services_not_restarted == [
        "nvidia-persistenced"]
    assert services.calls == [("stop", "nvidia-persistenced")]
    restore_groups(ctx, [A("0000:02:00.0")])
    assert services.calls[-1] == ("start", "nvidia-persistenced")


MDEV_DOMAIN = """<domain type='test'><name>{name}</name><memory>1048576</memory><os><type>hvm</type></os>
<devices><hostdev mode='subsystem' type='mdev' model='vfio-pci'><source><address uuid='{uuid}'/></source>
</hostdev></devices></domain>"""


def test_a_gpu_whose_mdev_a_domain_uses_is_in_use(tmp_path):
    """A legacy-vGPU guest uses its GPU through an mdev: binding that GPU is refused like a GPU
    passed through (on main only PCI hostdevs counted)."""
    from gpuvfio.ops.vgpu import create

    b = HostBuilder(str(tmp_path / "host"))
    b.iommu("amd")
    rb = b.root_bus()
    t4 = b.function(rb, "0000:82:00.0", "10de", "1eb8", "030200", driver="nvidia")
    b.mdev_types(t4, [("nvidia-222", "GRID T4-1B", 2, "1 GB")])
    b.modules(["nvidia"])
    ctx = sim_context(b.root)
    uuid = create(ctx, A("0000:82:00.0"), "nvidia-222").instance
    uri = libvirt_test_uri(str(tmp_path))
    ctx.libvirt(uri).defineXML(MDEV_DOMAIN.format(name="vdi-7", uuid=uuid))
    with pytest.raises(Refused) as info:
        plan_operation(ctx, [A("0000:82:00.0")], BindPolicy(), uri=uri).shown()
    assert "libvirt domain(s) vdi-7" in str(info.value)
