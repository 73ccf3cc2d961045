"""attach carries out its plan (issue 23 item 1): the plan, made read-only, then the run on a
simulated kernel, libvirt's test driver and real SSH: the run's steps are the plan's, its
placement the plan's, and a refused plan the run's refusal in the same words."""

from __future__ import annotations

import json

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.domain.request import domain_request
from gpuvfio.errors import Refused
from gpuvfio.ops import guests
from gpuvfio.ops.attach_plan import plan_attach
from gpuvfio.ops.targets import SshOptions
from tests.conftest import gpu_workstation
from tests.contexts import SharedConnection, sim_context
from tests.simkernel import SimKernel
from tests.unit.test_plan_attach import AUDIO, GPU, _domains, kernel_file, tree_digest

libvirt = pytest.importorskip("libvirt")


def test_the_run_carries_out_the_plans_steps_and_its_placement(tmp_path, ssh_lane, monkeypatch):
    """The plan (read-only: the tree, the state dir and libvirt as before), then the run on a
    simulated kernel and libvirt's test driver, reaching this machine behind dropbear as the
    guest: the run's steps are the plan's, by name and order, and its placement is the plan's."""
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    host = gpu_workstation(tmp_path / "host")
    kernel = SimKernel(host.root)
    shared = SharedConnection()
    ctx = sim_context(host.root, kernel, connect=lambda uri: shared)
    server = ssh_lane.start(str(tmp_path / "guest"), env={"GPUVFIO_PROBE_ROOT": host.root})
    try:
        request = domain_request("planned-vm", vcpus=2, memory="2G", hugepages="none", firmware="bios",
                                 kernel=kernel_file(tmp_path))
        ssh = SshOptions(host="127.0.0.1", port=server.port, key=server.client_key,
                         known_hosts=server.known_hosts, timeout=20)
        wanted = [PciAddress.parse(GPU), PciAddress.parse(AUDIO)]
        before, domains = tree_digest(host.root), _domains(shared.conn)
        plan = plan_attach(ctx, wanted, request, ssh=ssh, uri="test:///default", verify=None)
        assert tree_digest(host.root) == before and not (tmp_path / "state").exists()
        assert _domains(shared.conn) == domains and "planned-vm" not in domains
        assert [s.kind.value for s in plan.steps] == ["bind", "define", "start", "wait for ssh"] and not plan.refused
        result = guests.attach(ctx, wanted, request, ssh=ssh, uri="test:///default", verify=None)
        assert result.ok and [s["step"] for s in result.steps] == [s.kind.value for s in plan.steps]
        assert all(s["ok"] for s in result.steps)
        assert result.placement == plan.placement and result.xml == plan.xml
        assert json.loads(json.dumps(result.to_json()))["placement"]["cells"][0]["node"] == 0
        assert kernel.driver_of(GPU) == "vfio-pci"
        # A second plan, with the guest running: refused in the words the run uses.
        again = plan_attach(ctx, wanted, request, ssh=ssh, uri="test:///default", verify=None)
        with pytest.raises(Refused) as refused:
            guests.attach(ctx, wanted, request, ssh=ssh, uri="test:///default", verify=None)
        assert str(refused.value) == str(again.refusal()) == "refused: domain planned-vm is running; gpuvfio " \
                                                              "detach planned-vm first"
        guests.detach(ctx, "planned-vm", uri="test:///default", timeout=0)
        assert kernel.driver_of(GPU) == "nvidia"
    finally:
        server.stop()
        shared.conn.close()
