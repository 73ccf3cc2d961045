"""For each of the 13 operations that change the host, the steps its run carried out are its
plan's steps (issue 33 item 4): the plan is made, then the run; what the run recorded (its
result's steps, the journal's step log, the files on disk, testbed's steps.json) is compared
with the plan, step by step (gpuvfio.planning.Step.key). attach is compared on a real libvirtd
(tests/daemon/test_plan_attach_run.py) and here on its run's record.
"""

from __future__ import annotations

import ctypes
import json
import os

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError
from gpuvfio.ops import binding, domains, guests, vgpu
from gpuvfio.ops import unbind as unbinding
from gpuvfio.ops.binding import BindPolicy
from gpuvfio.ops.reset import plan_reset, reset
from tests.conftest import gpu_workstation
from tests.contexts import sim_context
from tests.simkernel import SimKernel

libvirt = pytest.importorskip("libvirt")

GPU, AUDIO = "0000:01:00.0", "0000:01:00.1"
A = PciAddress.parse


def keys(steps) -> list[tuple]:
    return [s.key for s in steps]


@pytest.fixture
def host(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    built = gpu_workstation(tmp_path / "host")
    return built, SimKernel(built.root)


def _bound(host):
    built, kernel = host
    with sim_context(built.root, kernel) as ctx:
        binding.bind(ctx, [A(GPU), A(AUDIO)], BindPolicy())
    return built, kernel


def test_bind_runs_its_plans_steps_and_the_journal_records_each_as_done(host):
    built, kernel = host
    with sim_context(built.root, kernel) as ctx:
        planned = binding.plan_operation(ctx, [A(GPU)], BindPolicy(), uri="none").plan
        binding.bind(ctx, [A(GPU)], BindPolicy(), uri="none")
        log = ctx.journal().data["operation"]["steps"]
    assert [(s["kind"], s["address"], s["name"]) for s in log] == keys(planned.steps)
    assert {s["state"] for s in log} == {"done"} and len(log) >= 5  # modprobe, override x2, unbind x2, probe x2


@pytest.mark.parametrize("remove", [False, True])
def test_persist_and_unpersist_write_exactly_the_planned_files(host, remove):
    built, kernel = host
    with sim_context(built.root, kernel) as ctx:
        if remove:
            binding.persist(ctx, [A(GPU)])
        planned = binding.plan_persist(ctx, [A(GPU)], remove=remove)
        done = binding.persist(ctx, [A(GPU)], remove=remove)
    assert planned.changes and keys(done.steps) == keys(planned.steps)
    for change in planned.changes:
        path = os.path.join(built.root, change.rel)
        if change.new is None:
            assert not os.path.lexists(path)
        elif change.link:
            assert os.readlink(path) == change.new
        else:
            assert open(path).read() == change.new


def test_reset_runs_its_plans_writes(host, monkeypatch):
    built, kernel = _bound(host)
    with sim_context(built.root, kernel) as ctx:
        planned = plan_reset(ctx, [A(GPU)], uri="none")
        if planned.refused:
            pytest.fail(f"the workstation's GPU should offer a reset: {planned.refusals}")
        done = reset(ctx, [A(GPU)], uri="none")
    assert keys(done.steps) == keys(planned.steps) and done.steps[0].path == planned.steps[0].path


def test_restore_and_release_run_their_plans_steps(host):
    built, kernel = _bound(host)
    with sim_context(built.root, kernel) as ctx:
        planned = binding.plan_restore_groups(ctx, [A(GPU)])
        done = binding.restore_groups(ctx, [A(GPU)])
    assert keys(done.steps) == keys(planned.steps) == [("restore", GPU, None), ("restore", AUDIO, None)]
    _bound(host)
    with sim_context(built.root, kernel) as ctx:
        planned = binding.plan_restore(ctx, [])
        done = binding.restore(ctx, [])
    assert keys(done.steps) == keys(planned.steps) and kernel.driver_of(GPU) == "nvidia"


def test_unbind_runs_its_plans_writes(host):
    built, kernel = _bound(host)
    with sim_context(built.root, kernel) as ctx:
        planned = unbinding.plan_unbind(ctx, [A(GPU), A(AUDIO)], uri="none")
        done = unbinding.unbind(ctx, [A(GPU), A(AUDIO)], uri="none")
    assert keys(done.steps) == keys(planned.steps) and len(planned.steps) == 6
    assert done.drivers == {GPU: "nvidia", AUDIO: "snd_hda_intel"}


def test_define_and_detach_run_their_plans(host):
    """xml --define's plan defines, its second plan has nothing to do; detach's plan (stop,
    undefine, give back what gpuvfio holds) is what its run took, on libvirt's test driver."""
    built, kernel = _bound(host)
    conn = libvirt.open("test:///default")
    try:
        with sim_context(built.root, kernel) as ctx:
            request = domains.domain_request("plans-run", firmware="bios")
            xml = domains.provision_xml(ctx, [A(GPU), A(AUDIO)], request, uri="test:///default").xml
            planned = domains.plan_define(ctx, xml, uri="test:///default")
            assert planned.outcome == "would_define" and [s.kind.value for s in planned.steps] == ["define"]
            assert domains.run_define(ctx, planned).result == "defined"
            again = domains.plan_define(ctx, xml, uri="test:///default")
            assert again.nothing_to_do and domains.run_define(ctx, again).result == "unchanged"
            detach_plan = guests.plan_detach(ctx, "plans-run", uri="test:///default", timeout=0)
            done = guests.detach(ctx, "plans-run", uri="test:///default", timeout=0)
        assert keys(done.steps) == keys(detach_plan.steps)
        assert [k for k, _a, _n in keys(done.steps)] == ["stop", "undefine", "restore", "restore"]
        assert kernel.driver_of(GPU) == "nvidia" and "plans-run" not in [d.name() for d in conn.listAllDomains(0)]
    finally:
        conn.close()


def test_vgpu_create_and_remove_run_their_plans(tmp_path, monkeypatch):
    from tests.unit.test_dry_runs import vgpu_host

    built, kernel, _state = vgpu_host.__wrapped__(tmp_path, monkeypatch)
    uuid = "0d2f9b9e-7a2f-4c35-9c4e-3f1a2b3c4d5e"
    with sim_context(built.root, kernel) as ctx:
        planned = vgpu.plan_create(ctx, A("0000:82:00.0"), "GRID T4-1B", uuid=uuid)
        made = vgpu.create(ctx, A("0000:82:00.0"), "GRID T4-1B", uuid=uuid)
        assert keys(made.steps) == keys(planned.steps) == [("create vGPU", "0000:82:00.0", uuid)]
        planned = vgpu.plan_remove(ctx, uuid)
        gone = vgpu.remove(ctx, uuid)
    assert keys(gone.steps) == keys(planned.steps) == [("remove vGPU", None, uuid), ("forget vGPU", None, uuid)]


def test_vgpu_scheduler_and_a_testbed_variant_run_their_plans(tmp_path, monkeypatch, fakecuda_libdir):
    """The scheduler change through the stand-in NVML; then a vGPU testbed variant whose guest
    never answers: its steps.json holds its plan and the steps it took, the failed attach
    missing and the teardown there."""
    from tests.unit import test_vgpu_scheduler as sched_tests

    env, sched = sched_tests.nvml.__wrapped__(tmp_path, fakecuda_libdir)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ctypes.CDLL(os.path.join(fakecuda_libdir, "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)
    root = sched_tests.build(str(tmp_path / "scheduler-host"))
    with sim_context(root) as ctx:
        planned = vgpu.plan_scheduler(ctx, A(sched_tests.H100), "fixed-share")
        changed = vgpu.set_scheduler(ctx, A(sched_tests.H100), "fixed-share")
        assert keys(changed.steps) == keys(planned.steps) == [("set vGPU scheduler", sched_tests.H100, None)]
        binding.restore(ctx, [])
    assert sched.read_text().split()[0] == "1"
    error, _seen, _root = sched_tests._testbed_that_cannot_reach_its_guest(tmp_path, monkeypatch, env,
                                                                          fakecuda_libdir)
    record = json.loads((tmp_path / "out" / "results" / "vgpu-mig-1g" / "steps.json").read_text())
    planned_kinds = [s["kind"] for s in record["planned"]]
    assert planned_kinds == ["set vGPU scheduler", "create vGPU", "attach", "teardown"]
    assert [s["kind"] for s in record["taken"]] == [k for k in planned_kinds if k != "attach"]
    assert isinstance(error, GpuvfioError) and "did not answer SSH" in str(error)
