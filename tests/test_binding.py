"""Binding on the unit lane: a HostBuilder tree driven by the simulated kernel."""

import errno
import json
import multiprocessing
import os
import time

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.bindapply import Actions, BindError, current_driver
from gpuvfio.bindcmd import Refused, bind, restore, status, unbind
from gpuvfio.errors import GpuvfioError
from gpuvfio.hostroot import HostRoot
from gpuvfio.journal import CorruptJournal, Journal, LockTimeout, RunLock, state_dir
from gpuvfio.sysfs_write import SysfsWriter
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
        self.services = []
        self.actions = Actions(modprobe=self.kernel.modprobe,
                               stop_service=lambda unit: self.services.append(("stop", unit)),
                               start_service=lambda unit: self.services.append(("start", unit)))

    def writer(self, timeout=5.0):
        return SysfsWriter(self.host, timeout=timeout, backend=self.kernel)

    def bind(self, *addresses, **kw):
        kw.setdefault("writer", self.writer())
        return bind(HostRoot(self.root), [A(a) for a in addresses], actions=self.actions, **kw)

    def restore(self, *addresses, **kw):
        return restore(HostRoot(self.root), [A(a) for a in addresses], writer=self.writer(),
                       actions=self.actions, **kw)

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
    assert report["result"] == "applied"
    assert report["devices"] == [GPU, AUDIO]  # the audio function goes too; the root port does not
    assert h.drivers() == {GPU: "vfio-pci", AUDIO: "vfio-pci", PORT: "pcieport", NIC: "igc"}
    assert os.path.exists(os.path.join(h.root, "dev", "vfio", str(h.group)))
    kinds = [s["kind"] for s in report["steps"]]
    assert kinds == ["modprobe", "override", "override", "unbind", "unbind", "probe", "probe"]
    journal = Journal.load(state_dir(h.host))
    assert journal.devices[GPU]["original_driver"] == "nvidia"
    assert journal.devices[AUDIO]["original_driver"] == "snd_hda_intel"
    assert all(s["state"] == "done" for s in journal.data["operation"]["steps"])


def test_restore_returns_exactly(h):
    before = h.snapshot()
    h.bind(GPU)
    assert h.restore()["restored"] == {GPU: "nvidia", AUDIO: "snd_hda_intel"}
    assert h.snapshot() == before
    assert Journal.load(state_dir(h.host)).devices == {}
    assert status(h.host)["devices"] == []


def test_already_bound_is_a_noop(h):
    h.bind(GPU)
    writes = len(h.kernel.writes())
    report = h.bind(AUDIO)
    assert report["result"] == "nothing_to_do" and report["steps"] == []
    assert len(h.kernel.writes()) == writes


def test_dry_run_changes_nothing(h):
    before = h.snapshot()
    report = h.bind(GPU, dry_run=True)
    assert report["result"] == "dry_run" and report["devices"] == [GPU, AUDIO]
    assert h.snapshot() == before and h.kernel.writes() == []
    assert not os.path.exists(state_dir(h.host))


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
    before = h.snapshot()
    h.kernel.inject("unbind", GPU, hang=True)
    started = time.monotonic()
    with pytest.raises(BindError) as info:
        h.bind(GPU, writer=h.writer(timeout=0.5))
    assert time.monotonic() - started < 10
    assert "did not return within 0.5s" in str(info.value)
    assert h.snapshot() == before  # the simulated write never happened; rollback cleared the overrides
    steps = Journal.load(state_dir(h.host)).data
    assert steps["devices"] == {}


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
    assert report["result"] == "applied" and h.services == [("stop", "nvidia-persistenced")]
    h.restore()
    assert h.services[-1] == ("start", "nvidia-persistenced")


def test_boot_vga_refused_unless_forced(h):
    with open(os.path.join(h.builder.functions[A(GPU)].path, "boot_vga"), "w") as f:
        f.write("1\n")
    with pytest.raises(Refused):
        h.bind(GPU)
    assert h.bind(GPU, force=True)["result"] == "applied"


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
    assert h.bind(GPU, allow_unsafe_host=True)["result"] == "applied"


def test_iommu_off_refused(tmp_path):
    b = HostBuilder(str(tmp_path))
    b.iommu(None)
    rb = b.root_bus()
    b.function(rb, GPU, "10de", "1db4", "030200", driver="nvidia")
    kernel = SimKernel(b.root)
    with pytest.raises(Refused) as info:
        bind(HostRoot(b.root), [A(GPU)], writer=SysfsWriter(HostRoot(b.root), backend=kernel),
             actions=Actions(kernel.modprobe, print, print), force=True)
    assert "IOMMU is off" in str(info.value)


def test_libvirt_domain_refuses(h):
    report_calls = []

    def used(addresses):
        report_calls.append(addresses)
        return {a: (["win11"] if str(a) == AUDIO else []) for a in addresses}

    with pytest.raises(Refused) as info:
        h.bind(GPU, domains_using=used)
    assert "libvirt domain(s) win11" in str(info.value)
    report = h.bind(GPU, domains_using=lambda addresses: None)
    assert any(c["id"] == "libvirt" and c["status"] == "skip" for c in report["checks"])


@pytest.mark.parametrize("stop_after", range(1, 8))
def test_crash_between_steps_then_restore(h, stop_after):
    """Run the bind in a child process and SIGKILL it after step N; restore must undo."""
    before = h.snapshot()
    os.environ["GPUVFIO_TEST_PAUSE_AFTER_STEP"] = str(stop_after)
    try:
        child = multiprocessing.get_context("fork").Process(target=_bind_in_child, args=(h,))
        child.start()
        journal_path = os.path.join(state_dir(h.host), "journal.json")
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
    finally:
        del os.environ["GPUVFIO_TEST_PAUSE_AFTER_STEP"]
    assert h.snapshot() != before or stop_after == 1  # the crash left the host half-way
    h.restore()
    assert h.snapshot() == before
    assert status(h.host)["devices"] == []


def _bind_in_child(h):
    h.bind(GPU)


def test_concurrent_runs(h):
    directory = state_dir(h.host)
    with RunLock(directory, 1):
        started = time.monotonic()
        with pytest.raises(LockTimeout) as info:
            h.bind(GPU, lock_timeout=0.5)
        assert time.monotonic() - started >= 0.5
    assert f"pid {os.getpid()}" in str(info.value)
    assert h.bind(GPU, lock_timeout=0.5)["result"] == "applied"  # free again


def test_corrupt_journal_refused_and_kept(h):
    directory = state_dir(h.host)
    os.makedirs(directory)
    path = os.path.join(directory, "journal.json")
    with open(path, "w") as f:
        f.write("{not json")
    for action in (lambda: h.bind(GPU), lambda: h.restore(), lambda: status(h.host),
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
    result = unbind(h.host, [A(GPU), A(AUDIO)], writer=h.writer())
    assert result["drivers"] == {GPU: "nvidia", AUDIO: "snd_hda_intel"}
    assert h.drivers() == ORIGINAL


def test_restore_unknown_address(h):
    with pytest.raises(GpuvfioError, match="not held by gpuvfio"):
        h.restore(NIC)


def test_bind_on_non_live_tree_rolls_back(h):
    """The real kernel backend against a plain directory tree: nothing binds, all is undone."""
    before = h.snapshot()
    with pytest.raises(BindError) as info:
        h.bind(GPU, writer=SysfsWriter(h.host, timeout=5))  # real write(2), no kernel behind it
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
    host = HostRoot(b.root)
    actions = Actions(kernel.modprobe, print, print)
    writer = SysfsWriter(host, backend=kernel)
    assert bind(host, [A("0000:12:00.0")], writer=writer, actions=actions)["result"] == "applied"
    assert kernel.driver_of("0000:12:00.0") == "vfio-pci"
    assert current_driver(host, "0000:12:00.0") == "vfio-pci"
    # already bound: nothing to do, even when a libvirt domain uses it (that is the point)
    again = bind(host, [A("0000:12:00.0")], writer=writer, actions=actions,
                 domains_using=lambda addresses: {a: ["guest"] for a in addresses})
    assert again["result"] == "nothing_to_do"
    restore(host, [], writer=writer, actions=actions)
    assert kernel.driver_of("0000:12:00.0") == "nvidia"
