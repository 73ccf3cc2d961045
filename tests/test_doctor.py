from gpuvfio.address import PciAddress
from gpuvfio.ops.inventory import doctor_report
from gpuvfio.host.root import HostRoot
from gpuvfio.host.nvidia import nvidia_holders
from tests.conftest import gpu_workstation


def checks(root) -> dict:
    return {c["id"]: c for c in doctor_report(HostRoot(root))["checks"]}


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
