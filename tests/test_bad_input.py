"""Bad input: one line on stderr, exit status 2, no traceback; never read outside <root>/sys."""

import os

import pytest

from gpuvfio.errors import UnsafePathError
from gpuvfio.host.root import HostRoot
from gpuvfio.host.inventory import read_inventory
from tests.conftest import run_gpuvfio


def assert_one_line_error(result, *fragments):
    assert result.code == 2, (result.code, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith("gpuvfio: error: ")
    assert "Traceback" not in result.err
    for fragment in fragments:
        assert fragment in lines[0]


def test_root_not_a_directory(cli, tmp_path):
    assert_one_line_error(cli("list", "--root", str(tmp_path / "nope")), "not a directory")


def test_root_without_sys(cli, tmp_path):
    assert_one_line_error(cli("--root", str(tmp_path), "list"), "missing", "sys/bus/pci/devices")


def test_malformed_address(cli, workstation):
    assert_one_line_error(cli("--root", workstation.root, "list", "0000:01:00.9"), "not a PCI address")
    assert_one_line_error(cli("--root", workstation.root, "list", "../../etc"), "not a PCI address")


def test_unknown_address(cli, workstation):
    assert_one_line_error(cli("--root", workstation.root, "list", "0000:07:00.0"), "no such PCI function")


def test_unknown_option_is_one_line(cli):
    assert_one_line_error(cli("list", "--frobnicate"), "--frobnicate")


def test_unreadable_attribute(cli, workstation):
    vendor = os.path.join(workstation.functions[min(workstation.functions)].path, "vendor")
    os.unlink(vendor)
    os.mkdir(vendor)  # a directory where the kernel has a file: the tree is not sysfs
    assert_one_line_error(cli("--root", workstation.root, "list", "--all"), "vendor")


def test_device_link_leading_out_of_sys_is_refused(cli, workstation, tmp_path):
    outside = tmp_path / "outside" / "0000:09:00.0"
    outside.mkdir(parents=True)
    for name, value in (("vendor", "0x10de"), ("device", "0x2330"), ("class", "0x030200")):
        (outside / name).write_text(value + "\n")
    link = os.path.join(workstation.root, "sys", "bus", "pci", "devices", "0000:09:00.0")
    os.symlink(os.path.relpath(outside, os.path.dirname(link)), link)
    assert_one_line_error(cli("--root", workstation.root, "list", "--all"), "outside")


def test_absolute_symlink_is_refused(workstation):
    link = os.path.join(workstation.root, "sys", "bus", "pci", "devices", "0000:0a:00.0")
    os.symlink("/sys/devices/pci0000:00", link)
    with pytest.raises(UnsafePathError):
        read_inventory(HostRoot(workstation.root))


def test_attribute_symlink_is_not_followed(workstation, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("0x10de\n")
    fn = workstation.functions[min(workstation.functions)]
    os.unlink(os.path.join(fn.path, "vendor"))
    os.symlink(str(secret), os.path.join(fn.path, "vendor"))
    with pytest.raises(UnsafePathError):
        read_inventory(HostRoot(workstation.root))


def test_sys_symlink_to_live_host_is_refused(tmp_path):
    (tmp_path / "r").mkdir()
    os.symlink("/sys", tmp_path / "r" / "sys")
    with pytest.raises(UnsafePathError):
        HostRoot(str(tmp_path / "r"))


def test_bad_fixture_file(cli, tmp_path):
    bad = tmp_path / "bad.host"
    bad.write_text("hello\n")
    assert_one_line_error(cli("--root", str(bad), "list"), "not a gpuvfio host fixture")
    evil = tmp_path / "evil.host"
    evil.write_text("# gpuvfio host fixture v1\nF ../../etc/x 1\n")
    assert_one_line_error(cli("--root", str(evil), "list"), "unsafe path")
    assert not (tmp_path / "etc").exists()


def test_real_process_has_no_traceback(tmp_path):
    result = run_gpuvfio("list", "--root", str(tmp_path))
    assert_one_line_error(result, "missing")
