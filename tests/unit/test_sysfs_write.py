"""The writer: child process, timeout, errno reporting, refusal to leave <root>/sys."""

import errno
import os
import time

import pytest

from gpuvfio.errors import UnsafePathError
from gpuvfio.host.root import HostRoot
from gpuvfio.bind.sysfs_write import SysfsWriteError, SysfsWriter, SysfsWriteTimeout
from tests.hostbuilder import HostBuilder


@pytest.fixture
def host(tmp_path):
    b = HostBuilder(str(tmp_path / "host"))
    b.iommu("intel")
    rb = b.root_bus()
    b.function(rb, "0000:00:02.0", "10de", "1db4", "030200", driver="nvidia")
    return HostRoot(b.root)


def test_write_happens_in_a_child(host):
    pids = []

    def backend(path, data, fd):
        pids.append(os.getpid())  # recorded in the child's memory only
        os.write(fd, data)

    target = host.sys_path("bus", "pci", "devices", "0000:00:02.0", "driver_override")
    SysfsWriter(host, backend=backend).write(target, "vfio-pci\n")
    assert pids == []  # the parent never ran the backend
    assert host.read(target) == "vfio-pci"


def test_errno_is_reported_with_path_and_value(host):
    def backend(path, data, fd):
        raise OSError(errno.EBUSY, "Device or resource busy")

    target = host.sys_path("bus", "pci", "drivers", "nvidia", "unbind")
    with pytest.raises(SysfsWriteError) as info:
        SysfsWriter(host, backend=backend).write(target, "0000:00:02.0")
    assert info.value.errno == errno.EBUSY
    assert "drivers/nvidia/unbind" in str(info.value) and "EBUSY" in str(info.value)
    assert "'0000:00:02.0'" in str(info.value)


def test_hanging_write_times_out(host):
    def backend(path, data, fd):
        time.sleep(20)  # bounded: a writer a mutant leaves unkilled must not outlive the run

    started = time.monotonic()
    with pytest.raises(SysfsWriteTimeout) as info:
        SysfsWriter(host, timeout=0.3, backend=backend).write(host.sys_path("bus", "pci", "drivers_probe"), "x")
    assert time.monotonic() - started < 5
    assert "did not return within 0.3s" in str(info.value)
    with pytest.raises(ProcessLookupError):  # the stuck child was killed and reaped
        os.kill(info.value.pid, 0)


def test_refuses_symlinked_attribute_leaving_sys(host, tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("")
    probe = host.sys_path("bus", "pci", "drivers_probe")
    os.unlink(probe)
    os.symlink(str(outside), probe)
    with pytest.raises(UnsafePathError):
        SysfsWriter(host).write(probe, "0000:00:02.0")
    assert outside.read_text() == ""


def test_refuses_driver_directory_leading_out(host, tmp_path):
    elsewhere = tmp_path / "evil"
    elsewhere.mkdir()
    (elsewhere / "unbind").write_text("")
    link = host.sys_path("bus", "pci", "drivers", "evil")
    os.symlink(os.path.relpath(elsewhere, os.path.dirname(link)), link)
    with pytest.raises(UnsafePathError):
        SysfsWriter(host).write(os.path.join(link, "unbind"), "0000:00:02.0")
    assert (elsewhere / "unbind").read_text() == ""


def test_real_write_backend(host):
    target = host.sys_path("bus", "pci", "devices", "0000:00:02.0", "driver_override")
    SysfsWriter(host).write(target, "vfio-pci\n")
    assert host.read(target) == "vfio-pci"
