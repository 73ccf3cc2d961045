"""Edges of the PCI inventory reader on real sysfs-shaped trees: ids shorter than their width,
attributes the kernel leaves out or empties, bounds of NUMA node and vGPU type numbers, resource
lines that are not BARs, and the reads a selection makes through FunctionIndex.

Layouts: Documentation/ABI/testing/sysfs-bus-pci and sysfs-kernel-iommu_groups;
drivers/pci/pci-sysfs.c (resource_show, driver_override_show)."""

from __future__ import annotations

import os

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.errors import HostReadError
from gpuvfio.host import inventory
from gpuvfio.host.inventory import (FunctionIndex, Inventory, list_addresses, parse_resource,
                                    parse_vgpu_types, read_function, read_functions, read_ids,
                                    read_inventory)
from gpuvfio.host.model import Bar, Link, PciFunction
from gpuvfio.host.pciids import PciIds
from gpuvfio.host.root import HostRoot
from tests.hostbuilder import BAR64_PREF, GiB, HostBuilder

A = PciAddress.parse
NAMES = PciIds(b"# pci.ids, two entries\n10de  NVIDIA Corporation\n\t2684  AD102 [GeForce RTX 4090]\n"
               b"C 03  Display controller\n\t00  VGA compatible controller\n")


def _host(tmp_path, numa: int = -1):
    b = HostBuilder(str(tmp_path))
    b.iommu("intel", 1)
    return b, b.root_bus(numa=numa)


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _one(tmp_path, address: str) -> PciFunction:
    return read_inventory(HostRoot(str(tmp_path))).functions[A(address)]


def test_short_hex_ids_are_zero_padded_to_their_width(tmp_path):
    """A recorded or hand-made tree may print ``0x1`` where the kernel prints ``0x01``: the ids
    an admin matches (``-d 10de:``, a revision) must read the same either way."""
    b, rb = _host(tmp_path)
    b.function(rb, "0000:00:1c.0", "10de", "2684", "030000", subsystem=("de", "1"), revision="1")
    fn = _one(tmp_path, "0000:00:1c.0")
    assert (fn.subsystem_vendor_id, fn.subsystem_device_id, fn.revision) == ("00de", "0001", "01")


def test_missing_ids_refuse_naming_the_function_and_the_attribute(tmp_path):
    """A function without a readable vendor is a broken tree: the error names where and what,
    so the admin can find the file, instead of an inventory with a hole in it."""
    b, rb = _host(tmp_path)
    fn = b.function(rb, "0000:00:1d.0", "10de", "2684", "030000")
    os.unlink(os.path.join(fn.path, "uevent"))  # recorded before gpuvfio recorded uevents
    _write(os.path.join(fn.path, "vendor"), "nvidia\n")
    host = HostRoot(str(tmp_path))
    with pytest.raises(HostReadError, match=r"0000:00:1d\.0: missing or malformed vendor/device/class$"):
        read_ids(host, A("0000:00:1d.0"))
    with host.sys_dirs() as dirs, pytest.raises(HostReadError, match=r"1d\.0: missing or malformed vendor$"):
        FunctionIndex(host).vendor(A("0000:00:1d.0"), dirs)


def test_numa_node_reads_up_to_the_kernels_last_node(tmp_path):
    """Node numbers run 0-1023 (x86-64 CONFIG_NODES_SHIFT at most 10): 1023 is a node a GPU can
    be pinned near, 1024 is no node, and -1 (no affinity) is none either."""
    for numa, expected in ((1023, 1023), (1024, None), (-1, None)):
        root = tmp_path / str(numa)
        root.mkdir()
        b, rb = _host(root, numa=numa)
        b.function(rb, "0000:00:1e.0", "10de", "2684", "030000")
        assert _one(root, "0000:00:1e.0").numa_node == expected


def test_driver_override_null_and_empty_read_as_none(tmp_path):
    """``(null)`` (driver_override_show with none set) and an empty file both mean no override;
    any other value is the driver the function will bind to next, shown as is."""
    b, rb = _host(tmp_path)
    for n, text in enumerate(("vfio-pci\n", "(null)\n", "\n")):
        fn = b.function(rb, f"0000:00:{n + 3:02x}.0", "10de", "2684", "030000")
        _write(os.path.join(fn.path, "driver_override"), text)
    inv = read_inventory(HostRoot(str(tmp_path)))
    assert [inv.functions[A(f"0000:00:{n + 3:02x}.0")].driver_override for n in range(3)] == [
        "vfio-pci", None, None]


def test_boot_vga_is_true_only_for_1(tmp_path):
    """boot_vga says which GPU the firmware drew the console on (the one not to take from the
    host); absent (a non-VGA function) is unknown, not false."""
    b, rb = _host(tmp_path)
    for n, flag in enumerate((True, False, None)):
        b.function(rb, f"0000:00:{n + 8:02x}.0", "10de", "2684", "030000", boot_vga=flag)
    inv = read_inventory(HostRoot(str(tmp_path)))
    assert [inv.functions[A(f"0000:00:{n + 8:02x}.0")].boot_vga for n in range(3)] == [True, False, None]


def test_link_is_read_when_only_current_or_only_max_attributes_exist(tmp_path):
    """A tree holding only the current link attributes, or only the maximum ones (a partial
    recording), still shows the link it has: Gen and width are what the admin checks."""
    b, rb = _host(tmp_path)
    current = b.function(rb, "0000:00:0c.0", "10de", "2684", "030000", link=(4, 16))
    top = b.function(rb, "0000:00:0d.0", "10de", "2684", "030000", link=(3, 8, 4, 16))
    for fn, gone in ((current, "max"), (top, "current")):
        for attr in ("link_speed", "link_width"):
            os.unlink(os.path.join(fn.path, f"{gone}_{attr}"))
    inv = read_inventory(HostRoot(str(tmp_path)))
    assert inv.functions[A("0000:00:0c.0")].link == Link(16.0, 16, None, None)
    assert inv.functions[A("0000:00:0d.0")].link == Link(None, None, 16.0, 16)


def test_vgpu_types_read_when_either_nvidia_file_is_there(tmp_path):
    """NVIDIA's vGPU manager shows creatable_vgpu_types and current_vgpu_type; either alone is
    still what the VF offers or runs, and an nvidia directory with neither is no vGPU at all.
    A legacy mdev type's description (its heads and resolution) is shown with it."""
    b, rb = _host(tmp_path)
    fns = [b.function(rb, f"0000:00:{n + 0x10:02x}.0", "10de", "2236", "030200") for n in range(3)]
    b.vgpu_types(fns[0], [(590, "NVIDIA A10-4Q")], current=590)
    os.unlink(os.path.join(fns[0].path, "nvidia", "current_vgpu_type"))
    b.vgpu_types(fns[1], [], current=591)
    os.unlink(os.path.join(fns[1].path, "nvidia", "creatable_vgpu_types"))
    os.makedirs(os.path.join(fns[2].path, "nvidia"))
    b.mdev_types(fns[2], [("nvidia-222", "GRID T4-1B", 16, "num_heads=4, max_resolution=5120x2880")])
    inv = read_inventory(HostRoot(str(tmp_path)))
    only_types, only_current, neither = (inv.functions[f.address] for f in fns)
    assert [(t.type_id, t.name) for t in only_types.vgpu_creatable] == [(590, "NVIDIA A10-4Q")]
    assert only_types.vgpu_current is None
    assert (only_current.vgpu_creatable, only_current.vgpu_current) == ([], 591)
    assert (neither.vgpu_creatable, neither.vgpu_current) == (None, None)
    assert [m.description for m in neither.mdev_types] == ["num_heads=4, max_resolution=5120x2880"]


def test_resource_lines_that_are_not_bars_are_skipped_and_reading_goes_on():
    """Each line of ``resource`` is one resource, its index its position: a line that is unused,
    short, not hex, or ends before it starts is no BAR, and the BARs after it keep their index.
    The range is inclusive (resource_show prints start and end), so start == end is one byte."""
    text = "\n".join([
        "0x0 0x0 0x0",  # unused, unpadded
        "0x00000000f0000000 0x00000000f0ffffff",  # a field short
        "0x00000000f1000000 0x00000000f1ffffff 0xzz",  # flags not hex
        "0x00000000f2000000 0x00000000f1ffffff 0x0000000000040200",  # ends before it starts
        "0x0000000000001000 0x0000000000001000 0x0000000000040101",  # one byte
        "0x00000000f3000000 0x00000000f3ffffff 0x0000000000040200",
    ])
    assert parse_resource(text) == [Bar(4, 0x1000, 1, 0x40101), Bar(5, 0xF3000000, 16 << 20, 0x40200)]


def test_vgpu_type_ids_are_32_bit_and_names_keep_their_colons():
    """A vGPU type ID is 32 bits (NVML's nvmlVgpuTypeId_t, an unsigned int): one past it is no
    type. A blank line does not end the list, and a name is everything after the first colon."""
    text = "ID    : vGPU Name\n\n4294967295 : NVIDIA A10-4Q: MIG 1g\n4294967296 : NVIDIA A10-8Q\n"
    assert [(t.type_id, t.name) for t in parse_vgpu_types(text)] == [(4294967295, "NVIDIA A10-4Q: MIG 1g")]


def test_one_function_and_its_ids_read_without_an_open_pass(tmp_path):
    """read_function and read_ids open their own pass when the caller has none (a completion,
    a selector's class check), with the names the caller gave; with a pass, they use it."""
    b, rb = _host(tmp_path)
    b.function(rb, "0000:00:1f.0", "10de", "2684", "030000", bars=[(1, 32 * GiB, BAR64_PREF)])
    host = HostRoot(str(tmp_path))
    fn = read_function(host, A("0000:00:1f.0"), names=NAMES)
    assert (fn.address, fn.vendor_name, fn.device_name, fn.class_name) == (
        A("0000:00:1f.0"), "NVIDIA Corporation", "AD102 [GeForce RTX 4090]", "VGA compatible controller")
    assert fn.largest_bar == 32 * GiB
    assert read_ids(host, A("0000:00:1f.0")) == ("10de", "2684", "030000")
    with host.sys_dirs() as dirs:
        assert read_ids(host, A("0000:00:1f.0"), dirs) == ("10de", "2684", "030000")


def test_read_functions_reads_only_the_addresses_asked(tmp_path):
    """``list ADDRESS`` reads the functions named, not every function of the host."""
    b, rb = _host(tmp_path)
    for n in range(3):
        b.function(rb, f"0000:00:{n + 0x14:02x}.0", "10de", "2684", "030000")
    assert list(read_functions(HostRoot(str(tmp_path)), [A("0000:00:15.0")])) == [A("0000:00:15.0")]


def test_every_listed_address_is_parsed_on_first_sight(tmp_path, monkeypatch):
    """The addresses under bus/pci/devices, seen for the first time in this command (an empty
    cache), are the host's functions; a name that is no address is none of them."""
    monkeypatch.setattr(inventory, "_ADDRESS_CACHE", {})
    b, rb = _host(tmp_path)
    for address in ("0000:00:17.0", "0000:00:16.0"):
        b.function(rb, address, "10de", "2684", "030000")
    os.makedirs(b.sys_path("bus", "pci", "devices", "not-an-address"))
    host = HostRoot(str(tmp_path))
    assert list_addresses(host) == [A("0000:00:16.0"), A("0000:00:17.0")]
    assert list_addresses(host) == [A("0000:00:16.0"), A("0000:00:17.0")]  # and again, from the cache


def test_group_members_are_only_functions_the_host_lists(tmp_path):
    """An IOMMU group's directory may name a function gone from bus/pci/devices (removed while
    the group is read): it is no member to judge, and reading it is no error."""
    b, rb = _host(tmp_path)
    gpu = b.function(rb, "0000:00:18.0", "10de", "2684", "030000")
    os.symlink("../../../../devices/pci0000:00/0000:00:19.0",
               b.sys_path("kernel", "iommu_groups", str(gpu.group), "devices", "0000:00:19.0"))
    host = HostRoot(str(tmp_path))
    with host.sys_dirs() as dirs:
        assert FunctionIndex(host).group_members(gpu.group, dirs) == [A("0000:00:18.0")]


def test_function_index_keeps_its_first_answer_for_the_command(tmp_path):
    """A command reads a function's ids and group once: if the tree changes under it (a rebind
    moving a group link), the selection and the group's verdict still agree on one answer."""
    b, rb = _host(tmp_path)
    gpu = b.function(rb, "0000:00:1a.0", "10de", "2684", "030000")
    host = HostRoot(str(tmp_path))
    index = FunctionIndex(host)
    with host.sys_dirs() as dirs:
        first = index.ids(A("0000:00:1a.0"), dirs)
        os.makedirs(b.sys_path("kernel", "iommu_groups", "77", "devices"))
        os.unlink(os.path.join(gpu.path, "iommu_group"))
        os.symlink("../../../kernel/iommu_groups/77", os.path.join(gpu.path, "iommu_group"))
        assert index.ids(A("0000:00:1a.0"), dirs) == first and first.iommu_group == gpu.group
        assert index.vendor(A("0000:00:1a.0"), dirs) == "10de"


def test_group_of_is_none_without_groups_or_without_the_function():
    """On a host without IOMMU groups, or for an address it does not have, a function's group is
    none (the report says so) rather than an error."""
    fn = PciFunction(address=A("0000:00:1b.0"), vendor_id="10de", device_id="2684", class_id="030000")
    fn.iommu_group = 3
    assert Inventory({fn.address: fn}, None).group_of(fn.address) is None
    assert Inventory({fn.address: fn}, {}).group_of(A("0000:00:1b.1")) is None


@pytest.mark.parametrize("width, expected", [("255", None), ("254", 254), ("16", 16), ("0", 0)])
def test_max_link_width_255_is_the_kernels_unknown(tmp_path, width, expected):
    """Linux writes 255 (PCIE_LNK_WIDTH_UNKNOWN) when a function's Link Capabilities read 0
    (QEMU's virtio functions; seen in the kernel lane): no maximum, not a width of 255."""
    b, rb = _host(tmp_path)
    fn = b.function(rb, "0000:00:1c.0", "1af4", "1041", "020000")
    for name, value in (("current_link_width", "1"), ("max_link_width", width),
                        ("current_link_speed", "2.5 GT/s PCIe"), ("max_link_speed", "Unknown")):
        _write(os.path.join(fn.path, name), value + "\n")
    link = _one(tmp_path, "0000:00:1c.0").link
    assert (link.current_width, link.max_width, link.max_speed_gts) == (1, expected, None)
