"""vGPU instances on the unit lane: legacy mdev and SR-IOV types, journaled and undone."""

import errno
import json
import os

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.bind.sysfs_write import SysfsWriteError
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.ops.binding import restore, status
from gpuvfio.ops.vgpu import TypesKind, create, create_for_domain, remove, types
from tests.contexts import sim_context
from tests.hostbuilder import BAR64_PREF, GiB, HostBuilder
from tests.simkernel import SimKernel

T4, A10 = "0000:82:00.0", "0000:41:00.0"
UUID = "0d2f9b9e-7a2f-4c35-9c4e-3f1a2b3c4d5e"


@pytest.fixture
def host(tmp_path):
    b = HostBuilder(str(tmp_path / "host"))
    b.iommu("amd")
    b.numa_node(0, list(range(8)), 64)
    rb = b.root_bus(numa=0)
    t4 = b.function(rb, T4, "10de", "1eb8", "030200", driver="nvidia")
    b.mdev_types(t4, [("nvidia-222", "GRID T4-1B", 2, "1 GB"), ("nvidia-230", "GRID T4-16Q", 1, "16 GB")])
    a10 = b.function(rb, A10, "10de", "2236", "030200", driver="nvidia", bars=[(1, 32 * GiB, BAR64_PREF)])
    vfs = b.sriov(a10, 32, ["0000:41:00.4", "0000:41:00.5"], "2236", "10de", "030200", driver="nvidia",
                  vf_bar=GiB)
    for vf in vfs:
        b.vgpu_types(vf, [(590, "NVIDIA A10-2Q"), (593, "NVIDIA A10-4Q")])
    kernel = SimKernel(b.root)
    ctx = sim_context(b.root, kernel)
    return ctx, ctx.host, kernel


def test_types(host):
    ctx, _h, _k = host
    legacy = types(ctx, PciAddress.parse(T4))
    assert legacy.kind is TypesKind.MDEV and [t.type_id for t in legacy.mdev_types] == ["nvidia-222", "nvidia-230"]
    assert legacy.to_json() == {"address": T4, "kind": "mdev", "mdev_types": [
        {"id": "nvidia-222", "name": "GRID T4-1B", "available_instances": 2, "description": "1 GB"},
        {"id": "nvidia-230", "name": "GRID T4-16Q", "available_instances": 1, "description": "16 GB"}],
        "sriov_types": [], "sriov_in_use": []}
    sriov = types(ctx, PciAddress.parse(A10))
    assert sriov.kind is TypesKind.SRIOV
    assert [(t.type_id, t.available_instances) for t in sriov.sriov_types] == [(590, 2), (593, 2)]
    assert sriov.to_json()["sriov_types"][0] == {"id": 590, "name": "NVIDIA A10-2Q",
                                                 "free_vfs": ["0000:41:00.4", "0000:41:00.5"], "mig_backed": None,
                                                 "available_instances": 2}


def test_mdev_create_remove(host):
    ctx, h, _k = host
    report = create(ctx, PciAddress.parse(T4), "GRID T4-16Q", uuid=UUID)
    shown = report.to_json()
    assert [(s["kind"], s["name"]) for s in shown.pop("steps")] == [("create vGPU", UUID)]
    assert shown == {"kind": "mdev", "uuid": UUID, "type": "nvidia-230", "parent": T4, "result": "created"}
    assert os.path.islink(os.path.join(h.sys, "bus", "mdev", "devices", UUID))
    assert create(ctx, PciAddress.parse(T4), "nvidia-230", uuid=UUID).outcome.value == "exists"
    with pytest.raises(Refused, match="no available instances"):
        create(ctx, PciAddress.parse(T4), "nvidia-230")
    with pytest.raises(Refused, match="already exists with type nvidia-230"):
        create(ctx, PciAddress.parse(T4), "nvidia-222", uuid=UUID)
    assert status(ctx).mdevs[UUID]["type"] == "nvidia-230"
    remove(ctx, UUID)
    assert not os.path.lexists(os.path.join(h.sys, "bus", "mdev", "devices", UUID))
    assert status(ctx).mdevs == {}


def test_unknown_type_refused(host):
    ctx, _h, kernel = host
    with pytest.raises(Refused, match="does not offer mdev type"):
        create(ctx, PciAddress.parse(T4), "nvidia-999")
    assert kernel.writes() == []


def test_sriov_type_set_and_cleared_by_restore(host):
    ctx, h, _k = host
    report = create(ctx, PciAddress.parse(A10), "NVIDIA A10-4Q")
    assert report.instance == "0000:41:00.4" and report.type_id == 593
    second = create(ctx, PciAddress.parse(A10), "590")
    assert second.instance == "0000:41:00.5"
    with pytest.raises(Refused, match="no VF"):
        create(ctx, PciAddress.parse(A10), "590")
    restore(ctx, [])
    for vf in ("0000:41:00.4", "0000:41:00.5"):
        assert h.read(h.sys_path("bus", "pci", "devices", vf, "nvidia", "current_vgpu_type")) == "0"
    assert status(ctx).vgpus == {}


def test_failed_mdev_create_stays_journaled(host):
    ctx, _h, kernel = host
    kernel.inject("mdev_create", errno_=errno.EIO)
    with pytest.raises(SysfsWriteError):
        create(ctx, PciAddress.parse(T4), "nvidia-222", uuid=UUID)
    # journaled before the write: restore reconciles (nothing exists, the entry goes)
    assert UUID in status(ctx).mdevs
    restore(ctx, [])
    assert status(ctx).mdevs == {}


def test_remove_unknown(host):
    ctx, _h, _k = host
    with pytest.raises(GpuvfioError, match="not created by gpuvfio"):
        remove(ctx, UUID)
    with pytest.raises(InputError, match="not an mdev UUID"):
        remove(ctx, "../../x")


def test_a_created_instance_builds_into_its_domain(cli, host):
    """The T4's 16Q type has one instance. vgpu create takes it (the type then reports 0
    available); the domain naming that instance must still build (on main it was refused for
    lack of an available instance), and another domain without it must not."""
    ctx, h, _k = host
    create(ctx, PciAddress.parse(T4), "GRID T4-16Q", uuid=UUID)
    assert types(ctx, PciAddress.parse(T4)).mdev_types[1].available_instances == 0
    ok = cli("--root", h.root, "xml", T4, "--name", "t4", "--mdev", "GRID T4-16Q", "--uuid", UUID,
             "--numa", "none", "--firmware", "bios", "--json")
    assert ok.code == 0, ok.err
    assert f"uuid='{UUID}'" in ok.json()["xml"]
    other = cli("--root", h.root, "xml", T4, "--name", "t4b", "--mdev", "GRID T4-16Q", "--numa", "none",
                "--firmware", "bios")
    assert other.code == 1 and "no available instances" in other.err
    wrong = cli("--root", h.root, "xml", T4, "--name", "t4", "--mdev", "GRID T4-1B", "--uuid", UUID,
                "--numa", "none", "--firmware", "bios")
    assert wrong.code == 1 and "exists already, as type nvidia-230" in wrong.err


def test_create_for_domain_uses_the_uuid_the_domain_names(cli, host):
    """The testbed creates the vGPU first, then builds the domain: same UUID, no --uuid needed."""
    ctx, h, _k = host
    made = create_for_domain(ctx, "tb-t4", PciAddress.parse(T4), "GRID T4-16Q")
    built = cli("--root", h.root, "xml", T4, "--name", "tb-t4", "--mdev", "GRID T4-16Q", "--numa", "none",
                "--firmware", "bios", "--json")
    assert built.code == 0, built.err
    assert f"uuid='{made.instance}'" in built.json()["xml"]


def test_cli_vgpu_bad_input(cli, host):
    _ctx, h, _k = host
    result = cli("--root", h.root, "vgpu", "create", T4, "nvidia-222", "--uuid", "nope")
    assert result.code == 2 and "not a UUID" in result.err
    result = cli("--root", h.root, "vgpu", "types", "0000:82:00.9")
    assert result.code == 2
    assert cli("--root", h.root, "vgpu", "types", A10, "--json").json()["kind"] == "sriov"


def test_persist_writes_mdevctls_store(host):
    """The file format is the one mdevctl 1.2.0's ``define --auto`` writes (seen on this machine)."""
    ctx, h, _k = host
    create(ctx, PciAddress.parse(T4), "nvidia-222", uuid=UUID, persist=True)
    path = os.path.join(h.root, "etc", "mdevctl.d", T4, UUID)
    with open(path) as handle:
        assert json.load(handle) == {"mdev_type": "nvidia-222", "start": "auto", "attrs": []}
    remove(ctx, UUID)
    assert not os.path.exists(path)


def test_vgpu_list_shows_instances_their_domains_and_persistence(host, tmp_path):
    """gpuvfio vgpu list (issue 15 item 5): mdevs as mdevctl list shows them, and SR-IOV vGPUs,
    with the libvirt domains that use each (here the test driver, asked through --connect)."""
    from gpuvfio.ops.vgpu import instances_list

    ctx, _h, _k = host
    create(ctx, PciAddress.parse(T4), "nvidia-222", uuid=UUID, persist=True)
    create(ctx, PciAddress.parse(A10), "593")
    node = tmp_path / "testdriver.xml"
    node.write_text("<node/>")
    libvirt = pytest.importorskip("libvirt")
    conn = libvirt.open(f"test://{node}")
    conn.defineXML(f"<domain type='test'><name>uses-mdev</name><memory>1024</memory><os><type>hvm</type></os>"
                   f"<devices><hostdev mode='subsystem' type='mdev' model='vfio-pci'><source><address uuid='{UUID}'/>"
                   "</source></hostdev></devices></domain>")
    ctx.connections[f"test://{node}"] = conn
    report = instances_list(ctx, uri=f"test://{node}")
    assert report.libvirt == "asked"
    by_id = {i.instance: i.to_json() for i in report.instances}
    assert by_id[UUID] == {"kind": "mdev", "instance": UUID, "parent": T4, "type": "nvidia-222", "by_gpuvfio": True,
                           "persisted": True, "domains": ["uses-mdev"]}
    assert by_id["0000:41:00.4"] == {"kind": "sriov", "instance": "0000:41:00.4", "parent": A10, "type": 593,
                                     "type_name": "NVIDIA A10-4Q", "by_gpuvfio": True, "persisted": None,
                                     "domains": []}
    restore(ctx, [])
    assert instances_list(ctx, uri="none").to_json() == {"instances": [],
                                                         "libvirt": "libvirt not asked (--connect none)"}


def test_vgpu_types_on_a_vf_names_its_physical_function(host, cli):
    _ctx, h, _k = host
    report = types(_ctx, PciAddress.parse("0000:41:00.4"))
    assert report.kind is TypesKind.VF and report.physfn == A10
    assert report.to_json() == {"address": "0000:41:00.4", "kind": "vf", "physfn": A10, "mdev_types": [],
                                "sriov_types": [], "sriov_in_use": []}
    out = cli("--root", h.root, "vgpu", "types", "41:00.4")
    assert out.code == 0 and f"is an SR-IOV VF of {A10}" in out.out and f"gpuvfio vgpu types {A10}" in out.out


def test_persist_list_shows_driverctls_and_gpuvfios_overrides(cli, tmp_path):
    from tests.conftest import gpu_workstation

    b = gpu_workstation(tmp_path / "ws")
    os.makedirs(os.path.join(b.root, "etc", "driverctl.d"))
    for name, text in (("pci-0000:03:00.0", "igc\n"), ("pci-0000:01:00.0", "vfio-pci\n"), ("pci-bogus", "x\n"),
                       ("pci-0000:04:00.0", "\x1b[31mevil\n")):
        with open(os.path.join(b.root, "etc", "driverctl.d", name), "w") as handle:
            handle.write(text)
    data = cli("--root", b.root, "persist", "--list", "--json").json()
    assert data["overrides"] == [
        {"address": "0000:01:00.0", "driver": "vfio-pci", "mechanism": "driverctl"},
        {"address": "0000:03:00.0", "driver": "igc", "mechanism": "driverctl"}]
    text = cli("--root", b.root, "persist", "--list")  # plain, into a pipe
    assert text.out == ("Address       Driver    Mechanism\n0000:01:00.0  vfio-pci  driverctl\n"
                        "0000:03:00.0  igc       driverctl\n")
    assert cli("--root", b.root, "persist", "--list", "--format", "csv").out.splitlines()[1] == \
        "0000:01:00.0,vfio-pci,driverctl"
    assert cli("--root", b.root, "persist", "--list", "01:00").code == 2
