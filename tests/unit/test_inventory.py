import json
import os

import pytest

from gpuvfio.ops.context import Context
from gpuvfio.address import PciAddress
from gpuvfio.host.root import HostRoot
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.pciids import PciIds
from tests.conftest import BAR64_PREF, GiB, MiB, gpu_workstation
from tests.hostbuilder import HostBuilder
from tests.lspci import compare, lspci_available, lspci_records

A = PciAddress.parse


def test_functions_read_from_tree(workstation):
    inv = read_inventory(HostRoot(workstation.root), names=PciIds.load())
    gpu = inv.functions[A("0000:01:00.0")]
    assert (gpu.vendor_id, gpu.device_id, gpu.class_id) == ("10de", "2684", "030000")
    assert gpu.driver == "nvidia" and gpu.numa_node == 0 and gpu.local_cpulist == "0-15"
    assert gpu.parents == [A("0000:00:01.0")]
    assert gpu.link.current_gen == 4 and gpu.link.current_width == 16
    bars = {b.index: b for b in gpu.bars}
    assert bars[1].size == 32 * GiB and bars[1].is_64bit and bars[1].prefetchable
    assert bars[0].size == 16 * MiB and not bars[0].is_64bit
    assert gpu.largest_bar == 32 * GiB
    assert gpu.boot_vga is False and gpu.reset_method == ["flr", "bus"]
    assert gpu.device_name and "4090" in gpu.device_name
    assert gpu.class_name == "VGA compatible controller"
    assert inv.functions[A("0000:00:00.0")].driver is None


def test_groups_and_viability(workstation):
    inv = read_inventory(HostRoot(workstation.root), names=PciIds.load())
    gpu_group = inv.group_of(A("0000:01:00.0"))
    assert gpu_group.devices == [A("0000:01:00.0"), A("0000:01:00.1")]
    assert gpu_group.viable and gpu_group.problems == []
    shared = inv.group_of(A("0000:04:00.0"))
    assert not shared.viable
    assert shared.problems == [
        f"shares IOMMU group {shared.group_id} with 0000:03:00.0 [8086:15f3] Ethernet controller (igc)"]


def test_sriov_mdev_and_vgpu(tmp_path):
    b = HostBuilder(str(tmp_path))
    b.iommu("amd", 1)
    b.numa_node(0, list(range(8)), 32)
    rb = b.root_bus(numa=-1)
    rp = b.bridge(rb, "0000:40:01.1", "1022", "14ab", secondary_bus=0x41, link=(4, 16))
    pf = b.function(rp, "0000:41:00.0", "10de", "2236", "030200", driver="nvidia", link=(4, 16),
                    bars=[(1, 32 * GiB, BAR64_PREF)])
    vfs = b.sriov(pf, 32, ["0000:41:00.4", "0000:41:00.5"], "2236", "10de", "030200", driver="nvidia",
                  vf_bar=1 * GiB)
    b.vgpu_types(vfs[0], [(590, "NVIDIA A10-4Q"), (591, "NVIDIA A10-8Q")], current=591)
    t4 = b.function(rp, "0000:41:01.0", "10de", "1eb8", "030200", driver="nvidia")
    b.mdev_types(t4, [("nvidia-222", "GRID T4-1B", 16, "num_heads=4, max_resolution=5120x2880")])
    inv = read_inventory(HostRoot(str(tmp_path)))
    p = inv.functions[A("0000:41:00.0")]
    assert p.sriov_total_vfs == 32 and p.sriov_num_vfs == 2
    assert p.vfs == [A("0000:41:00.4"), A("0000:41:00.5")]
    vf = inv.functions[A("0000:41:00.4")]
    assert vf.physfn == A("0000:41:00.0") and vf.numa_node is None  # numa_node -1 means absent
    assert [(t.type_id, t.name) for t in vf.vgpu_creatable] == [(590, "NVIDIA A10-4Q"), (591, "NVIDIA A10-8Q")]
    assert vf.vgpu_current == 591
    mdev = inv.functions[A("0000:41:01.0")].mdev_types
    assert [(m.type_id, m.name, m.available_instances, m.device_api) for m in mdev] == [
        ("nvidia-222", "GRID T4-1B", 16, "vfio-pci")]
    # All NVIDIA functions of different slots behind one port may share a group.
    assert inv.group_of(A("0000:41:00.0")).viable


def test_all_nvidia_group_is_viable_but_foreign_endpoint_is_not(tmp_path):
    b = HostBuilder(str(tmp_path))
    b.iommu("intel", 1)
    rb = b.root_bus()
    g = b.new_group()
    sw = b.bridge(rb, "0000:00:01.0", "1000", "c030", secondary_bus=1, group=g)
    b.function(sw, "0000:01:00.0", "10de", "2330", "030200", driver="nvidia", group=g)
    b.function(sw, "0000:01:01.0", "10de", "22a3", "068000", driver="nvidia", group=g)  # NVSwitch
    inv = read_inventory(HostRoot(str(tmp_path)))
    assert inv.groups[g].viable
    b.function(sw, "0000:01:02.0", "15b3", "1021", "020000", driver="mlx5_core", group=g)
    inv = read_inventory(HostRoot(str(tmp_path)), names=PciIds.load())
    assert not inv.groups[g].viable
    assert len(inv.groups[g].problems) == 1 and "0000:01:02.0 [15b3:1021]" in inv.groups[g].problems[0]
    assert inv.groups[g].problems[0].endswith("(mlx5_core)")


def test_no_iommu_means_null_groups(tmp_path):
    b = HostBuilder(str(tmp_path))
    b.iommu(None)
    rb = b.root_bus()
    b.function(rb, "0000:00:02.0", "10de", "1db4", "030200", driver="nvidia")
    inv = read_inventory(HostRoot(str(tmp_path)))
    assert inv.groups is None
    assert inv.functions[A("0000:00:02.0")].iommu_group is None


@pytest.mark.skipif(not lspci_available(), reason="pciutils not installed")
def test_matches_real_lspci_on_built_host(tmp_path):
    b = gpu_workstation(tmp_path)
    from gpuvfio.ops.inventory import list_report

    report = list_report(Context(host=HostRoot(b.root)), show_all=True)
    compare(report.to_json()["devices"], lspci_records(os.path.join(b.root, "sys", "bus", "pci")))


def test_without_pci_ids_names_are_null(workstation):
    inv = read_inventory(HostRoot(workstation.root), names=PciIds(b""))
    gpu = inv.functions[A("0000:01:00.0")]
    assert gpu.device_name is None and gpu.vendor_id == "10de"


def test_list_and_doctor_reports_hold_the_host_model(workstation):
    from gpuvfio.host.model import IommuGroup, PciFunction
    from gpuvfio.ops.inventory import list_report
    from gpuvfio.ops.readiness import doctor_report

    ctx = Context(host=HostRoot(workstation.root))
    listing = list_report(ctx, show_all=False)
    assert all(isinstance(f, PciFunction) and f.is_nvidia for f in listing.devices)
    assert [str(f.address) for f in listing.devices] == ["0000:01:00.0", "0000:01:00.1", "0000:04:00.0",
                                                         "0000:04:00.1"]
    assert all(isinstance(g, IommuGroup) for g in listing.groups)
    assert {g.group_id for g in listing.groups} == {f.iommu_group for f in listing.devices}
    shared = next(g for g in listing.groups if A("0000:03:00.0") in g.devices)  # the NIC's group, not listed
    assert not shared.viable and listing.to_json()["groups"][1] == shared.to_json()
    one = list_report(ctx, show_all=False, only=[A("0000:01:00.1")])
    assert [f.address for f in one.devices] == [A("0000:01:00.1")] and len(one.groups) == 1
    doctor = doctor_report(ctx)
    assert doctor.failed == [] and "hugepages" not in [c.check_id for c in doctor.warned]
    assert [c.to_json() for c in doctor.checks] == doctor.to_json()["checks"]
    assert doctor.kernel.iommu_vendor == "intel" and [n.node_id for n in doctor.numa_nodes] == [0]


def test_host_identity_is_typed_and_serialises_as_the_testbed_reads_it(workstation):
    from gpuvfio.ops.identity import IommuMode, host_identity

    ident = host_identity(Context(host=HostRoot(workstation.root)), [A("0000:01:00.0"), A("0000:01:00.1")])
    assert ident.iommu_mode is IommuMode.TRANSLATED  # the workstation's command line has no iommu=pt
    assert [a.function.address for a in ident.accelerators] == [A("0000:01:00.0")]  # not the audio function
    assert ident.cpus == 16 and ident.hugepage_sizes_kb == [2048, 1048576]  # every size the node offers
    data = ident.to_json()
    assert list(data) == ["host_cpu", "host_sockets", "host_cpus", "host_memory_kb", "host_os", "host_kernel",
                          "host_nvidia_driver", "accelerators", "accelerator_count", "iommu", "iommu_mode",
                          "numa_nodes", "hugepage_sizes_kb", "python", "qemu_version", "libvirt_version"]
    assert data["iommu_mode"] == "translated" and data["accelerator_count"] == 1
    assert data["accelerators"] == [{"address": "0000:01:00.0", "model": ident.accelerators[0].model,
                                     "numa_node": 0, "link_max": "Gen4 x16"}]
    assert json.loads(json.dumps(data)) == data
