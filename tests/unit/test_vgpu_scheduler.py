"""MIG-backed vGPU types and the vGPU scheduler policy (NVML), alone and in a testbed variant.

NVML here is tests/fakecuda built as libnvidia-ml.so.1 and found through LD_LIBRARY_PATH
by the real pynvml in a real gpuvfio process; its scheduler state is a file, so one process
sets what the next reads. The testbed case runs ``gpuvfio testbed run`` on a built host
with libvirt's test:/// driver: the guest never answers SSH, and the test checks that the
vGPU and the scheduler policy are put back all the same.
"""

from __future__ import annotations

import json
import os

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.errors import Refused
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.root import HostRoot
from gpuvfio.vgpu.instances import types
from gpuvfio.vgpu.scheduler import SchedulerChange, SchedulerOutcome, SchedulerSnapshot, SchedulerState, snapshot
from gpuvfio.vgpu.types import MigProfile, mig_backed, pick_vf
from tests.conftest import run_gpuvfio
from tests.hostbuilder import BAR64_PREF, GiB, HostBuilder
from tests.testbed_data import guest_toml

H100 = "0000:41:00.0"
VFS = ["0000:41:00.4", "0000:41:00.5"]
MIG_TYPES = [(1046, "NVIDIA H100-1-10C"), (1049, "NVIDIA H100-3-40C"), (1061, "NVIDIA H100-1-10CME"),
             (1052, "NVIDIA H100-20C")]


def build(root: str) -> str:
    b = HostBuilder(root)
    b.iommu("intel", 1)
    b.numa_node(0, list(range(8)), 64)
    rb = b.root_bus(numa=0)
    gpu = b.function(rb, H100, "10de", "2331", "030200", driver="nvidia", bars=[(1, 128 * GiB, BAR64_PREF)])
    for vf in b.sriov(gpu, 16, VFS, "2331", "10de", "030200", driver="nvidia", vf_bar=GiB):
        b.vgpu_types(vf, MIG_TYPES)
    return b.root


def test_mig_backed_names():
    assert mig_backed("NVIDIA A100-3-20C") == MigProfile(slices=3, memory_gb=20, media=False)
    assert mig_backed("NVIDIA H100-1-10CME").to_json() == {"slices": 1, "memory_gb": 10, "media": True}
    assert mig_backed("NVIDIA A10-4Q") is None and mig_backed("NVIDIA H100-20C") is None
    assert mig_backed("GRID T4-1B") is None and mig_backed(None) is None


def test_types_mark_mig_backed_and_missing_instance_is_explained(tmp_path, cli):
    root = build(str(tmp_path / "host"))
    report = types(read_inventory(HostRoot(root)), PciAddress.parse(H100))
    marked = {t.name: t.mig for t in report.sriov_types}
    assert marked["NVIDIA H100-3-40C"] == MigProfile(3, 40, False)
    assert marked["NVIDIA H100-20C"] is None
    assert {t["name"]: t["mig_backed"] for t in report.to_json()["sriov_types"]}["NVIDIA H100-3-40C"] == {
        "slices": 3, "memory_gb": 40, "media": False}
    text = cli("--root", root, "vgpu", "types", H100).out
    assert "NVIDIA H100-1-10C            free VFs 2  MIG-backed: 1 slice(s), 10 GB" in text
    with pytest.raises(Refused) as info:
        pick_vf(read_inventory(HostRoot(root)), PciAddress.parse(H100), "NVIDIA H100-7-80C")
    assert "MIG-backed (7 GPU slice(s), 80 GB)" in str(info.value) and "nvidia-smi mig -cgi" in str(info.value)


@pytest.fixture
def nvml(tmp_path, fakecuda_libdir):
    sched = tmp_path / "nvml-sched"
    sched.write_text("1 1 2000\n")  # best effort, ARR off, 2 ms
    env = {"LD_LIBRARY_PATH": fakecuda_libdir, "FAKENVML_SCHED": str(sched),
           "GPUVFIO_STATE_DIR": str(tmp_path / "state"), "FAKENVML_BUSID": H100}
    return env, sched


def test_scheduler_set_journaled_and_restored(nvml, tmp_path):
    env, sched = nvml
    shown = run_gpuvfio("vgpu", "scheduler", H100, "--json", env=env)
    assert shown.code == 0, shown.err
    assert shown.json()["policy"] == "best-effort" and shown.json()["supported"] == [
        "best-effort", "equal-share", "fixed-share"]
    changed = run_gpuvfio("vgpu", "scheduler", H100, "--set", "fixed-share", env=env)
    assert changed.code == 0 and "fixed-share" in changed.out and "was best-effort" in changed.out, changed.err
    assert sched.read_text().split()[0] == "3"
    journal = json.loads((tmp_path / "state" / "journal.json").read_text())
    assert journal["schedulers"][H100] == {"policy": "best-effort", "arr_mode": "disabled", "timeslice": 2000,
                                           "avg_factor": 0}
    status = run_gpuvfio("status", "--json", env=env)
    assert H100 in status.json()["schedulers"]
    assert f"vGPU scheduler of {H100} changed by gpuvfio; restore puts back best-effort" in run_gpuvfio(
        "status", env=env).err  # plain in a pipe: the journal's records as notes on stderr
    restored = run_gpuvfio("restore", env=env)
    assert restored.code == 0 and "back to best-effort" in restored.err + restored.out, restored.err
    assert sched.read_text().split() == ["1", "1", "2000"]
    assert json.loads((tmp_path / "state" / "journal.json").read_text())["schedulers"] == {}


@pytest.mark.parametrize("extra_env, args, code, fragment", [
    ({"FAKENVML_SCHED": "/nonexistent"}, ["--set", "equal-share"], 1, "does not expose the vGPU scheduler"),
    ({"LD_LIBRARY_PATH": "/nonexistent"}, [], 1, "NVML is not available on this host"),
    ({"FAKENVML_VM_RUNNING": "1"}, ["--set", "equal-share"], 1, "setting the vGPU scheduler failed"),
    ({}, ["--set", "round-robin"], 2, "must be one of best-effort, equal-share, fixed-share"),
    ({}, ["--set", "equal-share", "--root", "/nonexistent"], 2, "/nonexistent"),
])
def test_scheduler_refusals_are_one_line(nvml, tmp_path, extra_env, args, code, fragment):
    env, sched = nvml
    result = run_gpuvfio("vgpu", "scheduler", H100, *args, env={**env, **extra_env})
    assert result.code == code and fragment in result.err and result.err.count("\n") == 1, result.err
    assert "Traceback" not in result.err
    assert sched.read_text().split()[0] == "1"  # unchanged
    journal = tmp_path / "state" / "journal.json"
    assert not journal.exists() or json.loads(journal.read_text()).get("schedulers") == {}


def vgpu_spec_toml(kernel, port: int) -> str:
    return guest_toml(kernel=str(kernel), vcpus=1, memory="256M", virt_type="qemu", firmware="bios",
                      ssh={"port": port, "boot_timeout": 2, "trust_on_first_use": True}) + TESTBED


TESTBED = """
[run]
repetitions = 1
gpus = ["{gpu}"]
connect = "test:///default"

[[variant]]
name = "vgpu-mig-1g"
kind = "vgpu"
profile = "NVIDIA H100-1-10C"
scheduler = "equal-share"
numa = "none"
hugepages = "none"
"""


def _testbed_that_cannot_reach_its_guest(tmp_path, monkeypatch, env, fakecuda_libdir):
    """Run a one-variant vGPU testbed whose guest never answers SSH (simulated kernel for the
    sysfs writes, the stand-in NVML preloaded so that pynvml finds it by name, libvirt's
    test:/// driver); returns (error, progress lines, host root)."""
    import ctypes

    from gpuvfio.errors import GpuvfioError
    from gpuvfio.testbed.run import run_testbed
    from gpuvfio.testbed.spec import load_spec
    from tests.contexts import sim_context
    from tests.lanes.guest import free_port

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ctypes.CDLL(os.path.join(fakecuda_libdir, "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)
    root = build(str(tmp_path / "host"))
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"\0")
    spec_path = tmp_path / "testbed.toml"
    spec_path.write_text(vgpu_spec_toml(kernel, free_port()).replace("{gpu}", H100))
    plan = run_gpuvfio("--root", root, "testbed", "plan", str(spec_path), "--json", env=env)
    assert plan.code == 0, plan.err
    vgpu = plan.json()["variants"][0]["vgpu"]
    assert vgpu["mig_backed"]["slices"] == 1 and vgpu["scheduler"] == "equal-share"
    seen: list[str] = []
    # One context, one test:///default connection for the whole run (as a command has).
    with sim_context(root, progress=seen.append) as ctx:
        with pytest.raises(GpuvfioError, match="did not answer SSH") as failed:
            run_testbed(ctx, load_spec(str(spec_path)), str(tmp_path / "out"), uri="test:///default")
        conn = ctx.libvirt("test:///default")
        assert [d.name() for d in conn.listAllDomains(0) if d.name().startswith("gpuvfio-tb-")] == []
    assert "rolled back: destroy, undefine" in str(failed.value)  # attach undid its own domain
    types_now = {vf: open(os.path.join(root, "sys", "bus", "pci", "devices", vf, "nvidia",
                                       "current_vgpu_type")).read().strip() for vf in VFS}
    assert types_now == {vf: "0" for vf in VFS}
    return failed.value, seen, root


def test_testbed_vgpu_variant_applies_scheduler_and_puts_everything_back(nvml, tmp_path, monkeypatch,
                                                                         fakecuda_libdir):
    """The guest never answers: the run fails at attach, and the VF's type, the journal and the
    scheduler policy are back to what they were."""
    env, sched = nvml
    _error, seen, _root = _testbed_that_cannot_reach_its_guest(tmp_path, monkeypatch, env, fakecuda_libdir)
    assert seen[0] == f"vgpu-mig-1g: vGPU scheduler of {H100}: equal-share (set)", seen
    assert seen[-1] == "vgpu-mig-1g: vGPU scheduler put back", seen
    assert sched.read_text().split() == ["1", "1", "2000"]
    journal = json.loads((tmp_path / "state" / "journal.json").read_text())
    assert journal["vgpus"] == {} and journal["schedulers"] == {}


def test_testbed_puts_back_what_it_found_not_the_first_original(nvml, tmp_path, monkeypatch, fakecuda_libdir):
    """An operator set fixed-share with gpuvfio before (journal: original best-effort): the variant's
    teardown returns the GPU to fixed-share, and gpuvfio restore still knows best-effort."""
    env, sched = nvml
    assert run_gpuvfio("vgpu", "scheduler", H100, "--set", "fixed-share", env=env).code == 0
    _error, seen, _root = _testbed_that_cannot_reach_its_guest(tmp_path, monkeypatch, env, fakecuda_libdir)
    assert sched.read_text().split()[0] == "3"
    journal = json.loads((tmp_path / "state" / "journal.json").read_text())
    assert journal["schedulers"][H100]["policy"] == "best-effort"


def test_nvml_refuses_a_root_that_is_not_this_machine(nvml, tmp_path):
    """NVML reaches the GPUs of the machine gpuvfio runs on, whatever --root says (on main
    vgpu scheduler --set on a recorded host changed this machine's GPU)."""
    env, sched = nvml
    root = build(str(tmp_path / "host"))
    for args in (["--json"], ["--set", "equal-share"]):
        result = run_gpuvfio("--root", root, "vgpu", "scheduler", H100, *args, env=env)
        assert result.code == 1 and "not this machine" in result.err and result.err.count("\n") == 1, result.err
    assert sched.read_text().split()[0] == "1"  # unchanged


STATE = SchedulerState("0000:41:00.0", "best-effort", "disabled", 2000, None,
                       ["best-effort", "equal-share", "fixed-share"], (1000, 30000), True)


def test_scheduler_results_give_the_json_of_before():
    """As ``gpuvfio vgpu scheduler --json`` printed them (tests/unit/test_vgpu_scheduler.py runs it)."""
    shown = ('{"address": "0000:41:00.0", "policy": "best-effort", "arr": "disabled", "timeslice": 2000, '
             '"avg_factor": null, "supported": ["best-effort", "equal-share", "fixed-share"], '
             '"timeslice_range": [1000, 30000], "arr_supported": true')
    assert json.dumps(STATE.to_json()) == shown + "}"
    before = snapshot(STATE)
    assert before == SchedulerSnapshot("best-effort", "disabled", 2000, 0)
    after = SchedulerState(**{**STATE.__dict__, "policy": "fixed-share"})
    changed = SchedulerChange(after, SchedulerOutcome.SET, "best-effort", before, True)
    assert json.dumps(changed.to_json()) == shown.replace('"policy": "best-effort"', '"policy": "fixed-share"') + (
        ', "result": "set", "previous": "best-effort", "before": {"policy": "best-effort", "arr_mode": "disabled", '
        '"timeslice": 2000, "avg_factor": 0}, "journaled": true, "steps": []}')
    same = SchedulerChange(STATE, SchedulerOutcome.UNCHANGED)
    assert json.dumps(same.to_json()) == shown + ', "result": "unchanged", "steps": []}'


def test_scheduler_snapshot_reads_old_and_new_journal_records():
    assert SchedulerSnapshot.from_json({"policy": "equal-share", "arr": True}).arr is True
    assert SchedulerSnapshot.from_json({"policy": "equal-share", "arr_mode": "enabled", "timeslice": 3,
                                        "avg_factor": 2}) == SchedulerSnapshot("equal-share", "enabled", 3, 2)
    record = SchedulerSnapshot("fixed-share", "default")
    assert SchedulerSnapshot.from_json(record.to_json()) == record and record.arr is False
    # a timeslice NVML reports outside the range it accepts is written back as the default (0)
    assert snapshot(SchedulerState(**{**STATE.__dict__, "timeslice": 99})).timeslice == 0


def test_undoing_a_scheduler_change_waits_for_the_run_lock(tmp_path):
    """A testbed's undo writes the journal: it takes the run lock through the Context (its
    timeout, its holder named), so a concurrent gpuvfio run is never raced."""
    from gpuvfio.bind.journal import LockTimeout
    from gpuvfio.ops.vgpu import undo_scheduler
    from tests.contexts import lock_held_elsewhere, sim_context

    opened = []
    ctx = sim_context(build(str(tmp_path / "host")), lock_timeout=0.3, nvml=lambda: opened.append("nvml"))
    before = SchedulerSnapshot("best-effort", "disabled", 2000, 0)
    with lock_held_elsewhere(ctx.state.path(), "gpuvfio bind 41:00.0") as holder:
        with pytest.raises(LockTimeout) as info:
            undo_scheduler(ctx, PciAddress.parse(H100), before, True)
    assert str(holder) in str(info.value) and opened == []
