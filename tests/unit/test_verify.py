"""Host-side verification logic: probe parsing, verifier output, checks from facts."""

import json
import os
import subprocess
import sys

import pytest

from gpuvfio.guest.checks import evaluate
from gpuvfio.guest.expect import HEALTHY, LANE_GBPS, RAW_SHARE, Expected, Gates, gates, parse_expect
from gpuvfio.guest.payload import PROBE, VERIFIER
from gpuvfio.guest.verify import VerifyError, parse_probe, parse_verifier
from gpuvfio.errors import InputError
from tests.conftest import gpu_workstation

H100 = Expected("0000:1b:00.0", "10de", "2330", "030200", 5, 16, "0000:1b:00.0 Gen5 x16")
AUDIO = Expected("0000:1b:00.1", "10de", "22bb", "040300", None, None)


def probe_text(pci_lines, python="/usr/bin/python3", dmesg=()):
    return "\n".join(["GPUVFIO-PROBE 1", "KERNEL 6.8.0", f"PYTHON3 {python}", *pci_lines,
                      "MODULE nvidia 1", "NVIDIA-VERSION NVRM version: 550.54", *(f"DMESG {d}" for d in dmesg),
                      "END"]) + "\n"


GPU_LINE = "PCI|0000:01:00.0|0x10de|0x2330|0x030200|nvidia|32.0 GT/s PCIe|16|32.0 GT/s PCIe|16|0000:00:02.0"
AUDIO_LINE = "PCI|0000:01:00.1|0x10de|0x22bb|0x040300|snd_hda_intel|-|-|-|-|0000:00:02.0"


def gpu_line(bus, device="2330", driver="nvidia", function=0, klass="0x030200"):
    return f"PCI|0000:{bus:02x}:00.{function}|0x10de|0x{device}|{klass}|{driver}|-|-|-|-|-"


def measured(h2d=50.0, d2h=49.0, gen=5, width=16, verified=True):
    def one(v):
        return {"median": v, "samples": [v]}
    return {"h2d": one(h2d), "d2h": one(d2h), "d2d": one(1500.0), "bidir_h2d": one(h2d * 0.9),
            "bidir_d2h": one(d2h * 0.9), "bidir_total": one((h2d + d2h) * 0.9), "verified": verified,
            "mismatches": {"h2d": 0 if verified else 3, "d2d": 0, "d2h": 0, "bidir": 0},
            "link_under_load": {"current_gen": gen, "current_width": width, "max_gen": 5, "max_width": 16}}


def verifier_data(buses=("0000:01:00.0",), cuda=True, nvml=True, mig=False, errors=None, p2p=None, nccl=None,
                  **bw):
    devices = [{"name": "NVIDIA H100", "bus_id": "0000" + b, "virtualization_mode": "Pass-Through", "mig": mig,
                "link_idle": {"current_gen": 1, "current_width": 16, "max_gen": 5, "max_width": 16}} for b in buses]
    return {"version": 2, "method": {}, "errors": dict(errors or {}),
            "nvml": {"driver_version": "550.54", "cuda_driver_version": 12040, "devices": devices} if nvml else None,
            "cuda": {"driver_version": 12040, "devices": [{"index": i, "name": "NVIDIA H100", "bus_id": b}
                                                          for i, b in enumerate(buses)]} if cuda else None,
            "bandwidth": {b: measured(**bw) for b in buses} if cuda else {},
            "latency": {b: {"hops": 10, "samples_us": [1.9], "median_us": 1.9} for b in buses} if cuda else {},
            "copy_overhead": {}, "compute": {b: {"launch_ms": 0.19, "verified": True} for b in buses} if cuda else {},
            "p2p": p2p, "nccl": nccl}


def verifier_json(**kwargs):
    return "noise\nGPUVFIO-VERIFIER " + json.dumps(verifier_data(**kwargs)) + "\n"


def statuses(report):
    return {c["id"]: c["status"] for c in report["checks"]}


def all_statuses(report, check_id):
    return [c["status"] for c in report["checks"] if c["id"] == check_id]


def test_full_pass():
    report = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json()), [H100])
    assert statuses(report) == {"pci_present": "pass", "driver": "pass", "nvml": "pass", "cuda": "pass",
                                "pcie_link": "pass", "h2d_bandwidth": "pass", "d2h_bandwidth": "pass",
                                "bidir_bandwidth": "pass", "data_verified": "pass", "compute": "pass"}
    assert report["ok"] and report["bandwidth_gbps"]["0000:01:00.0"]["h2d"] == 50.0
    present = report["checks"][0]
    assert present["observed"] == "0000:01:00.0 (under 0000:00:02.0)" and present["device"] == "0000:1b:00.0"


def test_slow_link_and_low_bandwidth_fail():
    report = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json(h2d=20.0, gen=4)), [H100])
    got = statuses(report)
    assert got["pcie_link"] == "fail" and got["h2d_bandwidth"] == "fail" and got["d2h_bandwidth"] == "pass"
    link = next(c for c in report["checks"] if c["id"] == "pcie_link")
    assert link["expected"] == "Gen5 x16" and link["observed"] == "Gen4 x16"
    assert not report["ok"]


def test_a_gen5_gpu_in_a_gen4_slot_is_judged_by_the_slot():
    """The ceiling is the host slot's capability, not the device's maximum (on main a Gen5 GPU
    in a Gen4 slot failed both link and bandwidth)."""
    in_gen4 = Expected("0000:1b:00.0", "10de", "2330", "030200", 4, 16, "slot Gen4 x16")
    report = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json(h2d=26.0, d2h=25.5, gen=4)),
                      [in_gen4])
    got = statuses(report)
    assert got["pcie_link"] == "pass" and got["h2d_bandwidth"] == "pass", report["checks"]
    floor = next(c for c in report["checks"] if c["id"] == "h2d_bandwidth")["expected"]
    assert floor == ">= 21.5 GB/s (90% of the 23.9 GB/s healthy Gen4 x16 cards measure)"


def test_gen5_x16_floor_is_near_the_clouds_48_gbps_and_can_be_overridden():
    assert round(Gates().floor(5, 16), 1) == 47.7
    report = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json(h2d=45.0)), [H100],
                      gates=gates(min_gbps=40.0))
    assert statuses(report)["h2d_bandwidth"] == "pass"
    report = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json(h2d=45.0)), [H100],
                      gates=gates(link_efficiency=0.9))
    assert statuses(report)["h2d_bandwidth"] == "fail"


def test_a_healthy_gen3_card_passes_and_a_halved_link_fails():
    """A T4 in a Gen3 x16 slot measuring what healthy Gen3 cards measure (12-13 GB/s) passes;
    76.2 % of the raw rate put the floor at 12.0 GB/s and failed it (issue 37)."""
    t4 = Expected("0000:1b:00.0", "10de", "1eb8", "030200", 3, 16, "slot Gen3 x16")
    t4_line = GPU_LINE.replace("0x2330", "0x1eb8").replace("32.0 GT/s", "8.0 GT/s")
    report = evaluate(parse_probe(probe_text([t4_line])),
                      parse_verifier(verifier_json(h2d=11.9, d2h=12.6, gen=3)), [t4])
    got = statuses(report)
    assert (got["pcie_link"], got["h2d_bandwidth"], got["d2h_bandwidth"]) == ("pass", "pass", "pass"), report
    report = evaluate(parse_probe(probe_text([t4_line])),
                      parse_verifier(verifier_json(h2d=10.7, d2h=12.6, gen=3)), [t4])
    assert statuses(report)["h2d_bandwidth"] == "fail"


@pytest.mark.parametrize("gen", sorted(HEALTHY))
def test_each_measured_floor_passes_healthy_cards_and_fails_half_a_link(gen):
    """Each generation's floor sits below the low end of what healthy cards measure and above
    what the link carries at half its width (a slot trained down to x8) or one generation
    lower, at any width."""
    healthy = HEALTHY[gen].x16_gbps
    for width in (16, 8, 4, 2, 1):
        floor = Gates().floor(gen, width)
        assert floor < healthy * width / 16 < LANE_GBPS[gen] * width
        assert LANE_GBPS[gen] * width / 2 < floor and LANE_GBPS[gen - 1] * width < floor
    assert f"{healthy:g}" in HEALTHY[gen].source  # the floor comes from the cited runs


def test_unmeasured_generations_and_explicit_shares_use_the_raw_rate():
    assert Gates().floor(6, 16) == pytest.approx(RAW_SHARE * LANE_GBPS[6] * 16)
    assert Gates().floor(2, 8) == pytest.approx(RAW_SHARE * 4.0)
    assert RAW_SHARE == pytest.approx(Gates().floor(5, 16) / (LANE_GBPS[5] * 16))
    assert gates(link_efficiency=0.9).floor(3, 16) == pytest.approx(0.9 * LANE_GBPS[3] * 16)
    assert Gates().to_json() == (">= 90% per direction of what healthy cards of the host slot's generation "
                                 "measure, scaled to its width (Gen3 x16 10.8 GB/s, Gen4 x16 21.5 GB/s, Gen5 x16 "
                                 "47.7 GB/s); other generations 75.7% of the raw rate")
    assert gates(link_efficiency=0.8).to_json() == ">= 80.0% of each GPU's host slot link per direction"
    assert gates(min_gbps=20).to_json() == ">= 20 GB/s per direction (--min-gbps)"


@pytest.mark.parametrize("kwargs", [{"link_efficiency": 0}, {"link_efficiency": float("nan")},
                                    {"link_efficiency": 1.5}, {"min_gbps": -1}, {"min_gbps": float("inf")}])
def test_bad_gates_are_input_errors(kwargs):
    with pytest.raises(InputError):
        gates(**kwargs)


def test_missing_device_and_driver():
    other = "PCI 0000:00:02.0 0x1af4 0x1041 0x020000 virtio-pci - - - -"
    report = evaluate(parse_probe(probe_text([other])), None, [H100])
    got = statuses(report)
    assert got["pci_present"] == "fail" and got["driver"] == "fail" and not report["ok"]


def test_no_python_fails_closed():
    """An NVIDIA GPU was assigned and nothing could check CUDA: a failure, not a skip."""
    report = evaluate(parse_probe(probe_text([GPU_LINE], python="none")), None, [H100])
    cuda = next(c for c in report["checks"] if c["id"] == "cuda")
    assert cuda["status"] == "fail" and "no python3" in cuda["reason"] and not report["ok"]


def test_a_dead_gpu_fails_with_the_guests_own_words():
    """The large-BAR failure: the driver loads, probe -1, no CUDA device. On main: skip, ok."""
    dmesg = ["NVRM: BAR1 is 0M @ 0x0 (PCI:0000:01:00.0)", "nvidia: probe of 0000:01:00.0 failed with error -1"]
    data = verifier_json(cuda=False, nvml=False, errors={
        "nvml": "nvmlInit_v2 returned NVML error 9 (Driver Not Loaded)",
        "cuda": "cuInit failed: CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)"})
    report = evaluate(parse_probe(probe_text([gpu_line(1, driver="-")], dmesg=dmesg)), parse_verifier(data), [H100])
    got = statuses(report)
    assert got["driver"] == "fail" and got["nvml"] == "fail" and got["cuda"] == "fail" and not report["ok"]
    cuda = next(c for c in report["checks"] if c["id"] == "cuda")
    assert "CUDA_ERROR_NO_DEVICE" in cuda["reason"] and "probe of 0000:01:00.0 failed" in cuda["reason"]
    assert all(c["status"] == "fail" for c in report["checks"] if c["id"].endswith("_bandwidth"))


def test_hdmi_audio_is_only_present_and_does_not_double_cuda():
    """The RTX 4090 sample on main: the audio function got a driver check and doubled CUDA's count."""
    expected = [H100,
                Expected("0000:1b:00.1", "10de", "22bb", "040300", None, None)]
    report = evaluate(parse_probe(probe_text([GPU_LINE, AUDIO_LINE])), parse_verifier(verifier_json()), expected)
    assert all_statuses(report, "pci_present") == ["pass", "pass"]
    assert all_statuses(report, "driver") == ["pass"] and all_statuses(report, "cuda") == ["pass"]
    assert report["ok"]


def test_four_identical_gpus_need_four():
    """pci_present matched by vendor:device on main: one visible GPU satisfied four."""
    four = [Expected(f"0000:{b:02x}:00.0", "10de", "2330", "030200", 5, 16, "x") for b in (0x1b, 0x2b, 0x3b, 0x4b)]
    one_visible = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json()), four)
    assert all_statuses(one_visible, "pci_present") == ["pass", "fail", "fail", "fail"] and not one_visible["ok"]
    buses = [f"0000:{b:02x}:00.0" for b in range(1, 5)]
    lines = [gpu_line(b) for b in range(1, 5)]
    two_cuda = verifier_data(buses=buses)
    two_cuda["cuda"]["devices"] = two_cuda["cuda"]["devices"][:2]
    report = evaluate(parse_probe(probe_text(lines)), parse_verifier("GPUVFIO-VERIFIER " + json.dumps(two_cuda)),
                      four)
    cuda = next(c for c in report["checks"] if c["id"] == "cuda")
    assert cuda["status"] == "fail" and cuda["observed"] == 2 and "2 of the 4" in cuda["reason"]


def test_slots_match_as_slots():
    """A GPU and its audio function are one slot in the guest too; with two such slots, each
    host slot takes one whole guest slot."""
    expected = [Expected("0000:1b:00.0", "10de", "2330", "030200", None, None),
                Expected("0000:1b:00.1", "10de", "22bb", "040300", None, None),
                Expected("0000:2b:00.0", "10de", "2330", "030200", None, None),
                Expected("0000:2b:00.1", "10de", "22bb", "040300", None, None)]
    lines = [gpu_line(1), gpu_line(1, "22bb", "snd_hda_intel", 1, "0x040300"),
             gpu_line(2), gpu_line(2, "22bb", "snd_hda_intel", 1, "0x040300")]
    report = evaluate(parse_probe(probe_text(lines)), None, expected)
    seen = [c["observed"] for c in report["checks"] if c["id"] == "pci_present"]
    assert seen == ["0000:01:00.0", "0000:01:00.1", "0000:02:00.0", "0000:02:00.1"]


def test_expected_verdicts_say_why():
    vgpu_b = Expected("0000:1b:00.4", "10de", "2236", "030200", 4, 16, "x", "NVIDIA A10-4B")
    report = evaluate(parse_probe(probe_text([gpu_line(1, "2236")])),
                      parse_verifier(verifier_json(cuda=False, errors={"cuda": "cuInit failed: CUDA_ERROR_NOT_SUPPORTED"})),
                      [vgpu_b])
    cuda = next(c for c in report["checks"] if c["id"] == "cuda")
    assert cuda["status"] == "expected" and "B-series" in cuda["reason"] and report["ok"]
    mig = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json(cuda=False, mig=True, errors={
        "cuda": "cuDeviceGetCount: 0"})), [H100])
    cuda = next(c for c in mig["checks"] if c["id"] == "cuda")
    assert cuda["status"] == "expected" and "MIG" in cuda["reason"]


def test_expect_by_ids():
    assert [e.device_id for e in parse_expect(["10de:2335x4", "10DE:22BB"])] == ["2335"] * 4 + ["22bb"]
    assert parse_expect(["10de:2335"])[0].kind == "gpu" and parse_expect(["8086:1234"])[0].kind == "present"
    for bad in ("10de", "10de:2335x0", "10de:2335x65", "10de:23351", "x:y", ""):
        with pytest.raises(InputError):
            parse_expect([bad])


def test_not_observable_link_is_not_a_failure():
    """--expect gives no host slot: the link is reported, not judged; the floor comes from the
    link the GPU itself negotiated (NVML reads the GPU's own register, not an emulated port)."""
    report = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json()), parse_expect(["10de:2330"]))
    got = statuses(report)
    assert got["pcie_link"] == "skip" and got["h2d_bandwidth"] == "pass" and report["ok"]


def test_data_corruption_fails():
    report = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json(verified=False)), [H100])
    assert statuses(report)["data_verified"] == "fail"


def test_peer_checks_with_two_gpus():
    two = [Expected(f"0000:{b:02x}:00.0", "10de", "2330", "030200", 5, 16, "x") for b in (0x1b, 0x2b)]
    buses = ["0000:01:00.0", "0000:02:00.0"]
    lines = [gpu_line(1), gpu_line(2)]
    good = {"bus_ids": buses, "access": [[False, True], [True, False]],
            "bandwidth": {"0000:01:00.0->0000:02:00.0": {"median": 40.0, "samples": [40.0], "verified": True},
                          "0000:02:00.0->0000:01:00.0": {"median": 41.0, "samples": [41.0], "verified": True}}}
    nccl = {"version": 22304, "devices": 2, "results": [{"bytes": 8 << 20, "busbw_gbps": 30.0, "verified": True}]}
    report = evaluate(parse_probe(probe_text(lines)), parse_verifier(verifier_json(buses=buses, p2p=good, nccl=nccl)),
                      two)
    assert statuses(report)["p2p"] == "pass" and statuses(report)["nccl_allreduce"] == "pass" and report["ok"]
    wrong = json.loads(json.dumps(good))
    wrong["bandwidth"]["0000:01:00.0->0000:02:00.0"]["verified"] = False
    report = evaluate(parse_probe(probe_text(lines)), parse_verifier(verifier_json(
        buses=buses, p2p=wrong, errors={"nccl": "libnccl.so.2 not found: no such file"})), two)
    assert statuses(report)["p2p"] == "fail" and statuses(report)["nccl_allreduce"] == "skip"


def nccl_with(topology):
    nccl = {"version": 22304, "devices": 2, "results": [{"bytes": 8 << 20, "busbw_gbps": 30.0, "verified": True}]}
    return nccl if topology is None else dict(nccl, topology=topology)


def topology_checks(topology):
    two = [Expected(f"0000:{b:02x}:00.0", "10de", "2330", "030200", 5, 16, "x") for b in (0x1b, 0x2b)]
    buses = ["0000:01:00.0", "0000:02:00.0"]
    data = verifier_json(buses=buses, p2p={"bus_ids": buses, "access": [[False, False], [False, False]],
                                           "bandwidth": {}}, nccl=nccl_with(topology))
    report = evaluate(parse_probe(probe_text([gpu_line(1), gpu_line(2)])), parse_verifier(data), two)
    return report, [c for c in report["checks"] if c["id"] == "nccl_topology"]


def test_nccls_view_beside_the_files_is_a_warning_where_they_differ():
    link = {"link_speed": "16.0 GT/s PCIe", "link_width": "16"}
    same = {"file": "/etc/gpuvfio/nccl-topo.xml", "source": "gpuvfio", "error": None,
            "planned": {"0000:01:00.0": link, "0000:02:00.0": link}, "nccl": {"0000:01:00.0": link,
                                                                           "0000:02:00.0": dict(link, nvlink=4)}}
    report, (view,) = topology_checks(same)
    assert view["status"] == "pass" and view["expected"] == ("0000:01:00.0 16.0 GT/s PCIe x16, "
                                                            "0000:02:00.0 16.0 GT/s PCIe x16")
    assert view["observed"].endswith("0000:02:00.0 16.0 GT/s PCIe x16 +4 NVLink")
    assert report["facts"]["nccl"]["topology"] == same  # both views in the JSON, as the guest gave them
    other = dict(same, nccl={"0000:01:00.0": dict(link, link_width="8"), "0000:02:00.0": link})
    report, (view,) = topology_checks(other)
    assert view["status"] == "warn" and report["ok"]
    assert "0000:01:00.0 link_width '8', the file '16'" in view["reason"] and "/etc/gpuvfio/nccl-topo.xml" in view["reason"]
    report, (view,) = topology_checks(dict(same, nccl=None, error="NCCL wrote no topology dump (x)"))
    assert view["status"] == "warn" and view["reason"] == "NCCL wrote no topology dump (x)" and report["ok"]
    report, (view,) = topology_checks(dict(same, file=None, source=None, planned=None))
    assert view["status"] == "skip"


def test_a_verifier_from_before_the_view_gets_no_topology_check():
    """Recorded runs and older verifiers have no nccl.topology: nothing is judged from it."""
    report, views = topology_checks(None)
    assert views == [] and report["ok"]


def test_no_devices_assigned():
    report = evaluate(parse_probe(probe_text([])), None, [])
    assert set(statuses(report).values()) == {"skip"} and report["ok"]


def test_a_verifier_that_failed_is_a_failed_check():
    report = evaluate(parse_probe(probe_text([GPU_LINE])), None, [H100], verifier_problem="it printed no result")
    assert statuses(report)["cuda"] == "fail" and not report["ok"]


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(errors=[]), lambda d: d.update(cuda={"devices": "x"}),
    lambda d: d["bandwidth"]["0000:01:00.0"]["h2d"].update(median="fast"),
    lambda d: d["bandwidth"].update({"x": 1}), lambda d: d.update(p2p={"bandwidth": {"a": {"median": None}}}),
    lambda d: d.update(nccl={"results": [{"bytes": 1}]}),
    lambda d: d.update(p2p={"bandwidth": {"a->b": {"error": "", "verified": True}}}),
    lambda d: d.update(p2p={"bandwidth": {"a->b": {"error": None, "verified": True, "median": "x"}}}),
    lambda d: d["nvml"]["devices"][0].update(link_idle={"current_gen": "5"}),
    lambda d: d.update(nccl={"results": [], "topology": []}),
    lambda d: d.update(nccl={"results": [], "topology": {"file": 1}}),
    lambda d: d.update(nccl={"results": [], "topology": {"nccl": {"0000:01:00.0": {"link_width": 16}}}}),
    lambda d: d.update(nccl={"results": [], "topology": {"planned": {"0000:01:00.0": "x"}}}),
    lambda d: d.update(nccl={"results": [], "topology": {"nccl": {"b": {"nvlink": "many"}}}})])
def test_malformed_verifier_answers_are_refused(mutate):
    data = verifier_data()
    mutate(data)
    with pytest.raises(VerifyError):
        parse_verifier("GPUVFIO-VERIFIER " + json.dumps(data))


def test_nan_from_the_guest_is_refused():
    text = verifier_json().replace('"median": 50.0', '"median": NaN', 1)
    with pytest.raises(VerifyError, match="NaN is not a JSON number"):
        parse_verifier(text)


def test_a_repeated_key_from_the_guest_is_refused():
    """Python's json keeps the last of two equal keys: a guest could hide a failed value behind a
    passing one. The one strict reader (gpuvfio.strictjson) refuses it."""
    text = verifier_json().replace('{"version": ', '{"version": 0, "version": ', 1)
    assert text != verifier_json()
    with pytest.raises(VerifyError, match="appears twice"):
        parse_verifier(text)


@pytest.mark.parametrize("text", ["", "hello\n", "GPUVFIO-PROBE 1\nKERNEL x\n",
                                  "GPUVFIO-PROBE 1\nPCI 0000:01:00.0 broken\nEND\n"])
def test_garbage_probe(text):
    with pytest.raises(VerifyError):
        parse_probe(text)


@pytest.mark.parametrize("line, what", [
    (GPU_LINE.replace("0000:01:00.0", "0000:01:00.0.1", 1), "address"),  # split and rsplit would differ
    (GPU_LINE.replace("0000:01:00.0", "0000:01:00.0\u202e", 1), "address"),
    (GPU_LINE.replace("0000:01:00.0", "x:y:z.w", 1), "address"),
    (GPU_LINE.replace("0000:01:00.0", "0000:01:20.0", 1), "address"),  # slots are 0-31
    (GPU_LINE.replace("0000:00:02.0", "pci0000:00", 1), "address"),  # the upstream bridge, too
    (GPU_LINE.replace("0x10de", "0x10de\x1b[2J", 1), "ids"),
    (GPU_LINE.replace("0x030200", "0x0302", 1), "ids"),
])
def test_a_probe_line_must_name_a_pci_function_as_a_kernel_prints_it(line, what):
    """The guest's addresses and ids are matched against the plan (slots, functions): a guest
    that says anything else is refused, not matched by whatever split happens to cut it."""
    with pytest.raises(VerifyError, match=f"malformed PCI {what} from the guest probe"):
        parse_probe(probe_text([line]))
    assert parse_probe(probe_text([GPU_LINE.replace("0000:01:00.0", "10000:01:1F.7", 1)]))["pci"][0]["address"] \
        == "10000:01:1f.7"  # a domain past 0xffff (VMD), upper-case hex: lower-cased


@pytest.mark.parametrize("text", ["", "GPUVFIO-VERIFIER {not json\n", 'GPUVFIO-VERIFIER {"version": 9}\n',
                                  'GPUVFIO-VERIFIER {"version": 1}\n'])
def test_garbage_verifier(text):
    with pytest.raises(VerifyError):
        parse_verifier(text)


@pytest.mark.parametrize("shell", [["/usr/bin/busybox", "sh"], ["/usr/bin/dash"], ["sh"]])
def test_probe_runs_in_posix_shells_against_a_tree(tmp_path, shell):
    if not os.path.exists(shell[0]) and shell[0] != "sh":
        pytest.skip(f"{shell[0]} not installed")
    b = gpu_workstation(tmp_path / "host")
    out = subprocess.run(shell + [PROBE], capture_output=True, text=True, check=True,
                         env={"GPUVFIO_PROBE_ROOT": b.root, "PATH": "/usr/bin:/bin"}).stdout
    facts = parse_probe(out)
    gpu = next(p for p in facts["pci"] if p["address"] == "0000:01:00.0")
    assert (gpu["vendor_id"], gpu["device_id"], gpu["driver"]) == ("10de", "2684", "nvidia")
    assert gpu["link"]["current_speed"] == "16.0 GT/s PCIe" and gpu["link"]["current_width"] == "16"
    assert "nvidia" in facts["modules"]


def test_verifier_runs_here_without_a_gpu():
    """The real verifier on this GPU-less machine: no NVML, no libcuda, said so."""
    out = subprocess.run([sys.executable, VERIFIER], capture_output=True, text=True, check=True).stdout
    data = parse_verifier(out)
    assert data["nvml"] is None and data["cuda"] is None
    assert "libnvidia-ml.so.1" in data["errors"]["nvml"] and "libcuda.so.1" in data["errors"]["cuda"]


def test_probe_fits_a_dropbear_command_line():
    """The probe travels as sh -c's argument; dropbear refuses commands over 9000 bytes."""
    import shlex

    from gpuvfio.guest.payload import PROBE
    from gpuvfio.guest.verify import probe_argv

    with open(PROBE, encoding="utf-8") as handle:
        assert len(shlex.join(probe_argv(handle.read())).encode()) < 8000


def test_banner_poll_says_why_a_server_is_not_ready():
    """While a guest boots, QEMU's user networking accepts and closes at once: not ready. The
    reasons differ and are said (on main every one read "no SSH banner yet")."""
    import socket
    import threading

    from gpuvfio.guest.ssh import banner_state

    def serve(greeting: bytes):
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(1)

        def accept_once():
            conn, _ = server.accept()
            conn.sendall(greeting)
            conn.close()
            server.close()

        threading.Thread(target=accept_once, daemon=True).start()
        return server.getsockname()[1]

    assert banner_state("127.0.0.1", serve(b"SSH-2.0-dropbear_2022.83\r\n")) is None
    assert "closed before an SSH banner" in banner_state("127.0.0.1", serve(b""))
    assert banner_state("127.0.0.1", serve(b"HTTP/1.1 400 Bad Request\r\n")).startswith(
        "not an SSH server (it sent 'HTTP/1.1 400 Bad Requ")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    assert banner_state("127.0.0.1", port) == "connection refused"
    assert "not resolved" in banner_state("no-such-host.invalid", 22)


def test_ssh_errors_say_which(cli, tmp_path):
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)

    def http():
        for _ in range(5):
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.close()

    threading.Thread(target=http, daemon=True).start()
    try:
        result = cli("verify", "--ssh-host", "127.0.0.1", "--ssh-port", str(server.getsockname()[1]),
                     "--timeout", "5")
    finally:
        server.close()
    assert result.code == 1 and "not an SSH server" in result.err
    refused = cli("verify", "--ssh-host", "127.0.0.1", "--ssh-port", "1", "--timeout", "0.5")
    assert refused.code == 1 and "connection refused" in refused.err
    zero = cli("verify", "--ssh-host", "127.0.0.1", "--ssh-port", "0")
    assert zero.code == 2 and "--ssh-port must be from 1 to 65535" in zero.err  # on main 0 silently became 22


@pytest.mark.parametrize("args, words", [
    (["--expect", "10de"], "--expect takes VENDOR:DEVICE"), (["--expect", "10de:2335x0"], "count must be 1-64"),
    (["--link-efficiency", "nan"], "'nan' is not a number"),
    (["--link-efficiency", "1.5"], "--link-efficiency must be from 0.01 to 1"),
    (["--min-gbps", "-1"], "--min-gbps must be from 0.001"), (["--min-gbps", "inf"], "'inf' is not a number"),
    (["--min-gbps", "1e999"], "--min-gbps must be a number"),
    (["--size-mib", "0"], "--size-mib"), (["--copies", "100000"], "--copies")])
def test_verify_options_are_checked_before_anything_runs(cli, args, words):
    result = cli("verify", "--ssh-host", "127.0.0.1", "--ssh-port", "1", *args)
    assert result.code == 2 and words in result.err and len(result.err.strip().splitlines()) == 1, result.err


@pytest.mark.parametrize("fragment", ['"\\ud800"', '"x\\udc00y"', "1e999", "-1e999"])
def test_surrogates_and_overflowing_numbers_from_the_guest_are_refused(fragment):
    """A lone surrogate is valid JSON text but no Unicode string (printing it raised
    UnicodeEncodeError in gpuvfio verify: a traceback from a hostile guest); 1e999 reads as inf."""
    data = verifier_data()
    data["errors"] = {"verifier": "PLACEHOLDER"}
    text = "GPUVFIO-VERIFIER " + json.dumps(data).replace('"PLACEHOLDER"', fragment)
    with pytest.raises(VerifyError, match="garbled"):
        parse_verifier(text)


def _vgpu_host(tmp_path):
    from tests.hostbuilder import BAR64_PREF, HostBuilder
    b = HostBuilder(str(tmp_path))
    b.iommu("amd", 1)
    b.numa_node(0, list(range(8)), 32)
    rb = b.root_bus(numa=-1)
    rp = b.bridge(rb, "0000:40:01.1", "1022", "14ab", secondary_bus=0x41, link=(4, 8))
    pf = b.function(rp, "0000:41:00.0", "10de", "2236", "030200", driver="nvidia", link=(5, 16),
                    bars=[(1, 32 << 30, BAR64_PREF)])
    vfs = b.sriov(pf, 32, ["0000:41:00.4", "0000:41:00.5", "0000:41:00.6", "0000:41:00.7"], "2236", "10de",
                  "030200", driver="nvidia", vf_bar=1 << 30)
    b.vgpu_types(vfs[0], [(590, "NVIDIA A10-4Q"), (591, "NVIDIA A10-8Q")], current=591)
    b.vgpu_types(vfs[1], [(590, "NVIDIA A10-4Q")], current=592)  # not in its own list, nor the PF's
    b.vgpu_types(vfs[2], [(590, "NVIDIA A10-4Q")], current=0)
    b.vgpu_types(pf, [(593, "NVIDIA A10-2B")])
    b.vgpu_types(vfs[3], [], current=593)  # a VF whose list is empty once created: the PF's names it
    b.function(rb, "0000:00:05.0", "8086", "1234", "020000", driver="e1000e", link=(3, 1))
    b.function(rb, "0000:00:06.0", "10de", "2330", "030200", driver="nvidia", link=(5, 16))  # on the root bus
    bare = b.bridge(rb, "0000:00:07.0", "8086", "352a", secondary_bus=0x50)  # a port without link files
    b.function(bare, "0000:50:00.0", "10de", "2330", "030200", driver="nvidia", link=(5, 16))
    half = b.bridge(rb, "0000:00:08.0", "8086", "352a", secondary_bus=0x60, link=(4, 8))
    os.remove(os.path.join(half.path, "max_link_speed"))  # a port that knows its width only
    t4 = b.function(half, "0000:60:00.0", "10de", "1eb8", "030200", driver="nvidia", link=(3, 16))
    b.vgpu_types(t4, [(600, "GRID T4-1Q")], current=601)  # a current type on a function no PF owns
    return b


def test_expectations_take_the_slot_and_the_vgpu_profile_from_the_host(tmp_path):
    from gpuvfio.address import PciAddress
    from gpuvfio.guest.expect import expectations
    from gpuvfio.host.inventory import read_inventory
    from gpuvfio.host.root import HostRoot

    inventory = read_inventory(HostRoot(_vgpu_host(tmp_path).root))
    got = expectations(inventory, [PciAddress.parse(a) for a in (
        "0000:41:00.0", "0000:41:00.4", "0000:41:00.5", "0000:41:00.6", "0000:41:00.7", "0000:00:05.0")])
    pf = got[0]
    assert (pf.link_gen, pf.link_width, pf.link_source, pf.vgpu_profile) == (
        4, 8, "0000:41:00.0 Gen5 x16, its slot (0000:40:01.1) Gen4 x8", None)
    assert [e.vgpu_profile for e in got[1:5]] == ["NVIDIA A10-8Q", "vGPU type 592", None, "NVIDIA A10-2B"]
    nic = got[5]  # not NVIDIA: no gate from its link
    assert (nic.link_gen, nic.link_width, nic.link_source, nic.kind) == (None, None, None, "present")
    with pytest.raises(InputError, match="no such PCI function on this host: 0000:41:01.0"):
        expectations(inventory, [PciAddress.parse("0000:41:01.0")])
    root, bare, half = expectations(inventory, [PciAddress.parse(a) for a in ("0000:00:06.0", "0000:50:00.0",
                                                                            "0000:60:00.0")])
    assert (root.link_gen, root.link_width, root.link_source) == (5, 16, "0000:00:06.0 Gen5 x16")
    assert (bare.link_gen, bare.link_width, bare.link_source) == (5, 16, "0000:50:00.0 Gen5 x16")
    assert (half.link_gen, half.link_width, half.link_source, half.vgpu_profile) == (
        3, 16, "0000:60:00.0 Gen3 x16", "vGPU type 601")


def test_gates_say_their_floor():
    from gpuvfio.guest.expect import gates as make
    assert make().describe(5, 16) == ">= 47.7 GB/s (90% of the 53.0 GB/s healthy Gen5 x16 cards measure)"
    assert make().describe(4, 8) == ">= 10.8 GB/s (90% of the 11.9 GB/s healthy Gen4 x8 cards measure)"
    assert make().describe(6, 16) == ">= 91.6 GB/s (76% of Gen6 x16: no measured source for Gen6)"
    assert make(link_efficiency=0.762).describe(5, 16) == ">= 48.0 GB/s (76% of Gen5 x16)"
    assert make(min_gbps=12.25).describe(5, 16) == ">= 12.2 GB/s (--min-gbps)"
    assert make(min_gbps=12.0).floor(None, None) == 12.0 and make(min_gbps=0.5).floor(5, 16) == 0.5
    assert len(parse_expect(["10de:2335x64"])) == 64
    assert make().floor(7, 16) is None and make().floor(5, 0) is None and make().floor(None, 16) is None
    assert make(link_efficiency=1).floor(1, 1) == 0.25
    with pytest.raises(InputError, match="a fraction in"):
        make(link_efficiency=0)
    with pytest.raises(InputError, match="positive number of GB/s"):
        make(min_gbps=0)


def test_the_report_keeps_the_guests_nvidia_and_vfio_modules_only():
    probe = parse_probe(probe_text([GPU_LINE]).replace("MODULE nvidia 1\n", "MODULE nvidia 1\nMODULE nvidia_uvm 2\n"
                                                       "MODULE vfio_pci 3\nMODULE snd_hda_intel 4\nMODULE vfio 5\n"))
    facts = evaluate(probe, None, [H100])["facts"]
    assert facts["nvidia_modules"] == ["nvidia 1", "nvidia_uvm 2", "vfio_pci 3", "vfio 5"]
