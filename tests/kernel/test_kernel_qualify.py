"""Kernel lane: ``gpuvfio qualify`` cycles the real resets of an emulated device (issue 38 item 5).

A virtio-net function behind a PCIe root port (QEMU 7.2: function-level reset, x-pcie-flr-init
on by default; the port's secondary bus reset) is bound to vfio-pci, then qualified with two
cycles of each method its reset_method lists. The real kernel selects each method
(reset_method_store), resets the device (pci_reset_function) and restores its config space; the
checks read what it left. Afterwards reset_method holds the original list, the verdicts file
records each method for 1af4:1041, health rates the reset as qualified, and restore gives the
device back to virtio-pci.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

import pytest

from tests.lanes import kernel as kl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.skipif(kl.skip_reason() is not None, reason=str(kl.skip_reason()))]

DEVICE = "0000:01:00.0"
MODEL = "1af4:1041"  # virtio 1.0 network device
DEVICES = [
    "pcie-root-port,id=rp_q,bus=pcie.0,chassis=30,slot=30,addr=0x14.0",
    "virtio-net-pci,id=nic_q,bus=rp_q,netdev=kq0",
]
SYSFS = f"/sys/bus/pci/devices/{DEVICE}"
RUN = (f"env PYTHONPATH={shlex.quote(REPO)} PYTHONDONTWRITEBYTECODE=1 GPUVFIO_STATE_DIR=/tmp/gpuvfio-state "
       f"{shlex.quote(sys.executable)} -m gpuvfio")

SCRIPT = f"""#!/bin/sh
cd {shlex.quote(REPO)} || exit 2
run() {{ name=$1; shift; {RUN} "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"; echo $? >"$OUT/$name.rc"; }}
cat {SYSFS}/reset_method >"$OUT/before.txt"
run bind bind {DEVICE} --connect none --yes
readlink {SYSFS}/driver >"$OUT/bound.txt"
run qualify qualify {DEVICE} --cycles 2 --connect none --json
cat {SYSFS}/reset_method >"$OUT/after.txt"
cat /tmp/gpuvfio-state/reset-verdicts.json >"$OUT/verdicts.json"
run health health {DEVICE} --connect none --json
run restore restore {DEVICE}
readlink {SYSFS}/driver >"$OUT/restored.txt"
dmesg | grep -i -e reset -e {DEVICE} >"$OUT/dmesg.txt"
"""


@pytest.fixture(scope="module")
def guest():
    result = kl.run_in_guest(SCRIPT, devices=DEVICES, extra_qemu=["-netdev", "user,id=kq0"], timeout=900)
    assert result.returncode == 0, result.stderr[-3000:] + result.vng_stderr[-3000:]
    return result


def _said(guest, name: str) -> str:
    return f"{name}: rc {guest.files.get(name + '.rc', '?').strip()}\n{guest.files.get(name + '.err', '')[-2000:]}"


def test_the_device_is_bound_and_offers_reset_methods(guest):
    assert guest.files["bind.rc"].strip() == "0", _said(guest, "bind")
    assert guest.files["bound.txt"].strip().endswith("/vfio-pci")
    assert "flr" in guest.files["before.txt"].split(), guest.files["before.txt"]


def test_each_method_the_kernel_lists_passes_twice_and_the_list_goes_back(guest):
    methods = guest.files["before.txt"].split()
    assert guest.files["qualify.rc"].strip() == "0", _said(guest, "qualify") + guest.files["qualify.out"]
    result = json.loads(guest.files["qualify.out"])
    assert [(m["method"], m["outcome"], m["cycles"]) for m in result["methods"]] == [
        (method, "passed", 2) for method in methods]
    assert result["ok"] and result["problems"] == []
    assert guest.files["after.txt"] == guest.files["before.txt"]
    resets = [s for s in result["steps"] if s["kind"] == "reset"]
    assert len(resets) == 2 * len(methods)


def test_the_verdicts_and_health_say_so(guest):
    verdicts = json.loads(guest.files["verdicts.json"])
    recorded = verdicts["models"][MODEL]
    assert sorted(recorded) == sorted(guest.files["before.txt"].split())
    assert all(r["verdict"] == "passed" and r["passed"] == 1 and r["last"]["cycles"] == 2 and
               r["last"]["device"] == DEVICE for r in recorded.values())
    health = json.loads(guest.files["health.out"])["devices"][0]
    first = guest.files["before.txt"].split()[0]
    assert [f["message"] for f in health["findings"] if f["check"] == "reset"] == [
        f"its reset ({first}) qualified for {MODEL} in 1 run(s), 2 cycle(s) the last"]


def test_restore_gives_it_back(guest):
    assert guest.files["restore.rc"].strip() == "0", _said(guest, "restore")
    assert guest.files["restored.txt"].strip().endswith("/virtio-pci")
