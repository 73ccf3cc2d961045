"""Every command that changes the host has a dry run that is the run's own plan (issue 23 item 1):
detach, unbind, restore, reset, vgpu create/remove, xml --define.

Each dry run: the host tree, the state dir and libvirt's domains are as they were (a digest of
every name, link and byte); the exit is the run's (0, 1 refused, 2 bad input) with the run's
error line; and the run then does the plan's steps (a simulated kernel answers its writes).
"""

from __future__ import annotations

import os

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.ops import binding, vgpu
from gpuvfio.ops import unbind as unbinding
from gpuvfio.host.root import HostRoot
from gpuvfio.ops.binding import BindPolicy
from gpuvfio.ops.context import Context
from gpuvfio.ops.reset import plan_reset, reset
from tests.conftest import gpu_workstation
from tests.contexts import sim_context
from tests.hostbuilder import BAR32, BAR64_PREF, GiB, HostBuilder, KiB, MiB
from tests.simkernel import SimKernel
from tests.unit.test_plan_attach import tree_digest

libvirt = pytest.importorskip("libvirt")

GPU, AUDIO, NIC = "0000:01:00.0", "0000:01:00.1", "0000:03:00.0"
A = PciAddress.parse


def _errors(result) -> list[str]:
    return [line for line in result.err.splitlines() if "error:" in line]


@pytest.fixture
def bound(tmp_path, monkeypatch):
    """The workstation with its RTX 4090 slot bound to vfio-pci by gpuvfio (journaled), through
    a simulated kernel: (builder, kernel, state dir)."""
    state = tmp_path / "state"
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(state))
    host = gpu_workstation(tmp_path / "host")
    kernel = SimKernel(host.root)
    with sim_context(host.root, kernel) as ctx:
        binding.bind(ctx, [A(GPU), A(AUDIO)], BindPolicy())
    assert kernel.driver_of(GPU) == "vfio-pci"
    return host, kernel, state


@pytest.fixture
def test_driver():
    """libvirt's process-wide test driver, kept alive for the test (its domains live while a
    connection is open)."""
    conn = libvirt.open("test:///default")
    yield conn
    conn.close()


def _domains(conn) -> list[str]:
    return sorted(d.name() for d in conn.listAllDomains(0))


def test_restore_dry_run_lists_the_recorded_drivers_and_the_run_restores_them(cli, bound):
    host, kernel, state = bound
    before = tree_digest(host.root), tree_digest(str(state))
    dry = cli("--root", host.root, "restore", "--dry-run", "--json")
    assert dry.code == 0, dry.err
    plan = dry.json()
    assert plan["operation"] == "restore" and plan["target"] == "everything gpuvfio holds"
    assert [s["detail"] for s in plan["steps"]] == [f"{GPU}: back to nvidia", f"{AUDIO}: back to snd_hda_intel"]
    assert [(s["kind"], s["address"]) for s in plan["steps"]] == [("restore", GPU), ("restore", AUDIO)]
    assert (tree_digest(host.root), tree_digest(str(state))) == before
    with sim_context(host.root, kernel) as ctx:
        done = binding.restore(ctx, [])
    assert sorted(done.restored) == plan["devices"] == [GPU, AUDIO]
    assert [s.to_json()["kind"] for s in done.steps] == [s["kind"] for s in plan["steps"]]
    assert kernel.driver_of(GPU) == "nvidia" and kernel.driver_of(AUDIO) == "snd_hda_intel"
    # Nothing held now: the dry run says so and exits 0.
    again = cli("--root", host.root, "restore", "--dry-run")
    assert again.code == 0 and "dry run: nothing to do" in again.err


def test_restore_of_a_device_gpuvfio_does_not_hold_is_bad_input_in_the_dry_run_as_in_the_run(cli, bound):
    host, _kernel, state = bound
    before = tree_digest(host.root), tree_digest(str(state))
    dry = cli("--root", host.root, "restore", NIC, "--dry-run")
    run = cli("--root", host.root, "restore", NIC)
    assert dry.code == run.code == 2
    assert _errors(dry) == _errors(run) == [f"gpuvfio: error: not held by gpuvfio: {NIC} (see gpuvfio status)"]
    assert (tree_digest(host.root), tree_digest(str(state))) == before


def test_unbind_dry_run_shows_each_write_and_the_run_makes_them(cli, bound):
    host, kernel, state = bound
    before = tree_digest(host.root), tree_digest(str(state))
    dry = cli("--root", host.root, "unbind", "01:00", "--dry-run", "--json", "--connect", "none")
    assert dry.code == 0, dry.err
    plan = dry.json()
    assert [s["kind"] for s in plan["steps"]] == ["clear override", "unbind", "probe"] * 2
    assert [s["path"] for s in plan["steps"]][:3] == [f"/sys/bus/pci/devices/{GPU}/driver_override",
                                                      "/sys/bus/pci/drivers/vfio-pci/unbind", "/sys/bus/pci/drivers_probe"]
    assert {c["id"]: c["status"] for c in plan["checks"]} == {"libvirt": "warn", "journal": "warn"}
    assert (tree_digest(host.root), tree_digest(str(state))) == before
    with sim_context(host.root, kernel) as ctx:
        done = unbinding.unbind(ctx, [A(GPU), A(AUDIO)], uri="none")
    assert done.drivers == {GPU: "nvidia", AUDIO: "snd_hda_intel"}
    assert [(s.kind.value, s.address) for s in done.steps] == [(s["kind"], s["address"]) for s in plan["steps"]]


def test_unbind_of_a_device_a_domain_uses_is_refused_in_the_plans_words(bound, test_driver):
    """vfio-pci's release waits for the guest to let the device go: unbinding under a domain
    would hang the write, so the plan refuses it, and the run with the same words."""
    host, kernel, _state = bound
    test_driver.defineXML(
        "<domain type='test'><name>holds-gpu</name><memory>1048576</memory><os><type>hvm</type></os><devices>"
        "<hostdev mode='subsystem' type='pci' managed='no'><source><address domain='0' bus='1' slot='0' "
        "function='0'/></source></hostdev></devices></domain>")
    try:
        with sim_context(host.root, kernel) as ctx:
            plan = unbinding.plan_unbind(ctx, [A(GPU)], uri="test:///default")
            assert plan.refused and plan.refusals[0].message == f"in use by {GPU}: holds-gpu"
            with pytest.raises(Refused) as refused:
                unbinding.unbind(ctx, [A(GPU)], uri="test:///default")
            assert str(refused.value) == str(plan.refusal())
        assert kernel.driver_of(GPU) == "vfio-pci"
    finally:
        test_driver.lookupByName("holds-gpu").undefine()


def test_reset_dry_run_refuses_a_device_gpuvfio_does_not_hold_as_the_run(cli, bound):
    host, _kernel, state = bound
    before = tree_digest(host.root), tree_digest(str(state))
    dry = cli("--root", host.root, "reset", NIC, "--dry-run", "--json", "--connect", "none")
    run = cli("--root", host.root, "reset", NIC, "--connect", "none")
    assert dry.code == run.code == 1
    assert dry.json()["refused"][0].startswith("gpuvfio resets only devices it holds; not held: " + NIC)
    assert _errors(dry) == _errors(run)
    assert (tree_digest(host.root), tree_digest(str(state))) == before


def one_slot(root, reset_method: str | None) -> HostBuilder:
    """A root port with a GPU and its audio function (one group), the GPU's reset as given:
    "flr bus" (its reset file is there), "" (reset_method empty: the kernel offers none, no
    reset file) or None (a kernel without reset_method, and no reset file either)."""
    b = HostBuilder(str(root))
    b.iommu("intel", 1)
    cpus = b.cpu_topology(1, 4, 2)
    b.numa_node(0, cpus[0], 16, {2048: (0, 0)})
    rb = b.root_bus(numa=0)
    peg = b.bridge(rb, "0000:00:01.0", "8086", "a70d", secondary_bus=1, link=(4, 16))
    b.function(peg, GPU, "10de", "2684", "030000", driver="nvidia", link=(4, 16),
               bars=[(0, 16 * MiB, BAR32), (1, 32 * GiB, BAR64_PREF)], multifunction=True, reset_method=reset_method)
    b.function(peg, AUDIO, "10de", "22ba", "040300", driver="snd_hda_intel", bars=[(0, 16 * KiB, BAR32)])
    b.modules(["nvidia", "snd_hda_intel"])
    return b


def _bound_slot(tmp_path, monkeypatch, reset_method: str | None) -> tuple[HostBuilder, SimKernel]:
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    host = one_slot(tmp_path / "host", reset_method)
    kernel = SimKernel(host.root)
    with sim_context(host.root, kernel) as ctx:
        binding.bind(ctx, [A(GPU), A(AUDIO)], BindPolicy())
    assert kernel.driver_of(GPU) == "vfio-pci"
    return host, kernel


class CountingContext(Context):
    """A Context that counts its journal loads (the reset run's plan and settle share one)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.loads = 0

    def journal(self):
        self.loads += 1
        return super().journal()


def test_reset_plans_the_kernels_reset_file_and_the_run_writes_it(tmp_path, monkeypatch):
    host, kernel = _bound_slot(tmp_path, monkeypatch, "flr bus")
    reset_file = os.path.join("sys", "devices", "pci0000:00", "0000:00:01.0", GPU, "reset")
    with sim_context(host.root, kernel) as ctx:
        plan = plan_reset(ctx, [A(GPU)], uri="none")
    assert not plan.refused
    assert {k: plan.to_json()[k] for k in ("method", "devices", "reset")} == {
        "method": "function", "devices": [GPU], "reset": [reset_file]}
    assert [s["path"] for s in plan.to_json()["steps"] if s["kind"] == "reset"] == [f"/{reset_file}"]
    counting = CountingContext(host=HostRoot(host.root), backend=kernel, writable=True)
    with counting as ctx:
        report = reset(ctx, [A(GPU)], uri="none")
    assert counting.loads == 1  # one journal load for the plan and the settle
    assert report.reset == plan.to_json()["reset"] and report.method is plan.method
    assert [s.key for s in report.steps] == [s.key for s in plan.steps] == [("reset", None, None),
                                                                              ("settle", None, None)]
    assert report.devices == {GPU: None}


@pytest.mark.parametrize("reset_method, words", [
    ("", f"{GPU} has no reset method the kernel offers (reset_method is empty)"),
    (None, f"{GPU}: the kernel offers no reset for it"),
])
def test_reset_without_a_reset_method_is_refused_by_plan_and_run_alike(tmp_path, monkeypatch, reset_method, words):
    host, kernel = _bound_slot(tmp_path, monkeypatch, reset_method)
    assert not os.path.exists(os.path.join(host.root, "sys", "bus", "pci", "devices", GPU, "reset"))
    with sim_context(host.root, kernel) as ctx:
        plan = plan_reset(ctx, [A(GPU)], uri="none")
        assert plan.refused and [c.check_id for c in plan.refusals] == ["reset_method"]
        assert words in plan.refusals[0].message
        assert plan.to_json()["reset"] == []
        before = tree_digest(host.root)
        with pytest.raises(Refused) as refused:
            reset(ctx, [A(GPU)], uri="none")
    assert str(refused.value) == str(plan.refusal())
    assert tree_digest(host.root) == before


def test_detach_dry_run_and_xml_define_dry_run_leave_libvirt_as_it_is(cli, workstation, tmp_path, monkeypatch,
                                                                      test_driver):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    args = ["--root", workstation.root, "xml", GPU, "--name", "dry-vm", "--firmware", "bios",
            "--connect", "test:///default", "--json"]
    domains = _domains(test_driver)
    would = cli(*args, "--define", "--dry-run")
    assert would.code == 0 and would.json()["define"]["result"] == "would_define", would.err
    assert _domains(test_driver) == domains
    assert cli(*args, "--define").json()["define"]["result"] == "defined"
    try:
        changed = args + ["--vcpus", "2"]
        differs = cli(*changed, "--define", "--dry-run")
        run_differs = cli(*changed, "--define")
        assert differs.code == run_differs.code == 1  # differs without --update: exit 1, as the run
        assert differs.json()["define"]["result"] == run_differs.json()["define"]["result"] == "differs"
        update = cli(*changed, "--define", "--update", "--dry-run")
        assert update.code == 0 and update.json()["define"]["result"] == "would_update"
        xml = test_driver.lookupByName("dry-vm").XMLDesc(0)
        assert "<vcpu placement='static'>4</vcpu>" in xml or ">4</vcpu>" in xml  # not redefined
        # detach: stop (not running), undefine; no devices held: nothing to give back.
        dry = cli("--root", workstation.root, "detach", "dry-vm", "--connect", "test:///default", "--dry-run",
                  "--json")
        assert dry.code == 0, dry.err
        plan = dry.json()
        assert [s["kind"] for s in plan["steps"]] == ["stop", "undefine"]
        assert plan["steps"][0]["detail"] == "not running now; destroy after 60s if it runs by then" or \
            plan["steps"][0]["detail"].startswith("not running now; ACPI shutdown")
        assert "dry-vm" in _domains(test_driver)
    finally:
        test_driver.lookupByName("dry-vm").undefine()
    gone = cli("--root", workstation.root, "detach", "dry-vm", "--connect", "test:///default", "--dry-run")
    assert gone.code == 2 and _errors(gone) == ["gpuvfio: error: no domain named dry-vm"]


def test_detach_dry_run_refuses_a_domain_gpuvfio_did_not_define_as_the_run(cli, workstation, tmp_path,
                                                                           monkeypatch, test_driver):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    args = ["--root", workstation.root, "detach", "test", "--connect", "test:///default"]  # the driver's own
    dry, run = cli(*args, "--dry-run"), cli(*args)
    assert dry.code == run.code == 1
    assert _errors(dry) == _errors(run) == [
        "gpuvfio: error: refused: domain test was not created by gpuvfio; stop it with virsh"]
    assert "test" in _domains(test_driver)


@pytest.fixture
def vgpu_host(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    b = HostBuilder(str(tmp_path / "host"))
    b.iommu("amd")
    b.numa_node(0, list(range(8)), 64)
    rb = b.root_bus(numa=0)
    t4 = b.function(rb, "0000:82:00.0", "10de", "1eb8", "030200", driver="nvidia")
    b.mdev_types(t4, [("nvidia-222", "GRID T4-1B", 2, "1 GB"), ("nvidia-230", "GRID T4-16Q", 0, "16 GB")])
    return b, SimKernel(b.root), tmp_path / "state"


def test_vgpu_create_and_remove_dry_runs_are_the_runs_decisions(cli, vgpu_host):
    host, kernel, state = vgpu_host
    uuid = "0d2f9b9e-7a2f-4c35-9c4e-3f1a2b3c4d5e"
    before = tree_digest(host.root)
    dry = cli("--root", host.root, "vgpu", "create", "0000:82:00.0", "GRID T4-1B", "--uuid", uuid, "--dry-run",
              "--json")
    assert dry.code == 0, dry.err
    plan = dry.json()
    assert [(s["kind"], s["detail"]) for s in plan["steps"]] == [
        ("create vGPU", f"write {uuid} to 0000:82:00.0's mdev_supported_types/nvidia-222/create")]
    # No instance of GRID T4-16Q is left: refused in the dry run, as in the run.
    full = cli("--root", host.root, "vgpu", "create", "0000:82:00.0", "GRID T4-16Q", "--dry-run")
    assert full.code == 1
    assert tree_digest(host.root) == before and not state.exists()
    with sim_context(host.root, kernel) as ctx:
        with pytest.raises(Refused) as refused:
            vgpu.create(ctx, A("0000:82:00.0"), "GRID T4-16Q")
        assert _errors(full) == [f"gpuvfio: error: {refused.value}"]
        made = vgpu.create(ctx, A("0000:82:00.0"), "GRID T4-1B", uuid=uuid)
        assert (made.instance, made.type_id) == (uuid, plan["type"])
        assert [s.to_json()["kind"] for s in made.steps] == [s["kind"] for s in plan["steps"]]
    gone = cli("--root", host.root, "vgpu", "remove", uuid, "--dry-run", "--json")
    assert gone.code == 0 and [s["kind"] for s in gone.json()["steps"]] == ["remove vGPU", "forget vGPU"]
    unknown = cli("--root", host.root, "vgpu", "remove", "11111111-2222-3333-4444-555555555555", "--dry-run")
    assert unknown.code == 2 and "was not created by gpuvfio" in unknown.err
    assert os.path.lexists(os.path.join(host.root, "sys", "bus", "mdev", "devices", uuid))


def test_a_dry_run_plan_raises_bad_input_not_a_plan(bound):
    host, kernel, _state = bound
    with sim_context(host.root, kernel) as ctx:
        with pytest.raises(InputError):
            unbinding.plan_unbind(ctx, [])
        with pytest.raises(InputError):
            plan_reset(ctx, [A(GPU)], bus=True, forget=True)


def test_testbed_run_dry_run_is_testbed_plan_and_writes_no_out_dir(cli, workstation, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    spec = tmp_path / "spec.toml"
    disk = tmp_path / "g.qcow2"  # a guest that can boot (issue 33 item 2)
    disk.write_bytes(b"QFI\xfb")
    spec.write_text(f'[guest]\ndisk = "{disk}"\nvcpus = 2\nmemory = "2G"\n'
                    'firmware = "bios"\n[guest.ssh]\nport = 2222\n\n[run]\ngpus = ["01:00"]\n\n[[variant]]\n'
                    'name = "pt"\nkind = "passthrough"\nhugepages = "none"\n')
    out = tmp_path / "out"
    before = tree_digest(workstation.root)
    plan = cli("--root", workstation.root, "testbed", "plan", str(spec), "--json", "--yes")
    dry = cli("--root", workstation.root, "testbed", "run", str(spec), "--out", str(out), "--dry-run", "--json",
              "--yes")
    assert plan.code == dry.code == 0, dry.err
    assert dry.json() == plan.json()
    text = cli("--root", workstation.root, "testbed", "run", str(spec), "--out", str(out), "--dry-run", "--yes")
    assert "   attach steps: bind, define, start, wait for ssh, verify" in text.out
    # 01:00 is two functions of one device: no --yes needed; -d 10de: reaches two GPUs.
    spec.write_text(spec.read_text().replace('gpus = ["01:00"]', 'gpu_ids = ["10de::0300"]'))
    unconfirmed = cli("--root", workstation.root, "testbed", "run", str(spec), "--out", str(out), "--dry-run")
    assert unconfirmed.code == 1 and "add --yes" in unconfirmed.err and "== pt (passthrough)" in unconfirmed.out
    assert not out.exists() and tree_digest(workstation.root) == before and not (tmp_path / "state").exists()


def test_a_read_only_context_cannot_write_by_construction(bound, tmp_path, monkeypatch):
    """A dry run's Context (and a recording's): its state dir refuses every write, its sysfs
    writer and modprobe/systemctl refuse, it takes no lock. So a run carried out on it by
    mistake stops at its first change, with nothing changed."""
    from gpuvfio.files import ReadOnly
    from gpuvfio.read_only_tree import ReadOnlyTree
    from gpuvfio.host.root import HostRoot
    from gpuvfio.ops.context import Context

    host, _kernel, state = bound
    ctx = Context(host=HostRoot(host.root))
    assert isinstance(ctx.state, ReadOnlyTree) and ctx.state.path() == str(state)
    assert ctx.journal().devices  # reading works
    before = tree_digest(host.root), tree_digest(str(state))
    for attempt in (lambda: ctx.state.write("journal.json", "{}"), lambda: ctx.state.make_dir("x"),
                    lambda: ctx.state.remove("journal.json"), lambda: ctx.state.open_lock("lock"),
                    lambda: ctx.state.sub("a").write("b", "c"), ctx.lock,
                    lambda: ctx.writer().write(os.path.join(host.root, "sys", "bus", "pci", "drivers_probe"), GPU),
                    lambda: binding.restore(ctx, []), lambda: unbinding.unbind(ctx, [A(GPU)], uri="none"),
                    lambda: ctx.host.tree.write("etc/gpuvfio-probe", "x")):  # the host's own files too
        with pytest.raises(ReadOnly):
            attempt()
    with pytest.raises(GpuvfioError, match="this context only reads"):  # persist's files: none written
        binding.run_persist(ctx, binding.plan_persist(ctx, [A(GPU)]))
    with pytest.raises(Exception, match="not the live host"):
        ctx.host_actions().modprobe("vfio-pci")
    assert (tree_digest(host.root), tree_digest(str(state))) == before
    # The state dir is decided when the Context is built, not read from the environment later.
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "elsewhere"))
    assert ctx.state.path() == str(state) and ctx.journal().devices


def test_a_read_only_context_opens_libvirt_read_only(tmp_path):
    """A Context that only reads opened libvirt read-write, so a service carried out on it by
    mistake could define, start or destroy a domain. It now opens libvirt's read-only connection
    (virConnectOpenReadOnly): listing and reading work, every change is refused by libvirt."""
    import libvirt

    reader = Context(host=HostRoot(str(tmp_path)))
    conn = reader.libvirt("test:///default")
    dom = conn.lookupByName("test")
    assert dom.isActive() and "<name>test</name>" in dom.XMLDesc(0)
    for change in (dom.destroy, dom.undefine, lambda: conn.defineXML(dom.XMLDesc(0))):
        with pytest.raises(libvirt.libvirtError, match="read only access"):
            change()
    writer = Context(host=HostRoot(str(tmp_path)), writable=True)
    other = writer.libvirt("test:///default").lookupByName("test")
    other.suspend()  # a context that may write still may (its own test driver instance)
    assert other.info()[0] == libvirt.VIR_DOMAIN_PAUSED


def test_detach_is_planned_and_run_under_the_run_lock(cli, workstation, tmp_path, monkeypatch, test_driver):
    """Issue 33 item 4: detach planned outside the lock, then stopped and undefined the domain
    before the release met the lock another run held. Now it waits for the lock first, and on a
    timeout leaves the domain as it was."""
    from gpuvfio.bind.journal import LockTimeout
    from gpuvfio.ops import guests
    from tests.contexts import lock_held_elsewhere, sim_context

    state = tmp_path / "state"
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(state))
    defined = cli("--root", workstation.root, "xml", GPU, "--name", "locked-vm", "--firmware", "bios",
                  "--connect", "test:///default", "--define", "--json")
    assert defined.code == 0, defined.err
    test_driver.lookupByName("locked-vm").create()
    try:
        with lock_held_elsewhere(state, "gpuvfio attach other 01:00"), sim_context(workstation.root) as ctx:
            ctx.lock_timeout = 0.5
            with pytest.raises(LockTimeout, match="gpuvfio attach other 01:00"):
                guests.detach(ctx, "locked-vm", uri="test:///default", timeout=0)
        dom = test_driver.lookupByName("locked-vm")
        assert dom.isActive(), "stopped although another run held the lock"
    finally:
        dom = test_driver.lookupByName("locked-vm")
        if dom.isActive():
            dom.destroy()
        dom.undefine()
