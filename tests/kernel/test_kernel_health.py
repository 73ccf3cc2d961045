"""Kernel lane: ``gpuvfio health`` inside a real kernel reads the AER errors QEMU injects and the
links QEMU trains (issue 38).

QEMU's monitor (HMP ``pcie_aer_inject_error``, hw/pci/pcie_aer.c in QEMU 7.2) injects, once the
guest's script has started, a non-fatal error (UNSUP) into one virtio-net function with the AER
capability and a fatal one (MALF_TLP, fatal by the spec's default severity) into another; the
guest kernel's AER driver counts them. A third function sits behind a root port trained narrow
(``x-width=4,x-speed=2_5``). health, run in the guest on those three, must rate them from the
kernel's own counters and links.

An injected correctable error (BAD_TLP) never reached this guest's kernel (QEMU 7.2, Linux 6.1:
no "Corrected error received" in its log, even with Correctable Error Reporting Enable set), so
correctable counts are the unit lane's (tests/unit/test_pcie_health.py).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
import threading
import time

import pytest

from tests.lanes import kernel as kl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.skipif(kl.skip_reason() is not None, reason=str(kl.skip_reason()))]

ERRORS, FATAL, NARROW = "0000:01:00.0", "0000:02:00.0", "0000:03:00.0"
NARROW_PORT, FATAL_PORT = "0000:00:16.0", "0000:00:15.0"
DEVICES = [
    "pcie-root-port,id=rp_aer,bus=pcie.0,chassis=20,slot=20,addr=0x14.0",
    "virtio-net-pci,id=nic_aer,bus=rp_aer,aer=on,netdev=kh0",
    "pcie-root-port,id=rp_fatal,bus=pcie.0,chassis=21,slot=21,addr=0x15.0",
    "virtio-net-pci,id=nic_fatal,bus=rp_fatal,aer=on,netdev=kh1",
    "pcie-root-port,id=rp_narrow,bus=pcie.0,chassis=22,slot=22,addr=0x16.0,x-speed=2_5,x-width=4",
    "virtio-net-pci,id=nic_narrow,bus=rp_narrow,netdev=kh2",
]
INJECTIONS = ["pcie_aer_inject_error nic_aer UNSUP", "pcie_aer_inject_error nic_fatal MALF_TLP"]

# The guest waits (90 s at most) until the kernel counted both errors, records the raw counters
# and links, and runs health on the three functions.
SCRIPT = f"""#!/bin/sh
echo READY
total() {{ grep "^$2 " "/sys/bus/pci/devices/$1/$3" 2>/dev/null | cut -d' ' -f2; }}
for i in $(seq 1 90); do
  [ "$(total {ERRORS} TOTAL_ERR_NONFATAL aer_dev_nonfatal)" = 1 ] &&
  [ "$(cat /sys/bus/pci/devices/{FATAL_PORT}/aer_rootport_total_err_fatal)" = 1 ] && break
  sleep 1
done
for d in {ERRORS} {FATAL} {NARROW} {NARROW_PORT} {FATAL_PORT}; do
  for f in aer_dev_correctable aer_dev_nonfatal aer_dev_fatal current_link_width max_link_width \\
           current_link_speed max_link_speed aer_rootport_total_err_fatal; do
    [ -e "/sys/bus/pci/devices/$d/$f" ] && sed "s|^|$d $f |" "/sys/bus/pci/devices/$d/$f"
  done
done >"$OUT/sysfs.txt"
cd {shlex.quote(REPO)} || exit 2
PYTHONPATH={shlex.quote(REPO)} PYTHONDONTWRITEBYTECODE=1 {shlex.quote(sys.executable)} -m gpuvfio health \\
  {ERRORS} {FATAL} {NARROW} --json >"$OUT/health.json" 2>"$OUT/health.err"
echo $? >"$OUT/health.rc"
dmesg | grep -e AER -e aer >"$OUT/dmesg.txt"
"""


def _inject(sock: str, ready: threading.Event, said: list[str]) -> None:
    """Once the guest's script has started: each injection, through the HMP monitor socket."""
    deadline = time.monotonic() + 600
    while not os.path.exists(sock) and time.monotonic() < deadline:
        time.sleep(0.2)
    with socket.socket(socket.AF_UNIX) as mon:
        mon.connect(sock)
        mon.settimeout(10)
        said.append(mon.recv(4096).decode("utf-8", "replace"))
        if not ready.wait(600):
            return
        for command in INJECTIONS:
            mon.sendall(command.encode() + b"\n")
            answer = b""
            while b"\n(qemu)" not in answer:
                answer += mon.recv(4096)
            said.append(answer.decode("utf-8", "replace"))


@pytest.fixture(scope="module")
def guest():
    where = tempfile.mkdtemp(prefix="gpuvfio-mon-", dir="/tmp")
    sock = os.path.join(where, "hmp.sock")
    ready, said = threading.Event(), []
    injector = threading.Thread(target=_inject, args=(sock, ready, said), daemon=True)
    injector.start()

    def follow(text: str) -> None:
        if "READY" in text:
            ready.set()

    extra = ["-netdev", "user,id=kh0", "-netdev", "user,id=kh1", "-netdev", "user,id=kh2",
             "-monitor", f"unix:{sock},server=on,wait=off"]
    try:
        result = kl.run_in_guest(SCRIPT, devices=DEVICES, extra_qemu=extra, timeout=600, follow=follow)
    finally:
        ready.set()
        injector.join(30)
        shutil.rmtree(where, ignore_errors=True)
    assert sum("OK id:" in s for s in said) == len(INJECTIONS), said
    assert result.returncode == 0, result.stderr[-3000:] + result.vng_stderr[-3000:]
    return result


def _sysfs(guest) -> dict[tuple[str, str], str]:
    """(device, ``file`` or ``file KIND``) -> value, as the guest's kernel wrote them."""
    out = {}
    for line in guest.files["sysfs.txt"].splitlines():
        device, name, value = line.split(" ", 2)
        key, _, count = value.rpartition(" ")
        if name.startswith("aer_dev_") and key:
            out[(device, f"{name} {key}")] = count
        else:
            out[(device, name)] = value
    return out


def _health(guest) -> dict[str, dict]:
    return {d["address"]: d for d in json.loads(guest.files["health.json"])["devices"]}


def _said(device: dict, check: str) -> list[tuple[str, str]]:
    return [(f["status"], f["message"]) for f in device["findings"] if f["check"] == check]


def test_the_kernel_counted_what_qemu_injected(guest):
    """The non-fatal error at the function that sent it; the fatal one at least at its root port
    (the kernel may not read a sender whose link went down)."""
    kernel = _sysfs(guest)
    assert (kernel[(ERRORS, "aer_dev_nonfatal UnsupReq")],
            kernel[(FATAL_PORT, "aer_rootport_total_err_fatal")]) == ("1", "1"), guest.files["dmesg.txt"]


def test_health_rates_the_injected_errors_from_the_kernels_counters(guest):
    assert guest.files["health.rc"].strip() == "1", guest.files["health.err"]
    health = _health(guest)
    errors, fatal = health[ERRORS], health[FATAL]
    assert errors["status"] == "degraded" and _said(errors, "aer") == [
        ("degraded", "1 nonfatal error(s) (UnsupReq 1) since boot")]
    own = ("failed", "1 fatal error(s) (MalfTLP 1) since boot")
    unclaimed = ("failed", f"its root port {FATAL_PORT}: 1 fatal error message(s) since boot that no function "
                           "below it counted (the kernel could not read the sender: its link went down)")
    if _sysfs(guest)[(FATAL, "aer_dev_fatal MalfTLP")] == "1":  # the kernel read the sender
        assert fatal["status"] == "failed" and own in _said(fatal, "aer"), fatal
    else:  # Linux 6.1: "type=Inaccessible", counted at the root port only
        assert fatal["status"] == "failed" and unclaimed in _said(fatal, "port_aer"), fatal
    kernel = _sysfs(guest)
    for address, device in ((ERRORS, errors), (FATAL, fatal)):
        for severity in ("correctable", "nonfatal", "fatal"):
            total = {"correctable": "TOTAL_ERR_COR", "nonfatal": "TOTAL_ERR_NONFATAL", "fatal": "TOTAL_ERR_FATAL"}
            assert device["aer"]["self"][severity]["total"] == int(kernel[(address, f"aer_dev_{severity} "
                                                                                     f"{total[severity]}")])


def test_health_reads_the_links_as_the_kernel_trained_them(guest):
    """The narrow root port's x4 Gen1 is what the kernel reads; the function behind it is rated
    on the kernel's numbers. A function whose Link Capabilities read 0 (virtio: the kernel says
    width 255, speed Unknown) has no maximum to fall below: no "lanes lost"."""
    kernel, health = _sysfs(guest), _health(guest)
    assert (kernel[(NARROW_PORT, "max_link_width")], kernel[(NARROW_PORT, "max_link_speed")]) == ("4", "2.5 GT/s PCIe")
    narrow = health[NARROW]
    current, maximum = int(kernel[(NARROW, "current_link_width")]), int(kernel[(NARROW, "max_link_width")])
    allowed = min(maximum, 4)
    ((status, message),) = _said(narrow, "link")
    assert (status == "degraded") == (current < allowed), message
    assert f"x{current}" in message
    if kernel[(ERRORS, "max_link_width")] == "255":
        assert _said(health[ERRORS], "link") == []
