"""vGPU instances on the unit lane: legacy mdev and SR-IOV types, journaled and undone."""

import errno
import json
import os

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.bindapply import Actions
from gpuvfio.bindcmd import restore, status
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.hostroot import HostRoot
from gpuvfio.inventory import read_inventory
from gpuvfio.sysfs_write import SysfsWriteError, SysfsWriter
from gpuvfio.vgpucmd import create, remove, types
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
    h = HostRoot(b.root)
    return h, SysfsWriter(h, backend=kernel), kernel


def test_types(host):
    h, _w, _k = host
    inv = read_inventory(h)
    legacy = types(inv, PciAddress.parse(T4))
    assert legacy["kind"] == "mdev" and [t["id"] for t in legacy["mdev_types"]] == ["nvidia-222", "nvidia-230"]
    sriov = types(inv, PciAddress.parse(A10))
    assert sriov["kind"] == "sriov"
    assert [(t["id"], t["available_instances"]) for t in sriov["sriov_types"]] == [(590, 2), (593, 2)]


def test_mdev_create_remove(host):
    h, w, _k = host
    report = create(h, PciAddress.parse(T4), "GRID T4-16Q", writer=w, uuid=UUID)
    assert report == {"kind": "mdev", "uuid": UUID, "type": "nvidia-230", "parent": T4, "result": "created"}
    assert os.path.islink(os.path.join(h.sys, "bus", "mdev", "devices", UUID))
    assert create(h, PciAddress.parse(T4), "nvidia-230", writer=w, uuid=UUID)["result"] == "exists"
    with pytest.raises(InputError, match="no available instances"):
        create(h, PciAddress.parse(T4), "nvidia-230", writer=w)
    with pytest.raises(InputError, match="already exists with type nvidia-230"):
        create(h, PciAddress.parse(T4), "nvidia-222", writer=w, uuid=UUID)
    assert status(h)["mdevs"][UUID]["type"] == "nvidia-230"
    remove(h, UUID, writer=w)
    assert not os.path.lexists(os.path.join(h.sys, "bus", "mdev", "devices", UUID))
    assert status(h)["mdevs"] == {}


def test_unknown_type_refused(host):
    h, w, kernel = host
    with pytest.raises(InputError, match="does not offer mdev type"):
        create(h, PciAddress.parse(T4), "nvidia-999", writer=w)
    assert kernel.writes() == []


def test_sriov_type_set_and_cleared_by_restore(host):
    h, w, _k = host
    report = create(h, PciAddress.parse(A10), "NVIDIA A10-4Q", writer=w)
    assert report["vf"] == "0000:41:00.4" and report["type"] == 593
    second = create(h, PciAddress.parse(A10), "590", writer=w)
    assert second["vf"] == "0000:41:00.5"
    with pytest.raises(InputError, match="no VF"):
        create(h, PciAddress.parse(A10), "590", writer=w)
    restore(h, [], writer=w, actions=Actions(print, print, print))
    for vf in ("0000:41:00.4", "0000:41:00.5"):
        assert h.read(h.sys_path("bus", "pci", "devices", vf, "nvidia", "current_vgpu_type")) == "0"
    assert status(h)["vgpus"] == {}


def test_failed_mdev_create_stays_journaled(host):
    h, w, kernel = host
    kernel.inject("mdev_create", errno_=errno.EIO)
    with pytest.raises(SysfsWriteError):
        create(h, PciAddress.parse(T4), "nvidia-222", writer=w, uuid=UUID)
    # journaled before the write: restore reconciles (nothing exists, the entry goes)
    assert UUID in status(h)["mdevs"]
    restore(h, [], writer=w, actions=Actions(print, print, print))
    assert status(h)["mdevs"] == {}


def test_remove_unknown(host):
    h, w, _k = host
    with pytest.raises(GpuvfioError, match="not created by gpuvfio"):
        remove(h, UUID, writer=w)
    with pytest.raises(InputError, match="not an mdev UUID"):
        remove(h, "../../x", writer=w)


def test_cli_vgpu_bad_input(cli, host):
    h, _w, _k = host
    result = cli("--root", h.root, "vgpu", "create", T4, "nvidia-222", "--uuid", "nope")
    assert result.code == 2 and "not a UUID" in result.err
    result = cli("--root", h.root, "vgpu", "types", "0000:82:00.9")
    assert result.code == 2
    assert cli("--root", h.root, "vgpu", "types", A10, "--json").json()["kind"] == "sriov"


def test_persist_writes_mdevctls_store(host):
    """The file format is the one mdevctl 1.2.0's ``define --auto`` writes (seen on this machine)."""
    h, w, _k = host
    create(h, PciAddress.parse(T4), "nvidia-222", writer=w, uuid=UUID, persist=True)
    path = os.path.join(h.root, "etc", "mdevctl.d", T4, UUID)
    with open(path) as handle:
        assert json.load(handle) == {"mdev_type": "nvidia-222", "start": "auto", "attrs": []}
    remove(h, UUID, writer=w)
    assert not os.path.exists(path)
