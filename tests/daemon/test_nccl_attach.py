"""attach writes the NCCL topology file inside the guest (issue 14 item 3), end to end: the
attach service binds two GPUs under a host switch (a simulated kernel answers the sysfs
writes), defines and starts the guest on libvirt's test driver, reaches it over real SSH
(this machine behind dropbear, tests/lanes/hypervisor.py), runs the probe there and writes
/etc/gpuvfio/nccl-topo.xml from the bus ids the guest shows, and names it in the guest's
/etc/nccl.conf (the admin's lines kept; an earlier NCCL_TOPO_FILE replaced when asked, and said), where
NCCL finds it by itself. The stand-in guest's PCI tree is
built as the plan's guest tree (root port, emulated switch, two GPUs), under the root its
probe reads (GPUVFIO_PROBE_ROOT); a guest unlike the plan gets no file, and says why.
"""

from __future__ import annotations

import os

import pytest
from lxml import etree

from gpuvfio.address import PciAddress
from gpuvfio.domain.request import domain_request
from gpuvfio.ops import guests
from gpuvfio.ops.targets import SshOptions
from tests.contexts import SharedConnection, lock_held_elsewhere, sim_context
from tests.hostbuilder import BAR32, BAR64_PREF, GiB, HostBuilder, MiB
from tests.simkernel import SimKernel
from tests.unit.test_plan_attach import kernel_file

libvirt = pytest.importorskip("libvirt")

L40S = ("10de", "26b9", "030200")
GPUS = ["0000:03:00.0", "0000:04:00.0"]
GUEST_FILE = os.path.join("etc", "gpuvfio", "nccl-topo.xml")
GUEST_CONF = os.path.join("etc", "nccl.conf")


def _gpu_tree(root: str, *, switch: bool, gpu_link=(4, 16), first_bus: int = 1, bridge_link=(5, 16),
              gpus: list[str] = GPUS) -> HostBuilder:
    """One socket: a root port -> (a switch ->) two L40S, each in a group of its own (the
    downstream ports isolate them). The host: buses 1-4; a stand-in guest: other bus numbers and
    the emulated ports' link, so that a file written from the host's view would show."""
    b = HostBuilder(root)
    b.iommu("intel", 1)
    b.cmdline("BOOT_IMAGE=/vmlinuz ro intel_iommu=on iommu=pt")
    b.cpuinfo("Intel(R) Xeon(R) Gold 6448Y", 46)
    b.firmware()
    cpus = b.cpu_topology(1, 4, 2)
    b.numa_node(0, cpus[0], 64)
    rb = b.root_bus(numa=0)
    bars = [(0, 16 * MiB, BAR32), (1, 32 * GiB, BAR64_PREF), (3, 32 * MiB, BAR64_PREF)]
    up_bus, down_bus = first_bus, first_bus + 1
    gpu_buses = [int(a.split(":")[1], 16) for a in gpus]
    if switch:
        rp = b.bridge(rb, "0000:00:01.0", "8086", "352a", secondary_bus=up_bus, link=bridge_link)
        up = b.bridge(rp, f"0000:{up_bus:02x}:00.0", "1000", "c030", secondary_bus=down_bus, link=bridge_link)
        parents = [b.bridge(up, f"0000:{down_bus:02x}:{n:02x}.0", "1000", "c030", secondary_bus=bus,
                            link=bridge_link) for n, bus in enumerate(gpu_buses)]
    else:
        parents = [b.bridge(rb, f"0000:00:{1 + n:02x}.0", "8086", "352a", secondary_bus=bus, link=bridge_link)
                   for n, bus in enumerate(gpu_buses)]
    for parent, address in zip(parents, gpus):
        b.function(parent, address, *L40S, driver="nvidia", link=gpu_link, bars=bars, boot_vga=False)
    b.modules(["nvidia"], available=["vfio-pci", "vfio_pci"])
    return b


GUEST_GPUS = ["0000:0c:00.0", "0000:0d:00.0"]  # as the stand-in guest numbers them


def _attach(tmp_path, hv, guest_root: str, name: str, **options):
    """Attach the two GPUs of a host tree to guest ``name`` whose probe reads ``guest_root``;
    detach again (devices back on nvidia, the domain gone). (the attach's result, its files)"""
    host = _gpu_tree(str(tmp_path / "host"), switch=True)
    kernel = SimKernel(host.root)
    shared = SharedConnection()
    ctx = sim_context(host.root, kernel, connect=lambda uri: shared)
    server = hv.start(str(tmp_path / f"guest-{name}"), env={"GPUVFIO_PROBE_ROOT": guest_root})
    try:
        request = domain_request(name, vcpus=2, memory="2G", hugepages="none", firmware="bios",
                                 kernel=kernel_file(tmp_path), **options)
        ssh = SshOptions(host="127.0.0.1", port=server.port, key=server.client_key,
                         known_hosts=server.known_hosts, timeout=20)
        result = guests.attach(ctx, [PciAddress.parse(a) for a in GPUS], request, ssh=ssh, uri="test:///default",
                               verify=None)
        assert [kernel.driver_of(a) for a in GPUS] == ["vfio-pci", "vfio-pci"]
        guests.detach(ctx, name, uri="test:///default", timeout=0)
        assert [kernel.driver_of(a) for a in GPUS] == ["nvidia", "nvidia"]
        return result
    finally:
        server.stop()
        shared.conn.close()


def test_attach_writes_the_nccl_topology_file_in_the_guest(tmp_path, ssh_lane, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    guest = _gpu_tree(str(tmp_path / "guest-tree"), switch=True, gpu_link=(1, 1), first_bus=0x0a,
                      bridge_link=(1, 1), gpus=GUEST_GPUS)
    os.makedirs(os.path.join(guest.root, "etc"), exist_ok=True)
    with open(os.path.join(guest.root, GUEST_CONF), "wb") as handle:  # an admin's file
        handle.write(b"# site\nNCCL_DEBUG=WARN\r\nNCCL_TOPO_FILE=/opt/site.xml\nNCCL_IB_HCA=mlx5")
    # Asked to: an admin's own NCCL_TOPO_FILE is kept otherwise (tests/unit/test_nccl_conf.py).
    result = _attach(tmp_path, ssh_lane, guest.root, "nccl-2gpu", replace_nccl_topo_file=True)
    assert result.ok
    written = result.nccl_topology.to_json()
    assert written["written"] is True and written["path"] == "/etc/gpuvfio/nccl-topo.xml", written
    assert written["conf"] == {"path": "/etc/nccl.conf", "change": "replaced", "previous": "/opt/site.xml",
                               "error": None}
    with open(os.path.join(guest.root, GUEST_CONF), "rb") as handle:
        assert handle.read() == (b"# site\nNCCL_DEBUG=WARN\r\nNCCL_TOPO_FILE=/etc/gpuvfio/nccl-topo.xml\n"
                                 b"NCCL_IB_HCA=mlx5")
    assert written["use"].startswith("/etc/nccl.conf carries NCCL_TOPO_FILE=/etc/gpuvfio/nccl-topo.xml")
    with open(os.path.join(guest.root, GUEST_FILE), encoding="utf-8") as handle:
        text = handle.read()
    assert text == written["xml"]
    doc = etree.fromstring(text.encode())
    gpus = doc.findall(".//pci[@class='0x030200']")
    assert sorted(g.get("busid") for g in gpus) == GUEST_GPUS  # the bus ids the guest shows, not the host's
    # The guest's own switch (its bridge two levels above each GPU) holds both, at the host's
    # link speeds, not the emulated ports' (the stand-in guest's ports report 2.5 GT/s x1).
    (switch,) = {g.getparent() for g in gpus}
    assert switch.get("busid") == "0000:0a:00.0"
    assert {(g.get("link_speed"), g.get("link_width")) for g in gpus} == {("16.0 GT/s PCIe", "16")}
    assert (switch.get("link_speed"), switch.get("link_width")) == ("32.0 GT/s PCIe", "16")
    assert any(s["step"] == "nccl topology" and s["ok"] for s in result.steps)


def test_a_guest_unlike_the_plan_gets_no_file_and_a_reason(tmp_path, ssh_lane, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    flat = _gpu_tree(str(tmp_path / "guest-tree"), switch=False, gpus=GUEST_GPUS)  # the guest shows no switch
    result = _attach(tmp_path, ssh_lane, flat.root, "nccl-flat")
    assert result.ok  # not writing the file is a warning, not a failed attach
    written = result.nccl_topology.to_json()
    assert written["written"] is False and "switch" in written["error"], written
    assert not os.path.exists(os.path.join(flat.root, GUEST_FILE))
    assert not os.path.exists(os.path.join(flat.root, GUEST_CONF))  # no file: nccl.conf left alone


def test_an_attach_while_another_run_holds_the_lock_is_refused_naming_it(tmp_path, monkeypatch):
    """attach holds the run lock from its first change to its verdict; a second attach of the
    same GPUs meanwhile waits lock_timeout, then is refused naming the first (pid, command,
    since), before it changes anything (on main the lock was taken per step: a second attach
    between the first one's bind and define went through)."""
    from gpuvfio.bind.journal import LockTimeout

    state = tmp_path / "state"
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(state))
    host = _gpu_tree(str(tmp_path / "host"), switch=True)
    kernel = SimKernel(host.root)
    shared = SharedConnection()
    ctx = sim_context(host.root, kernel, connect=lambda uri: shared)
    ctx.lock_timeout = 0.5
    try:
        with lock_held_elsewhere(state, "gpuvfio attach first-vm 01:00") as first:
            request = domain_request("second-vm", vcpus=2, memory="2G", hugepages="none", firmware="bios",
                                     kernel=kernel_file(tmp_path))
            ssh = SshOptions(host="127.0.0.1", port=22, timeout=1)
            with pytest.raises(LockTimeout, match=f"pid {first}, gpuvfio attach first-vm 01:00, since "):
                guests.attach(ctx, [PciAddress.parse(a) for a in GPUS], request, ssh=ssh, uri="test:///default",
                              verify=None)
            assert kernel.writes() == [] and shared.conn.listDefinedDomains() == []
    finally:
        shared.conn.close()
