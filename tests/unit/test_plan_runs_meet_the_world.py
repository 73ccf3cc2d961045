"""The typed plans of issue 33 item 4 against what changes between plan and run, and against
the cases a review found them wrong in: a partition activated for GPUs gpuvfio did not bind,
a guest started or undefined behind gpuvfio's back (libvirt is not under its run lock), a
testbed resumed over a running leftover or with nothing left to do, an existing mdev
persisted, the journal's mark of a bind that died half-way."""

from __future__ import annotations

import json
import os

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.bind.journal import Journal
from gpuvfio.host.state import state_dir
from gpuvfio.domain.request import domain_request
from gpuvfio.errors import GpuvfioError
from gpuvfio.ops import binding, domains, fabric, guests, vgpu
from gpuvfio.ops.attach_plan import plan_attach
from gpuvfio.ops.binding import BindPolicy
from gpuvfio.ops.targets import ssh_options
from gpuvfio.testbed.plan import gpus_on, plan as plan_a_testbed, request_for
from gpuvfio.testbed.run import run_testbed
from gpuvfio.testbed.spec import load_spec
from tests.conftest import gpu_workstation
from tests.contexts import lock_held_elsewhere, sim_context
from tests.lanes.guest import free_port
from tests.simkernel import SimKernel
from tests.unit.test_fabric import dgx, dgx_tree, fm, gpus  # noqa: F401 - fixtures
from tests.unit.test_fabric_flow import shared  # noqa: F401 - fixture

libvirt = pytest.importorskip("libvirt")
A = PciAddress.parse
SLOT = [A("0000:01:00.0"), A("0000:01:00.1")]


@pytest.fixture
def workstation(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    built = gpu_workstation(tmp_path / "host")
    return built, SimKernel(built.root)


@pytest.mark.parametrize("restore", [True, False])
def test_detach_deactivates_the_partition_it_activated_for_gpus_gpuvfio_does_not_hold(shared, restore):
    ctx, fm = shared
    name = f"partition-{restore}"
    provisioned = domains.provision_xml(ctx, gpus(5, 6, 7, 8), domain_request(
        name, vcpus=4, memory="16G", numa="none", firmware="bios"), uri="test:///default")
    domains.run_define(ctx, domains.plan_define(ctx, provisioned.xml, uri="test:///default"))
    assert fabric.activate(ctx, provisioned.spec.fabric) == [2]
    assert not Journal.load(state_dir(ctx.host)).devices  # on vfio-pci before: the bind moved none
    plan = guests.plan_detach(ctx, name, uri="test:///default", timeout=0, restore=restore)
    done = guests.detach(ctx, name, uri="test:///default", timeout=0, restore=restore)
    assert fm.active() == set() and done.partitions == ["2"]
    assert [s.key for s in done.steps] == [s.key for s in plan.steps]


def test_detach_stops_a_guest_started_after_its_plan(workstation):
    built, kernel = workstation
    with sim_context(built.root, kernel) as ctx:
        binding.bind(ctx, SLOT, BindPolicy())
        xml = domains.provision_xml(ctx, SLOT, domain_request("started-late", firmware="bios"),
                                    uri="test:///default").xml
        domains.run_define(ctx, domains.plan_define(ctx, xml, uri="test:///default"))
        conn = ctx.libvirt("test:///default")
        with binding.operation_lock(ctx):
            plan = guests.plan_detach(ctx, "started-late", uri="test:///default", timeout=0)
            conn.lookupByName("started-late").create()  # virsh start meanwhile
            done = guests.run_detach(ctx, plan)
        assert done.stopped == "destroyed" and "started-late" not in [d.name() for d in conn.listAllDomains(0)]
    assert kernel.driver_of("0000:01:00.0") == "nvidia"


def test_attach_refuses_in_one_line_when_libvirt_changed_after_its_plan(workstation, tmp_path):
    """The define step carries out its plan only while libvirt holds what the plan read; a
    domain undefined meanwhile fails the run (rolled back), never a traceback."""
    built, kernel = workstation
    disk = tmp_path / "g.qcow2"
    disk.write_bytes(b"QFI\xfb")
    request = domains.domain_request("changed-behind", firmware="bios", disk=str(disk))
    ssh = ssh_options(host="127.0.0.1", port=free_port(), timeout=1, trust_on_first_use=True)
    with sim_context(built.root, kernel) as ctx:
        first = plan_attach(ctx, SLOT, request, ssh=ssh, uri="test:///default", policy=BindPolicy(), verify=None)
        domains.run_define(ctx, domains.plan_define(ctx, first.xml, uri="test:///default"))
        plan = plan_attach(ctx, SLOT, request, ssh=ssh, uri="test:///default", policy=BindPolicy(), verify=None)
        assert plan.define.outcome == "unchanged"
        ctx.libvirt("test:///default").lookupByName("changed-behind").undefine()
        with pytest.raises(guests.AttachFailed, match="definition of changed-behind changed since the plan"):
            guests.run_attach(ctx, plan)
    assert kernel.driver_of("0000:01:00.0") == "nvidia"  # the bind was rolled back


def _spec(tmp_path, name: str, disk: str, port: int) -> str:
    path = tmp_path / "spec.toml"
    path.write_text(f'[guest]\ndisk = "{disk}"\nvcpus = 2\nmemory = "2G"\nfirmware = "bios"\n'
                    f'[guest.ssh]\nport = {port}\nboot_timeout = 1\ntrust_on_first_use = true\n\n'
                    '[run]\nrepetitions = 1\ngpus = ["01:00"]\nconnect = "test:///default"\n\n'
                    f'[[variant]]\nname = "{name}"\nkind = "passthrough"\nhugepages = "none"\nnuma = "none"\n')
    return str(path)


def test_a_resumed_testbed_detaches_a_running_leftover_then_attaches(workstation, tmp_path):
    built, kernel = workstation
    disk = tmp_path / "g.qcow2"
    disk.write_bytes(b"QFI\xfb")
    spec = load_spec(_spec(tmp_path, "leftover", str(disk), free_port()))
    seen: list[str] = []
    with sim_context(built.root, kernel, progress=seen.append) as ctx:
        gpus_now = gpus_on(ctx, spec, yes=True)
        request = request_for(ctx, spec, spec.variants[0], gpus_now)
        binding.bind(ctx, SLOT, BindPolicy())  # what an interrupted run leaves: bound, defined, running
        domains.run_define(ctx, domains.plan_define(
            ctx, domains.provision_xml(ctx, gpus_now, request, uri="test:///default").xml, uri="test:///default"))
        ctx.libvirt("test:///default").lookupByName(request.name).create()
        with pytest.raises(GpuvfioError, match="did not answer SSH"):  # the attach ran: no guest OS here
            run_testbed(ctx, spec, str(tmp_path / "out"), uri="test:///default")
    assert any("left from an interrupted run" in line for line in seen)
    record = json.loads((tmp_path / "out" / "results" / "leftover" / "steps.json").read_text())
    assert [s["kind"] for s in record["taken"]] == ["detach leftover", "teardown"]


@pytest.mark.parametrize("line, said", [("", "ACPI shutdown, destroyed after 60s"),
                                         ("stop_timeout = 0\n", "destroyed; devices given back"),
                                         ("stop_timeout = 2.5\n", "ACPI shutdown, destroyed after 2.5s")])
def test_a_testbed_stops_its_guests_as_its_spec_says(workstation, tmp_path, monkeypatch, line, said):
    """The teardown waited 10 s for the guest's ACPI shutdown whatever the spec: [run] stop_timeout
    (the table's, detach's --stop-timeout) is the wait the plan shows and the run hands detach."""
    built, kernel = workstation
    disk = tmp_path / "g.qcow2"
    disk.write_bytes(b"QFI\xfb")
    path = _spec(tmp_path, "stops", str(disk), free_port())
    with open(path, encoding="utf-8") as handle:
        text = handle.read().replace("[run]\n", "[run]\n" + line, 1)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    spec = load_spec(path)
    waits: list[float] = []
    real_detach = guests.detach
    monkeypatch.setattr(guests, "detach", lambda *a, **k: (waits.append(k["timeout"]), real_detach(*a, **k))[1])
    with sim_context(built.root, kernel) as ctx:
        planned = plan_a_testbed(ctx, spec, uri="test:///default", yes=True)
        assert said in planned.variants[0].steps[-1].detail
        # A guest left running by an interrupted run: detached first, with the spec's wait.
        request = request_for(ctx, spec, spec.variants[0], gpus_on(ctx, spec, yes=True))
        binding.bind(ctx, SLOT, BindPolicy(), uri="test:///default")
        domains.run_define(ctx, domains.plan_define(
            ctx, domains.provision_xml(ctx, SLOT, request, uri="test:///default").xml, uri="test:///default"))
        ctx.libvirt("test:///default").lookupByName(request.name).create()
        with pytest.raises(GpuvfioError, match="did not answer SSH"):  # no guest OS here
            run_testbed(ctx, spec, str(tmp_path / "out"), uri="test:///default")
    assert waits == [spec.stop_timeout] and spec.stop_timeout == float(said.split("after ")[-1].rstrip("s")
                                                                       if "after" in said else 0)


def test_a_testbed_with_every_repetition_done_takes_no_lock(workstation, tmp_path):
    built, kernel = workstation
    out = tmp_path / "out"
    os.makedirs(out / "results" / "done")
    (out / "identity.json").write_text(json.dumps({"gpus": ["0000:01:00.0", "0000:01:00.1"]}))
    (out / "results" / "done" / "rep-0.json").write_text("{}")
    spec = load_spec(_spec(tmp_path, "done", "/nonexistent.qcow2", 2222))
    with lock_held_elsewhere(tmp_path / "state", "gpuvfio attach"):
        with sim_context(built.root, kernel) as ctx:
            assert run_testbed(ctx, spec, str(out), uri="test:///default") == {"done": {"ran": 0}}


def test_persisting_an_existing_mdev_is_a_step_of_its_plan(tmp_path, monkeypatch):
    from tests.unit.test_dry_runs import vgpu_host

    built, kernel, _state = vgpu_host.__wrapped__(tmp_path, monkeypatch)
    uuid = "0d2f9b9e-7a2f-4c35-9c4e-3f1a2b3c4d5e"
    gpu = A("0000:82:00.0")
    with sim_context(built.root, kernel) as ctx:
        vgpu.create(ctx, gpu, "GRID T4-1B", uuid=uuid)
        planned = vgpu.plan_create(ctx, gpu, "GRID T4-1B", uuid=uuid, persist=True)
        made = vgpu.create(ctx, gpu, "GRID T4-1B", uuid=uuid, persist=True)
    assert [s.kind.value for s in planned.steps] == ["persist vGPU"] and made.persisted
    assert [s.key for s in made.steps] == [s.key for s in planned.steps]


def test_restore_clears_the_mark_of_a_bind_that_died_with_nothing_held(workstation):
    built, kernel = workstation
    with sim_context(built.root, kernel) as ctx:
        binding.bind(ctx, SLOT, BindPolicy())
        binding.restore(ctx, [])
        journal = ctx.journal()
        journal.data["operation"] = {"kind": "bind", "pid": 1, "started": 0, "devices": [], "steps": []}
        journal.save()
        plan = binding.plan_restore(ctx, [])
        done = binding.restore(ctx, [])
        assert ctx.journal().data["operation"] is None
    assert [s.kind.value for s in plan.steps] == ["forget unfinished operation"]
    assert [s.key for s in done.steps] == [s.key for s in plan.steps]


class CountingConnection:
    """libvirt's test driver, counting how often its domains are listed."""

    def __init__(self):
        self.conn, self.listings = libvirt.open("test:///default"), 0

    def listAllDomains(self, flags=0):  # noqa: N802 - libvirt's name
        self.listings += 1
        return self.conn.listAllDomains(flags)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_an_attach_plan_lists_libvirts_domains_once(workstation, tmp_path):
    """Issue 36 item 2: the plan asked libvirt for every domain twice, once for the domains using
    the devices, once for the vCPU pins of the others. Now its questions share one listing; a
    plan made after it (the run's, under the lock) lists afresh."""
    built, kernel = workstation
    disk = tmp_path / "g.qcow2"
    disk.write_bytes(b"QFI\xfb")
    request = domains.domain_request("listed-once", firmware="bios", disk=str(disk))
    ssh = ssh_options(host="127.0.0.1", port=free_port(), timeout=1, trust_on_first_use=True)
    counting = CountingConnection()
    with sim_context(built.root, kernel, connect=lambda uri: counting) as ctx:
        plan = plan_attach(ctx, SLOT, request, ssh=ssh, uri="test:///default", policy=BindPolicy(), verify=None)
        assert not plan.refused and counting.listings == 1
        plan_attach(ctx, SLOT, request, ssh=ssh, uri="test:///default", policy=BindPolicy(), verify=None)
        assert counting.listings == 2 and ctx.listing is None



def test_a_testbed_plan_lists_libvirts_domains_once_for_all_its_variants(workstation, tmp_path):
    """Issue 36 item 2: each variant's attach plan listed libvirt's domains anew (one listing per
    variant); the testbed plan is one plan, its variants share one listing."""
    built, kernel = workstation
    disk = tmp_path / "g.qcow2"
    disk.write_bytes(b"QFI\xfb")
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[guest]\ndisk = "{disk}"\nvcpus = 2\nmemory = "2G"\nfirmware = "bios"\n[guest.ssh]\n'
                    'port = 2222\n\n[run]\ngpus = ["01:00"]\n\n[[variant]]\nname = "pt"\nkind = "passthrough"\n'
                    'hugepages = "none"\n\n[[variant]]\nname = "pt-again"\nkind = "passthrough"\n'
                    'hugepages = "none"\nnuma = "none"\n')
    counting = CountingConnection()
    with sim_context(built.root, kernel, connect=lambda uri: counting) as ctx:
        planned = plan_a_testbed(ctx, load_spec(str(spec)), uri="test:///default", yes=True)
        assert [v.target for v in planned.variants] == ["pt", "pt-again"] and planned.refused == []
        assert counting.listings == 1 and ctx.listing is None