"""HGX partitions through the services (issue 14 item 5): the plan asks the Fabric Manager for
its partitions and matches the GPUs; activation is journaled and undone; detach's and
restore's deactivation; all against the stand-in fmpm on the dgx-h100 sample."""

from __future__ import annotations

import json
import os
import sys

import pytest

from gpuvfio.bind.fabric_manager import FabricManagerClient, FabricStepError
from gpuvfio.bind.journal import Journal
from gpuvfio.host.state import state_dir
from gpuvfio.domain.request import domain_request
from gpuvfio.errors import GpuvfioError, Refused
from gpuvfio.host.root import HostRoot
from gpuvfio.ops import binding, fabric
from gpuvfio.ops.binding import BindPolicy
from gpuvfio.ops.context import Context
from gpuvfio.ops.domains import provision_xml
from tests.unit.test_fabric import FMPM, MODULE, SWITCHES, VERSION, dgx, dgx_tree, fm, gpus, set_mode, write  # noqa: F401


@pytest.fixture
def shared(dgx, fm, tmp_path):
    """The DGX in shared-NVSwitch mode (FABRIC_MODE=1, its nv-fabricmanage process running) with
    a context whose Fabric Manager is the stand-in; gpuvfio's state under the tree."""
    set_mode(dgx, 1)
    write(dgx, "sys/module/nvidia/version", VERSION + "\n")
    ctx = Context(host=HostRoot(dgx), fabric_manager=lambda: FabricManagerClient([sys.executable, FMPM]), writable=True)
    yield ctx, fm
    for key in list(Journal.load(state_dir(ctx.host)).data["partitions"]):
        fabric.deactivate(ctx, partition_ids=[int(key)])


def plan(ctx, addresses):
    return provision_xml(ctx, addresses, domain_request("part", vcpus=4, memory="16G", numa="none"))


def test_four_gpus_of_partition_1(shared):
    ctx, fm = shared
    provisioned = plan(ctx, gpus(1, 2, 3, 4))
    decision = provisioned.spec.fabric
    assert decision.kind == "partition" and decision.partition.partition_id == 1
    assert not set(map(str, SWITCHES)) & set(provisioned.spec.host_devices)  # the NVSwitches stay home
    assert any("activate the partition" in note for note in provisioned.spec.notes)
    assert decision.guest_driver_version == VERSION


def test_three_gpus_are_refused(shared):
    ctx, _fm = shared
    with pytest.raises(Refused, match="not exactly one Fabric Manager partition"):
        plan(ctx, gpus(1, 2, 3))


def test_activate_journals_and_detach_deactivates(shared):
    ctx, fm = shared
    decision = plan(ctx, gpus(5, 6, 7, 8)).spec.fabric
    assert fabric.activate(ctx, decision) == [2]
    assert fm.active() == {2}
    journal = Journal.load(state_dir(ctx.host))
    assert journal.data["partitions"]["2"]["state"] == "active"
    # a second guest asking for the same GPUs is refused: the partition is active
    with pytest.raises(Refused, match="is active"):
        plan(ctx, gpus(5, 6, 7, 8))
    assert [line.split(" (")[0] for line in fabric.deactivate(ctx, devices=[MODULE[5]])] == [
        "deactivate Fabric Manager partition 2"]
    assert fm.active() == set() and Journal.load(state_dir(ctx.host)).data["partitions"] == {}


def test_failed_activation_leaves_nothing(shared, monkeypatch):
    ctx, fm = shared
    decision = plan(ctx, gpus(1, 3)).spec.fabric
    monkeypatch.setenv("FAKEFM_FAIL", "activate=-2")
    with pytest.raises(FabricStepError, match="FM_ST_GENERIC_ERROR"):
        fabric.activate(ctx, decision)
    assert fm.active() == set() and Journal.load(state_dir(ctx.host)).data["partitions"] == {}


def test_restore_deactivates_what_a_crash_left(shared):
    ctx, fm = shared
    fabric.activate(ctx, plan(ctx, gpus(2, 4)).spec.fabric)
    assert fm.active() == {4}
    report = binding.restore(ctx, [])
    assert any("partition 4" in line for line in report.vgpu), report
    assert fm.active() == set()


def test_not_the_live_host_no_fabric_manager(dgx):
    set_mode(dgx, 1)
    ctx = Context(host=HostRoot(dgx))  # no Fabric Manager reachable: the plan cannot match a partition
    with pytest.raises(Refused, match="partition list is needed"):
        plan(ctx, gpus(1, 2, 3, 4))
    state = json.dumps(Journal.load(state_dir(ctx.host)).data["partitions"])
    assert state == "{}"


@pytest.mark.parametrize("line, status", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023", "pass"),
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024", "fail"),
    (None, "fail"),
])
def test_the_guest_driver_must_be_the_fabric_managers(line, status):
    from gpuvfio.guest.checks import evaluate
    from gpuvfio.guest.expect import Expected

    expected = [Expected("0000:1b:00.0", "10de", "2330", "030200", 5, 16, driver_version=VERSION)]
    probe = {"pci": [{"address": "0000:01:00.0", "vendor_id": "10de", "device_id": "2330", "class_id": "030200",
                      "driver": "nvidia", "upstream": None, "link": {}}], "nvidia_version": line, "modules": [],
             "dmesg": []}
    result = evaluate(probe, None, expected)
    (row,) = [c for c in result["checks"] if c["id"] == "driver_version"]
    assert row["status"] == status and not result["ok"]  # no verifier: the run fails anyway (fail closed)


def test_h100_partitions_matched_by_module_ids_from_nvml(shared, dgx):
    """On HGX H100 the Fabric Manager lists partition GPUs by module id only (no PCI bus id):
    the module ids NVML reported (recorded with the NVLinks) map them to addresses."""
    ctx, fm = shared
    import os

    state_path = os.environ["FAKEFM_STATE"]
    with open(state_path) as handle:
        state = json.load(handle)
    for partition in state["partitions"]:
        for gpu in partition["gpus"]:
            gpu["pciBusId"] = ""
    with open(state_path, "w") as handle:
        json.dump(state, handle)
    with pytest.raises(Refused, match="have no PCI address"):
        plan(ctx, gpus(1, 2, 3, 4))
    with pytest.raises(Refused, match="have no PCI address"):  # not mistaken for a GPU in no partition
        plan(ctx, gpus(1))
    recording = os.path.join(dgx, "var", "lib", "gpuvfio-fixture", "nvlink.json")
    with open(recording) as handle:
        original = handle.read()
    try:
        record = json.loads(original)
        record["modules"] = {str(address): module for module, address in MODULE.items()}
        with open(recording, "w") as handle:
            json.dump(record, handle)
        decision = plan(ctx, gpus(1, 2, 3, 4)).spec.fabric
        assert decision.kind == "partition" and decision.partition.partition_id == 1
        record["modules"]["0000:1b:00.0"] = record["modules"]["0000:43:00.0"]  # two GPUs, one module: refused
        with open(recording, "w") as handle:
            json.dump(record, handle)
        with pytest.raises(Exception, match="module id of its own"):
            plan(ctx, gpus(1, 2, 3, 4))
    finally:
        with open(recording, "w") as handle:
            handle.write(original)


def test_bind_applies_the_fabric_rules(dgx, cli):
    """gpuvfio bind (and so the Ansible device module, which calls the same service) refuses what
    xml and attach refuse, and in full-passthrough mode binds the NVSwitches with all the GPUs."""
    set_mode(dgx, 0)  # the sample's Fabric Manager, DCGM and persistenced run: --stop-services
    ctx = Context(host=HostRoot(dgx))
    with pytest.raises(Refused) as info:
        binding.plan_operation(ctx, gpus(1, 2, 3, 4), BindPolicy(stop_services=True), uri="none").shown()
    assert "4 of the 8 baseboard GPUs" in str(info.value)
    assert [c["id"] for c in info.value.report["refused"]] == ["fabric"]
    report = binding.plan_operation(ctx, gpus(*range(1, 9)), BindPolicy(stop_services=True), uri="none").shown()
    assert set(SWITCHES) <= set(report.devices) and report.status is binding.BindStatus.DRY_RUN
    assert any(c.check_id == "fabric" and "full passthrough" in c.message for c in report.checks)
    assert report.fabric is not None and report.fabric.kind == "full_passthrough"
    alone = binding.plan_operation(ctx, gpus(3), BindPolicy(stop_services=True), uri="none").shown()
    assert any(c.check_id == "fabric" and c.status is binding.CheckStatus.WARN and "NVreg_NvLinkDisable=1" in c.message
               for c in alone.checks)
    assert not set(SWITCHES) & set(alone.devices)
    refused = cli("--root", dgx, "bind", *map(str, gpus(1, 2)), "--dry-run", "--yes", "--stop-services", "--connect", "none")
    assert refused.code == 1 and "FABRIC_MODE=0" in refused.err
    set_mode(dgx, 1)  # shared NVSwitch, but no Fabric Manager to ask here: no partition can be matched
    refused = cli("--root", dgx, "bind", *map(str, gpus(1, 2, 3, 4)), "--dry-run", "--stop-services", "--connect", "none", "--json")
    assert refused.code == 1 and "partition list is needed" in refused.out


def test_a_partition_that_stays_active_keeps_its_gpus(shared, cli, monkeypatch):
    """restore (and so attach's undo and release) gives back no GPU whose partition could not be
    deactivated; status shows the partition; a failed activation is a finished operation."""
    ctx, fm = shared
    fabric.activate(ctx, plan(ctx, gpus(2, 4)).spec.fabric)
    journal = Journal.load(state_dir(ctx.host))
    for n, address in enumerate(gpus(2, 4)):  # as attach's bind journals them
        journal.devices[str(address)] = {"original_driver": "nvidia", "original_override": None, "group": 90 + n}
    journal.save()
    status = cli("--root", ctx.host.root, "status", "--json").json()
    assert status["partitions"] == {"4": {"state": "active", "modules": [2, 4], "devices": list(map(str, gpus(2, 4)))}}
    shown = cli("--root", ctx.host.root, "status")  # plain in a pipe: the journal's records as notes on stderr
    assert "Fabric Manager partition 4 (active)" in shown.err
    monkeypatch.setenv("FAKEFM_FAIL", "deactivate=-2")
    with pytest.raises(GpuvfioError, match="partition 4 still active") as info:
        binding.restore(ctx, [])
    assert set(info.value.report["kept"]) == set(map(str, gpus(2, 4))) and info.value.report["restored"] == {}
    assert set(Journal.load(state_dir(ctx.host)).devices) == set(map(str, gpus(2, 4)))  # still held
    assert fm.active() == {4}
    monkeypatch.delenv("FAKEFM_FAIL")
    fabric.deactivate(ctx, partition_ids=[4])
    journal = Journal.load(state_dir(ctx.host))
    journal.devices.clear()
    journal.save()
    monkeypatch.setenv("FAKEFM_FAIL", "activate=-2")
    with pytest.raises(FabricStepError):
        fabric.activate(ctx, plan(ctx, gpus(1, 3)).spec.fabric)
    status = cli("--root", ctx.host.root, "status", "--json").json()
    assert status["unfinished_operation"] is None and status["partitions"] == {}


@pytest.fixture
def quiet_dgx(tmp_path):
    """The dgx-h100 sample on its own, without the processes that hold its GPUs (persist refuses
    a held GPU as bind does)."""
    import shutil

    from gpuvfio.host.fixture import load_fixture
    from tests.make_samples import sample_path

    with open(sample_path("dgx-h100"), encoding="utf-8") as handle:
        root = load_fixture(handle.read(), str(tmp_path / "dgx"))
    for name in os.listdir(os.path.join(root, "proc")):
        if name.isdigit() and name != "1":  # PID 1: the host's mounts and routes
            shutil.rmtree(os.path.join(root, "proc", name))
    return root


def test_the_nvswitches_go_back_and_persist_with_the_last_gpu(quiet_dgx):
    """Full passthrough binds the NVSwitches with all eight GPUs; releasing the eight (attach's
    undo, Ansible state=host, restore of the GPUs) gives them back too, and persist/unpersist of
    the eight takes them along, as bind does."""
    set_mode(quiet_dgx, 0)
    ctx = Context(host=HostRoot(quiet_dgx))
    inventory = binding.read_inventory(ctx.host)
    journal = Journal.load(state_dir(ctx.host))
    for address in gpus(*range(1, 9)) + SWITCHES:  # as the bind journals them
        journal.devices[str(address)] = {"original_driver": "nvidia", "original_override": None,
                                         "group": inventory.functions[address].iommu_group}
    journal.save()
    switches = set(map(str, SWITCHES))
    held = binding.held(ctx, gpus(*range(1, 9)))
    assert switches <= set(held) and all(d.original_driver == "nvidia" for d in held.values())
    assert not switches & set(binding.held(ctx, gpus(1, 2, 3, 4)))  # four GPUs still need them
    persisted = binding.plan_persist(ctx, gpus(*range(1, 9)))
    assert set(SWITCHES) <= set(persisted.devices) and len(persisted.devices) == 12
    assert persisted.status is binding.PersistStatus.DRY_RUN
    unpersisted = binding.plan_persist(ctx, gpus(*range(1, 9)), remove=True)
    assert set(SWITCHES) <= set(unpersisted.devices)
    with pytest.raises(Refused, match="4 of the 8 baseboard GPUs"):
        binding.plan_persist(ctx, gpus(1, 2, 3, 4))


def test_persist_in_shared_mode_is_not_refused_for_the_fabric_managers_state(quiet_dgx):
    """Shared NVSwitch: the GPUs of a partition persist on vfio-pci (the usual boot state); that
    the Fabric Manager cannot be asked now is no reason to refuse it."""
    set_mode(quiet_dgx, 1)
    ctx = Context(host=HostRoot(quiet_dgx))
    report = binding.plan_persist(ctx, gpus(1, 2, 3, 4))
    assert report.devices == gpus(1, 2, 3, 4)


def test_verify_of_a_running_guest_wants_the_fabric_managers_driver(shared):
    """verify on a guest gpuvfio did not just plan (an existing domain, --expect-device) reads the
    fabric as attach does: a baseboard GPU in shared-NVSwitch mode needs the host FM's driver in
    the guest; a non-GPU function and full-passthrough mode need none."""
    from gpuvfio.guest.expect import expectations
    from gpuvfio.host.inventory import read_inventory
    from gpuvfio.ops.guests import fabric_driver

    ctx, _fm = shared
    inventory = read_inventory(ctx.host)
    expected = expectations(inventory, gpus(1) + SWITCHES[:1])
    got = fabric_driver(ctx, inventory, expected)
    assert [(e.address, e.driver_version) for e in got] == [(str(gpus(1)[0]), VERSION), (str(SWITCHES[0]), None)]
    set_mode(ctx.host.root, 0)
    assert [e.driver_version for e in fabric_driver(ctx, read_inventory(ctx.host), expected)] == [None, None]
