"""Kernel lane: what the host itself uses, asked of a real kernel (issue 33 item 1).

One guest boot with two emulated NVMe controllers and an e1000e NIC, each behind its own root
port (its own IOMMU group). Inside, the script makes a filesystem on the first NVMe and mounts
it, gives the NIC an address and the default route, and leaves the second NVMe alone. Then:
the bind of the mounted disk and of the routed NIC are refused, each naming its chain; the
spare NVMe is really bound to vfio-pci and given back to nvme by ``restore``. The real kernel's
shapes (the NVMe multipath head under nvme-subsystem, /proc/1/mountinfo, /proc/1/net/route)
are what gpuvfio reads here, not our builder's idea of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from tests.lanes import kernel as kl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSTEM_DISK, SPARE_DISK, NIC = "0000:01:00.0", "0000:02:00.0", "0000:03:00.0"

pytestmark = [pytest.mark.skipif(kl.skip_reason() is not None, reason=str(kl.skip_reason()))]

DEVICES = [
    "pcie-root-port,id=rp_sys,bus=pcie.0,chassis=1,slot=1,addr=0x10.0",
    "nvme,id=nvme_sys,drive=d_sys,serial=gpuvfiosys,bus=rp_sys,addr=0x0.0",
    "pcie-root-port,id=rp_spare,bus=pcie.0,chassis=2,slot=2,addr=0x11.0",
    "nvme,id=nvme_spare,drive=d_spare,serial=gpuvfiospare,bus=rp_spare,addr=0x0.0",
    "pcie-root-port,id=rp_nic,bus=pcie.0,chassis=3,slot=3,addr=0x12.0",
    "e1000e,id=nic0,netdev=hostnet0,bus=rp_nic,addr=0x0.0",
]

SCRIPT = r"""#!/bin/sh
set -u
cd "@REPO@"
export PYTHONPATH="@REPO@" PYTHONDONTWRITEBYTECODE=1 GPUVFIO_STATE_DIR=/tmp/gpuvfio-state
g() { name=$1; shift; @PY@ -m gpuvfio "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"; echo $? > "$OUT/$name.rc"; }
driver() { basename "$(readlink /sys/bus/pci/devices/$1/driver 2>/dev/null || echo -)"; }
# The namespace of each controller, found by its serial (a multipath head's parent is its subsystem).
for b in /sys/block/nvme*; do
  case "${b##*/}" in *c*) continue ;; esac
  echo "$(cat "$b/device/serial" | tr -d ' ') ${b##*/}"
done > "$OUT/namespaces"
sys_ns=$(awk '$1 == "gpuvfiosys" {print $2}' "$OUT/namespaces")
mkdir -p /tmp/sysdisk
mkfs.ext4 -q -F "/dev/$sys_ns" > "$OUT/mkfs" 2>&1 && mount "/dev/$sys_ns" /tmp/sysdisk >> "$OUT/mkfs" 2>&1
nic=$(ls /sys/bus/pci/devices/@NIC@/net | head -n 1)
ip link set "$nic" up && ip addr add 192.0.2.10/24 dev "$nic" && ip route add default via 192.0.2.1 dev "$nic" \
  > "$OUT/ip" 2>&1
{ ls -l /sys/class/block/ /sys/class/net/; cat /proc/1/mountinfo /proc/1/net/route; } > "$OUT/shapes" 2>&1
g sys bind @SYS@ --connect none --dry-run --json
g nic bind @NIC@ --connect none --dry-run --json
g nic_taken bind @NIC@ --connect none --dry-run --json --take-host-devices
g spare_plan bind @SPARE@ --connect none --dry-run --json
g spare bind @SPARE@ --connect none --yes --json
driver @SPARE@ > "$OUT/spare_bound"
g spare_restore restore @SPARE@ --yes --json
driver @SPARE@ > "$OUT/spare_restored"
driver @SYS@ > "$OUT/sys_after"
findmnt -n -o SOURCE /tmp/sysdisk > "$OUT/still_mounted" 2>&1
""".replace("@PY@", sys.executable).replace("@REPO@", REPO).replace("@SYS@", SYSTEM_DISK)\
    .replace("@SPARE@", SPARE_DISK).replace("@NIC@", NIC)


@pytest.fixture(scope="module")
def guest():
    images = tempfile.mkdtemp(prefix="gpuvfio-kl-disks-", dir="/tmp")
    drives = []
    for name in ("sys", "spare"):
        path = os.path.join(images, f"{name}.img")
        subprocess.run(["truncate", "-s", "64M", path], check=True)
        drives += ["-drive", f"if=none,id=d_{name},file={path},format=raw"]
    try:
        result = kl.run_in_guest(SCRIPT, devices=DEVICES, timeout=420,
                                 extra_qemu=drives + ["-netdev", "user,id=hostnet0"])
    finally:
        subprocess.run(["rm", "-rf", images], check=False)
    assert result.returncode == 0, result.stderr
    return result.files


def ran(files, name):
    assert name + ".rc" in files, f"{name} did not run: {files.get('shapes', '')[:2000]}"
    return int(files[name + ".rc"]), files[name + ".out"], files[name + ".err"]


def refusals(out: str) -> list[str]:
    return [c["message"] for c in json.loads(out)["checks"] if c["id"] == "host_use" and c["status"] == "refuse"]


def test_the_mounted_nvme_is_refused_by_the_real_kernels_answer(guest):
    assert guest.get("mkfs", "") == "", guest.get("mkfs")
    code, out, err = ran(guest, "sys")
    assert code == 1, err
    found = refusals(out)
    assert len(found) == 1 and found[0].startswith(f"{SYSTEM_DISK}: nvme") and \
        "is mounted on /tmp/sysdisk: the host loses it" in found[0], (found, guest["shapes"])
    assert guest["sys_after"].strip() == "nvme" and guest["still_mounted"].strip().startswith("/dev/nvme")


def test_the_nic_with_the_default_route_is_refused_and_the_override_plans(guest):
    code, out, err = ran(guest, "nic")
    assert code == 1, err
    # (slirp also advertises an IPv6 router: the default routes may be "(IPv4 via 192.0.2.1; IPv6 via fe80::2)")
    assert any(f"{NIC}: " in m and "carries the default route" in m and "IPv4 via 192.0.2.1" in m
               for m in refusals(out)), \
        (out, guest.get("ip"), guest["shapes"])
    code, out, err = ran(guest, "nic_taken")
    assert code == 0, err
    assert [c["status"] for c in json.loads(out)["checks"] if c["id"] == "host_use"][0] == "warn"


def test_the_spare_nvme_is_bound_and_given_back(guest):
    code, out, err = ran(guest, "spare_plan")
    assert code == 0, err
    assert any("is not a GPU" in c["message"] for c in json.loads(out)["checks"] if c["id"] == "host_use")
    code, out, err = ran(guest, "spare")
    assert code == 0, err
    assert guest["spare_bound"].strip() == "vfio-pci"
    code, out, err = ran(guest, "spare_restore")
    assert code == 0, err
    assert guest["spare_restored"].strip() == "nvme"
