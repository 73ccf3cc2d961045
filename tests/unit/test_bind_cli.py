"""The bind family through the CLI: contracts, refusals, bad input, persistence files."""

import os
import shutil
import subprocess

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError
from gpuvfio.ops.binding import persist
from tests.conftest import gpu_workstation
from tests.contexts import sim_context


@pytest.fixture
def ws(tmp_path):
    return gpu_workstation(tmp_path / "host")


def test_dry_run_json_contract(cli, ws):
    ws.driver("vfio-pci")  # loaded already: a recorded tree cannot run this machine's modprobe
    result = cli("--root", ws.root, "bind", "0000:01:00.0", "--dry-run", "--json")
    assert result.code == 0, result.err
    plan = result.json()
    assert plan["devices"] == ["0000:01:00.0", "0000:01:00.1"]
    assert [s["kind"] for s in plan["steps"]] == ["override", "override", "unbind", "unbind", "probe", "probe"]
    assert {c["id"] for c in plan["checks"]} >= {"iommu", "group_viable", "holders", "libvirt"}
    assert plan["steps"][2]["path"] == "/sys/bus/pci/drivers/nvidia/unbind"  # as the host names it
    assert not os.path.exists(os.path.join(ws.root, "var", "lib", "gpuvfio"))


def test_dry_run_on_a_root_that_is_not_this_machine_says_what_it_could_not_do(cli, ws):
    """modprobe and systemctl act on this machine only: a plan for another root says that a run
    against that root stops there (the plan itself is right for the host the root records)."""
    result = cli("--root", ws.root, "bind", "0000:01:00.0", "--dry-run", "--json")
    assert result.code == 0, result.err
    (note,) = [c for c in result.json()["checks"] if c["id"] == "live_host"]
    assert note["status"] == "warn" and "load module vfio-pci" in note["message"]


def test_refusal_exit_1_names_the_foreign_device(cli, ws):
    result = cli("--root", ws.root, "bind", "0000:04:00.0", "--json")
    assert result.code == 1
    assert "0000:03:00.0 [8086:15f3] Ethernet controller (igc)" in result.err
    assert len(result.err.strip().splitlines()) == 1
    assert result.json()["result"] == "refused"


@pytest.mark.parametrize("as_json", [False, True])
def test_dry_run_of_a_refused_bind_exits_1_and_shows_the_refusal(cli, ws, as_json):
    """A plan exits as the real run would: on main a dry run printed "refuse" and exited 0."""
    result = cli("--root", ws.root, "bind", "0000:04:00.0", "--dry-run", *(["--json"] if as_json else []))
    assert result.code == 1, result.out
    assert "gpuvfio: error: refused:" in result.err and "(igc)" in result.err
    if as_json:
        assert result.json()["result"] == "refused" and result.json()["refused"]
    else:
        assert "refuse" in result.out and "group_viable" in result.out and "--force" in result.out
    assert not os.path.exists(os.path.join(ws.root, "var", "lib", "gpuvfio"))
    forced = cli("--root", ws.root, "bind", "0000:04:00.0", "--dry-run", "--force", "--json")
    assert forced.code == 0 and forced.json()["result"] == "dry_run"


@pytest.mark.parametrize("args, fragment", [
    (["bind", "0000:01:00.8"], "not a PCI address"),
    (["bind", "0000:01:00.0/../../x"], "not a PCI address"),
    (["bind", "0000:09:00.0"], "no such PCI function"),
    (["bind", "0000:00:01.0"], "is a PCI bridge"),
    (["restore", "0000:01:00.0"], "not held by gpuvfio"),
    (["persist", "0000:0a:00.0"], "no such PCI function"),
    (["unbind", "zz"], "not a PCI address"),
])
def test_bad_input_exit_2(cli, ws, args, fragment):
    result = cli("--root", ws.root, *args)
    assert result.code == 2, result.err
    assert fragment in result.err and len(result.err.strip().splitlines()) == 1


def test_corrupt_journal_exit_2_and_kept(cli, ws):
    directory = os.path.join(ws.root, "var", "lib", "gpuvfio")
    os.makedirs(directory)
    with open(os.path.join(directory, "journal.json"), "w") as handle:
        handle.write("garbage")
    for args in (["status"], ["restore"], ["bind", "0000:01:00.0", "--dry-run"]):
        result = cli("--root", ws.root, *args)
        assert result.code == 2 and "corrupt" in result.err
    with open(os.path.join(directory, "journal.json")) as handle:
        assert handle.read() == "garbage"


def test_status_empty(cli, ws):
    result = cli("--root", ws.root, "status", "--json")
    assert result.code == 0 and result.json()["devices"] == []


def test_state_dir_env(cli, ws, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    assert cli("--root", ws.root, "status", "--json").json()["state_dir"] == str(tmp_path / "state")


def test_persist_udev_and_softdep(cli, ws):
    result = cli("--root", ws.root, "persist", "0000:01:00.0", "--dry-run")
    assert result.code == 0 and 'KERNEL=="0000:01:00.1"' in result.out and "+softdep nvidia pre: vfio-pci" in result.out
    assert "update-initramfs" in result.err  # the initramfs hint (generic: no os-release)
    assert not os.path.exists(os.path.join(ws.root, "etc", "udev"))
    report = cli("--root", ws.root, "persist", "0000:01:00.0", "--json").json()
    assert report["mechanism"] == "udev" and report["result"] == "applied"
    with open(os.path.join(ws.root, "etc", "udev", "rules.d", "61-gpuvfio-vfio-pci.rules")) as handle:
        rules = handle.read()
    assert 'KERNEL=="0000:01:00.0", ATTR{driver_override}="vfio-pci"' in rules
    assert "10de" not in rules  # by address, never by vendor:device
    unit = os.path.join(ws.root, "etc", "systemd", "system", "gpuvfio-vfio-pci.service")
    with open(unit) as handle:
        text = handle.read()
    assert "gpuvfio-vfio-pci 0000:01:00.0 0000:01:00.1" in text and "WantedBy=multi-user.target" in text
    wants = os.path.join(ws.root, "etc", "systemd", "system", "multi-user.target.wants", "gpuvfio-vfio-pci.service")
    assert os.readlink(wants) == "/etc/systemd/system/gpuvfio-vfio-pci.service"
    assert cli("--root", ws.root, "persist", "0000:01:00.0", "--json").json()["result"] == "nothing_to_do"
    cli("--root", ws.root, "unpersist", "0000:01:00.0")
    assert not os.path.exists(os.path.join(ws.root, "etc", "udev", "rules.d", "61-gpuvfio-vfio-pci.rules"))
    assert not os.path.lexists(wants) and not os.path.exists(unit)
    assert not os.path.exists(os.path.join(ws.root, "etc", "modprobe.d", "gpuvfio-vfio.conf"))


def test_persist_uses_driverctl_when_installed(cli, ws):
    os.makedirs(os.path.join(ws.root, "usr", "sbin"))
    open(os.path.join(ws.root, "usr", "sbin", "driverctl"), "w").close()
    report = cli("--root", ws.root, "persist", "0000:01:00.0", "--json").json()
    assert report["mechanism"] == "driverctl"
    for fn in ("0000:01:00.0", "0000:01:00.1"):
        with open(os.path.join(ws.root, "etc", "driverctl.d", f"pci-{fn}")) as handle:
            assert handle.read() == "vfio-pci\n"
    assert not os.path.exists(os.path.join(ws.root, "etc", "udev", "rules.d", "61-gpuvfio-vfio-pci.rules"))


def test_persist_failure_leaves_no_partial_files(ws):
    calls = []

    def failing_rename(dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")

    with pytest.raises(GpuvfioError, match="No space left on device"):
        persist(sim_context(ws.root), [PciAddress.parse("0000:01:00.0")], fault=failing_rename)
    leftovers = []
    for directory, _dirs, files in os.walk(os.path.join(ws.root, "etc")):
        leftovers += [os.path.join(directory, f) for f in files]
    assert leftovers == []  # the first file was put back (removed), no temp files remain


def test_persist_failure_restores_previous_content(ws):
    path = os.path.join(ws.root, "etc", "modules-load.d")
    os.makedirs(path)
    with open(os.path.join(path, "gpuvfio-vfio.conf"), "w") as handle:
        handle.write("old\n")

    def failing_rename(dst):
        if dst.endswith("modules-load.d/gpuvfio-vfio.conf"):
            raise OSError(5, "Input/output error")

    with pytest.raises(GpuvfioError):
        persist(sim_context(ws.root), [PciAddress.parse("0000:01:00.0")], fault=failing_rename)
    with open(os.path.join(path, "gpuvfio-vfio.conf")) as handle:
        assert handle.read() == "old\n"
    assert not os.path.exists(os.path.join(ws.root, "etc", "udev", "rules.d", "61-gpuvfio-vfio-pci.rules"))
    assert sorted(os.listdir(path)) == ["gpuvfio-vfio.conf"]


def test_bind_help_lists_options(cli):
    result = cli("bind", "--help")
    assert result.code == 0
    for option in ("--dry-run", "--force", "--stop-services", "--allow-unsafe-host", "--timeout", "--json"):
        assert option in result.out


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_persist_unit_passes_systemd_analyze(ws, tmp_path):
    """The unit is checked by systemd's own parser; its shell script by sh -n."""
    from gpuvfio.bind.persist import UNIT_SCRIPT, unit_file

    unit = tmp_path / "gpuvfio-vfio-pci.service"
    unit.write_text(unit_file([PciAddress.parse("0000:01:00.0"), PciAddress.parse("0000:01:00.1")]))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert subprocess.run(["sh", "-n", "-c", UNIT_SCRIPT]).returncode == 0


def test_persist_softdep_names_modules_not_drivers(cli, tmp_path):
    """modprobe.d's softdep takes module names: the USB-C functions of a GPU are driven by
    xhci_hcd (module xhci_pci) and nvidia-gpu (module i2c_nvidia_gpu)."""
    from tests.hostbuilder import HostBuilder

    b = HostBuilder(str(tmp_path / "host"))
    b.iommu("intel", 1)
    rb = b.root_bus()
    group = b.new_group()
    port = b.bridge(rb, "0000:00:01.0", "8086", "1901", secondary_bus=1, group=group)
    for fn, device, klass, driver in (("0", "1e87", "030000", "nvidia"), ("1", "10f8", "040300", "snd_hda_intel"),
                                      ("2", "1ad8", "0c0330", "xhci_hcd"), ("3", "1ad9", "0c8000", "nvidia-gpu")):
        b.function(port, f"0000:01:00.{fn}", "10de", device, klass, driver=driver, group=group,
                   multifunction=fn == "0")
    result = cli("--root", b.root, "persist", "0000:01:00.0", "--json")
    assert result.code == 0, result.err
    with open(os.path.join(b.root, "etc", "modprobe.d", "gpuvfio-vfio.conf")) as handle:
        softdeps = [line for line in handle.read().splitlines() if line.startswith("softdep")]
    assert softdeps == ["softdep i2c_nvidia_gpu pre: vfio-pci", "softdep nvidia pre: vfio-pci",
                        "softdep snd_hda_intel pre: vfio-pci", "softdep xhci_pci pre: vfio-pci"]


def test_persist_refuses_a_group_with_a_foreign_device(cli, ws):
    """persist follows bind's group policy: the chipset NIC in the RTX 3060's group is not taken at
    the next boot (a lock-out on a remote host) unless forced."""
    result = cli("--root", ws.root, "persist", "0000:04:00.0")
    assert result.code == 1 and "(igc)" in result.err and "--force" in result.err
    assert not os.path.exists(os.path.join(ws.root, "etc", "udev"))
    forced = cli("--root", ws.root, "persist", "0000:04:00.0", "--force", "--json")
    assert forced.code == 0 and "0000:03:00.0" in forced.json()["devices"]


def test_persist_refuses_what_bind_refuses(cli, ws, tmp_path):
    """One refusal policy: the boot VGA persisted to vfio-pci is a host without a console at the
    next boot; a process holding the GPU refuses persist as it refuses bind."""
    from tests.conftest import gpu_workstation

    b = gpu_workstation(tmp_path / "vga")
    with open(os.path.join(b.root, "sys", "bus", "pci", "devices", "0000:01:00.0", "boot_vga"), "w") as handle:
        handle.write("1\n")
    bind = cli("--root", b.root, "bind", "0000:01:00.0", "--dry-run", "--connect", "none")
    persist = cli("--root", b.root, "persist", "0000:01:00.0", "--dry-run")
    assert bind.code == persist.code == 1 and "boot_vga=1" in persist.err and "--force" in persist.err
    assert cli("--root", b.root, "persist", "0000:01:00.0", "--force", "--dry-run").code == 0
    assert not os.path.exists(os.path.join(b.root, "etc", "udev"))


def test_processes_holding_many_gpus_are_named_once(cli, tmp_path):
    """Eight GPUs and four NVSwitches held by the same processes: one refusal that names all the
    functions, not twelve copies of the same holder list."""
    from gpuvfio.host.fixture import load_fixture
    from tests.make_samples import sample_path

    root = tmp_path / "dgx"
    with open(sample_path("dgx-h100"), encoding="utf-8") as handle:
        load_fixture(handle.read(), str(root))
    result = cli("--root", str(root), "bind", "-d", "10de:2330", "--yes", "--dry-run", "--connect", "none", "--json")
    assert result.code == 1
    holders = [c for c in result.json()["refused"] if c["id"] == "holders"]
    assert len(holders) == 1, holders
    assert holders[0]["message"].startswith("0000:03:00.0, 0000:04:00.0, 0000:05:00.0, 0000:06:00.0, 0000:1b:00.0")
    assert "0000:df:00.0: nvidia-persiste (pid 2214) holds" in holders[0]["message"]
    assert result.err.count("nvidia-persiste (pid 2214)") == 1
