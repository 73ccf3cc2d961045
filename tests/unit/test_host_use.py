"""What the host itself runs on refuses a bind (issue 33 item 1): trees built in the kernel's
shapes (tests/hostbuilder.py: sysfs block, net, graphics, drm and vtconsole classes; PID 1's
mountinfo, swaps and routes), asked through the command as an admin asks it.

Each refusal names its chain; each free device plans with exit 0; ``--take-host-devices`` is the
one override, on bind, persist, attach, the testbed and Ansible alike."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.host.host_use import HostUseReader
from gpuvfio.host.recording import dump_host
from gpuvfio.host.root import HostRoot
from gpuvfio.options import RUN
from tests.hostbuilder import BAR32, BAR64_PREF, GiB, HostBuilder, MiB

A = PciAddress.parse
NVME, SATA, NIC, NIC2, GPU = "0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0", "0000:01:00.0"


def host(root) -> HostBuilder:
    """A server: a boot GPU, an NVMe, a SATA controller, two NICs, each alone in its group."""
    b = HostBuilder(str(root))
    b.iommu("intel", 1)
    b.cpuinfo("Intel(R) Xeon(R) Gold 6430", 46)
    cpus = b.cpu_topology(1, 4, 2)
    b.numa_node(0, cpus[0], 64)
    rb = b.root_bus(numa=0)
    b.function(rb, "0000:00:00.0", "8086", "09a2", "060000")
    b.modules(["nvidia", "nvme", "ahci", "igb"])
    for slot, (address, vendor, device, klass, driver) in enumerate((
            (GPU, "10de", "2684", "030000", "nvidia"), (NVME, "144d", "a80a", "010802", "nvme"),
            (SATA, "8086", "a352", "010601", "ahci"), (NIC, "8086", "1533", "020000", "igb"),
            (NIC2, "8086", "1533", "020000", "igb")), start=1):
        port = b.bridge(rb, f"0000:00:{slot:02x}.0", "8086", "352a", secondary_bus=int(address[5:7], 16),
                        link=(4, 16))
        b.function(port, address, vendor, device, klass, driver=driver, link=(4, 16), boot_vga=address == GPU,
                   bars=[(0, 16 * MiB, BAR32)] + ([(1, 8 * GiB, BAR64_PREF)] if address == GPU else []))
    return b


def dry_bind(cli, root, *args):
    return cli("--root", str(root), "bind", *args, "--connect", "none", "--dry-run", "--json")


def refusals(result) -> list[str]:
    return [c["message"] for c in result.json()["checks"] if c["id"] == "host_use" and c["status"] == "refuse"]


@pytest.fixture
def b(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    return host(tmp_path / "host")


def fn(b, address):
    return b.functions[A(address)]


def test_root_on_lvm_on_luks_on_an_nvme_partition_is_refused_by_its_chain(cli, b):
    b.block("nvme0n1", "259:0", fn=fn(b, NVME))
    b.block("nvme0n1p1", "259:1", disk="nvme0n1")
    b.block("nvme0n1p3", "259:3", disk="nvme0n1")
    b.dm("dm-0", "253:0", "luks-3f0c", "CRYPT-LUKS2-3f0c0000-luks-3f0c", "nvme0n1p3")
    b.dm("dm-1", "253:1", "vg0-root", "LVM-aaaabbbb", "dm-0")
    b.mount("253:1", "/", "/dev/mapper/vg0-root", "ext4")
    b.mount("259:1", "/boot/efi", "/dev/nvme0n1p1", "vfat")
    result = dry_bind(cli, b.root, NVME)
    assert result.code == 1, result.err
    found = refusals(result)
    assert f"{NVME}: nvme0n1p3 holds LUKS luks-3f0c, which holds LVM vg0-root, which is mounted on /" in found[1]
    assert found[0].startswith(f"{NVME}: nvme0n1p1 is mounted on /boot/efi")
    assert all("--take-host-devices" in m for m in found)
    # The override makes it a plan again, each finding kept as a warning.
    taken = cli("--root", str(b.root), "bind", NVME, "--connect", "none", "--take-host-devices", "--dry-run", "--json")
    assert taken.code == 0, taken.err
    warned = [c for c in taken.json()["checks"] if c["id"] == "host_use"]
    assert [c["status"] for c in warned] == ["warn", "warn"] and "taken anyway" in warned[1]["message"]


def test_md_raid1_of_two_sata_disks_behind_one_controller_is_refused(cli, b):
    ahci = fn(b, SATA)
    for n, disk in enumerate(("sda", "sdb")):
        b.block(disk, f"8:{16 * n}", fn=ahci, sub=f"ata{n + 1}/host{n}/target{n}:0:0/{n}:0:0:0/block")
        b.block(f"{disk}1", f"8:{16 * n + 1}", disk=disk)
    b.md("md0", "9:0", "raid1", "sda1", "sdb1")
    b.mount("9:0", "/", "/dev/md0", "xfs")
    result = dry_bind(cli, b.root, SATA)
    assert result.code == 1
    assert refusals(result) == [f"{SATA}: sda1 holds md md0 (raid1), which is mounted on /: the host loses it "
                                "(--take-host-devices to take it anyway)"]


def test_swap_on_a_partition_and_a_btrfs_member_are_refused(cli, b):
    b.block("nvme0n1", "259:0", fn=fn(b, NVME))
    b.block("nvme0n1p2", "259:2", disk="nvme0n1")
    b.block("nvme0n1p3", "259:3", disk="nvme0n1")
    b.swap("/dev/nvme0n1p2")
    # btrfs shows an anonymous device number in mountinfo: known by its member link.
    os.makedirs(b.sys_path("fs", "btrfs", "6f1e", "devices"))
    os.symlink("../../../../devices/x", b.sys_path("fs", "btrfs", "6f1e", "devices", "nvme0n1p3"))
    b.mount("0:33", "/srv", "/dev/sdz9", "btrfs")
    found = refusals(dry_bind(cli, b.root, NVME))
    assert found == [f"{NVME}: nvme0n1p2 is active swap: the host loses it (--take-host-devices to take it anyway)",
                     f"{NVME}: nvme0n1p3 is in the mounted btrfs filesystem 6f1e: the host loses it "
                     "(--take-host-devices to take it anyway)"]


def test_a_nic_under_a_bond_under_a_bridge_with_the_default_route_is_refused(cli, b):
    b.net("eno1", fn=fn(b, NIC))
    b.net("bond0", devtype="bond")
    b.net("br0", devtype="bridge")
    b.upper("eno1", "bond0")
    b.upper("bond0", "br0")
    b.route("br0", "10.0.0.0", "255.255.255.0")
    b.route("br0", "0.0.0.0", "0.0.0.0", "10.0.0.1")
    found = refusals(dry_bind(cli, b.root, NIC))
    assert found == [f"{NIC}: eno1 is in bond bond0, which is in bridge br0, which carries the default route "
                     "(IPv4 via 10.0.0.1): the host loses it (--take-host-devices to take it anyway)"]


def test_a_nic_with_only_ipv6_is_refused_and_a_down_one_plans(cli, b):
    b.net("eno1", fn=fn(b, NIC))
    b.inet6("eno1", "2001:db8::5")
    b.inet6("eno1", "fe80::1", scope=0x20)
    b.net("eno2", fn=fn(b, NIC2))
    b.inet6("eno2", "fe80::2", scope=0x20)  # link-local only: on every interface that is up
    assert refusals(dry_bind(cli, b.root, NIC)) == [
        f"{NIC}: eno1 carries the address 2001:db8::5: the host loses it (--take-host-devices to take it anyway)"]
    free = dry_bind(cli, b.root, NIC2)
    assert free.code == 0, free.err
    notes = [c["message"] for c in free.json()["checks"] if c["id"] == "host_use"]
    assert f"{NIC2} is not a GPU (Ethernet controller); nothing on the host uses it" in notes


def test_an_ipv6_default_route_is_named_first(cli, b):
    b.net("eno1", fn=fn(b, NIC))
    b.net("eno1.20", devtype="vlan")
    b.upper("eno1", "eno1.20", master=False)
    b.route6("eno1.20", "2001:db8:20::", 64)
    b.route6("eno1.20", "::", 0, "fe80::1")
    b.route6("eno1.20", "fe80::", 64)
    assert refusals(dry_bind(cli, b.root, NIC)) == [
        f"{NIC}: eno1 is in VLAN eno1.20, which carries the default route (IPv6 via fe80::1): the host loses it "
        "(--take-host-devices to take it anyway)"]
    b.route("eno1.20", "0.0.0.0", "0.0.0.0", "192.0.2.1")
    assert refusals(dry_bind(cli, b.root, NIC)) == [
        f"{NIC}: eno1 is in VLAN eno1.20, which carries the default routes (IPv4 via 192.0.2.1; IPv6 via fe80::1): "
        "the host loses it (--take-host-devices to take it anyway)"]


def test_a_spare_nvme_plans_and_says_it_is_no_gpu(cli, b):
    b.block("nvme0n1", "259:0", fn=fn(b, NVME))
    b.block("nvme0n1p1", "259:1", disk="nvme0n1")
    result = dry_bind(cli, b.root, NVME)
    assert result.code == 0, result.err
    notes = [c["message"] for c in result.json()["checks"] if c["id"] == "host_use"]
    assert notes[0].startswith(f"{NVME} is not a GPU (Non-Volatile memory controller")
    assert result.json()["result"] == "dry_run"


def test_the_boot_gpu_with_the_framebuffer_console_and_a_lit_display(cli, b):
    gpu = fn(b, GPU)
    b.fb(gpu, "fb0")
    b.vtconsole("vtcon0", "(S) dummy device", False)
    b.vtconsole("vtcon1", "(M) frame buffer device", True)
    b.drm(gpu, "card0", {"DP-1": True, "HDMI-A-1": False})
    result = cli("--root", str(b.root), "bind", GPU, "--connect", "none", "--force", "--dry-run", "--json")
    assert result.code == 1, "--force overrides boot_vga, never the host's console"
    assert refusals(result) == [
        f"{GPU}: fb0 carries the host's text console (vtcon1: (M) frame buffer device): the host loses it "
        "(--take-host-devices to take it anyway)",
        f"{GPU}: card0-DP-1 is lit (a display is enabled on it): the host loses it "
        "(--take-host-devices to take it anyway)"]
    both = cli("--root", str(b.root), "bind", GPU, "--connect", "none", "--force", "--take-host-devices",
               "--dry-run", "--json")
    assert both.code == 0, both.err


def test_an_unbound_console_and_a_dark_connector_take_nothing(cli, b):
    gpu = fn(b, GPU)
    b.fb(gpu, "fb0")
    b.vtconsole("vtcon1", "(M) frame buffer device", False)
    b.drm(gpu, "card0", {"DP-1": False})
    assert refusals(cli("--root", str(b.root), "bind", GPU, "--connect", "none", "--force", "--dry-run",
                        "--json")) == []


def test_an_nvme_multipath_head_belongs_to_its_controllers(cli, b):
    ctrl = os.path.join(fn(b, NVME).path, "nvme", "nvme0")
    subsys = b.sys_path("devices", "virtual", "nvme-subsystem", "nvme-subsys0")
    os.makedirs(ctrl)
    os.makedirs(subsys)
    os.symlink(os.path.relpath(ctrl, subsys), os.path.join(subsys, "nvme0"))
    b.block("nvme0c0n1", "259:9", fn=fn(b, NVME))  # the hidden path device
    b.block("nvme0n1", "259:0", fn=None, sub="")
    os.rename(b.sys_path("devices", "virtual", "block", "nvme0n1"), os.path.join(subsys, "nvme0n1"))
    os.unlink(b.sys_path("class", "block", "nvme0n1"))
    os.symlink(os.path.relpath(os.path.join(subsys, "nvme0n1"), b.sys_path("class", "block")),
               b.sys_path("class", "block", "nvme0n1"))
    b.mount("259:0", "/var", "/dev/nvme0n1", "ext4")
    assert refusals(dry_bind(cli, b.root, NVME)) == [
        f"{NVME}: nvme0n1 is mounted on /var: the host loses it (--take-host-devices to take it anyway)"]


@pytest.mark.parametrize("missing", ["proc/1/mountinfo", "proc/swaps", "proc/1/net/route", "sys/class/block",
                                     "sys/class/net"])
def test_a_tree_that_cannot_answer_refuses(cli, b, missing):
    path = os.path.join(b.root, missing)
    shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    result = dry_bind(cli, b.root, NIC)
    assert result.code == 1
    assert refusals(result) == [f"cannot tell what the host itself uses: no {missing} in this host's tree (a recording "
                                "made before gpuvfio read them: record the host again); --take-host-devices binds "
                                "without knowing"]


def test_a_class_link_out_of_sys_refuses_and_names_are_escaped(cli, b, tmp_path):
    b.block("nvme0n1", "259:0", fn=fn(b, NVME))
    b.dm("dm-0", "253:0", "vg0-root\x1b]0;pwned\x07\nrefuse fake", "LVM-x", "nvme0n1")
    b.mount("253:0", "/", "/dev/dm-0", "ext4")
    result = cli("--root", str(b.root), "bind", NVME, "--connect", "none", "--dry-run")
    assert result.code == 1
    assert "\x1b" not in result.out + result.err and "\nrefuse fake" not in result.out + result.err
    assert "LVM vg0-root\\x1b]0;pwned\\x07\\nrefuse fake, which is mounted on /" in result.err
    os.symlink("../../../../outside", b.sys_path("class", "net", "evil"))
    result = dry_bind(cli, b.root, NVME)
    assert result.code == 1
    assert refusals(result) == ["sys/class/net/evil links outside sys (to ../../../../outside); "
                                "--take-host-devices binds without knowing"]


def test_persist_refuses_the_system_disk(cli, b):
    b.block("nvme0n1", "259:0", fn=fn(b, NVME))
    b.mount("259:0", "/", "/dev/nvme0n1", "ext4")
    result = cli("--root", str(b.root), "persist", NVME, "--dry-run")
    assert result.code == 1
    assert "nvme0n1 is mounted on /" in result.err
    assert cli("--root", str(b.root), "persist", NVME, "--dry-run", "--take-host-devices").code == 0


def test_a_recording_carries_what_the_host_uses(b, tmp_path):
    b.block("nvme0n1", "259:0", fn=fn(b, NVME))
    b.block("nvme0n1p3", "259:3", disk="nvme0n1")
    b.dm("dm-0", "253:0", "vg0-root", "LVM-x", "nvme0n1p3")
    b.mount("253:0", "/", "/dev/mapper/vg0-root", "ext4")
    b.net("eno1", fn=fn(b, NIC))
    b.net("bond0", devtype="bond")
    b.upper("eno1", "bond0")
    b.route("bond0", "0.0.0.0", "0.0.0.0", "10.0.0.1")
    b.fb(fn(b, GPU))
    b.vtconsole("vtcon1", "(M) frame buffer device", True)
    live = HostUseReader(HostRoot(b.root))
    path = tmp_path / "rec.host"
    path.write_text(dump_host(HostRoot(b.root)))
    from gpuvfio.ops.inventory import open_host
    with open_host(str(path)) as (recorded, _label):
        again = HostUseReader(recorded)
        for address in (NVME, NIC, GPU):
            assert again.uses(A(address)) == live.uses(A(address)) != []


def test_the_override_is_one_option_everywhere(cli):
    option = RUN["take_host_devices"]
    assert option.flag == "--take-host-devices" and option.default is False
    assert "attach" in option.cli and "variant" in option.spec
    for command in ("bind", "persist", "attach"):
        assert "--take-host-devices" in cli(command, "--help").out, command
    from gpuvfio.testbed.schema import schema
    spec = json.dumps(schema())
    assert "take_host_devices" in spec


def test_a_master_link_out_of_sys_refuses_as_a_check(cli, b):
    """A link up the stack that leaves sys: the plan refuses naming it (fail closed), one line."""
    b.net("eno1", fn=fn(b, NIC))
    os.symlink("/etc", os.path.join(os.path.realpath(b.sys_path("class", "net", "eno1")), "master"))
    result = dry_bind(cli, b.root, NIC)
    assert result.code == 1 and "Traceback" not in result.err
    found = refusals(result)
    assert len(found) == 1 and found[0].startswith(f"{NIC}: cannot tell what the host uses on it: ")
    assert "links to absolute path /etc" in found[0]


def test_a_large_stack_is_followed_whole_and_a_huge_one_is_not_called_unused(cli, b, monkeypatch):
    """64 LVs on one partition hid the mounted root (the walk stopped, then said "unused");
    each LV is followed now, and a stack past MAX_STACK refuses as "cannot tell"."""
    b.block("nvme0n1", "259:0", fn=fn(b, NVME))
    b.block("nvme0n1p3", "259:3", disk="nvme0n1")
    for n in range(100):
        b.dm(f"dm-{n}", f"253:{n}", f"vg0-lv{n}", f"LVM-x{n}", "nvme0n1p3")
    b.mount("253:99", "/", "/dev/mapper/vg0-lv99", "ext4")
    assert refusals(dry_bind(cli, b.root, NVME)) == [
        f"{NVME}: nvme0n1p3 holds LVM vg0-lv99, which is mounted on /: the host loses it "
        "(--take-host-devices to take it anyway)"]
    from gpuvfio.host import host_use

    monkeypatch.setattr(host_use, "MAX_STACK", 50)
    found = refusals(dry_bind(cli, b.root, NVME))
    assert found == [f"{NVME}: cannot tell what the host uses on it: more than 50 devices stacked on nvme0n1p3 "
                     "(--take-host-devices binds without knowing)"], found


def test_a_vmd_domain_nvme_is_its_own_owner(b):
    """Behind Intel VMD the NVMe's address has a five-digit domain (10000:e1:00.0): its disk is
    its own, not the VMD controller's."""
    vmd = fn(b, NVME)
    path = os.path.join(vmd.path, "pci10000:e0", "10000:e0:06.0", "10000:e1:00.0", "nvme", "nvme0", "nvme0n1")
    os.makedirs(path)
    os.symlink(os.path.relpath(path, b.sys_path("class", "block")), b.sys_path("class", "block", "nvme0n1"))
    with open(os.path.join(path, "dev"), "w") as handle:
        handle.write("259:0\n")
    os.makedirs(os.path.join(path, "holders"))
    b.mount("259:0", "/", "/dev/nvme0n1", "xfs")
    reader = HostUseReader(HostRoot(b.root))
    assert [u.describe() for u in reader.uses(A("10000:e1:00.0"))] == ["10000:e1:00.0: nvme0n1 is mounted on /"]
    assert reader.uses(A(NVME)) == []


def test_a_zfs_host_cannot_tell_and_refuses(cli, b):
    """ZFS opens its disks itself: sysfs lists no holder and its mounts name the pool. A disk of
    a host that mounts ZFS is refused as unknown (fail closed)."""
    b.block("nvme0n1", "259:0", fn=fn(b, NVME))
    b.mount("0:42", "/", "rpool/ROOT/ubuntu", "zfs")
    assert refusals(dry_bind(cli, b.root, NVME)) == [
        f"{NVME}: nvme0n1 may be in the mounted ZFS pool rpool (ZFS's disks have no holders in sysfs: gpuvfio "
        "cannot tell): the host loses it (--take-host-devices to take it anyway)"]
