from gpuvfio.ops.context import Context
from gpuvfio.address import PciAddress
from gpuvfio.ops.readiness import doctor_report
from gpuvfio.host.root import HostRoot
from gpuvfio.host.nvidia import nvidia_holders
from tests.conftest import gpu_workstation
from tests.hostbuilder import BAR32, BAR64_PREF, GiB, MiB, HostBuilder


def checks(root) -> dict:
    return {c.check_id: c.to_json() for c in doctor_report(Context(host=HostRoot(root))).checks}


def test_healthy_workstation(workstation):
    got = checks(workstation.root)
    assert got["iommu"]["status"] == "ok" and "intel" in got["iommu"]["summary"]
    assert got["acs_override"]["status"] == "ok"
    assert got["interrupt_remapping"]["status"] == "ok"
    assert got["hugepages"]["status"] == "ok" and "512/512 x 2M" in got["hugepages"]["summary"]
    assert got["nvidia_holders"]["status"] == "ok"
    assert got["boot_vga"]["status"] == "ok"


def test_acs_override_fails(tmp_path):
    b = gpu_workstation(tmp_path)
    b.cmdline("ro intel_iommu=on pcie_acs_override=downstream,multifunction")
    got = checks(b.root)["acs_override"]
    assert got["status"] == "fail" and "downstream,multifunction" in got["summary"] and got["fix"]


def test_unsafe_interrupts_fail(tmp_path):
    b = gpu_workstation(tmp_path)
    b.module_param("vfio_iommu_type1", "allow_unsafe_interrupts", "Y")
    got = checks(b.root)["interrupt_remapping"]
    assert got["status"] == "fail" and "allow_unsafe_interrupts" in got["summary"]


def test_interrupt_remapping_inactive(tmp_path):
    b = gpu_workstation(tmp_path)
    b.iommu("intel", 1, interrupt_remapping=False)
    got = checks(b.root)["interrupt_remapping"]
    assert got["status"] == "fail" and "not active" in got["summary"]


def test_holders_named(tmp_path):
    b = gpu_workstation(tmp_path)
    b.holder(1234, "nvidia-persiste", ["/dev/nvidiactl", "/dev/nvidia0"])
    b.holder(777, "python3", ["/dev/null", "/dev/nvidia-uvm"])
    b.holder(55, "sshd", ["/dev/null"])
    holders = nvidia_holders(HostRoot(b.root))
    assert [(h.pid, h.comm, h.device_nodes) for h in holders] == [
        (777, "python3", ["/dev/nvidia-uvm"]), (1234, "nvidia-persiste", ["/dev/nvidia0", "/dev/nvidiactl"])]
    got = checks(b.root)["nvidia_holders"]
    assert got["status"] == "warn" and "nvidia-persiste (pid 1234)" in got["summary"]


def test_boot_vga_warns(tmp_path):
    b = gpu_workstation(tmp_path)
    fn = b.functions[PciAddress.parse("0000:01:00.0")]
    with open(f"{fn.path}/boot_vga", "w") as handle:
        handle.write("1\n")
    b.framebuffer("EFI VGA")
    got = checks(b.root)["boot_vga"]
    assert got["status"] == "warn" and "0000:01:00.0" in got["summary"] and "EFI VGA" in got["summary"]


def test_vfio_missing_fails(tmp_path):
    b = gpu_workstation(tmp_path)
    b.modules(["nvidia"], available=[])
    got = checks(b.root)["vfio_modules"]
    assert got["status"] == "fail" and "vfio_pci" in got["summary"]
    b.modules(["vfio", "vfio_pci", "vfio_iommu_type1"], available=[])
    assert checks(b.root)["vfio_modules"]["status"] == "ok"


def test_no_hugepages_warns(tmp_path):
    b = gpu_workstation(tmp_path)
    b.numa_node(0, list(range(16)), 64, {})
    got = checks(b.root)["hugepages"]
    assert got["status"] == "warn" and "none reserved" in got["summary"]


def test_fix_follows_distribution(tmp_path):
    b = gpu_workstation(tmp_path)
    b.iommu(None)
    b.os_release("Rocky Linux 9", "rocky", "rhel centos fedora")
    assert "grubby" in checks(b.root)["iommu"]["fix"]


def _linked_os_release(tmp_path, target: str):
    import os

    b = gpu_workstation(tmp_path)
    b.iommu(None)
    b.os_release("Rocky Linux 9", "rocky", "rhel centos fedora")
    etc = os.path.join(b.root, "etc", "os-release")
    lib = os.path.join(b.root, "usr", "lib")
    os.makedirs(lib, exist_ok=True)
    os.replace(etc, os.path.join(lib, "os-release"))
    os.symlink(target, etc)
    return b


def test_os_release_symlink_is_followed_inside_the_root(tmp_path):
    """systemd hosts ship /etc/os-release -> ../usr/lib/os-release (this machine too)."""
    b = _linked_os_release(tmp_path / "relative", "../usr/lib/os-release")
    assert "grubby" in checks(b.root)["iommu"]["fix"]
    b = _linked_os_release(tmp_path / "absolute", "/usr/lib/os-release")  # taken under the root
    assert "grubby" in checks(b.root)["iommu"]["fix"]


def test_os_release_symlink_out_of_the_root_is_refused(tmp_path, cli):
    b = _linked_os_release(tmp_path, "../../../../../../../../etc/hostname")
    result = cli("--root", b.root, "doctor")
    assert result.code == 2 and "leads outside the root" in result.err and result.err.count("\n") == 1


def test_doctor_on_this_machine_reports():
    """The live host (root /): whatever its checks say, they are a report, not bad input."""
    from tests.conftest import run_gpuvfio

    result = run_gpuvfio("doctor", "--json")
    assert result.code in (0, 1), result.err
    assert {c["id"] for c in result.json()["checks"]} >= {"iommu", "vfio_modules", "hugepages"}


def test_os_release_dangling_link_out_of_the_root_is_refused(tmp_path):
    import os

    import pytest

    from gpuvfio.errors import UnsafePathError

    b = gpu_workstation(tmp_path)
    etc = os.path.join(b.root, "etc", "os-release")
    os.makedirs(os.path.dirname(etc), exist_ok=True)
    if os.path.lexists(etc):
        os.unlink(etc)
    os.symlink("../../../../../../../../nonexistent/os-release", etc)
    with pytest.raises(UnsafePathError, match="leads outside the root"):
        HostRoot(b.root).config_path("etc", "os-release")


def _gpu_host(root, *, gpu_node: int, pages: dict[int, dict[int, tuple[int, int]]], sockets: int = 2):
    """One NUMA node per socket, one GPU behind a root port of ``gpu_node`` (-1: firmware
    without _PXM)."""
    b = HostBuilder(str(root))
    b.iommu("intel", 2)
    cpus = b.cpu_topology(sockets, 4, 2)
    for node in range(sockets):
        b.numa_node(node, cpus[node], 64, pages.get(node, {}))
    rb = b.root_bus(0, 0x80, numa=gpu_node)
    port = b.bridge(rb, "0000:80:01.0", "8086", "352a", secondary_bus=0x81, link=(5, 16))
    b.function(port, "0000:81:00.0", "10de", "2330", "030200", driver="nvidia", link=(5, 16),
               bars=[(0, 16 * MiB, BAR32), (2, 128 * GiB, BAR64_PREF)])
    b.modules(["nvidia"])
    return b


def test_hugepages_near_gpus_ok_on_the_workstation(workstation):
    got = checks(workstation.root)["hugepages_near_gpus"]
    assert got["status"] == "ok" and got["fix"] is None
    assert got["summary"] == "node0 (0000:01:00.0, 0000:04:00.0): 512/512 x 2M free"


def test_hugepages_on_another_node_than_the_gpu_warn(tmp_path):
    """Pages reserved on node 0 do not back a guest bound to its GPU's node 1: the any-node check
    is content, this one is not."""
    b = _gpu_host(tmp_path, gpu_node=1, pages={0: {1048576: (64, 64)}})
    got = checks(b.root)
    assert got["hugepages"]["status"] == "ok"
    near = got["hugepages_near_gpus"]
    assert near["status"] == "warn"
    assert near["summary"].startswith("node1 (0000:81:00.0): none reserved")
    assert "free hugepages on node0 do not back guests bound to their GPU's node" in near["summary"]
    assert "echo N > /sys/devices/system/node/node1/hugepages/hugepages-1048576kB/nr_hugepages" in near["fix"]
    assert "hugepagesz=1G hugepages=1:N" in near["fix"] and "node0/" not in near["fix"]
    b.numa_node(1, list(range(4, 8)) + list(range(12, 16)), 64, {1048576: (8, 8)})
    near = checks(b.root)["hugepages_near_gpus"]
    assert near["status"] == "ok" and near["summary"] == "node1 (0000:81:00.0): 8/8 x 1G free"


def test_hugepages_near_gpus_all_in_use_warn(tmp_path):
    b = _gpu_host(tmp_path, gpu_node=0, pages={0: {2048: (1024, 0)}, 1: {2048: (1024, 1024)}})
    near = checks(b.root)["hugepages_near_gpus"]
    assert near["status"] == "warn" and "node0 (0000:81:00.0): 0/1024 x 2M free, all in use" in near["summary"]
    assert "node0/hugepages/hugepages-1048576kB/nr_hugepages" in near["fix"]


def test_no_hugepages_near_the_gpu_warns_not_fails(tmp_path, cli):
    b = gpu_workstation(tmp_path)
    b.numa_node(0, list(range(16)), 64, {})
    near = checks(b.root)["hugepages_near_gpus"]
    assert near["status"] == "warn" and "none reserved" in near["summary"]
    assert near["fix"].startswith("echo N > /sys/devices/system/node/node0/hugepages/hugepages-1048576kB/nr_hugepages")
    assert "'hugepagesz=1G hugepages=0:N'" in near["fix"] and "update-grub" in near["fix"]
    assert cli("--root", b.root, "doctor", "--json").code == 0  # a warning, not a failure


def test_hugepages_near_gpus_without_a_gpu_node_or_gpu_skip(tmp_path):
    b = _gpu_host(tmp_path / "nopxm", gpu_node=-1, pages={0: {1048576: (64, 64)}})
    near = checks(b.root)["hugepages_near_gpus"]
    assert near["status"] == "skip" and "0000:81:00.0 report(s) no NUMA node" in near["summary"]
    # On a one-node host a GPU without a node is on that node (the workstation sample's case).
    b = _gpu_host(tmp_path / "one", gpu_node=-1, pages={0: {1048576: (64, 64)}}, sockets=1)
    near = checks(b.root)["hugepages_near_gpus"]
    assert near["status"] == "ok" and near["summary"] == "node0 (0000:81:00.0): 64/64 x 1G free"
    bare = HostBuilder(str(tmp_path / "bare"))
    bare.iommu("intel", 1)
    bare.numa_node(0, [0, 1], 8, {})
    assert checks(bare.root)["hugepages_near_gpus"] == {"id": "hugepages_near_gpus", "status": "skip",
                                                        "summary": "no NVIDIA GPU", "fix": None}


def test_doctor_reads_the_journal_without_creating_it(cli, tmp_path, monkeypatch):
    """A device marked broken fails doctor (binds refuse it) with the reset to run; an operation
    that did not finish warns; a journal gpuvfio cannot trust fails; no journal is no problem and
    doctor creates nothing."""
    import json

    b = gpu_workstation(tmp_path / "host")
    state = tmp_path / "state"
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(state))
    got = checks(b.root)["journal"]
    assert got["status"] == "ok" and "holds nothing" in got["summary"] and not state.exists()

    state.mkdir()
    journal = state / "journal.json"
    record = {"version": 1, "devices": {"0000:01:00.0": {"original_driver": "nvidia", "original_override": None,
                                                           "group": 1}},
              "broken": {"0000:01:00.0": {"reason": "config space reads 0xffff after the guest", "since": 1.0}}}
    journal.write_text(json.dumps(record))
    result = cli("--root", b.root, "doctor", "--json")
    assert result.code == 1
    got = {c["id"]: c for c in result.json()["checks"]}["journal"]
    assert got["status"] == "fail" and "0000:01:00.0: config space reads 0xffff" in got["summary"]
    assert got["fix"].startswith("gpuvfio reset 0000:01:00.0")

    del record["broken"]
    record["operation"] = {"kind": "bind", "pid": 4242, "started": 1.0, "steps": [{"state": "running"}]}
    journal.write_text(json.dumps(record))
    got = checks(b.root)["journal"]
    assert got["status"] == "warn" and "bind operation (pid 4242) did not finish" in got["summary"]
    record["operation"]["finished"] = 2.0
    journal.write_text(json.dumps(record))
    got = checks(b.root)["journal"]
    assert got["status"] == "ok" and "holds 1 function(s)" in got["summary"]

    record["operation"].pop("finished")  # broken marks and an unfinished operation: both said
    record["broken"] = {"0000:01:00.0": {"reason": "x" * 5000, "since": 1.0}}
    journal.write_text(json.dumps(record))
    got = checks(b.root)["journal"]
    assert got["status"] == "fail" and "did not finish" in got["summary"] and "marked broken" in got["summary"]
    assert len(got["summary"]) < 600 and "gpuvfio status" in got["fix"] and "gpuvfio reset" in got["fix"]
    record["operation"]["kind"], record["operation"]["pid"] = ["hostile"], "4242; rm"
    del record["broken"]
    journal.write_text(json.dumps(record))
    got = checks(b.root)["journal"]
    assert "a gpuvfio operation (pid ?) did not finish" in got["summary"], got

    for damaged in ('{"version": 1, "devices": {"nope": {}}}', '{"version": 1}'):
        journal.write_text(damaged)
        result = cli("--root", b.root, "doctor")
        assert result.code == 1 and "journal" in result.out and "corrupt" in result.out, result.out + result.err
        assert "Traceback" not in result.err


def test_doctor_of_a_recording_does_not_speak_for_gpuvfios_state_there(cli):
    from tests.make_samples import sample_path

    result = cli("--root", sample_path("workstation"), "doctor", "--json")
    got = {c["id"]: c for c in result.json()["checks"]}["journal"]
    assert got["status"] == "skip" and "recording" in got["summary"]
