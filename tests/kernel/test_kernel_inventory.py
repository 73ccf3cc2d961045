"""Kernel lane: ``gpuvfio list --all --json`` inside a real kernel agrees with lspci.

One guest script runs both readers over the same live sysfs (emulated IOMMU,
GPU-host-shaped topology, a second NUMA node), before anything is bound in the boot
the GPU-host modules share (tests/kernel/conftest.py); the host side compares them.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.host.inventory import parse_uevent
from tests.lanes import kernel as kl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli_missing() -> str | None:
    """The lane costs a boot; don't pay it when the command isn't there at all."""
    try:
        proc = subprocess.run([sys.executable, "-m", "gpuvfio", "list", "--help"], cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"gpuvfio CLI not runnable: {exc}"
    if proc.returncode != 0:
        return "gpuvfio list CLI not available: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return None


pytestmark = [
    pytest.mark.skipif(kl.skip_reason() is not None, reason=str(kl.skip_reason())),
]

# The guest sees this checkout and this interpreter (venv) at the same paths.
SCRIPT = f"""#!/bin/sh
cd {shlex.quote(REPO)} || exit 2
PYTHONPATH={shlex.quote(REPO)} PYTHONDONTWRITEBYTECODE=1 \\
  {shlex.quote(sys.executable)} -m gpuvfio list --all --json >"$OUT/inventory.json" 2>"$OUT/inventory.err"
echo $? >"$OUT/inventory.rc"
lspci -D -nn -k -vmm >"$OUT/lspci.txt"
{kl.iommu_groups_script()} >"$OUT/groups.txt"
lspci -D -vvv >"$OUT/lspci_vvv.txt" 2>&1
for dev in /sys/bus/pci/devices/*; do
  echo "${{dev##*/}}|$(cat "$dev/reset_method" 2>/dev/null || echo -)"
done >"$OUT/reset_methods.txt"
for dev in /sys/bus/pci/devices/*; do
  printf '%s|' "${{dev##*/}}"; tr '\n' ';' <"$dev/uevent"; echo
done >"$OUT/uevents.txt"
"""


GPU_HOST_PART = kl.Part("inventory", SCRIPT, timeout=300)


@pytest.fixture(scope="module")
def guest(request):
    reason = _cli_missing()
    if reason:
        pytest.skip(reason)
    result = request.getfixturevalue("gpu_host_boot")[GPU_HOST_PART.name]
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def inventory(guest):
    rc = guest.files.get("inventory.rc", "").strip()
    assert rc == "0", f"gpuvfio list exited {rc}:\n{guest.files.get('inventory.err', '')}"
    data = json.loads(guest.files["inventory.json"])
    return {d["address"]: d for d in data["devices"]}, data.get("groups")


@pytest.fixture(scope="module")
def lspci(guest):
    recs = kl.parse_lspci_vmm(guest.files["lspci.txt"])
    assert recs, "lspci printed nothing"
    return recs


def _lspci_view(rec: dict) -> dict:
    cls = kl.bracket_id(rec.get("Class"))
    numa = rec.get("NUMANode")
    group = rec.get("IOMMUGroup")
    return {
        "vendor_id": kl.bracket_id(rec.get("Vendor")),
        "device_id": kl.bracket_id(rec.get("Device")),
        "class": cls,
        "prog_if": (rec.get("ProgIf") or "00").lower(),
        "driver": rec.get("Driver"),
        "numa_node": None if numa is None or int(numa) < 0 else int(numa),
        "iommu_group": None if group is None else int(group),
    }


def _gpuvfio_view(dev: dict) -> dict:
    class_id = dev.get("class_id") or ""
    return {
        "vendor_id": dev.get("vendor_id"),
        "device_id": dev.get("device_id"),
        "class": class_id[:4],
        "prog_if": class_id[4:6],
        "driver": dev.get("driver"),
        "numa_node": dev.get("numa_node"),
        "iommu_group": dev.get("iommu_group"),
    }


def test_same_addresses(inventory, lspci):
    devices, _ = inventory
    assert set(devices) == set(lspci)
    for addr in (kl.GPU_FN0, kl.GPU_FN1, kl.EDU, kl.NUMA1_EDU):
        assert addr in devices


def test_ids_drivers_numa_groups_agree(inventory, lspci):
    devices, _ = inventory
    rows, mismatches = [], []
    for addr in sorted(lspci):
        want, got = _lspci_view(lspci[addr]), _gpuvfio_view(devices.get(addr, {}))
        rows.append(f"{addr} {got['vendor_id']}:{got['device_id']} class={got['class']}"
                    f"{got['prog_if']} drv={got['driver']} numa={got['numa_node']}"
                    f" group={got['iommu_group']}")
        for key in want:
            if want[key] != got[key]:
                mismatches.append(f"{addr} {key}: lspci={want[key]!r} gpuvfio={got[key]!r}")
    print("\n".join(["gpuvfio inventory in the kernel-lane guest:"] + rows))
    assert not mismatches, "\n".join(mismatches)


def test_id_format(inventory):
    devices, _ = inventory
    hexdigits = set("0123456789abcdef")
    for addr, dev in devices.items():
        assert len(dev["vendor_id"]) == 4 and set(dev["vendor_id"]) <= hexdigits, addr
        assert len(dev["device_id"]) == 4 and set(dev["device_id"]) <= hexdigits, addr
        assert len(dev["class_id"]) == 6 and set(dev["class_id"]) <= hexdigits, addr


def test_groups_match_sysfs(inventory, guest):
    _, groups = inventory
    sysfs = kl.parse_groups(guest.files["groups.txt"])
    assert groups is not None, "inventory reports no IOMMU groups, but the guest has them"
    got = {}
    for g in groups:
        got[int(g["id"])] = {d["address"] if isinstance(d, dict) else d for d in g["devices"]}
    assert got == sysfs


def test_known_topology(inventory):
    devices, groups = inventory
    assert devices[kl.GPU_FN0]["driver"] == kl.GPU_FN0_DRIVER
    assert devices[kl.GPU_FN1]["driver"] == kl.GPU_FN1_DRIVER
    assert devices[kl.GPU_FN0]["iommu_group"] == devices[kl.GPU_FN1]["iommu_group"]
    assert (devices[kl.EDU]["vendor_id"], devices[kl.EDU]["device_id"]) == kl.EDU_IDS
    assert devices[kl.EDU]["driver"] is None
    assert devices[kl.NUMA1_EDU]["numa_node"] == 1
    by_id = {int(g["id"]): g for g in groups}
    edu_group = by_id[devices[kl.EDU]["iommu_group"]]
    assert len(edu_group["devices"]) == 1


def _lspci_flr(text: str) -> dict[str, bool]:
    """address -> FLReset+ in DevCap, from lspci -vvv (an independent reader of config space)."""
    found, address = {}, None
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if line and not line[0].isspace():
            address = line.split()[0]
        elif address and "DevCap:" in line:  # FLReset is on DevCap's continuation line
            chunk = line + " " + (lines[index + 1] if index + 1 < len(lines) else "")
            if "FLReset" in chunk:
                found[address] = "FLReset+" in chunk
    return found


def test_health_agrees_with_the_kernel_and_lspci(inventory, guest):
    """reset_method as the kernel lists it, FLR as lspci decodes DevCap, every function alive."""
    devices, _ = inventory
    methods = dict(line.split("|", 1) for line in guest.files["reset_methods.txt"].splitlines())
    flr = _lspci_flr(guest.files["lspci_vvv.txt"])
    assert flr, "lspci -vvv decoded no DevCap (not root in the guest?)"
    rows = []
    for address, device in sorted(devices.items()):
        health = device["health"]
        rows.append(f"{address} {health}")
        if device.get("is_bridge"):
            continue
        assert health["alive"] is True, address
        want = None if methods[address] == "-" else methods[address].split()
        assert health["reset_method"] == want, address
        if address in flr:
            assert health["flr"] is flr[address], address
    print("\n".join(rows))
    # Something to compare: at least one endpoint whose kernel offers a reset.
    assert any(d["health"]["reset_method"] for d in devices.values() if d["health"])


def test_every_uevent_of_the_real_kernel_gives_what_lspci_reads(guest, lspci):
    """The one read the inventory takes per function (its uevent) is taken on a real kernel, and
    says what lspci reads from the separate attributes and the driver link: ids, class, driver."""
    rows = dict(line.split("|", 1) for line in guest.files["uevents.txt"].splitlines())
    assert set(rows) == set(lspci)
    for address, text in sorted(rows.items()):
        found = parse_uevent(text.replace(";", "\n"), PciAddress.parse(address))
        assert found is not None, (address, text)
        want = _lspci_view(lspci[address])
        assert (found.vendor_id, found.device_id, found.class_id, found.driver) == (
            want["vendor_id"], want["device_id"], want["class"] + want["prog_if"], want["driver"]), address
        record = lspci[address]
        if "SVendor" in record:
            assert (found.subsystem_vendor_id, found.subsystem_device_id) == (
                kl.bracket_id(record["SVendor"]), kl.bracket_id(record["SDevice"])), address
