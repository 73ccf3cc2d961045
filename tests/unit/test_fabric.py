"""HGX NVSwitch fabrics (issue 14 item 5): the fabric read from a host, the decision for a guest in
each Fabric Manager mode, the fmpm client against its stand-in (tests/fakefm/fmpm), and the
journaled partition steps with their rollback.

The partition table is the FM user guide's for DGX/HGX H100 ("GPU Partitions": 0 = modules 1-8,
1 = 1-4, 2 = 5-8, 3 = 1,3, 4 = 2,4, 5 = 5,7, 6 = 6,8, 7-14 = one module each). Which bus each
module sits on is made up here, deliberately not in bus order: module ids do not follow it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.bind.fabric_manager import (FabricManagerClient, FabricManagerError, FabricManagerOutputError,
                                         FabricManagerTimeout, FabricStepError, PartitionStep, apply_partition_steps,
                                         deactivate_journaled, parse_partitions, plan_attach, plan_checks, plan_detach)
from gpuvfio.bind.journal import CorruptJournal, Journal
from gpuvfio.errors import InputError, Refused
from gpuvfio.host.fabric import NVLINK_DISABLE, Partition, PartitionGpu, fabric_decision, read_fabric
from gpuvfio.host.fixture import load_fixture
from gpuvfio.host.recording import dump_host
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.root import HostRoot
from tests.hostbuilder import BAR64_PREF, GiB, HostBuilder
from tests.make_samples import sample_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FMPM = os.path.join(REPO, "tests", "fakefm", "fmpm")
A = PciAddress.parse
SWITCHES = [A(f"0000:{b:02x}:00.0") for b in (3, 4, 5, 6)]
GPUS = [A(f"0000:{b}:00.0") for b in ("1b", "43", "52", "61", "9d", "c3", "d1", "df")]
BUS_OF_MODULE = {1: "61", 2: "52", 3: "43", 4: "1b", 5: "df", 6: "d1", 7: "c3", 8: "9d"}
MODULE = {m: A(f"0000:{b}:00.0") for m, b in BUS_OF_MODULE.items()}
H100_PARTITIONS = [(0, list(range(1, 9))), (1, [1, 2, 3, 4]), (2, [5, 6, 7, 8]), (3, [1, 3]), (4, [2, 4]),
                   (5, [5, 7]), (6, [6, 8])] + [(6 + m, [m]) for m in range(1, 9)]
VERSION = "535.104.05"


def gpus(*modules: int) -> list[PciAddress]:
    return sorted(MODULE[m] for m in modules)


def write(root, rel: str, text: str) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def set_mode(root, mode: int) -> None:
    write(root, "usr/share/nvidia/nvswitch/fabricmanager.cfg", f"# Fabric Manager\nLOG_LEVEL=4\nFABRIC_MODE={mode}\n")


@pytest.fixture(scope="module")
def dgx_tree(tmp_path_factory):
    with open(sample_path("dgx-h100"), encoding="utf-8") as handle:
        return load_fixture(handle.read(), str(tmp_path_factory.mktemp("dgx")))


@pytest.fixture
def dgx(dgx_tree):
    """The bundled dgx-h100 sample, materialised once; each test starts without the files the
    tests here write (fabricmanager.cfg, the driver version), as the sample has them."""
    for rel in ("usr/share/nvidia/nvswitch/fabricmanager.cfg", "sys/module/nvidia/version"):
        if os.path.exists(os.path.join(dgx_tree, rel)):
            os.unlink(os.path.join(dgx_tree, rel))
    return dgx_tree


def fabric_of(root, mode: int | None = None, version: str | None = VERSION, modules=None):
    if mode is not None:
        set_mode(root, mode)
    if version is not None:
        write(root, "sys/module/nvidia/version", version + "\n")
    host = HostRoot(root)
    return read_fabric(host, read_inventory(host), modules)


def table(bus_ids: bool = True, active: tuple[int, ...] = ()) -> list[Partition]:
    return [Partition(pid, pid in active, tuple(PartitionGpu(m, MODULE[m] if bus_ids else None) for m in modules))
            for pid, modules in H100_PARTITIONS]


# -- the fabric ---------------------------------------------------------------------------------
def test_fabric_of_the_dgx_sample(dgx):
    """4 NVSwitches, 8 H100 SXM5; the sample records no fabricmanager.cfg (FABRIC_MODE unset: FM's
    default 0) and no driver version, and its nv-fabricmanager runs (pid 2391)."""
    host = HostRoot(dgx)
    fabric = read_fabric(host, read_inventory(host))
    assert fabric.present and fabric.nvswitches == SWITCHES and fabric.gpus == GPUS and fabric.others == []
    assert fabric.mode is None and fabric.effective_mode == 0 and fabric.baseboard_by == "device id"
    assert fabric.fm_running and fabric.fm_version is None
    assert any("taken as FABRIC_MODE=0" in n for n in fabric.notes)
    data = fabric.to_json()
    assert data["mode_name"] == "bare metal / full passthrough" and len(data["nvswitches"]) == 4
    json.dumps(data)


def test_mode_and_fabric_manager_version_from_the_root(dgx):
    fabric = fabric_of(dgx, 1)
    assert fabric.mode == 1 and fabric.fm_version == VERSION and fabric.to_json()["mode_name"] == "shared NVSwitch"
    write(dgx, "sys/module/nvidia/version", "535.104.05; rm -rf /\n")
    fabric = fabric_of(dgx, 1, version=None)
    assert fabric.fm_version is None and any("not a driver version" in n for n in fabric.notes)


def test_dump_host_records_the_driver_version(dgx, tmp_path):
    write(dgx, "sys/module/nvidia/version", VERSION + "\n")
    set_mode(dgx, 1)
    again = load_fixture(dump_host(HostRoot(dgx)), str(tmp_path / "again"))
    host = HostRoot(again)
    fabric = read_fabric(host, read_inventory(host))
    assert fabric.mode == 1 and fabric.fm_version == VERSION


def _small_host(root, gpu_ids: list[tuple[str, str, str]], nvswitch: bool = True) -> HostRoot:
    b = HostBuilder(str(root))
    b.iommu("intel", 1)
    b.numa_node(0, b.cpu_topology(1, 4, 2)[0], 16)
    rb = b.root_bus(numa=0)
    if nvswitch:
        b.function(rb, "0000:00:02.0", "10de", "22a3", "068000", driver="nvidia")
    for address, device, klass in gpu_ids:
        b.function(rb, address, "10de", device, klass, driver="nvidia", bars=[(1, 64 * GiB, BAR64_PREF)])
    return HostRoot(b.root)


def test_pcie_cards_are_not_on_the_baseboard(tmp_path):
    host = _small_host(tmp_path / "h", [("0000:00:03.0", "2330", "030200"), ("0000:00:04.0", "27b8", "030200")])
    fabric = read_fabric(host, read_inventory(host))
    assert fabric.gpus == [A("0000:00:03.0")] and fabric.others == [A("0000:00:04.0")]
    decision = fabric_decision(fabric, [A("0000:00:04.0")], None)
    assert decision.kind == "none"  # a PCIe card on an HGX host: no fabric business


def test_unknown_sxm_part_falls_back_to_3d_controllers(tmp_path):
    host = _small_host(tmp_path / "h", [("0000:00:03.0", "2901", "030200"), ("0000:00:04.0", "2901", "030200")])
    fabric = read_fabric(host, read_inventory(host))
    assert fabric.baseboard_by == "class" and len(fabric.gpus) == 2 and fabric.notes


def test_no_nvswitch_no_fabric(tmp_path):
    host = _small_host(tmp_path / "h", [("0000:00:03.0", "2330", "030200")], nvswitch=False)
    fabric = read_fabric(host, read_inventory(host))
    assert not fabric.present and fabric.gpus == [] and fabric.others == [A("0000:00:03.0")]
    decision = fabric_decision(fabric, [A("0000:00:03.0")], None)
    assert decision.kind == "none" and not decision.refused and decision.add_devices == []


# -- decisions -----------------------------------------------------------------------------------
def test_full_passthrough_takes_all_gpus_and_the_nvswitches(dgx):
    decision = fabric_decision(fabric_of(dgx, 0), GPUS, None).check()
    assert decision.kind == "full_passthrough" and decision.add_devices == SWITCHES and decision.partition is None
    assert any(line.status == "warn" and "--stop-services" in line.message for line in decision.lines)
    with_switches = fabric_decision(fabric_of(dgx, 0), GPUS + SWITCHES[:2], None)
    assert with_switches.add_devices == SWITCHES[2:]


def test_full_passthrough_without_a_config_is_mode_0(dgx):
    decision = fabric_decision(fabric_of(dgx, None), GPUS, None)
    assert decision.kind == "full_passthrough" and "no FABRIC_MODE (default 0)" in decision.lines[0].message


def test_four_of_eight_in_full_passthrough_is_refused_naming_the_mode(dgx):
    decision = fabric_decision(fabric_of(dgx, 0), GPUS[:4], None)
    assert decision.refused and decision.add_devices == []
    message = decision.message
    assert "4 of the 8 baseboard GPUs" in message and "FABRIC_MODE=0" in message
    assert "use FABRIC_MODE=1 (shared NVSwitch) with a Fabric Manager partition" in message
    assert all(str(a) in message for a in GPUS[4:])
    with pytest.raises(Refused) as info:
        decision.check()
    assert info.value.report["fabric"]["kind"] == "refused"
    assert [c.status for c in plan_checks(decision)] == ["refuse"]


def test_nvswitches_alone_are_refused(dgx):
    assert fabric_decision(fabric_of(dgx, 0), SWITCHES, None).refused
    decision = fabric_decision(fabric_of(dgx, 1), [MODULE[1], SWITCHES[0]], table())
    assert decision.refused and "stay with the host's Fabric Manager" in decision.message


def test_single_gpu_without_a_partition_needs_nvlink_off(dgx):
    decision = fabric_decision(fabric_of(dgx, 0), [GPUS[0]], None).check()
    assert decision.kind == "single_gpu" and decision.guest_module_options == [NVLINK_DISABLE]
    assert decision.to_json()["guest_module_options"] == {"nvidia": ["NVreg_NvLinkDisable=1"]}
    assert "error 802" in decision.lines[0].message and decision.lines[0].status == "warn"
    no_singles = [p for p in table() if len(p.gpus) > 1]
    decision = fabric_decision(fabric_of(dgx, 1), [MODULE[5]], no_singles).check()
    assert decision.kind == "single_gpu" and "no 1-GPU Fabric Manager partition" in decision.lines[0].message
    assert decision.guest_driver_version == VERSION


def test_four_gpus_of_a_partition_in_shared_mode(dgx):
    decision = fabric_decision(fabric_of(dgx, 1), gpus(1, 2, 3, 4), table()).check()
    assert decision.kind == "partition" and decision.partition.partition_id == 1
    assert decision.add_devices == [] and decision.guest_driver_version == VERSION
    assert "bind, activate the partition, start" in decision.lines[0].message
    assert any(VERSION in line.message and "verifier" in line.message for line in decision.lines)
    assert decision.to_json()["partition"]["id"] == 1
    in_bus_order = fabric_decision(fabric_of(dgx, 1), GPUS[:2], table())  # modules 4 and 3: no partition
    assert in_bus_order.refused


def test_one_gpu_matches_its_single_partition(dgx):
    decision = fabric_decision(fabric_of(dgx, 1), [MODULE[6]], table()).check()
    assert decision.kind == "partition" and decision.partition.partition_id == 12
    assert decision.guest_module_options == []


def test_three_of_eight_match_no_partition(dgx):
    decision = fabric_decision(fabric_of(dgx, 1), gpus(1, 2, 3), table())
    assert decision.refused and "not exactly one Fabric Manager partition" in decision.message
    assert "no 3-GPU partition exists (sizes: 1, 2, 4, 8)" in decision.message
    two = fabric_decision(fabric_of(dgx, 1), gpus(1, 2), table())
    assert two.refused and "partition 3 (GPU modules 1, 3" in two.message and "partition 6" in two.message


def test_shared_mode_refusals(dgx):
    fabric = fabric_of(dgx, 1)
    assert "fmpm -l" in fabric_decision(fabric, gpus(1, 2, 3, 4), None).message
    busy = fabric_decision(fabric, gpus(1, 2, 3, 4), table(active=(1,)))
    assert busy.refused and "partition 1" in busy.message and "is active" in busy.message
    overlap = fabric_decision(fabric, gpus(1, 3), table(active=(1,)))
    assert overlap.refused and "some of these GPUs" in overlap.message
    fabric.fm_running = False
    stopped = fabric_decision(fabric, gpus(1, 2, 3, 4), table())
    assert stopped.refused and "nvidia-fabricmanager is not running" in stopped.message


def test_h100_partitions_without_bus_ids_need_module_ids(dgx):
    """On HGX H100 the partition list names GPUs by module id only (FM user guide)."""
    decision = fabric_decision(fabric_of(dgx, 1), gpus(5, 6, 7, 8), table(bus_ids=False))
    assert decision.refused and "module ids 1, 2, 3, 4, 5, 6, 7, 8 have no PCI address" in decision.message
    known = fabric_of(dgx, 1, modules=MODULE)
    assert fabric_decision(known, gpus(5, 6, 7, 8), table(bus_ids=False)).partition.partition_id == 2


def test_vgpu_mode_refuses_passthrough(dgx):
    decision = fabric_decision(fabric_of(dgx, 2), GPUS, None)
    assert decision.refused and "vGPU mode: use gpuvfio vgpu" in decision.message
    assert "FABRIC_MODE=2" in decision.message


# -- the fmpm client against the stand-in --------------------------------------------------------
@pytest.fixture
def fm(tmp_path, monkeypatch):
    """The stand-in fmpm with the H100 table in shared-NVSwitch mode; returns a client maker."""
    state = tmp_path / "fm-state.json"
    parts = [{"partitionId": pid, "isActive": 0,
              "gpus": [{"physicalId": m, "pciBusId": f"00000000:{BUS_OF_MODULE[m].upper()}:00.0",
                        "uuid": f"GPU-{m:08d}-0000-0000-0000-000000000000"} for m in modules]}
             for pid, modules in H100_PARTITIONS]
    state.write_text(json.dumps({"mode": 1, "partitions": parts}))
    monkeypatch.setenv("FAKEFM_STATE", str(state))
    monkeypatch.setenv("FAKEFM_LOG", str(tmp_path / "fm.log"))
    for knob in ("FAKEFM_FAIL", "FAKEFM_HANG", "FAKEFM_LIST_OUTPUT", "FAKEFM_CONNECT_FAIL"):
        monkeypatch.delenv(knob, raising=False)

    class FM:
        log = tmp_path / "fm.log"

        @staticmethod
        def client(timeout: float = 20.0, **kw) -> FabricManagerClient:
            return FabricManagerClient([sys.executable, FMPM], timeout=timeout, **kw)

        @staticmethod
        def active() -> set[int]:
            return {p["partitionId"] for p in json.loads(state.read_text())["partitions"] if p["isActive"]}

    return FM


def test_client_lists_activates_and_deactivates(fm):
    client = fm.client()
    partitions = client.list_partitions()
    assert [p.partition_id for p in partitions] == list(range(15))
    first = partitions[1]
    assert first.module_ids == [1, 2, 3, 4] and first.addresses() == gpus(1, 2, 3, 4) and not first.active
    assert first.gpus[0].uuid.startswith("GPU-") and first.gpus[0].nvlinks == 18
    client.activate(1)
    assert fm.active() == {1}
    with pytest.raises(FabricManagerError) as info:  # active already
        client.activate(1)
    assert info.value.status == -7 and "FM_ST_IN_USE" in str(info.value)
    assert "Failed to activate partition. fmReturn: -7" in str(info.value)
    with pytest.raises(FabricManagerError) as info:  # shares modules 1 and 3
        client.activate(3)
    assert info.value.status == -7
    client.deactivate(1)
    assert fm.active() == set()
    with pytest.raises(FabricManagerError) as info:
        client.deactivate(1)
    assert info.value.status == -4


def test_client_uses_argument_lists(fm):
    client = fm.client(hostname="127.0.0.1; touch /tmp/gpuvfio-pwned")
    client.list_partitions()
    assert fm.log.read_text().splitlines()[-1] == "--hostname 127.0.0.1; touch /tmp/gpuvfio-pwned -l"
    fm.client(unix_socket="/run/fm.sock").activate(2)
    assert fm.log.read_text().splitlines()[-1] == "--unix-domain-socket /run/fm.sock -a 2"
    for bad in (64, -1, True, "3"):
        with pytest.raises(InputError):
            fm.client().activate(bad)
    with pytest.raises(InputError):
        fm.client(hostname="a\0b")
    with pytest.raises(InputError):
        FabricManagerClient(FMPM, timeout=float("nan"))


@pytest.mark.parametrize("env, status, words", [
    ({"FAKEFM_FAIL": "activate=-2"}, -2, "FM_ST_GENERIC_ERROR"),
    ({"FAKEFM_FAIL": "activate=-3"}, -3, "not in shared-NVSwitch or vGPU mode"),
    ({"FAKEFM_CONNECT_FAIL": "1"}, -9, "Failed to connect to Fabric Manager instance."),
])
def test_client_failures_say_what_fm_said(fm, monkeypatch, env, status, words):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(FabricManagerError) as info:
        fm.client().activate(1)
    assert info.value.status == status and words in str(info.value) and "\n" not in str(info.value)
    assert fm.active() == set()


def test_client_missing_command_and_mode_0(fm, tmp_path, monkeypatch):
    with pytest.raises(FabricManagerError) as info:
        FabricManagerClient(str(tmp_path / "no-fmpm")).list_partitions()
    assert "cannot run" in str(info.value)
    state = json.loads(open(os.environ["FAKEFM_STATE"]).read())
    state["mode"] = 0
    with open(os.environ["FAKEFM_STATE"], "w") as handle:
        json.dump(state, handle)
    with pytest.raises(FabricManagerError) as info:
        fm.client().list_partitions()
    assert info.value.status == -3


def test_client_runs_the_script_by_its_path(fm):
    """The path alone works too (the stand-in is executable, like fmpm)."""
    assert len(FabricManagerClient(FMPM, timeout=20).list_partitions()) == 15


def test_client_timeout(fm, monkeypatch):
    monkeypatch.setenv("FAKEFM_HANG", "list")
    started = time.monotonic()
    with pytest.raises(FabricManagerTimeout) as info:
        fm.client(timeout=0.5).list_partitions()
    assert time.monotonic() - started < 10 and "no answer within 0.5s" in str(info.value)
    assert info.value.status is None


GOOD_GPU = {"physicalId": 1, "uuid": "", "pciBusId": "", "numNvLinksAvailable": 18, "maxNumNvLinks": 18,
            "nvlinkLineRateMBps": 25781}


def _doc(**partition) -> str:
    part = {"partitionId": 0, "isActive": 0, "numGpus": 1, "gpuInfo": [dict(GOOD_GPU)]}
    part.update(partition)
    return json.dumps({"version": 1, "numPartitions": 1, "maxNumPartitions": 64, "partitionInfo": [part]})


HOSTILE = {
    "not json": b"Failed to get partition list. fmReturn: -2\n",
    "empty": b"",
    "not utf-8": b"\xff\xfe{\x00",
    "nan": _doc(isActive=float("nan")).encode(),
    "duplicate key": b'{"partitionInfo": [], "partitionInfo": []}',
    "no partitionInfo": b'{"numPartitions": 0}',
    "not an object": b"[1, 2, 3]",
    "bool as number": _doc(isActive=True).encode(),
    "float id": _doc(partitionId=1.5).encode(),
    "id out of range": _doc(partitionId=64).encode(),
    "negative": _doc(partitionId=-1).encode(),
    "huge number": _doc(partitionId=10 ** 30).encode(),
    "too many digits": ('{"partitionInfo": [], "numPartitions": ' + "9" * 5000 + "}").encode(),
    "numGpus mismatch": _doc(numGpus=2).encode(),
    "bad bus id": _doc(gpuInfo=[dict(GOOD_GPU, pciBusId="../../etc/passwd")]).encode(),
    "control characters": _doc(gpuInfo=[dict(GOOD_GPU, uuid="GPU-\x1b[31m")]).encode(),
    "uuid too long": _doc(gpuInfo=[dict(GOOD_GPU, uuid="G" * 200)]).encode(),
    "no physicalId": _doc(gpuInfo=[{"uuid": ""}]).encode(),
    "gpu twice": _doc(numGpus=2, gpuInfo=[GOOD_GPU, GOOD_GPU]).encode(),
    "deep nesting": b"[" * 100000 + b"]" * 100000,
    "too many partitions": json.dumps({"partitionInfo": [{"partitionId": 0, "gpuInfo": []}] * 65}).encode(),
    "numPartitions lies": b'{"numPartitions": 3, "partitionInfo": []}',
    "too long": b" " * (2 << 20),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_output_is_a_typed_error(fm, tmp_path, monkeypatch, kind):
    out = tmp_path / "out"
    out.write_bytes(HOSTILE[kind])
    monkeypatch.setenv("FAKEFM_LIST_OUTPUT", str(out))
    with pytest.raises(FabricManagerOutputError) as info:
        fm.client().list_partitions()
    message = str(info.value)
    assert "\n" not in message and len(message) < 400 and "\x1b" not in message


def test_partition_lists_parse():
    two = json.dumps({"numPartitions": 2, "partitionInfo": [
        {"partitionId": 3, "isActive": 1, "numGpus": 2, "gpuInfo": [
            dict(GOOD_GPU, physicalId=1, pciBusId="00000000:61:00.0"), dict(GOOD_GPU, physicalId=3)]},
        {"partitionId": 7, "isActive": 0, "numGpus": 1, "gpuInfo": [dict(GOOD_GPU, physicalId=1)]}]})
    parsed = parse_partitions(two)
    assert [p.partition_id for p in parsed] == [3, 7] and parsed[0].active and not parsed[1].active
    assert parsed[0].gpus[0].pci == A("0000:61:00.0") and parsed[0].gpus[1].pci is None
    assert parsed[0].addresses() is None and parsed[0].addresses({3: A("0000:43:00.0")}) == gpus(1, 3)
    clash = json.dumps({"partitionInfo": [
        {"partitionId": 3, "isActive": 0, "numGpus": 1, "gpuInfo": [dict(GOOD_GPU, pciBusId="00000000:61:00.0")]},
        {"partitionId": 7, "isActive": 0, "numGpus": 1, "gpuInfo": [dict(GOOD_GPU, pciBusId="00000000:1B:00.0")]}]})
    with pytest.raises(FabricManagerOutputError, match="two PCI addresses"):
        parse_partitions(clash)
    assert parse_partitions('{"partitionInfo": []}') == []


# -- journaled steps -----------------------------------------------------------------------------
@pytest.fixture
def journal(tmp_path):
    return Journal(str(tmp_path / "state"))


def _attach_steps(dgx) -> list[PartitionStep]:
    decision = fabric_decision(fabric_of(dgx, 1), gpus(1, 2, 3, 4), table())
    return plan_attach(decision)


def test_attach_activates_and_detach_deactivates(dgx, fm, journal):
    steps = _attach_steps(dgx)
    assert [s.describe() for s in steps] == [
        "activate Fabric Manager partition 1 (GPU modules 1, 2, 3, 4: "
        + ", ".join(map(str, gpus(1, 2, 3, 4))) + ")"]
    assert steps[0].undo().kind == "deactivate_partition"
    lines = []
    apply_partition_steps(journal, fm.client(), steps, lines.append)
    assert fm.active() == {1} and lines == [f"[1/1] {steps[0].describe()}: done"]
    again = Journal.load(journal.directory)
    assert again.data["partitions"]["1"]["state"] == "active"
    assert again.data["partitions"]["1"]["devices"] == [str(a) for a in gpus(1, 2, 3, 4)]
    op = again.data["operation"]
    assert op["kind"] == "fabric" and op["finished"] and [s["state"] for s in op["steps"]] == ["done"]
    assert plan_detach(again, [A("0000:9d:00.0")]) == []  # not one of its GPUs
    detach = plan_detach(again, [MODULE[2]])
    assert [s.kind for s in detach] == ["deactivate_partition"] and detach[0].partition_id == 1
    apply_partition_steps(again, fm.client(), detach)
    assert fm.active() == set() and Journal.load(journal.directory).data["partitions"] == {}
    assert plan_attach(fabric_decision(fabric_of(dgx, 0), GPUS, None)) == []


def test_refused_activation_rolls_back(dgx, fm, journal, monkeypatch):
    monkeypatch.setenv("FAKEFM_FAIL", "activate=-5")
    with pytest.raises(FabricStepError) as info:
        apply_partition_steps(journal, fm.client(), _attach_steps(dgx))
    message = str(info.value)
    assert "step 1 (activate Fabric Manager partition 1" in message and "FM_ST_TIMEOUT" in message
    assert "rolled back: nothing was activated" in message
    again = Journal.load(journal.directory)
    assert again.data["partitions"] == {} and again.data["operation"]["steps"][0]["state"] == "failed"
    assert fm.active() == set()


def test_unanswered_activation_is_undone(dgx, fm, journal, monkeypatch):
    """The stand-in activates, then does not answer: the step is uncertain, and the rollback
    deactivates what FM may have done."""
    monkeypatch.setenv("FAKEFM_HANG", "activate")
    with pytest.raises(FabricStepError) as info:
        apply_partition_steps(journal, fm.client(timeout=1.0), _attach_steps(dgx))
    assert "no answer within 1s" in str(info.value) and "rolled back: partition 1 deactivated" in str(info.value)
    again = Journal.load(journal.directory)
    assert again.data["partitions"] == {} and again.data["operation"]["steps"][0]["state"] == "uncertain"
    assert fm.active() == set()


def test_a_partition_in_the_journal_is_left_alone(dgx, fm, journal):
    """Partition 1 is journaled active (a running guest): a second attach of it fails without
    deactivating it or dropping its record."""
    apply_partition_steps(journal, fm.client(), _attach_steps(dgx))
    with pytest.raises(FabricStepError) as info:
        apply_partition_steps(journal, fm.client(), _attach_steps(dgx))
    assert "in the journal already (active)" in str(info.value) and "nothing was activated" in str(info.value)
    assert fm.active() == {1} and Journal.load(journal.directory).data["partitions"]["1"]["state"] == "active"
    assert fm.log.read_text().splitlines().count("-a 1") == 1  # FM was not asked again


def test_failed_rollback_stays_for_restore(dgx, fm, journal, monkeypatch):
    monkeypatch.setenv("FAKEFM_HANG", "activate")
    monkeypatch.setenv("FAKEFM_FAIL", "deactivate=-2")
    with pytest.raises(FabricStepError) as info:
        apply_partition_steps(journal, fm.client(timeout=1.0), _attach_steps(dgx))
    assert "rollback incomplete (partition 1:" in str(info.value) and "gpuvfio restore" in str(info.value)
    again = Journal.load(journal.directory)
    assert again.data["partitions"]["1"]["state"] == "deactivating" and fm.active() == {1}
    monkeypatch.delenv("FAKEFM_FAIL")
    monkeypatch.delenv("FAKEFM_HANG")
    assert deactivate_journaled(again, fm.client()) == {"1": (True, "deactivated")}
    assert fm.active() == set() and Journal.load(journal.directory).data["partitions"] == {}


@pytest.mark.parametrize("fm_acted", [True, False])
def test_a_crash_between_steps_is_visible_and_restored(dgx, fm, journal, fm_acted):
    """The record is written before FM is asked: after a crash the journal shows the partition
    (state activating, operation unfinished) whether or not FM activated it, and the restore
    path deactivates it (FM's "not active" answer counts as done)."""
    step = _attach_steps(dgx)[0]
    journal.data["operation"] = {"kind": "fabric", "pid": 1, "started": 0.0, "devices": list(step.devices),
                                 "steps": [dict(step.to_json(), state="running")]}
    journal.data["partitions"]["1"] = {"state": "activating", "since": 0.0, "modules": list(step.modules),
                                       "devices": list(step.devices)}
    journal.save()
    if fm_acted:
        fm.client().activate(1)
    after = Journal.load(journal.directory)  # the next run
    assert after.data["partitions"]["1"]["state"] == "activating" and "finished" not in after.data["operation"]
    assert [s.partition_id for s in plan_detach(after)] == [1]
    assert deactivate_journaled(after, fm.client()) == {"1": (True, "deactivated")}
    assert fm.active() == set() and Journal.load(journal.directory).data["partitions"] == {}


def test_failed_deactivation_stays_in_the_journal(dgx, fm, journal, monkeypatch):
    apply_partition_steps(journal, fm.client(), _attach_steps(dgx))
    monkeypatch.setenv("FAKEFM_FAIL", "deactivate=-2")
    with pytest.raises(FabricStepError) as info:
        apply_partition_steps(journal, fm.client(), plan_detach(journal))
    assert "stays in the journal for gpuvfio restore" in str(info.value)
    assert Journal.load(journal.directory).data["partitions"]["1"]["state"] == "deactivating"


@pytest.mark.parametrize("record", [
    {"99": {"state": "active"}},
    {"x": {"state": "active"}},
    {"1": {"state": "on"}},
    {"1": {"state": "active", "devices": ["not-an-address"]}},
    {"1": {"state": "active", "modules": [True]}},
    {"1": {"state": "active", "extra": 1}},
    [],
])
def test_journal_refuses_bad_partition_records(journal, record):
    journal.save()
    data = json.loads(open(journal.path).read())
    data["partitions"] = record
    with open(journal.path, "w") as handle:
        json.dump(data, handle)
    with pytest.raises(CorruptJournal):
        Journal.load(journal.directory)
