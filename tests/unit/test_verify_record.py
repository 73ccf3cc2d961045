"""A record of verify's whole judgment (gpuvfio/guest/checks.py) over scenarios a guest can
report: tests/golden/verdicts.json. The rules are tested one by one in test_verify.py,
test_plausible_guest.py and test_fabric_flow.py; this record holds every check of every report
(its status, what was expected and observed, the reason and the device), so a change to any of
them is a reviewed change to the record. Each scenario spoils one thing of a healthy two-GPU
guest (one P2P clique, an HGX driver version) through the probe's and the verifier's own
parsers. Rewrite it with ``python -m tests.unit.test_verify_record --write`` and review the diff."""

from __future__ import annotations

import copy
import json
import math
import os
import sys

from gpuvfio.guest.checks import MOST_GBPS, evaluate
from gpuvfio.guest.expect import LANE_GBPS, Expected, gates, parse_expect
from gpuvfio.guest.verify import VerifyError, parse_probe, parse_verifier
from tests.unit.test_address_record import assert_recorded, load, write
from tests.unit.test_verify import gpu_line, probe_text, verifier_data

RECORD = os.path.join(os.path.dirname(__file__), os.pardir, "golden", "verdicts.json")
BUSES = ["0000:01:00.0", "0000:02:00.0"]
PAIR = "0000:01:00.0->0000:02:00.0"
LINK = {"link_speed": "16.0 GT/s PCIe", "link_width": "16"}


def expected(**change) -> list[Expected]:
    return [Expected(f"0000:{b:02x}:00.0", "10de", "2330", "030200", 5, 16, f"0000:{b:02x}:00.0 Gen5 x16",
                     driver_version="550.54.15", clique=0) for b in (0x1b, 0x2b)] + [
        Expected("0000:1b:00.1", "10de", "22bb", "040300", None, None)] if not change else \
        [Expected(**({"address": f"0000:{b:02x}:00.0", "vendor_id": "10de", "device_id": "2330",
                      "class_id": "030200", "link_gen": 5, "link_width": 16, "link_source": "the slot",
                      "driver_version": "550.54.15", "clique": 0} | change)) for b in (0x1b, 0x2b)]


def healthy() -> tuple[list[str], str, dict]:
    lines = [gpu_line(1), gpu_line(2), "PCI|0000:01:00.1|0x10de|0x22bb|0x040300|snd_hda_intel|-|-|-|-|-"]
    p2p = {"bus_ids": BUSES, "access": [[False, True], [True, False]],
           "bandwidth": {PAIR: {"median": 40.0, "samples": [40.0], "verified": True},
                         "0000:02:00.0->0000:01:00.0": {"median": 41.0, "samples": [41.0], "verified": True}}}
    nccl = {"version": 22304, "devices": 2, "results": [{"bytes": 8 << 20, "busbw_gbps": 30.0, "verified": True},
                                                         {"bytes": 1 << 30, "busbw_gbps": 45.5, "verified": True}],
        "topology": {"file": "/etc/gpuvfio/nccl-topo.xml", "source": "gpuvfio", "error": None,
                     "planned": {b: LINK for b in BUSES}, "nccl": {b: LINK for b in BUSES}}}
    return lines, "NVIDIA-VERSION NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5", \
        verifier_data(buses=BUSES, p2p=p2p, nccl=nccl)


def _bw(v, bus=BUSES[0]):
    return v["bandwidth"][bus]


def _set(path, value):
    def spoil(v):
        where = v
        for key in path[:-1]:
            where = where[key]
        if value is _DELETE:
            where.pop(path[-1], None)
        else:
            where[path[-1]] = value
    return spoil


_DELETE = object()
B0, B1 = BUSES

# name -> (spoil of the verifier dict, or None; probe lines change; version line; expected; judge options)
VERIFIER_SPOILS = {
    "healthy": lambda v: None,
    "verifier error": _set(["errors", "verifier"], "Traceback: boom"),
    "nvml down": lambda v: v.update(nvml=None, errors={"nvml": "NVML_ERROR_DRIVER_NOT_LOADED"}),
    "nvml down no words": lambda v: v.update(nvml=None),
    "nvml sees one": lambda v: v["nvml"]["devices"].pop(),
    "cuda down": lambda v: v.update(cuda=None, errors={"cuda": "cuInit: 999"}),
    "cuda sees one": lambda v: v["cuda"]["devices"].pop(),
    "mig without instances": lambda v: (v["cuda"]["devices"].pop(), v["nvml"]["devices"][1].update(mig=True)),
    "mig on a cuda device": lambda v: v["nvml"]["devices"][0].update(mig=True),
    "no link under load": lambda v: _bw(v).pop("link_under_load"),
    "link under load error": lambda v: _bw(v).update(link_under_load={"error": "NVML_ERROR_NOT_SUPPORTED"}),
    "no link at all": lambda v: (_bw(v).pop("link_under_load"), v["nvml"]["devices"][0].pop("link_idle")),
    "no link at all, nvml words": lambda v: (_bw(v).pop("link_under_load"), v["nvml"]["devices"][0].pop("link_idle"),
                                             v["errors"].update(nvml="nvmlDeviceGetCurrPcieLinkGeneration: 3")),
    "link gen 9": lambda v: _bw(v)["link_under_load"].update(current_gen=9),
    "link x3": lambda v: _bw(v)["link_under_load"].update(current_width=3),
    "link above the slot": lambda v: _bw(v)["link_under_load"].update(current_gen=6),
    "link wider than the slot": lambda v: _bw(v)["link_under_load"].update(current_width=32),
    "link below the slot under load": lambda v: _bw(v)["link_under_load"].update(current_gen=4),
    "link narrower under load": lambda v: _bw(v)["link_under_load"].update(current_width=8),
    "nothing measured": lambda v: v["bandwidth"].pop(B0),
    "nothing measured, its error": lambda v: (v["bandwidth"].pop(B0),
                                              v["errors"].update({f"bandwidth {B0}": "cudaMemcpy: 700"})),
    "no h2d figure": lambda v: _bw(v).pop("h2d"),
    "h2d huge": lambda v: _bw(v)["h2d"].update(median=1e9),
    "h2d negative": lambda v: _bw(v)["h2d"].update(median=-1.0),
    "h2d at the ceiling": lambda v: _bw(v)["h2d"].update(median=LANE_GBPS[5] * 16),
    "h2d over the ceiling": lambda v: _bw(v)["h2d"].update(median=math.nextafter(LANE_GBPS[5] * 16, math.inf)),
    "h2d below the floor": lambda v: _bw(v)["h2d"].update(median=20.0),
    "bidir at the floor": lambda v: _bw(v)["bidir_total"].update(median=gates().floor(5, 16)),
    "bidir just under the floor": lambda v: _bw(v)["bidir_total"].update(
        median=math.nextafter(gates().floor(5, 16), 0)),
    "data wrong": lambda v: _bw(v).update(verified=False),
    "no compute": lambda v: v["compute"].pop(B0),
    "no compute, its error": lambda v: (v["compute"].pop(B0), v["errors"].update({f"compute {B0}": "launch failed"})),
    "compute wrong": lambda v: v["compute"][B0].update(verified=False),
    "compute slow": lambda v: v["compute"][B0].update(launch_ms=math.nextafter(3600e3, math.inf)),
    "compute at the hour": lambda v: v["compute"][B0].update(launch_ms=3600e3),
    "compute negative": lambda v: v["compute"][B0].update(launch_ms=-0.5),
    "no p2p": lambda v: v.update(p2p=None),
    "no p2p, its error": lambda v: v.update(p2p=None, errors={"p2p": "cuDeviceCanAccessPeer: 1"}),
    "p2p pair error": lambda v: v["p2p"]["bandwidth"][PAIR].update(error="cudaMemcpyPeer: 700"),
    "p2p pair wrong": lambda v: v["p2p"]["bandwidth"][PAIR].update(verified=False, mismatches=12),
    "p2p no pairs": lambda v: v["p2p"].update(bandwidth={}),
    "p2p huge": lambda v: v["p2p"]["bandwidth"][PAIR].update(median=1e6),
    "p2p at its bound": lambda v: v["p2p"]["bandwidth"][PAIR].update(median=MOST_GBPS * 2),
    "p2p over its bound": lambda v: v["p2p"]["bandwidth"][PAIR].update(median=math.nextafter(MOST_GBPS * 2, math.inf)),
    "clique without access": lambda v: v["p2p"].update(access=[[False, False], [True, False]]),
    "clique, access one way": lambda v: v["p2p"].update(access=[[False, True], [False, False]]),
    "clique, no bus ids": lambda v: v["p2p"].update(bus_ids=[]),
    "clique, short matrix": lambda v: v["p2p"].update(access=[[False]]),
    "clique, upper-case bus ids": lambda v: v["p2p"].update(bus_ids=["00000000:01:00.0", "00000000:02:00.0"]),
    "no nccl": lambda v: v.update(nccl=None),
    "no libnccl": lambda v: v.update(nccl=None, errors={"nccl": "libnccl.so.2 not found: no such file"}),
    "nccl failed": lambda v: v.update(nccl=None, errors={"nccl": "ncclCommInitAll: 3"}),
    "nccl wrong sums": lambda v: v["nccl"]["results"][0].update(verified=False),
    "nccl no results": lambda v: v["nccl"].update(results=[]),
    "nccl huge busbw": lambda v: v["nccl"]["results"][1].update(busbw_gbps=1e9),
    "nccl huge bytes": lambda v: v["nccl"]["results"][1].update(bytes=1 << 50),
    "nccl no topology file": lambda v: v["nccl"]["topology"].update(file=None, planned=None),
    "nccl no view": lambda v: v["nccl"]["topology"].update(nccl=None, error="NCCL wrote no topology dump"),
    "nccl no view, no words": lambda v: v["nccl"]["topology"].update(nccl=None),
    "nccl view differs": lambda v: v["nccl"]["topology"]["nccl"].update({B0: dict(LINK, link_width="8")}),
    "nccl view misses one": lambda v: v["nccl"]["topology"]["nccl"].pop(B1),
    "nccl view has more": lambda v: v["nccl"]["topology"]["nccl"].update({"0000:03:00.0": dict(LINK, nvlink=4)}),
    "nccl view with nvlink": lambda v: v["nccl"]["topology"]["nccl"].update({B1: dict(LINK, nvlink=18)}),
    "nccl no file, no view": lambda v: v["nccl"]["topology"].update(file=None, planned=None, nccl=None),
    "nccl view without a plan": lambda v: v["nccl"]["topology"].update(planned=None, error="no GPU in the file"),
    "nccl busbw zero": lambda v: v["nccl"]["results"][1].update(busbw_gbps=0.0),
    "nccl busbw at its bound": lambda v: v["nccl"]["results"][1].update(busbw_gbps=MOST_GBPS * 64),
    "nccl busbw past its bound": lambda v: v["nccl"]["results"][1].update(busbw_gbps=MOST_GBPS * 64.5),
    "nccl zero bytes": lambda v: v["nccl"]["results"][0].update(bytes=0),
    "h2d zero": lambda v: _bw(v)["h2d"].update(median=0.0),
    "p2p zero median": lambda v: v["p2p"]["bandwidth"][PAIR].update(median=0.0),
    "cuda sees none, one mig": lambda v: (v["cuda"].update(devices=[]), v["nvml"]["devices"][1].update(mig=True)),
    "no compute, both errors": lambda v: (v["compute"].pop(B0), v["errors"].update(
        {f"bandwidth {B0}": "cudaMemcpy: 700", f"compute {B0}": "launch failed"})),
    "nothing measured, a compute error": lambda v: (v["bandwidth"].pop(B0),
                                                    v["errors"].update({f"compute {B0}": "launch failed"})),
    "compute without a time": lambda v: v["compute"][B0].pop("launch_ms"),
    "compute at zero": lambda v: v["compute"][B0].update(launch_ms=0.0),
    "cuda null, no error": lambda v: v.update(cuda=None),
    "link under load with an error": lambda v: _bw(v).update(link_under_load={
        "error": "NVML_ERROR_UNKNOWN", "current_gen": 5, "current_width": 16}),
    "idle link with an error": lambda v: (_bw(v).pop("link_under_load"), v["nvml"]["devices"][0].update(link_idle={
        "error": "NVML_ERROR_UNKNOWN", "current_gen": 5, "current_width": 16})),
    "clique, short matrix, ids reversed": lambda v: v["p2p"].update(bus_ids=[B1, B0], access=[[False, True]]),
}

# name -> (probe lines, version line, expected, judge options, verifier: None | "healthy")
OTHER = {
    "nothing assigned": (lambda lines: [], None, [], {}),
    "audio only": (None, None, [Expected("0000:1b:00.1", "10de", "22bb", "040300", None, None)], {}),
    "gpu missing": (lambda lines: lines[1:], None, None, {}),
    "driver not nvidia": (lambda lines: [gpu_line(1, driver="nouveau")] + lines[1:], None, None, {}),
    "driver unbound, kernel words": (lambda lines: [gpu_line(1, driver="-")] + lines[1:] + [
        "DMESG NVRM: GPU 0000:01:00.0: RmInitAdapter failed!", "DMESG usb 1-1: new device",
        "DMESG nvidia: probe of 0000:01:00.0 failed with error -1"], None, None, {}),
    "driver version other": (None, "NVIDIA-VERSION NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  x",
                             None, {}),
    "driver version short": (None, "NVIDIA-VERSION NVRM version: NVIDIA UNIX Kernel Module 550.54 x", None, {}),
    "driver version none": (None, "NVIDIA-VERSION -", None, {}),
    "no bandwidth asked": (None, None, None, {"bandwidth": False}),
    "min gbps": (None, None, None, {"gates": gates(min_gbps=49.5)}),
    "link efficiency": (None, None, None, {"gates": gates(link_efficiency=0.9)}),
    "no slot known": (None, None, expected(link_gen=None, link_width=None, link_source=None), {}),
    "no clique": (None, None, expected(clique=None), {}),
    "two cliques": (None, None, expected()[:1] + [Expected("0000:2b:00.0", "10de", "2330", "030200", 5, 16, "x",
                                                           driver_version="550.54.15", clique=1)], {}),
    "vgpu B-series": (lambda lines: [gpu_line(1, "2236")], None,
                      [Expected("0000:1b:00.4", "10de", "2236", "030200", 4, 16, "x", "NVIDIA A10-4B")], {}),
    "vgpu Q-series": (lambda lines: [gpu_line(1, "2236")], None,
                      [Expected("0000:1b:00.4", "10de", "2236", "030200", 4, 16, "x", "NVIDIA A10-4Q")], {}),
    "no python": (None, None, None, {"verifier": None}),
    "verifier problem": (None, None, None, {"verifier": None, "verifier_problem": "it printed no result"}),
    "verifier problem beside a result": (None, None, None, {"verifier_problem": "it exited 1"}),
    "audio only, verifier problem": (None, None, [Expected("0000:1b:00.1", "10de", "22bb", "040300", None, None)],
                                     {"verifier_problem": "it exited 1"}),
    "driver version after a second Kernel Module": (
        None, "NVIDIA-VERSION NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Kernel Module 1.2", None, {}),
    "driver version after a letter": (None, "NVIDIA-VERSION NVRM version: NVIDIA UNIX Kernel Module \u00e9550.54.15",
                                      None, {}),
}


def _nvml_form(verifier: dict) -> dict:
    """The verifier's tables keyed as NVML spells a bus id: eight-digit domain, upper-case hex."""
    def nvml(bus: str) -> str:
        return "0000" + bus.upper()
    for key in ("bandwidth", "latency", "compute"):
        verifier[key] = {nvml(bus): value for bus, value in verifier[key].items()}
    for device in verifier["cuda"]["devices"] + verifier["nvml"]["devices"]:
        device["bus_id"] = nvml(device["bus_id"][-12:])
    return verifier


def slots_as_slots():
    """Host slot 1b:00 has a GPU and its audio, 2b:00 a GPU alone; the guest shows the pair on
    02:00 and the lone GPU on 01:00: slots pair with slots, not the first GPU with the first."""
    lines = [gpu_line(1), gpu_line(2), "PCI|0000:02:00.1|0x10de|0x22bb|0x040300|snd_hda_intel|-|-|-|-|-"]
    exp = [Expected("0000:1b:00.0", "10de", "2330", "030200", 5, 16, "x"),
           Expected("0000:1b:00.1", "10de", "22bb", "040300", None, None),
           Expected("0000:2b:00.0", "10de", "2330", "030200", 5, 16, "x")]
    _lines, version, verifier = healthy()
    verifier["bandwidth"][B1]["h2d"]["median"] = 20.0  # so the pairing shows in which GPU fails
    return lines, version, verifier, exp, {}


def hex_buses_in_nvml_form():
    buses = ["0000:1b:00.0", "0000:2b:00.0"]
    _lines, version, verifier = healthy()
    verifier = _nvml_form(verifier_data(buses=buses, p2p=dict(verifier["p2p"], bus_ids=buses),
                                        nccl=verifier["nccl"]))
    verifier["nvml"]["devices"][1]["mig"] = True
    verifier["cuda"]["devices"].pop()
    return [gpu_line(0x1b), gpu_line(0x2b)], version, verifier, expected(), {}


def mig_with_instances_in_nvml_form():
    buses = ["0000:1b:00.0", "0000:2b:00.0"]
    _lines, version, verifier = healthy()
    verifier = _nvml_form(verifier_data(buses=buses, p2p=dict(verifier["p2p"], bus_ids=buses),
                                        nccl=verifier["nccl"]))
    verifier["nvml"]["devices"][1]["mig"] = True  # and CUDA sees it: a MIG instance is measured
    return [gpu_line(0x1b), gpu_line(0x2b)], version, verifier, expected(), {}


def verifier_error_and_problem():
    lines, version, verifier = healthy()
    verifier["errors"]["verifier"] = "Traceback: boom"
    return lines, version, verifier, expected(), {"verifier_problem": "it exited 1"}


def rounded_figures():
    lines, version, verifier = healthy()
    verifier["bandwidth"][B0]["h2d"]["median"] = 49.98765
    return lines, version, verifier, expected(), {}


def unknown_link(*spoils, **options):
    """A GPU with no slot the host knows and a link the guest does not report (or a wrong one)."""
    def scenario():
        lines, version, verifier = healthy()
        _bw(verifier).pop("link_under_load")
        verifier["nvml"]["devices"][0].pop("link_idle")
        for spoil in spoils:
            spoil(verifier)
        return lines, version, verifier, expected(link_gen=None, link_width=None, link_source=None), options
    return scenario


def three_gpus(cliques, spoil):
    def scenario():
        buses = BUSES + ["0000:03:00.0"]
        _lines, version, verifier = healthy()
        pairs = {f"{a}->{b}": {"median": 40.0, "samples": [40.0], "verified": True}
                 for a in buses for b in buses if a != b}
        verifier = verifier_data(buses=buses, nccl=verifier["nccl"], p2p={
            "bus_ids": buses, "access": [[a != b for b in buses] for a in buses], "bandwidth": pairs})
        spoil(verifier)
        exp = [Expected(f"0000:{b:02x}:00.0", "10de", "2330", "030200", 5, 16, "x", driver_version="550.54.15",
                        clique=c) for b, c in zip((0x1b, 0x2b, 0x3b), cliques)]
        return [gpu_line(1), gpu_line(2), gpu_line(3)], version, verifier, exp, {}
    return scenario


def second_gpu_missing():
    lines, version, verifier = healthy()
    return [lines[0], lines[2]], version, verifier, expected(), {}


def identical_by_ids():
    lines, version, verifier = healthy()
    return lines[:2], version, verifier, parse_expect(["10de:2330x2"]), {}


WHOLE = {"slots pair as slots": slots_as_slots, "mig with instances in NVML's form": mig_with_instances_in_nvml_form,
         "no slot, no link": unknown_link(),
         "no slot, no link, h2d huge": unknown_link(lambda v: _bw(v)["h2d"].update(median=1e6)),
         "no slot, link gen 9": unknown_link(lambda v: _bw(v).update(link_under_load={
             "current_gen": 9, "current_width": 16, "max_gen": 5, "max_width": 16})),
         "no link, no bandwidth asked": unknown_link(bandwidth=False),
         "no slot, no link, a figure to round": unknown_link(lambda v: _bw(v)["h2d"].update(median=49.98765)),
         "three GPUs in one clique, every pair wild": three_gpus((0, 0, 0), lambda v: [
             pair.update(median=1e6 + n) for n, pair in enumerate(v["p2p"]["bandwidth"].values())]),
         "second GPU missing": second_gpu_missing,
         "three GPUs, cliques 0 1 0, A and C apart": three_gpus((0, 1, 0), lambda v: v["p2p"]["access"][0].__setitem__(
             2, False)),
         "three GPUs in one clique, a wild pair": three_gpus((0, 0, 0), lambda v: v["p2p"]["bandwidth"][
             "0000:03:00.0->0000:01:00.0"].update(median=1e6)),
         "two identical GPUs by ids": identical_by_ids, "hex buses in NVML's form": hex_buses_in_nvml_form,
         "verifier error and problem": verifier_error_and_problem, "bandwidth figures rounded": rounded_figures}


def verdict(name: str) -> dict:
    lines, version, verifier = healthy()
    exp, options = expected(), {}
    if name in WHOLE:
        lines, version, verifier, exp, options = WHOLE[name]()
    elif name in VERIFIER_SPOILS:
        VERIFIER_SPOILS[name](verifier)
    else:
        change_lines, version_line, new_expected, options = OTHER[name]
        lines = change_lines(lines) if change_lines else lines
        version = version_line or version
        exp = exp if new_expected is None else new_expected
        options = dict(options)
    probe = probe_text(lines).replace("NVIDIA-VERSION NVRM version: 550.54", version)
    text = None if options.get("verifier", verifier) is None else \
        "GPUVFIO-VERIFIER " + json.dumps(verifier, allow_nan=False)
    options.pop("verifier", None)
    try:
        parsed = parse_verifier(text) if text is not None else None
    except VerifyError as refused:
        return {"refused": str(refused)}
    answer = evaluate(parse_probe(probe), parsed, exp, **options)
    return {key: answer[key] for key in ("ok", "checks", "bandwidth_gbps")}  # facts are the guest's own words


def recorded() -> dict:
    return {name: verdict(name) for name in [*VERIFIER_SPOILS, *OTHER, *WHOLE]}


def test_every_verdict_is_the_recorded_one():
    assert_recorded(RECORD, recorded())


def test_the_record_judges_every_scenario_and_sees_each_status():
    record = load(RECORD)
    assert not [name for name, v in record.items() if "refused" in v]  # every scenario reaches the checks
    statuses = {c["status"] for v in record.values() for c in v["checks"]}
    assert statuses == {"pass", "fail", "skip", "warn", "expected"}
    assert record["healthy"]["ok"] and all(c["status"] == "pass" for c in record["healthy"]["checks"])


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    write(RECORD, json.loads(json.dumps(recorded())))
