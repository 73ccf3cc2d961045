"""A function's ``uevent`` (drivers/pci/pci-driver.c pci_uevent, drivers/base/core.c dev_uevent)
gives its ids and driver in one read: the inventory read that way is the inventory read from the
separate attributes, on every sample and generated host; a uevent that cannot be trusted to say
the same is not used, and one that is not a regular file is an error, as any attribute is."""

import os

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.errors import HostReadError, UnsafePathError
from gpuvfio.host.inventory import FunctionIndex, KernelIds, parse_uevent, read_ids, read_inventory
from gpuvfio.host.pciids import PciIds
from gpuvfio.host.root import HostRoot
from tests.hostbuilder import write_uevent
from tests.make_samples import EVERY_HOST, host_tree

ADDRESS = PciAddress.parse("0000:41:00.0")
# What Linux 6.1 printed for an H100 bound to vfio-pci, line by line as uevent_show prints it.
KERNEL_TEXT = ("DRIVER=vfio-pci\nPCI_CLASS=30200\nPCI_ID=10DE:2330\nPCI_SUBSYS_ID=10DE:16C1\n"
               "PCI_SLOT_NAME=0000:41:00.0\nMODALIAS=pci:v000010DEd00002330sv000010DEsd000016C1bc03sc02i00\n")
ID_ATTRIBUTES = ("vendor", "device", "class", "subsystem_vendor", "subsystem_device")


def _root(name: str, tmp_path) -> str:
    return host_tree(name, str(tmp_path / name))


def _function_dirs(root: str) -> list[str]:
    devices = os.path.join(root, "sys", "bus", "pci", "devices")
    return [os.path.realpath(os.path.join(devices, name)) for name in sorted(os.listdir(devices))]


def _report(root: str) -> tuple[list[dict], dict]:
    host = HostRoot(root)
    inventory = read_inventory(host, names=PciIds.load(host))
    groups = {} if inventory.groups is None else {n: g.to_json() for n, g in inventory.groups.items()}
    return [f.to_json() for f in inventory.functions.values()], groups


@pytest.mark.parametrize("name", EVERY_HOST)
def test_the_uevent_read_is_the_attribute_read(name, tmp_path):
    """The same functions and groups three ways: uevent and attributes both there (the uevent
    read), the attributes and links without any uevent (an older recording), and the uevent
    alone, without the five id attributes and the driver link (what it carries is all it needs)."""
    root = _root(name, tmp_path)
    dirs = _function_dirs(root)
    assert all(os.path.isfile(os.path.join(d, "uevent")) for d in dirs)
    both = _report(root)
    assert any(f["driver"] for f in both[0]) and any(f["driver"] is None for f in both[0])
    saved = {}
    for d in dirs:
        with open(os.path.join(d, "uevent")) as handle:
            saved[d] = handle.read()
        os.unlink(os.path.join(d, "uevent"))
    assert _report(root) == both
    for d in dirs:
        with open(os.path.join(d, "uevent"), "w") as handle:
            handle.write(saved[d])
        for attribute in ID_ATTRIBUTES + ("driver",):
            if os.path.lexists(os.path.join(d, attribute)):
                os.unlink(os.path.join(d, attribute))
    assert _report(root) == both


def test_the_kernels_lines_give_ids_and_driver():
    assert parse_uevent(KERNEL_TEXT, ADDRESS) == KernelIds("10de", "2330", "030200", "10de", "16c1", "vfio-pci")
    unbound = KERNEL_TEXT.replace("DRIVER=vfio-pci\n", "")
    assert parse_uevent(unbound, ADDRESS).driver is None
    # dev_uevent's other lines (OF_* on device-tree platforms) may come between: ignored.
    assert parse_uevent("OF_NAME=gpu\n" + KERNEL_TEXT, ADDRESS).device_id == "2330"
    # A class with its leading digits (a host bridge is 060000, printed 60000; a 4-digit one 0000xx).
    assert parse_uevent(KERNEL_TEXT.replace("30200", "0680"), ADDRESS).class_id == "000680"
    # Driver names are what drivers chose: Linux 6.1's i6300esb watchdog is "i6300ESB timer".
    assert parse_uevent(KERNEL_TEXT.replace("vfio-pci", "i6300ESB timer"), ADDRESS).driver == "i6300ESB timer"


@pytest.mark.parametrize("name, taken", [
    ("x" * 255, True), ("x" * 256, False), ("é" * 127, True), ("é" * 128, False),  # NAME_MAX is in bytes
    ("\udcff" * 255, True), ("\udcff" * 256, False),  # undecodable bytes count one each
    (".", False), ("..", False), ("...", True), ("a/b", False), ("/", False),
])
def test_a_driver_name_is_any_name_a_sysfs_directory_can_have(name, taken):
    found = parse_uevent(KERNEL_TEXT.replace("DRIVER=vfio-pci", f"DRIVER={name}"), ADDRESS)
    assert (found is not None and found.driver == name) is taken


@pytest.mark.parametrize("text", [
    None, "", KERNEL_TEXT.replace("PCI_SLOT_NAME=0000:41:00.0", "PCI_SLOT_NAME=0000:42:00.0"),
    KERNEL_TEXT.replace("PCI_ID=10DE:2330\n", ""), KERNEL_TEXT.replace("PCI_SUBSYS_ID=10DE:16C1\n", ""),
    KERNEL_TEXT.replace("PCI_CLASS=30200\n", ""), KERNEL_TEXT.replace("PCI_ID=10DE:2330", "PCI_ID=10DE:2330:1"),
    KERNEL_TEXT.replace("PCI_ID=10DE:2330", "PCI_ID=10DE:233"), KERNEL_TEXT.replace("30200", "3020000"),
    KERNEL_TEXT.replace("30200", "30G00"), KERNEL_TEXT.replace("PCI_ID=10DE", "PCI_ID=１０DE"),
    KERNEL_TEXT + "PCI_ID=10DE:2331\n", KERNEL_TEXT + "DRIVER=nvidia\n",
    KERNEL_TEXT.replace("DRIVER=vfio-pci", "DRIVER=vfio/pci"), KERNEL_TEXT.replace("DRIVER=vfio-pci", "DRIVER=.."),
    KERNEL_TEXT.replace("DRIVER=vfio-pci", "DRIVER=" + "x" * 256), KERNEL_TEXT.replace("DRIVER=vfio-pci", "DRIVER"),
    KERNEL_TEXT.replace("DRIVER=vfio-pci", "DRIVER="), KERNEL_TEXT.replace("\n", "\r"),
])
def test_a_uevent_that_cannot_be_trusted_is_not_used(text):
    """Missing, another function's, a field absent, repeated, too long, not hex (ASCII only), or
    a driver name no sysfs directory could have: no answer, and the attributes are read instead."""
    assert parse_uevent(text, ADDRESS) is None


def test_a_malformed_uevent_falls_back_to_the_attributes(tmp_path):
    root = _root("generated", tmp_path)
    gpu = next(d for d in _function_dirs(root) if open(os.path.join(d, "vendor")).read().strip() == "0x10de")
    address = PciAddress.parse(os.path.basename(gpu))
    before = [f.to_json() for f in read_inventory(HostRoot(root)).functions.values()]
    with open(os.path.join(gpu, "uevent"), "w") as handle:  # ids of another function: never believed
        handle.write(KERNEL_TEXT.replace("0000:41:00.0", str(address)).replace("2330", "1234") + "PCI_ID=1:2\n")
    assert [f.to_json() for f in read_inventory(HostRoot(root)).functions.values()] == before
    with open(os.path.join(gpu, "vendor"), "w") as handle:
        handle.write("nvidia\n")
    with pytest.raises(HostReadError, match="missing or malformed vendor/device/class"):
        read_ids(HostRoot(root), address)


@pytest.mark.parametrize("swap", ["directory", "fifo", "link"])
def test_a_uevent_that_is_not_a_regular_file_is_an_error(swap, tmp_path):
    """As any attribute: a directory, a FIFO (never a read that waits) or a link in its place."""
    root = _root("generated", tmp_path)
    gpu = next(d for d in _function_dirs(root) if open(os.path.join(d, "vendor")).read().strip() == "0x10de")
    target = os.path.join(gpu, "uevent")
    secret = tmp_path / "secret"
    secret.write_text(KERNEL_TEXT)
    os.unlink(target)
    {"directory": os.mkdir, "fifo": os.mkfifo, "link": lambda p: os.symlink(str(secret), p)}[swap](target)
    host = HostRoot(root)
    with pytest.raises((HostReadError, UnsafePathError)):
        read_inventory(host)
    with host.sys_dirs() as dirs, pytest.raises((HostReadError, UnsafePathError)):
        FunctionIndex(host).ids(PciAddress.parse(os.path.basename(gpu)), dirs)


def test_a_fixtures_uevent_loses_its_driver_line_once_unbound(tmp_path):
    """Fixtures say what a kernel would: write_uevent (which HostBuilder and the simulated kernel
    call after each bind and unbind) follows the driver link."""
    root = _root("generated", tmp_path)
    gpu = next(d for d in _function_dirs(root) if open(os.path.join(d, "vendor")).read().strip() == "0x10de")
    os.unlink(os.path.join(gpu, "driver"))
    write_uevent(gpu)
    with open(os.path.join(gpu, "uevent")) as handle:
        assert not handle.read().startswith("DRIVER=")


def test_the_selection_reads_take_the_uevent_alone(tmp_path):
    """What a device selector, an IOMMU group's members and a Tab read (read_ids, FunctionIndex.ids,
    read_ids_and_physfn) come from the uevent when it is there: with the five id attributes gone
    they answer as before, and list -d, a slot and a Tab give what they gave."""
    from gpuvfio.ops.completion import device_candidates
    from gpuvfio.host.inventory import read_ids_and_physfn

    root = _root("generated", tmp_path)
    host = HostRoot(root)
    addresses = [PciAddress.parse(os.path.basename(d)) for d in _function_dirs(root)]

    def answers():
        with host.sys_dirs() as dirs:
            index = FunctionIndex(host)
            return ([read_ids(host, a) for a in addresses], [index.ids(a, dirs) for a in addresses],
                    [read_ids_and_physfn(host, a, dirs) for a in addresses], device_candidates(root, ""))

    before = answers()
    assert any(kind[3] for kind in before[2]) and before[3]
    for d in _function_dirs(root):
        for attribute in ID_ATTRIBUTES:
            os.unlink(os.path.join(d, attribute))
    assert answers() == before
