"""Daemon lane smoke test: a private libvirtd boots a tiny guest under QEMU (TCG) to SSH.

Also pins down how this machine's real QEMU driver treats PCI passthrough: a
domain with a PCI hostdev defines, but does not start (no VFIO/IOMMU here).

Run: .venv/bin/python -m pytest tests/daemon/test_daemon_lane_smoke.py -v -s
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from tests.lanes import daemon as dl
from tests.lanes import guest as gl


_REASON = dl.skip_reason() or gl.skip_reason()
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)

import libvirt  # noqa: E402  (only after the skip: libvirt-python may be missing)
import paramiko  # noqa: E402

libvirt.registerErrorHandler(lambda *a: None, None)

TIMINGS: dict[str, float] = {}


def _timed(key: str, t0: float) -> float:
    TIMINGS[key] = time.monotonic() - t0
    print(f"  [daemon lane] {key}: {TIMINGS[key]:.2f}s")
    return TIMINGS[key]


@pytest.fixture(scope="module")
def image() -> gl.GuestImage:
    t0 = time.monotonic()
    img = gl.build_guest()
    _timed("guest image (build or cache hit)", t0)
    return img


@pytest.fixture(scope="module")
def libvirtd():
    t0 = time.monotonic()
    gen = dl.libvirt_daemon()
    d = next(gen)
    _timed("daemon start", t0)
    try:
        yield d
    finally:
        t0 = time.monotonic()
        for _ in gen:  # runs the teardown (and its leftover checks)
            pass
        _timed("daemon stop", t0)
        print("  [daemon lane] timings: "
              + ", ".join(f"{k}={v:.2f}s" for k, v in TIMINGS.items()))


@pytest.fixture(scope="module")
def conn(libvirtd):
    t0 = time.monotonic()
    c = libvirtd.connect()
    c.listAllDomains(0)
    _timed("first connect", t0)
    return c


def _domain_pid(name: str) -> int | None:
    found = [pid for pid, n in dl.qemu_processes({name}).items()]
    return found[0] if found else None


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_guest_boots_and_answers_ssh(libvirtd, conn, image):
    name = dl.DOMAIN_PREFIX + "smoke"
    port = gl.free_port()
    console = libvirtd.console_path(name)
    xml = gl.domain_xml(name, image.kernel, image.initrd, port, console_log=console)

    t0 = time.monotonic()
    dom = conn.defineXML(xml)  # on a cold capabilities cache this includes the QEMU probe
    _timed("define", t0)
    try:
        t0 = time.monotonic()
        dom.create()
        _timed("create()", t0)
        try:
            banner = gl.wait_for_ssh_banner(port, timeout=120)
        except TimeoutError as exc:
            pytest.fail(f"{exc}\n--- console ---\n{gl.read_console(console)[-3000:]}\n"
                        f"--- qemu log ---\n{libvirtd.qemu_log(name)[-3000:]}")
        _timed("create -> ssh banner", t0)
        assert banner.startswith("SSH-2.0-dropbear")

        qemu_pid = _domain_pid(name)
        assert qemu_pid is not None, "no QEMU process with -name guest=" + name
        # libvirtd double-forks QEMU; it must land on our reaper, not on PID 1.
        assert _ppid(qemu_pid) == libvirtd.reaper_pid

        t0 = time.monotonic()
        rc, out, err = gl.ssh_run(image, port, ["uname", "-r"])
        _timed("ssh command (uname -r)", t0)
        assert (rc, err) == (0, "")
        assert out.strip() == image.kernel_version

        rc, out, err = gl.ssh_run(image, port, ["cat", "/proc/cmdline"])
        assert rc == 0, err
        assert out.strip() == gl.KERNEL_CMDLINE

        # The pin is really checked: another key for this host:port is refused.
        other = paramiko.PKey.from_path(image.client_key)  # a key, but not the host's
        wrong = dataclasses.replace(image, host_key_line=f"{other.get_name()} {other.get_base64()}")
        with pytest.raises(paramiko.SSHException):  # BadHostKeyException is a subclass
            gl.ssh_run(wrong, port, ["true"], timeout=20)

        # The console file got the init script's markers (it goes through virtlogd).
        text = gl.read_console(console)
        assert gl.BOOT_MARKER in text and gl.READY_MARKER in text, text[-2000:]

        t0 = time.monotonic()
        dom.destroy()
        _timed("destroy", t0)
        assert not dom.isActive()
        deadline = time.monotonic() + 10
        while dl._proc_state(qemu_pid) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dl._proc_state(qemu_pid) is None, \
            f"QEMU pid {qemu_pid} still there (state {dl._proc_state(qemu_pid)}) after destroy"
    finally:
        if dom.isActive():
            dom.destroy()
        dom.undefine()
    assert name not in {d.name() for d in conn.listAllDomains(0)}


def test_pci_hostdev_defines_but_does_not_start(libvirtd, conn, image):
    name = dl.DOMAIN_PREFIX + "hostdev"
    xml = gl.domain_xml(name, image.kernel, image.initrd, gl.free_port(),
                        extra_devices=[gl.hostdev_pci_xml("0000:01:00.0", managed=False)])
    dom = conn.defineXML(xml)
    try:
        defined = dom.XMLDesc(0)
        assert "<hostdev mode='subsystem' type='pci' managed='no'>" in defined
        assert "bus='0x01'" in defined
        with pytest.raises(libvirt.libvirtError) as info:
            dom.create()
        err = info.value
        assert err.get_error_code() == libvirt.VIR_ERR_CONFIG_UNSUPPORTED == 67, err
        assert "host doesn't support passthrough of host PCI devices" in str(err)
        assert not dom.isActive()
        assert _domain_pid(name) is None
    finally:
        dom.undefine()
