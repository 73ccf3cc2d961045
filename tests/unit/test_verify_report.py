"""verify's reports as typed results (issue 23 item 5): dataclasses with the check statuses and
the verdict as enums, and to_json() giving the JSON verify printed before they were typed.

The golden files in tests/golden/verify/ are that JSON, recorded from the dict-returning code
(``--regenerate`` rewrites them): a guest answering through a stand-in SSH session, the probe
and the verifier on the host answered through the Context's runner, the NCCL topology file.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.commands import Finished, Runner
from gpuvfio.guest.checks import CheckResult, CheckStatus, Outcome, VerifyReport, evaluate, judge
from gpuvfio.guest.expect import Expected
from gpuvfio.guest.verify import parse_probe, parse_verifier, verify_guest
from gpuvfio.host.root import HostRoot
from gpuvfio.ops import guests
from gpuvfio.ops.context import Context
from tests.conftest import REPO, golden_text, gpu_workstation
from tests.unit.test_verify import AUDIO_LINE, GPU_LINE, H100, gpu_line, probe_text, verifier_json

GOLDEN = os.path.join(REPO, "tests", "golden", "verify")
AUDIO = Expected("0000:1b:00.1", "10de", "22bb", "040300", None, None)
ADA = "PCI|0000:01:00.0|0x10de|0x2684|0x030000|nvidia|16.0 GT/s PCIe|16|16.0 GT/s PCIe|16|0000:00:02.0"


class Guest:
    """An SSH session's answers: the probe (``sh -c SCRIPT gpuvfio-probe``), the verifier (python3 -),
    the NCCL file's write (``sh -c SCRIPT sh DIR FILE``), each with its exit status, and the
    guest's /etc/nccl.conf (``conf``; None: there is none; ``conf_link``: a symbolic link) as the
    read and write of ``merge_nccl_conf`` see it."""

    def __init__(self, probe: str, verifier: str = "", probe_status: int = 0, verifier_status: int = 0,
                 write_status: int = 0, conf: bytes | None = None, conf_link: str | None = None) -> None:
        self.probe, self.verifier = probe, verifier
        self.probe_status, self.verifier_status, self.write_status = probe_status, verifier_status, write_status
        self.written: bytes | None = None
        self.conf, self.conf_link = conf, conf_link

    def run(self, argv, timeout=None, stdin=None):
        if argv[:2] == ["sh", "-c"] and argv[-1] == "gpuvfio-probe":
            return self.probe_status, self.probe, "probe err" if self.probe_status else ""
        if argv[0] == "sh":
            self.written = stdin
            return self.write_status, "", "cannot write" if self.write_status else ""
        return self.verifier_status, self.verifier, ""

    def run_bytes(self, argv, timeout=None, stdin=None):
        assert argv[:2] == ["sh", "-c"] and argv[4] == "/etc/nccl.conf", argv
        if len(argv) == 5:  # the read
            if self.conf_link is not None:
                return 0, f"LINK {self.conf_link}\n".encode(), b""
            return 0, b"NONE\n" if self.conf is None else b"FILE\n" + self.conf, b""
        assert self.conf_link is None, "written through a link"
        self.conf = stdin
        return 0, b"", b""


TWO = [Expected(f"0000:{b:02x}:00.0", "10de", "2330", "030200", 5, 16, "x") for b in (0x1b, 0x2b)]
TWO_BUSES = ["0000:01:00.0", "0000:02:00.0"]
LINK = {"link_speed": "16.0 GT/s PCIe", "link_width": "16"}
# The all-reduce ran with gpuvfio's file; NCCL's view (its dump) differs for one GPU: a warning.
NCCL_VIEW = {"version": 22304, "devices": 2, "results": [{"bytes": 8 << 20, "busbw_gbps": 30.0, "verified": True}],
             "topology": {"file": "/etc/gpuvfio/nccl-topo.xml", "source": "gpuvfio", "error": None,
                          "planned": {"0000:01:00.0": LINK, "0000:02:00.0": LINK},
                          "nccl": {"0000:01:00.0": LINK, "0000:02:00.0": dict(LINK, link_width="8")}}}
GUESTS = {
    "pass": (Guest(probe_text([GPU_LINE, AUDIO_LINE]), verifier_json()), [H100, AUDIO], {}),
    "slow": (Guest(probe_text([GPU_LINE]), verifier_json(h2d=20.0, gen=4)), [H100], {}),
    "nopython": (Guest(probe_text([GPU_LINE], python="none")), [H100], {}),
    "probe_fails": (Guest("", probe_status=3), [H100], {}),
    "probe_garbage": (Guest("hello\n"), [H100], {}),
    "verifier_garbage": (Guest(probe_text([GPU_LINE]), "GPUVFIO-VERIFIER {bad", verifier_status=1), [H100], {}),
    "verifier_shape": (Guest(probe_text([GPU_LINE]), 'GPUVFIO-VERIFIER {"version": 2, "errors": []}'), [H100], {}),
    "mig": (Guest(probe_text([GPU_LINE]), verifier_json(cuda=False, mig=True, errors={"cuda": "x"})), [H100], {}),
    "nodriver": (Guest(probe_text([gpu_line(1, driver="-")], dmesg=["NVRM: bad"]), verifier_json()), [H100], {}),
    "none-expected": (Guest(probe_text([GPU_LINE, AUDIO_LINE]), verifier_json()), [], {}),
    "nobw": (Guest(probe_text([GPU_LINE, AUDIO_LINE]), verifier_json()), [H100], {"bandwidth": False}),
    "nccl_view": (Guest(probe_text([gpu_line(1), gpu_line(2)]), verifier_json(
        buses=TWO_BUSES, p2p={"bus_ids": TWO_BUSES, "access": [[False, False], [False, False]], "bandwidth": {}},
        nccl=NCCL_VIEW)), TWO, {}),
}


def golden(name: str, text: str, regenerate: bool) -> None:
    path = os.path.join(GOLDEN, f"{name}.json")
    expected = golden_text(path, text + "\n", regenerate)
    assert text == expected.rstrip("\n"), f"{name}: the JSON changed (keys, order or values)"


@pytest.mark.parametrize("name", sorted(GUESTS))
def test_verify_guest_gives_a_typed_report_with_the_json_of_before(name, regenerate):
    session, expected, kwargs = GUESTS[name]
    report = verify_guest(session, expected, **kwargs)
    assert isinstance(report, VerifyReport) and report.expected == expected
    assert all(isinstance(c, CheckResult) and isinstance(c.status, CheckStatus) for c in report.checks)
    failed = [c for c in report.checks if c.status is CheckStatus.FAIL]
    assert report.failed == failed and report.ok is (not failed)
    assert report.outcome is (Outcome.FAIL if failed else Outcome.PASS)
    golden(f"verify_guest-{name}", json.dumps(report.to_json()), regenerate)


def test_the_verdicts_of_the_guests_above():
    """The golden files are not vacuous: the guests above pass and fail where they should."""
    outcomes = {name: verify_guest(session, expected, **kwargs).outcome
                for name, (session, expected, kwargs) in GUESTS.items()}
    assert {n for n, o in outcomes.items() if o is Outcome.PASS} == {"pass", "none-expected", "nobw", "mig",
                                                                     "nccl_view"}
    view = verify_guest(*GUESTS["nccl_view"][:2])
    assert [(c.check_id, c.status) for c in view.checks if c.check_id == "nccl_topology"] == [
        ("nccl_topology", CheckStatus.WARN)]
    probe = verify_guest(*GUESTS["probe_fails"][:2])
    assert [(c.check_id, c.status) for c in probe.checks] == [("probe", CheckStatus.FAIL)]
    mig = verify_guest(*GUESTS["mig"][:2])
    assert {c.status for c in mig.checks if c.check_id == "cuda"} == {CheckStatus.EXPECTED}


def test_evaluate_is_judge_as_json():
    """evaluate(), the JSON a recorded run keeps, is judge()'s report turned into JSON."""
    probe, verifier = parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json(h2d=20.0, gen=4))
    report = judge(probe, verifier, [H100])
    assert evaluate(probe, verifier, [H100]) == report.to_json()
    assert report.to_json()["ok"] is False and list(report.to_json()) == ["checks", "facts", "bandwidth_gbps", "ok"]
    warned = [c for c in report.checks if c.status is CheckStatus.FAIL]
    assert {c.check_id for c in warned} == {"pcie_link", "h2d_bandwidth"}


def test_a_report_carries_what_its_caller_adds_in_the_order_the_json_had():
    report = VerifyReport([CheckResult("driver", CheckStatus.SKIP, reason="no devices assigned")], {}, {},
                          expected=[AUDIO], ssh_notes=["a note"], host_root="/r")
    assert list(report.to_json()) == ["checks", "facts", "bandwidth_gbps", "ok", "expected", "ssh_notes", "host_root"]
    assert report.to_json()["checks"] == [{"id": "driver", "status": "skip", "expected": None, "observed": None,
                                           "reason": "no devices assigned", "device": None}]
    assert report.ok and report.to_json()["ssh_notes"] == ["a note"]


def answering(verifier: str, status: int = 0) -> Runner:
    """The Context's runner: the probe's answer for ``sh PROBE``, ``verifier`` for the verifier."""
    def start(command):
        if command.argv[0] == "sh":
            return Finished(0, probe_text([GPU_LINE]).encode(), b"")
        return Finished(status, verifier.encode(), b"verifier err" if status else b"")
    return Runner(start=start)


@pytest.mark.parametrize("name, verifier, status", [("ok", verifier_json(), 0), ("garbage", "nothing", 0),
                                                   ("exit", "", 2)])
def test_verify_here_gives_a_typed_report_with_the_json_of_before(tmp_path, regenerate, name, verifier, status):
    root = gpu_workstation(tmp_path / "ws").root
    ctx = Context(host=HostRoot(root), run=answering(verifier, status))
    report = guests.verify_here(ctx, [PciAddress.parse("0000:01:00.0")])
    assert isinstance(report, VerifyReport) and report.host_root == root
    # the probe shows an H100 where the host has its 4090: not present, whatever the verifier says
    assert not report.ok and report.failed[0].check_id == "pci_present"
    assert any(c.check_id == "verifier" for c in report.failed) is (name != "ok")
    assert [e.address for e in report.expected] == ["0000:01:00.0"]
    # The verifier's command line names this interpreter and this checkout: placeholders in the file.
    text = json.dumps(report.to_json()).replace(root, "ROOT").replace(sys.executable, "PYTHON").replace(REPO, "REPO")
    golden(f"verify_here-{name}", text, regenerate)


ADMIN_CONF = b"NCCL_DEBUG=WARN\nNCCL_TOPO_FILE=/opt/site-topo.xml\n"


# Each case makes its own guest: a Guest records what was written to it, and one made at import
# time would carry a first run's nccl.conf into a second run of the same test in one process.
@pytest.mark.parametrize("name, make_guest, written", [
    ("probe_fails", lambda: Guest("", probe_status=3), False),
    ("write_fails", lambda: Guest(probe_text([ADA]), write_status=1), False),
    ("unlike", lambda: Guest(probe_text([GPU_LINE])), False),  # the guest shows another device than planned
    ("written", lambda: Guest(probe_text([ADA])), True),
    ("conf_replaced", lambda: Guest(probe_text([ADA]), conf=ADMIN_CONF), True),
    ("conf_kept", lambda: Guest(probe_text([ADA]), conf=ADMIN_CONF), True),
    ("conf_link", lambda: Guest(probe_text([ADA]), conf_link="/srv/shared/nccl.conf"), True),
], ids=["probe_fails", "write_fails", "unlike", "written", "conf_replaced", "conf_kept", "conf_link"])
def test_the_nccl_topology_file_is_typed_with_the_json_of_before(tmp_path, regenerate, name, make_guest, written):
    from gpuvfio.domain.request import domain_request
    from gpuvfio.ops.domains import provision_xml

    guest = make_guest()
    ctx = Context(host=HostRoot(gpu_workstation(tmp_path / "ws").root))
    provisioned = provision_xml(ctx, [PciAddress.parse("0000:01:00.0")], domain_request("n", firmware="bios"))
    result = guests.write_nccl_topology(ctx, guest, provisioned, 5.0, replace=name == "conf_replaced")
    assert isinstance(result, guests.NcclTopology) and result.written is written
    if written:
        assert result.error is None and guest.written == result.xml.encode()
        assert result.path == "/etc/gpuvfio/nccl-topo.xml" and result.conf.path == "/etc/nccl.conf"
    else:
        assert result.path is None and result.use is None and result.error and result.conf is None
    if name == "written":  # no nccl.conf before: one made, and the hint says so
        assert result.conf.change.value == "created" and guest.conf.endswith(b"\nNCCL_TOPO_FILE=/etc/gpuvfio/nccl-topo.xml\n")
        assert result.use.startswith("/etc/nccl.conf carries NCCL_TOPO_FILE=/etc/gpuvfio/nccl-topo.xml")
    if name == "conf_replaced":  # asked to: the admin's other line kept, the old value said
        assert guest.conf == b"NCCL_DEBUG=WARN\nNCCL_TOPO_FILE=/etc/gpuvfio/nccl-topo.xml\n"
        assert result.conf.previous == "/opt/site-topo.xml" and "/opt/site-topo.xml" in result.use
    if name == "conf_kept":  # not asked: nothing written, the admin's value said, the job told to export
        assert guest.conf == ADMIN_CONF and result.conf.change.value == "kept" and not result.named
        assert result.use.startswith("export NCCL_TOPO_FILE=/etc/gpuvfio/nccl-topo.xml") and "site-topo" in result.use
    if name == "conf_link":  # nothing written through the link; the job is told to set it
        assert result.conf.change is None and "symbolic link" in result.conf.error and guest.conf is None
        assert result.use.startswith("export NCCL_TOPO_FILE=/etc/gpuvfio/nccl-topo.xml (/etc/nccl.conf does not")
    golden(f"nccl-{name}", json.dumps(result.to_json()), regenerate)


def test_attach_result_serialises_its_typed_parts():
    report = VerifyReport([CheckResult("probe", CheckStatus.FAIL, reason="no")], {}, {})
    result = guests.AttachResult("g", report=report, nccl_topology=guests.NcclTopology(error="no file"))
    data = result.to_json()
    assert data["verify"] == report.to_json() and data["verify"]["ok"] is False
    assert data["nccl_topology"] == {"written": False, "path": None, "error": "no file"}
    assert guests.AttachResult("g").to_json()["verify"] is None
