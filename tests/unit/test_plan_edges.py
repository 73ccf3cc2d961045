"""The bind plan's edges, decided on real sysfs-shaped trees (tests/hostbuilder.py) and read
through the real inventory and kernel readers: every check a plan carries (its id, verdict and
words), every step it orders, and the plan's JSON as a dry run shows it.

The kernel facts the plan follows are Documentation/ABI/testing/sysfs-bus-pci's bind by address
(driver_override, unbind, drivers_probe); VFIO hands out whole IOMMU groups."""

from __future__ import annotations

import os

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.bind.plan import BindPlan, BindPolicy, BindReport, BindStatus, LibvirtView, plan_bind
from gpuvfio.errors import InputError
from gpuvfio.host.fabric import Decision
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.kernel import read_kernel
from gpuvfio.host.root import HostRoot
from gpuvfio.ops import binding
from gpuvfio.planning import Check, CheckStatus, Step, StepKind
from tests.conftest import gpu_workstation
from tests.contexts import sim_context
from gpuvfio.host.pcie_health import read_records
from tests.hostbuilder import BAR32, BAR64_PREF, GiB, HostBuilder, KiB, MiB, write_uevent

A = PciAddress.parse
GPU, AUDIO, NIC, GPU2, AUDIO2 = "0000:01:00.0", "0000:01:00.1", "0000:03:00.0", "0000:04:00.0", "0000:04:00.1"
NOT_ASKED = LibvirtView(not_asked="libvirt not asked (--connect none)")
GPU_OK = "the host itself does not use {} (no mounted disk, swap, route, address or console on them)"


def plan(b: HostBuilder, *addresses: str, policy: BindPolicy = BindPolicy(), libvirt: LibvirtView = NOT_ASKED,
         broken: dict | None = None, names=None) -> BindPlan:
    """plan_bind on the tree as it is now, read as gpuvfio reads it."""
    host = HostRoot(b.root)
    records = None if broken is None else read_records(host, None, broken)
    return plan_bind(host, read_inventory(host, names=names), read_kernel(host), [A(a) for a in addresses], policy,
                     libvirt, records)


def said(p: BindPlan, *ids: str) -> list[tuple[str, str, str]]:
    """The plan's checks (of ``ids``, or all) as (id, verdict, message), in order."""
    return [(c.check_id, c.status.value, c.message) for c in p.checks if not ids or c.check_id in ids]


def write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text)


@pytest.fixture
def ws(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    return gpu_workstation(tmp_path / "host")


def attr(b: HostBuilder, address: str, name: str, value: str) -> None:
    write(os.path.join(b.functions[A(address)].path, name), value + "\n")


# -- the plan as JSON --------------------------------------------------------------------------

def test_the_plans_json_is_what_the_dry_run_prints_for_devices_steps_and_checks(cli, ws):
    """An admin (or Ansible) reads the dry run's devices, steps and checks: the plan's own JSON
    must carry the same fields, with step paths as the host names them."""
    ws.driver("vfio-pci")  # loaded: no modprobe, so a recorded root adds no live-host note
    with sim_context(ws.root) as ctx:
        bind_plan, report = binding.plan_report(ctx, [A(GPU)], BindPolicy(), uri="none")
    shown = bind_plan.to_json(ws.root)
    assert list(shown) == ["devices", "steps", "checks"]
    assert shown["devices"] == [GPU, AUDIO]
    assert [(s["kind"], s["path"]) for s in shown["steps"]] == [
        ("override", f"/sys/bus/pci/devices/{GPU}/driver_override"),
        ("override", f"/sys/bus/pci/devices/{AUDIO}/driver_override"),
        ("unbind", "/sys/bus/pci/drivers/nvidia/unbind"), ("unbind", "/sys/bus/pci/drivers/snd_hda_intel/unbind"),
        ("probe", "/sys/bus/pci/drivers_probe"), ("probe", "/sys/bus/pci/drivers_probe")]
    assert shown["checks"][0] == {"id": "iommu", "status": "ok", "message": "intel IOMMU with 4 groups",
                                  "overridable": False}
    assert shown["checks"] == [c.to_json() for c in bind_plan.checks]
    assert {k: report.to_json()[k] for k in shown} == shown
    # Without a root the paths are this process's own (where the tree lies).
    assert bind_plan.to_json()["steps"][0]["path"] == os.path.join(ws.root, "sys", "bus", "pci", "devices", GPU,
                                                                  "driver_override")
    dry = cli("--root", ws.root, "bind", GPU, "--dry-run", "--json", "--connect", "none")
    assert dry.code == 0, dry.err
    assert {k: dry.json()[k] for k in shown} == shown


def test_a_plan_with_no_root_and_its_report_carry_what_was_decided(ws):
    """The report a run and a dry run print: its fabric decision and result only when there is one,
    a plan with nothing moving reported as nothing to do."""
    p = plan(ws, GPU)
    report = BindReport.of(p, p.refusals(False), root=ws.root)
    out = report.to_json()
    assert list(out) == ["devices", "steps", "checks", "moving", "refused"]
    assert out["moving"] == [GPU, AUDIO] and out["refused"] == [] and report.status is None
    assert out["steps"][1]["path"] == f"/sys/bus/pci/devices/{GPU}/driver_override"
    decision = Decision("none", None)
    judged = BindReport.of(p, p.refusals(False), root=ws.root, fabric=decision)
    assert judged.fabric is decision and judged.root == ws.root
    judged.status = BindStatus.DRY_RUN
    assert judged.to_json()["fabric"] == decision.to_json() and judged.to_json()["result"] == "dry_run"
    assert list(judged.to_json()) == ["devices", "steps", "checks", "moving", "refused", "fabric", "result"]
    ws.driver("vfio-pci")
    for address in (GPU, AUDIO):
        ws.bind(A(address), "vfio-pci")
    done = plan(ws, GPU)
    assert done.nothing_to_do and done.moving == [] and done.steps == []
    assert BindReport.of(done, []).status is BindStatus.NOTHING_TO_DO
    assert BindReport.of(done, []).to_json()["result"] == "nothing_to_do"


def test_force_overrides_only_the_refusals_marked_overridable(ws):
    """--force takes the boot console (overridable) but never an ACS-override kernel (not): warnings
    and passes are never refusals."""
    attr(ws, GPU, "boot_vga", "1")
    ws.cmdline("ro intel_iommu=on pcie_acs_override=downstream")
    ws.holder(900, "nvidia-persiste", ["/dev/nvidiactl"])
    p = plan(ws, GPU, policy=BindPolicy(stop_services=True))
    assert [(c.check_id, c.overridable) for c in p.refusals(False)] == [("acs_override", False), ("boot_vga", True)]
    assert [c.check_id for c in p.refusals(True)] == ["acs_override"]
    assert ("services", "warn", "nvidia-persistenced (pid 900) will be stopped and restarted by gpuvfio restore") \
        in said(p)


def test_no_address_is_bad_input(ws):
    """A bind of nothing is the admin's mistake, said before anything is read."""
    with pytest.raises(InputError, match="no PCI address given"):
        plan(ws)


def server(root) -> HostBuilder:
    """A host with a GPU + audio in one group, a NIC, an NVSwitch and a USB controller with no
    driver, each alone in its group; vfio-pci not loaded but loadable."""
    b = HostBuilder(str(root))
    b.iommu("amd", 1)
    cpus = b.cpu_topology(1, 4, 2)
    b.numa_node(0, cpus[0], 32)
    rb = b.root_bus(numa=0)
    group = b.new_group()
    port = b.bridge(rb, "0000:00:01.0", "1022", "1483", secondary_bus=1, group=group)
    b.function(port, GPU, "10de", "2330", "030200", driver="nvidia", group=group, multifunction=True,
               bars=[(0, 16 * MiB, BAR32), (1, 8 * GiB, BAR64_PREF)])
    b.function(port, AUDIO, "10de", "22ba", "040300", driver="snd_hda_intel", group=group,
               bars=[(0, 16 * KiB, BAR32)])
    nic = b.bridge(rb, "0000:00:02.0", "1022", "1483", secondary_bus=3)
    b.function(nic, NIC, "8086", "1533", "020000", driver="igb")
    sw = b.bridge(rb, "0000:00:05.0", "1022", "1483", secondary_bus=5)
    b.function(sw, "0000:05:00.0", "10de", "22a3", "068000", driver="nvidia")
    usb = b.bridge(rb, "0000:00:06.0", "1022", "1483", secondary_bus=6)
    b.function(usb, "0000:06:00.0", "1b21", "2142", "0c0330")
    b.modules(["nvidia", "snd_hda_intel", "igb"])
    return b


@pytest.fixture
def srv(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    return server(tmp_path / "host")


def test_a_function_that_is_no_gpu_is_said_so_and_a_gpus_companions_are_not(srv):
    """NICs and USB controllers go to guests beside GPUs: the plan tells the admin such a function is
    no GPU, by its class name (pci.ids) or its class code; an NVSwitch (NVIDIA) or a GPU's audio
    function is part of the GPU passthrough and needs no such note."""
    from gpuvfio.host.pciids import PciIds

    usb = "0000:06:00.0"
    assert said(plan(srv, usb), "host_use")[0] == (
        "host_use", "ok", f"{usb} is not a GPU (0c0330); nothing on the host uses it")
    named = plan(srv, usb, NIC, names=PciIds.load(HostRoot(srv.root)))
    assert said(named, "host_use") == [
        ("host_use", "ok", f"{NIC} is not a GPU (Ethernet controller); nothing on the host uses it"),
        ("host_use", "ok", f"{usb} is not a GPU (USB controller); nothing on the host uses it"),
        ("host_use", "ok", GPU_OK.format(f"{NIC}, {usb}"))]
    assert said(plan(srv, "0000:05:00.0"), "host_use") == [("host_use", "ok", GPU_OK.format("0000:05:00.0"))]
    srv.bind(A(GPU), "vfio-pci")  # only the audio function moves: it sits in the GPU's slot
    assert said(plan(srv, AUDIO), "host_use") == [("host_use", "ok", GPU_OK.format(AUDIO))]


def test_the_steps_are_the_kernels_bind_by_address_in_order(srv):
    """sysfs-bus-pci: every driver_override first, then each unbind from its driver (none for a
    function with no driver), then drivers_probe expecting vfio-pci; vfio-pci is loaded first."""
    srv.holder(900, "nvidia-persiste", ["/dev/nvidiactl"])
    srv.holder(901, "nv-hostengine", ["/dev/nvidiactl"])
    p = plan(srv, "0000:06:00.0", GPU, policy=BindPolicy(stop_services=True))
    sys_ = os.path.join(srv.root, "sys", "bus", "pci")
    assert p.steps == [
        Step(StepKind.MODPROBE, name="vfio-pci"),
        Step(StepKind.STOP_SERVICE, name="nvidia-dcgm"),
        Step(StepKind.STOP_SERVICE, name="nvidia-persistenced"),
        Step(StepKind.OVERRIDE, GPU, os.path.join(sys_, "devices", GPU, "driver_override"), "vfio-pci"),
        Step(StepKind.OVERRIDE, AUDIO, os.path.join(sys_, "devices", AUDIO, "driver_override"), "vfio-pci"),
        Step(StepKind.OVERRIDE, "0000:06:00.0", os.path.join(sys_, "devices", "0000:06:00.0", "driver_override"),
             "vfio-pci"),
        Step(StepKind.UNBIND, GPU, os.path.join(sys_, "drivers", "nvidia", "unbind"), GPU, name="nvidia"),
        Step(StepKind.UNBIND, AUDIO, os.path.join(sys_, "drivers", "snd_hda_intel", "unbind"), AUDIO,
             name="snd_hda_intel"),
        Step(StepKind.PROBE, GPU, os.path.join(sys_, "drivers_probe"), GPU, expect="vfio-pci"),
        Step(StepKind.PROBE, AUDIO, os.path.join(sys_, "drivers_probe"), AUDIO, expect="vfio-pci"),
        Step(StepKind.PROBE, "0000:06:00.0", os.path.join(sys_, "drivers_probe"), "0000:06:00.0",
             expect="vfio-pci")]
    assert p.requested == [A(GPU), A("0000:06:00.0")] and p.devices == [A(GPU), A(AUDIO), A("0000:06:00.0")]
    assert p.moving == p.devices and p.services == ["nvidia-dcgm", "nvidia-persistenced"]
    assert p.originals == {A(GPU): ("nvidia", None), A(AUDIO): ("snd_hda_intel", None),
                           A("0000:06:00.0"): (None, None)}
    assert p.groups == {A(GPU): 0, A(AUDIO): 0, A("0000:06:00.0"): 6}
    assert said(p, "services") == [
        ("services", "warn", "nvidia-dcgm (pid 901) will be stopped and restarted by gpuvfio restore"),
        ("services", "warn", "nvidia-persistenced (pid 900) will be stopped and restarted by gpuvfio restore")]


@pytest.mark.parametrize("setup, modprobe, words", [
    ("loaded", False, [("vfio_modules", "ok", "vfio-pci loaded")]),
    ("loadable", True, [("vfio_modules", "ok", "vfio-pci loadable")]),
    ("builtin", True, [("vfio_modules", "ok", "vfio-pci loadable")]),
    ("missing", False, [("vfio_modules", "refuse", "vfio-pci is neither loaded nor in this kernel's modules "
                                                   "(see gpuvfio doctor)"),
                        ("vfio_modules", "ok", "vfio-pci loadable")]),
])
def test_vfio_pci_is_loaded_first_or_the_bind_is_refused(srv, setup, modprobe, words):
    """A kernel whose vfio-pci is neither loaded, in modules.dep nor in modules.builtin cannot take
    the devices: refused before any write; a loaded one needs no modprobe."""
    if setup == "loaded":
        srv.driver("vfio-pci")
    elif setup == "builtin":
        srv.modules(["nvidia", "snd_hda_intel", "igb"], available=[], builtin=["vfio_pci"])
    elif setup == "missing":
        srv.modules(["nvidia", "snd_hda_intel", "igb"], available=["vfio", "vfio_iommu_type1"])
    p = plan(srv, NIC)
    assert said(p, "vfio_modules") == words
    assert [s.kind for s in p.steps] == ["modprobe"] * modprobe + ["override", "unbind", "probe"]
    if modprobe:
        assert p.steps[0] == Step(StepKind.MODPROBE, name="vfio-pci")


def test_devices_already_on_vfio_pci_stay_out_of_the_moves(srv):
    """A function already on vfio-pci is part of the group (and of the originals the journal keeps)
    but gets no step; with nothing to move, no module check and no step at all."""
    srv.bind(A(AUDIO), "vfio-pci")
    attr(srv, AUDIO, "driver_override", "vfio-pci")
    p = plan(srv, GPU)
    assert p.devices == [A(GPU), A(AUDIO)] and p.moving == [A(GPU)] and not p.nothing_to_do
    assert p.originals == {A(GPU): ("nvidia", None), A(AUDIO): ("vfio-pci", "vfio-pci")}
    assert [(s.kind, s.address) for s in p.steps] == [("override", GPU), ("unbind", GPU), ("probe", GPU)]
    assert said(p, "vfio_modules") == [("vfio_modules", "ok", "vfio-pci loaded")]
    srv.bind(A(GPU), "vfio-pci")
    done = plan(srv, AUDIO)
    assert done.nothing_to_do and done.steps == [] and said(done, "vfio_modules", "holders", "host_use") == []
    assert said(done, "libvirt") == [("libvirt", "skip", "libvirt not asked (--connect none)")]


def test_the_iommu_line_names_the_vendor_or_says_an(srv):
    """The first line of a plan says which IOMMU isolates the devices and how many groups it made;
    units under /sys/class/iommu of no known kind still make groups."""
    assert said(plan(srv, NIC), "iommu") == [("iommu", "ok", "amd IOMMU with 7 groups")]
    for unit in os.listdir(srv.sys_path("class", "iommu")):
        os.unlink(srv.sys_path("class", "iommu", unit))
    assert said(plan(srv, NIC), "iommu") == [("iommu", "ok", "an IOMMU with 7 groups")]


def test_without_an_iommu_the_plan_has_no_groups_and_refuses(tmp_path):
    """No IOMMU groups: vfio-pci cannot isolate anything; the plan keeps the device with no group
    and says no IOMMU line."""
    b = HostBuilder(str(tmp_path / "host"))
    b.iommu(None)
    rb = b.root_bus()
    b.function(rb, GPU, "10de", "1db4", "030200", driver="nvidia")
    b.modules(["nvidia"])
    p = plan(b, GPU)
    assert p.groups == {A(GPU): None} and p.devices == [A(GPU)] and p.moving == [A(GPU)]
    assert said(p, "iommu", "group_viable") == [
        ("iommu", "refuse", f"the IOMMU is off: there are no IOMMU groups, vfio-pci cannot isolate {GPU} "
                            "(see gpuvfio doctor)")]


def test_a_function_with_no_group_moves_alone_and_is_refused(srv):
    """A function the IOMMU did not put in a group (no iommu_group link) cannot be isolated."""
    os.unlink(os.path.join(srv.functions[A(NIC)].path, "iommu_group"))
    p = plan(srv, NIC)
    assert p.groups == {A(NIC): None} and p.devices == [A(NIC)]
    assert said(p, "iommu", "group_viable") == [("iommu", "ok", "amd IOMMU with 6 groups"),
                                                ("iommu", "refuse", f"{NIC} has no IOMMU group")]


def _share_group(b: HostBuilder, address: str, group: int) -> None:
    """Put ``address`` into IOMMU group ``group``, as a chipset without ACS would."""
    path = b.functions[A(address)].path
    os.unlink(os.path.join(path, "iommu_group"))
    target = os.path.join(b.root, "sys", "kernel", "iommu_groups", str(group))
    os.symlink(os.path.relpath(target, path), os.path.join(path, "iommu_group"))
    os.symlink(os.path.relpath(path, os.path.join(target, "devices")), os.path.join(target, "devices", address))


def test_each_group_is_judged_once_however_many_of_its_devices_are_named(srv):
    """Naming the GPU and its audio function says the group's verdict once; a group shared with a
    foreign NIC is refused once (overridable), and goes whole when the NIC is named too."""
    p = plan(srv, GPU, AUDIO)
    assert said(p, "group_viable") == [
        ("group_viable", "ok", f"group 0 is viable: 0000:00:01.0, {GPU}, {AUDIO}")]
    _share_group(srv, NIC, 0)
    shared = plan(srv, GPU, AUDIO)
    foreign = (f"group 0 is not viable: shares IOMMU group 0 with {NIC} [8086:1533] class 020000 (igb) -- passing it "
               "through would take that device from the host")
    assert said(shared, "group_viable") == [("group_viable", "refuse", foreign)]
    assert [c.overridable for c in shared.checks if c.check_id == "group_viable"] == [True]
    assert shared.devices == [A(GPU), A(AUDIO), A(NIC)] and shared.groups[A(NIC)] == 0
    whole = plan(srv, NIC, GPU, AUDIO)
    assert said(whole, "group_viable") == [
        ("group_viable", "ok", f"group 0 goes whole: every device in it is asked for "
                               f"(0000:00:01.0, {GPU}, {AUDIO}, {NIC})")]
    assert whole.refusals(False) == []


def _dead(b: HostBuilder, address: str) -> None:
    """Config space reads all ones: the function no longer answers (gone from the bus, D3cold)."""
    with open(os.path.join(b.functions[A(address)].path, "config"), "wb") as handle:
        handle.write(b"\xff" * 64)


def test_a_dead_or_broken_device_is_refused_even_when_already_on_vfio_pci(srv):
    """A device that came back broken from its guest (the journal says so) or reads 0xffff is refused
    until gpuvfio reset, whether it moves or is already on vfio-pci, in health's words, and --force
    does not override it (dead, not free); a config space that cannot be read warns."""
    srv.bind(A(AUDIO), "vfio-pci")
    broken = {AUDIO: {"reason": "vendor ID 0xffff after the guest"}, NIC: {}}
    p = plan(srv, GPU, NIC, broken=broken)
    assert said(p, "health") == [
        ("health", "refuse", f"{AUDIO}: came back broken from its last guest (vendor ID 0xffff after the guest); "
                             f"gpuvfio reset {AUDIO}"),
        ("health", "refuse", f"{NIC}: came back broken from its last guest (?); gpuvfio reset {NIC}")]
    assert [c.overridable for c in p.checks if c.check_id == "health"] == [False, False]
    assert said(plan(srv, GPU, broken={}), "health") == []
    os.unlink(os.path.join(srv.functions[A(GPU)].path, "config"))  # unreadable: not known to be dead
    assert said(plan(srv, GPU), "health") == [("health", "warn", f"{GPU}: config space could not be read")]
    _dead(srv, GPU)
    dead = (f"{GPU}: config space reads 0xffff while bound to nvidia: the device fell off the bus (or sits in D3cold "
            "and does not come back)")
    assert said(plan(srv, GPU), "health") == [("health", "refuse", dead)]
    assert said(plan(srv, GPU, broken={GPU: {"reason": "gone"}}), "health") == [
        ("health", "refuse", dead),
        ("health", "refuse", f"{GPU}: came back broken from its last guest (gone); gpuvfio reset {GPU}")]
    assert [c.overridable for c in plan(srv, GPU).checks if c.check_id == "health"] == [False]


def test_the_boot_console_is_refused_unless_forced_and_names_the_framebuffers(srv):
    """boot_vga=1: the host loses its display; the plan names /proc/fb's framebuffers (or says there
    are none) and lets --force through."""
    attr(srv, GPU, "boot_vga", "1")
    line = f"{GPU} drives the host console (boot_vga=1; {{}}); the host loses its display"
    p = plan(srv, GPU)
    assert said(p, "boot_vga") == [("boot_vga", "refuse", line.format("no framebuffer listed"))]
    assert p.refusals(True) == [] and [c.overridable for c in p.refusals(False)] == [True]
    assert [c.reason for c in p.refusals(False)] == [line.format("no framebuffer listed") + " (--force to proceed)"]
    write(os.path.join(srv.root, "proc", "fb"), "0 EFI VGA\n1 simpledrmdrmfb\n")
    assert said(plan(srv, GPU), "boot_vga") == [("boot_vga", "refuse", line.format("EFI VGA, simpledrmdrmfb"))]
    attr(srv, GPU, "boot_vga", "0")
    assert said(plan(srv, GPU), "boot_vga") == []


def test_sr_iov_vfs_on_a_function_taken_along_are_refused(srv):
    """A function moved only because it shares the group must not have SR-IOV VFs enabled (a guest
    or vGPU may use them): refused, not overridable; the named function is judged by the pre-checks."""
    attr(srv, AUDIO, "sriov_totalvfs", "4")
    attr(srv, AUDIO, "sriov_numvfs", "2")
    p = plan(srv, GPU)
    assert said(p, "sriov") == [
        ("sriov", "refuse", f"{AUDIO} has 2 SR-IOV VFs enabled; disable them first (echo 0 > sriov_numvfs)")]
    assert [c.check_id for c in p.refusals(True)] == ["sriov"]
    named = plan(srv, AUDIO)
    assert said(named, "sriov") == [
        ("sriov", "refuse", f"{AUDIO} has 2 SR-IOV VFs enabled (a vGPU or a guest may use them); disable them "
                            "first (echo 0 > sriov_numvfs)")]
    attr(srv, AUDIO, "sriov_numvfs", "0")
    assert said(plan(srv, GPU), "sriov") == []


def test_a_function_without_driver_override_is_refused(srv):
    """gpuvfio binds only by address: a kernel older than 3.16 (no driver_override) is refused,
    never bound by ID through new_id."""
    os.unlink(os.path.join(srv.functions[A(AUDIO)].path, "driver_override"))
    assert said(plan(srv, GPU), "driver_override") == [
        ("driver_override", "refuse", f"{AUDIO} has no driver_override attribute (kernel older than 3.16?): "
                                      "gpuvfio binds only by address")]


def test_a_driver_or_override_name_the_journal_could_not_hold_is_refused(srv):
    """What a bind journals and writes back must be a kernel driver name: anything else is refused
    before the first write, shown escaped."""
    attr(srv, AUDIO, "driver_override", "bad name\x1b")
    p = plan(srv, GPU)
    assert said(p, "names") == [
        ("names", "refuse", f"{AUDIO}: its driver_override is 'bad name\\x1b', not a kernel driver name: gpuvfio "
                            "could not journal it and write it back")]
    attr(srv, AUDIO, "driver_override", "snd_hda_intel")
    weird = srv.driver("weird driver")
    os.unlink(os.path.join(srv.functions[A(GPU)].path, "driver"))
    os.symlink(os.path.relpath(weird, srv.functions[A(GPU)].path), os.path.join(srv.functions[A(GPU)].path, "driver"))
    write_uevent(srv.functions[A(GPU)].path)
    assert said(plan(srv, GPU), "names") == [
        ("names", "refuse", f"{GPU}: its driver is 'weird driver', not a kernel driver name: gpuvfio could not "
                            "journal it and write it back")]


def _disk(b: HostBuilder, address: str, name: str = "sda") -> str:
    """A SCSI disk below ``address``; its sysfs directory."""
    b.block(name, "8:0", fn=b.functions[A(address)], sub="host0/target0:0:0/0:0:0:0")
    return os.path.realpath(b.sys_path("class", "block", name))


def test_what_the_host_uses_refuses_its_function_and_take_host_devices_warns(srv):
    """A mounted disk is the host's: refused with the one override named; --take-host-devices keeps
    the finding as a warning. Functions with nothing on them are listed as free."""
    usb = "0000:06:00.0"
    _disk(srv, NIC)
    srv.mount("8:0", "/srv", "/dev/sda", "xfs")
    p = plan(srv, NIC, usb)
    assert said(p, "host_use") == [
        ("host_use", "refuse", f"{NIC}: sda is mounted on /srv: the host loses it (--take-host-devices to take it "
                               "anyway)"),
        ("host_use", "ok", f"{usb} is not a GPU (0c0330); nothing on the host uses it"),
        ("host_use", "ok", GPU_OK.format(usb))]
    taken = plan(srv, NIC, usb, policy=BindPolicy(take_host_devices=True))
    assert said(taken, "host_use")[0] == (
        "host_use", "warn", f"{NIC}: sda is mounted on /srv (taken anyway: --take-host-devices)")
    assert taken.refusals(False) == []


def test_a_function_the_reader_cannot_judge_is_refused_and_the_others_still_are(srv):
    """Fail closed: a holders link out of the tree means gpuvfio cannot tell what the host uses on
    that function -- refused (a warning with --take-host-devices); the next function is still read."""
    usb = "0000:06:00.0"
    real = _disk(srv, NIC)
    os.rmdir(os.path.join(real, "holders"))
    os.symlink("/etc", os.path.join(real, "holders"))
    why = f"{os.path.join(real, 'holders')} links to absolute path /etc"
    p = plan(srv, NIC, usb)
    assert said(p, "host_use") == [
        ("host_use", "refuse", f"{NIC}: cannot tell what the host uses on it: {why} (--take-host-devices binds "
                               "without knowing)"),
        ("host_use", "ok", f"{usb} is not a GPU (0c0330); nothing on the host uses it"),
        ("host_use", "ok", GPU_OK.format(usb))]
    taken = plan(srv, NIC, usb, policy=BindPolicy(take_host_devices=True))
    assert said(taken, "host_use")[0] == (
        "host_use", "warn", f"{NIC}: cannot tell what the host uses on it: {why} (taken anyway: --take-host-devices)")


def test_a_tree_that_cannot_say_what_the_host_uses_refuses_once(srv):
    """A recording without PID 1's mounts cannot answer for any function: one refusal, and with
    --take-host-devices one warning; nothing is called free."""
    os.unlink(os.path.join(srv.root, "proc", "1", "mountinfo"))
    head = ("cannot tell what the host itself uses: no proc/1/mountinfo in this host's tree (a recording made "
            "before gpuvfio read them: record the host again)")
    assert said(plan(srv, NIC, GPU), "host_use") == [
        ("host_use", "refuse", head + "; --take-host-devices binds without knowing")]
    assert said(plan(srv, NIC, GPU, policy=BindPolicy(take_host_devices=True)), "host_use") == [
        ("host_use", "warn", head + " (taken anyway: --take-host-devices)")]
    srv.bind(A(NIC), "vfio-pci")  # nothing moves: nothing to ask the host about
    assert said(plan(srv, NIC), "host_use") == []


def test_an_unsafe_host_is_refused_unless_allowed_and_then_warned(srv):
    """An ACS override (groups may lie), unsafe interrupts (a guest can forge MSIs) and no-IOMMU mode
    (no DMA isolation) each refuse; --allow-unsafe-host turns each into a warning, nothing else."""
    srv.cmdline("ro amd_iommu=on pcie_acs_override=downstream,multifunction")
    srv.module_param("vfio_iommu_type1", "allow_unsafe_interrupts", "Y")
    srv.module_param("vfio", "enable_unsafe_noiommu_mode", "Y")
    words = [("acs_override", "pcie_acs_override is on the command line: IOMMU groups may not reflect real "
                              "isolation"),
             ("unsafe_interrupts", "vfio_iommu_type1 allow_unsafe_interrupts=Y: a guest can forge MSIs"),
             ("noiommu", "vfio enable_unsafe_noiommu_mode=Y: no DMA isolation")]
    ids = [i for i, _ in words]
    assert said(plan(srv, NIC), *ids) == [
        (i, "refuse", m + " (--allow-unsafe-host to proceed anyway)") for i, m in words]
    allowed = plan(srv, NIC, policy=BindPolicy(allow_unsafe_host=True))
    assert said(allowed, *ids) == [(i, "warn", m + " (allowed by --allow-unsafe-host)") for i, m in words]
    assert allowed.refusals(False) == []
    srv.module_param("vfio_iommu_type1", "allow_unsafe_interrupts", "N")
    srv.module_param("vfio", "enable_unsafe_noiommu_mode", "N")
    srv.cmdline("ro amd_iommu=on")
    assert said(plan(srv, NIC), *ids) == []


def _fabric_mode(b: HostBuilder, mode: int) -> None:
    write(os.path.join(b.root, "usr", "share", "nvidia", "nvswitch", "fabricmanager.cfg"),
          f"# Fabric Manager\nLOG_LEVEL=4\nFABRIC_MODE={mode}\n")


def test_nvidia_services_refuse_a_gpu_bind_unless_stopped_and_the_shared_fabric_manager_runs_on(srv):
    """nvidia-persistenced, the Fabric Manager and DCGM keep the GPUs open: a bind of an nvidia
    function is refused until --stop-services, except the Fabric Manager in shared-NVSwitch mode
    (FABRIC_MODE=1), which manages the guests' NVSwitches and keeps running."""
    srv.holder(900, "nvidia-persiste", ["/dev/nvidiactl"])
    srv.holder(905, "nvidia-persiste", ["/dev/nvidiactl"])
    srv.holder(700, "nv-fabricmanage", ["/dev/nvidia-nvswitchctl", "/dev/nvidia-nvswitch0"])
    assert said(plan(srv, NIC), "services") == []  # no nvidia function moves: the services do not matter
    p = plan(srv, GPU)
    assert said(p, "services") == [
        ("services", "refuse", "nvidia-fabricmanager is running (pid 700) and keeps the GPU open; --stop-services "
                               "stops it now and restore restarts it"),
        ("services", "refuse", "nvidia-persistenced is running (pid 900, 905) and keeps the GPU open; "
                               "--stop-services stops it now and restore restarts it")]
    assert [c.overridable for c in p.refusals(False)] == [False, False]
    _fabric_mode(srv, 1)
    stopping = plan(srv, GPU, policy=BindPolicy(stop_services=True))
    assert said(stopping, "services", "holders") == [
        ("services", "ok", "nvidia-fabricmanager (pid 700) runs in shared-NVSwitch mode (FABRIC_MODE=1): it manages "
                           "the NVSwitches for the guests and keeps running"),
        ("services", "warn", "nvidia-persistenced (pid 900, 905) will be stopped and restarted by gpuvfio restore"),
        ("holders", "ok", "no process holds the GPU's /dev/nvidia* node")]
    assert stopping.services == ["nvidia-persistenced"]
    assert [s.name for s in stopping.steps if s.kind is StepKind.STOP_SERVICE] == ["nvidia-persistenced"]
    kept = plan(srv, GPU)
    assert said(kept, "services")[1][1] == "refuse" and kept.services == []


def _minor(b: HostBuilder, address: str, minor: int) -> None:
    write(os.path.join(b.root, "proc", "driver", "nvidia", "gpus", address, "information"),
          f"Model: NVIDIA H100\nDevice Minor: {minor}\n")


HANG = " -- unbinding nvidia under them can hang in the kernel; stop them first"


def test_a_process_holding_the_gpus_own_node_refuses_and_one_on_the_driver_warns(srv):
    """Unbinding nvidia under an open /dev/nvidiaN can hang in the kernel: the GPU's holders refuse
    (said once for all the GPUs they hold); a process with only /dev/nvidiactl open is a warning."""
    sw = "0000:05:00.0"
    srv.holder(4242, "python3", ["/dev/nvidia0", "/dev/nvidiactl"])
    p = plan(srv, GPU, sw)  # no minors known: any per-GPU node may be either GPU's
    assert said(p, "holders") == [
        ("holders", "refuse", f"{GPU}, {sw}: python3 (pid 4242) holds /dev/nvidia0, /dev/nvidiactl" + HANG)]
    _minor(srv, GPU, 3)
    _minor(srv, sw, 0)
    srv.holder(77, "nvidia-smi", ["/dev/nvidiactl"])
    srv.holder(88, "train", ["/dev/nvidia3"])
    p = plan(srv, GPU, sw)
    assert said(p, "holders") == [
        ("holders", "refuse", f"{GPU}: train (pid 88) holds /dev/nvidia3" + HANG),
        ("holders", "refuse", f"{sw}: python3 (pid 4242) holds /dev/nvidia0, /dev/nvidiactl" + HANG),
        ("holders", "warn", "open on the driver, not on this GPU: nvidia-smi (pid 77) holds /dev/nvidiactl")]
    assert said(plan(srv, GPU), "holders")[0] == ("holders", "refuse", f"{GPU}: train (pid 88) holds /dev/nvidia3"
                                                  + HANG)
    assert said(plan(srv, NIC), "holders") == []  # no nvidia function moves


def test_holders_being_stopped_let_go_and_a_refusal_needs_no_all_clear(srv):
    """nvidia-persistenced stopped by --stop-services no longer holds the GPU; when a real holder
    refuses, the plan does not also say nobody holds it."""
    _minor(srv, GPU, 0)
    srv.holder(900, "nvidia-persiste", ["/dev/nvidia0", "/dev/nvidiactl"])
    assert said(plan(srv, GPU, policy=BindPolicy(stop_services=True)), "holders") == [
        ("holders", "ok", "no process holds the GPU's /dev/nvidia* node")]
    refused = plan(srv, GPU)
    assert said(refused, "holders") == [
        ("holders", "refuse", f"{GPU}: nvidia-persiste (pid 900) holds /dev/nvidia0, /dev/nvidiactl" + HANG)]
    srv.holder(901, "nv-hostengine", ["/dev/nvidiactl"])
    assert said(plan(srv, GPU, policy=BindPolicy(stop_services=True)), "holders") == [
        ("holders", "ok", "no process holds the GPU's /dev/nvidia* node")]


def test_libvirt_decides_by_the_domains_using_the_devices_and_fails_closed(srv):
    """A device a libvirt domain uses (running or only defined) is refused, each domain named; a
    libvirt that did not answer refuses (fail closed); not asked is said as skipped."""
    sw = "0000:05:00.0"
    users = {A(AUDIO): ["zeta", "alpha"], A(GPU): ["win11"], A(sw): [], A(NIC): ["elsewhere"]}
    assert said(plan(srv, GPU, sw, libvirt=LibvirtView(users=users)), "libvirt") == [
        ("libvirt", "refuse", f"{GPU} is assigned to libvirt domain(s) win11; detach it there first"),
        ("libvirt", "refuse", f"{AUDIO} is assigned to libvirt domain(s) alpha, zeta; detach it there first")]
    assert said(plan(srv, sw, libvirt=LibvirtView(users=users)), "libvirt") == [
        ("libvirt", "ok", "no libvirt domain uses these devices")]
    assert said(plan(srv, GPU, libvirt=LibvirtView(users={})), "libvirt") == [
        ("libvirt", "ok", "no libvirt domain uses these devices")]
    assert said(plan(srv, GPU, libvirt=LibvirtView(error="socket gone")), "libvirt") == [
        ("libvirt", "refuse", "cannot ask libvirt which domains use these devices: socket gone (start libvirtd, "
                              "give --connect URI, or --connect none to bind without asking)")]
    assert said(plan(srv, GPU, libvirt=LibvirtView()), "libvirt") == [("libvirt", "skip", "libvirt not consulted")]
