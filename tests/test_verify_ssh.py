"""verify_guest over real SSH against a host that has python3: probe and verifier both run.

The "guest" is this machine behind dropbear (tests/lanes/hypervisor.py) with the stand-in
CUDA/NVML library on its LD_LIBRARY_PATH, so the verifier's code path (sent as
``python3 -c``) runs end to end; the tiny daemon-lane guest has no python3.
"""

from __future__ import annotations

import os

import pytest

from gpuvfio.guest.ssh import Session, SshTarget
from gpuvfio.guest.verify import verify_guest
from tests.lanes import hypervisor as hv

pytestmark = pytest.mark.daemon
if hv.skip_reason():
    pytest.skip(hv.skip_reason(), allow_module_level=True)


@pytest.fixture
def gpu_host(tmp_path, fakecuda_libdir):
    server = hv.start(str(tmp_path / "hv"), env={"LD_LIBRARY_PATH": fakecuda_libdir})
    yield server
    server.stop()


def test_probe_and_verifier_run_as_arguments_and_leave_nothing(gpu_host):
    before = set(os.listdir("/tmp"))
    target = SshTarget("127.0.0.1", gpu_host.port, "root", gpu_host.client_key, gpu_host.known_hosts)
    with Session(target) as session:
        report = verify_guest(session, [], timeout=300)
    facts = report["facts"]
    assert facts["guest_kernel"] == os.uname().release
    assert facts["nvml"]["devices"][0]["name"] == "FAKE CUDA (not a GPU)"
    bandwidth = report["bandwidth_gbps"]
    assert bandwidth and all(v["h2d"] > 0 for v in bandwidth.values())
    assert {c["id"] for c in report["checks"]} >= {"cuda"}
    assert not [p for p in set(os.listdir("/tmp")) - before if "gpuvfio" in p]
