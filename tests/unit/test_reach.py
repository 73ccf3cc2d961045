"""A guest that can boot and be reached, checked in attach's plan before anything changes
(issue 33 item 2), against libvirt's test driver (its ``default`` network is active and leases
addresses): the boot source, the network and the way to SSH. The real daemon's side is in
tests/daemon/test_attach_daemon.py."""

from __future__ import annotations

import pytest

from tests.make_samples import sample_path
from tests.unit.test_plan_attach import GPU

libvirt = pytest.importorskip("libvirt")

BASE = ["attach", GPU, "--name", "reach-vm", "--connect", "test:///default", "--virt-type", "qemu", "--firmware",
        "bios", "--dry-run", "--json"]


@pytest.fixture
def image(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    path = tmp_path / "guest.img"
    path.write_bytes(b"\0" * 4096)
    return str(path)


def checks_of(result) -> dict[str, list[tuple[str, str]]]:
    found: dict[str, list[tuple[str, str]]] = {}
    for check in result.json()["checks"]:
        found.setdefault(check["id"], []).append((check["status"], check["message"]))
    return found


def test_a_sound_guest_is_planned_with_each_check(cli, workstation, image):
    result = cli("--root", workstation.root, *BASE, "--disk", image, "--network", "default")
    assert result.code == 0, result.err
    checks = checks_of(result)
    assert checks["boot"] == [("ok", f"boots from --disk {image}")]
    assert checks["network"] == [("ok", "libvirt network default is active")]
    assert checks["ssh_route"] == [("ok", "the guest's address from libvirt network default's DHCP leases")]
    port = cli("--root", workstation.root, *BASE, "--disk", image, "--user-net-ssh-port", "2222")
    assert port.code == 0, port.err
    assert checks_of(port)["ssh_route"] == [("ok", "SSH through the user-networking port 2222")]


@pytest.mark.parametrize("extra, words", [
    ([], "nothing to boot: give --disk IMAGE or --kernel FILE"),
    (["--disk", "/nonexistent/guest.qcow2"], "--disk /nonexistent/guest.qcow2: no such file or directory"),
    (["--kernel", "/usr/share"], "--kernel /usr/share is not a regular file"),
    (["--network", "nosuchnet"], "libvirt network nosuchnet does not exist on this connection"),
])
def test_what_cannot_boot_is_refused_by_name(cli, workstation, image, extra, words):
    boot = [] if any(e in extra for e in ("--disk", "--kernel")) or not extra else ["--disk", image]
    result = cli("--root", workstation.root, *BASE, "--ssh-host", "192.0.2.7", *boot, *extra)
    assert result.code == 1
    assert any(words in message for message in result.json()["refused"]), result.json()["refused"]
    assert words in result.err.splitlines()[-1]


def test_no_way_to_ssh_is_refused(cli, workstation, image):
    result = cli("--root", workstation.root, *BASE, "--disk", image)
    assert result.code == 1
    assert result.json()["refused"] == ["no way to the guest's SSH: give --ssh-host, --network NAME (a libvirt "
                                        "network that leases addresses) or --user-net-ssh-port PORT"]


def test_an_inactive_network_and_one_without_dhcp(cli, workstation, image, tmp_path):
    conn = libvirt.open("test:///default")  # the same in-process driver state the command opens
    name = f"reach-{tmp_path.name[-12:]}"
    network = conn.networkDefineXML(f"<network><name>{name}</name><bridge name='virbr-r{len(name)}'/>"
                                    "<ip address='192.0.2.1' netmask='255.255.255.0'/></network>")
    try:
        down = cli("--root", workstation.root, *BASE, "--disk", image, "--network", name)
        assert down.code == 1 and down.json()["refused"] == [f"libvirt network {name} is not active "
                                                             f"(virsh net-start {name})"]
        network.create()
        no_dhcp = cli("--root", workstation.root, *BASE, "--disk", image, "--network", name)
        assert no_dhcp.code == 1 and no_dhcp.json()["refused"] == [
            f"no way to the guest's SSH: libvirt network {name} leases no addresses (no <dhcp>); give --ssh-host"]
        given = cli("--root", workstation.root, *BASE, "--disk", image, "--network", name, "--ssh-host", "192.0.2.9")
        assert given.code == 0, given.err
    finally:
        if network.isActive():
            network.destroy()
        network.undefine()
        conn.close()


def test_a_recording_cannot_look_and_says_so(cli):
    result = cli("--root", sample_path("epyc-mixed"), "attach", "0000:81:00.0", "--name", "t", "--ssh-host",
                 "192.0.2.7", "--disk", "/var/lib/libvirt/images/t.qcow2", "--dry-run", "--json")
    assert result.code == 0, result.err
    assert checks_of(result)["boot"] == [("warn", "--disk /var/lib/libvirt/images/t.qcow2 not checked here: the "
                                                  "host is a recording (the run there checks it)")]
