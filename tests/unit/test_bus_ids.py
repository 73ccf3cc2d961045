"""Bus ids as the kernel, NVML and CUDA print them are one address when their domains are one
number: verify never lends one GPU's figures to another whose address ends alike (a VMD
domain, 10000, beside domain 0000), and a guest's answer of the wrong shape is a failed check,
not a traceback."""

from __future__ import annotations

import copy
import json

import pytest

from gpuvfio.guest.checks import bus_key, evaluate
from gpuvfio.guest.expect import Expected
from gpuvfio.guest.verify import VerifyError, parse_probe, parse_verifier
from tests.unit.test_verify import measured, probe_text

A, VMD = "0000:01:00.0", "10000:01:00.0"


@pytest.mark.parametrize("spelled, key", [
    ("0000:01:00.0", A), ("00000000:01:00.0", A), ("0000:0A:00.0", "0000:0a:00.0"),  # kernel, NVML, CUDA
    ("10000:01:00.0", VMD), ("00010000:01:00.0", VMD), (" 0000:01:00.0", None), ("0000:01:00.0\n", None),
    ("0000:01:00.8", None), ("0000:01:20.0", None), ("000000000:01:00.0", None), ("01:00.0", None),
    ("", None), (None, None), (7, None), ("0000:01:00.0;rm", None),
])
def test_a_bus_id_is_read_as_its_numbers(spelled, key):
    assert bus_key(spelled) == key


def line(address):
    return f"PCI|{address}|0x10de|0x2330|0x030200|nvidia|-|-|-|-|-"


def two_domains(measured_for=(A,)):
    """GPUs at 0000:01:00.0 and 10000:01:00.0; the verifier measured only those named."""
    devices = [{"name": "NVIDIA H100", "bus_id": nvml, "virtualization_mode": "Pass-Through", "mig": False}
               for nvml in ("00000000:01:00.0", "00010000:01:00.0")]
    verifier = {"version": 2, "method": {}, "errors": {},
                "nvml": {"driver_version": "550.54", "cuda_driver_version": 12040, "devices": devices},
                "cuda": {"driver_version": 12040, "devices": [{"index": i, "name": "NVIDIA H100", "bus_id": b}
                                                              for i, b in enumerate((A, VMD))]},
                "bandwidth": {b: measured() for b in measured_for}, "latency": {}, "copy_overhead": {},
                "compute": {b: {"launch_ms": 0.19, "verified": True} for b in measured_for}, "p2p": None,
                "nccl": None}
    expected = [Expected(address, "10de", "2330", "030200", 5, 16, "the slot") for address in ("0000:1b:00.0",
                                                                                                 "0000:2b:00.0")]
    return parse_probe(probe_text([line(A), line(VMD)])), verifier, expected


def by_device(answer, check_id):
    return {c["device"]: c["status"] for c in answer["checks"] if c["id"] == check_id}


def test_a_gpu_in_a_vmd_domain_is_not_judged_by_domain_0000s_figures():
    probe, verifier, expected = two_domains()
    answer = evaluate(probe, parse_verifier("GPUVFIO-VERIFIER " + json.dumps(verifier)), expected)
    assert by_device(answer, "h2d_bandwidth") == {"0000:1b:00.0": "pass", "0000:2b:00.0": "fail"}
    assert by_device(answer, "compute") == {"0000:1b:00.0": "pass", "0000:2b:00.0": "fail"}
    assert answer["ok"] is False
    probe, verifier, expected = two_domains(measured_for=(A, "00010000:01:00.0"))  # NVML's spelling
    answer = evaluate(probe, parse_verifier("GPUVFIO-VERIFIER " + json.dumps(verifier)), expected)
    assert set(by_device(answer, "h2d_bandwidth").values()) == set(by_device(answer, "compute").values()) == {"pass"}


def test_an_error_keyed_in_upper_case_is_the_gpus_own_reason():
    probe, verifier, expected = two_domains(measured_for=(A,))
    verifier["errors"] = {"bandwidth 00010000:01:00.0": "cudaMalloc: out of memory",
                          "compute 10000:01:00.0": "launch failed", "bandwidth 0000:01:00.0X": "not this one"}
    answer = evaluate(probe, parse_verifier("GPUVFIO-VERIFIER " + json.dumps(verifier)), expected)
    reasons = {(c["id"], c["device"]): c["reason"] for c in answer["checks"]}
    assert reasons[("h2d_bandwidth", "0000:2b:00.0")] == "cudaMalloc: out of memory"
    assert reasons[("compute", "0000:2b:00.0")] == "launch failed"


@pytest.mark.parametrize("key", ["bandwidth of 10000:01:00.0", "bandwidth  10000:01:00.0", "bandwidth\t10000:01:00.0",
                                 "bandwidth10000:01:00.0"])
def test_an_error_is_a_gpus_only_when_keyed_stage_space_bus(key):
    """The verifier keys a GPU's error "STAGE BUS" (verifier.py stage()); any other key is no GPU's."""
    probe, verifier, expected = two_domains(measured_for=(A,))
    verifier["errors"] = {key: "cudaMalloc: out of memory"}
    answer = evaluate(probe, parse_verifier("GPUVFIO-VERIFIER " + json.dumps(verifier)), expected)
    reasons = {(c["id"], c["device"]): c["reason"] for c in answer["checks"]}
    assert reasons[("h2d_bandwidth", "0000:2b:00.0")] == "the verifier measured nothing for this GPU"


@pytest.mark.parametrize("address", ["00000:01:00.0", "000010000:01:00.0", "0001:01:00.0 "])
def test_an_address_no_kernel_prints_is_refused(address):
    with pytest.raises(VerifyError, match="malformed PCI address"):
        parse_probe(probe_text([line(address)]))


@pytest.mark.parametrize("p2p, problem", [
    ({"bus_ids": [1, 2], "access": [], "bandwidth": {}}, "p2p.bus_ids is not a list of bus ids"),
    ({"bus_ids": "0000:01:00.0", "access": [], "bandwidth": {}}, "p2p.bus_ids is not a list of bus ids"),
    ({"bus_ids": [A], "access": [1, 2], "bandwidth": {}}, "p2p.access is not a matrix"),
    ({"bus_ids": [A], "access": {"0": 1}, "bandwidth": {}}, "p2p.access is not a matrix"),
    ({"bus_ids": [A], "access": [[1]], "bandwidth": {}}, "p2p.access is not a matrix"),
])
def test_a_peer_matrix_of_the_wrong_shape_is_refused(p2p, problem):
    _probe, verifier, _expected = two_domains()
    spoiled = copy.deepcopy(verifier) | {"p2p": p2p}
    with pytest.raises(VerifyError, match=problem):
        parse_verifier("GPUVFIO-VERIFIER " + json.dumps(spoiled))
