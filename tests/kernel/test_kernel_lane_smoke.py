"""Kernel lane smoke test: a real kernel with an emulated IOMMU sees the GPU-host topology.

Its script runs in the boot the GPU-host modules share (tests/kernel/conftest.py), first.
"""

from __future__ import annotations

import pytest

from tests.lanes import kernel as kl

pytestmark = [
    pytest.mark.skipif(kl.skip_reason() is not None, reason=str(kl.skip_reason())),
]

SCRIPT = f"""#!/bin/sh
set -u
ls /sys/kernel/iommu_groups > "$OUT/group_ids.txt"
{kl.iommu_groups_script()} > "$OUT/groups.txt"
for d in /sys/bus/pci/devices/*; do
  drv=-
  [ -e "$d/driver" ] && drv=$(basename "$(readlink "$d/driver")")
  echo "${{d##*/}}|$drv|$(cat "$d/numa_node")"
done > "$OUT/drivers.txt"
lspci -D -nn -k -vmm > "$OUT/lspci.txt"
uname -r > "$OUT/uname.txt"
"""


GPU_HOST_PART = kl.Part("smoke", SCRIPT, timeout=180)


@pytest.fixture(scope="module")
def guest(gpu_host_boot):
    result = gpu_host_boot[GPU_HOST_PART.name]
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def groups(guest):
    return kl.parse_groups(guest.files["groups.txt"])


@pytest.fixture(scope="module")
def drivers(guest):
    out = {}
    for line in guest.files["drivers.txt"].splitlines():
        addr, drv, numa = line.split("|")  # driver names may contain spaces
        out[addr] = (None if drv == "-" else drv, int(numa))
    return out


def _group_of(groups, address):
    return next(g for g, members in groups.items() if address in members)


def test_booted_the_installed_kernel(guest):
    kernel = kl.find_kernel()
    assert guest.files["uname.txt"].strip() == kernel.split("vmlinuz-", 1)[1]


def test_iommu_groups_exist(guest, groups):
    assert guest.files["group_ids.txt"].split(), "no /sys/kernel/iommu_groups/*"
    assert len(groups) >= 5


def test_gpu_functions_share_one_group(groups):
    g = _group_of(groups, kl.GPU_FN0)
    assert kl.GPU_FN1 in groups[g]
    assert groups[g] == {kl.GPU_FN0, kl.GPU_FN1}


def test_edu_alone_in_its_group(groups):
    assert groups[_group_of(groups, kl.EDU)] == {kl.EDU}
    assert groups[_group_of(groups, kl.NUMA1_EDU)] == {kl.NUMA1_EDU}


def test_drivers_bound(drivers):
    assert drivers[kl.GPU_FN0][0] == kl.GPU_FN0_DRIVER
    assert drivers[kl.GPU_FN1][0] == kl.GPU_FN1_DRIVER
    assert drivers[kl.EDU][0] is None


def test_numa_node_of_expander(drivers):
    assert drivers[kl.NUMA1_EDU][1] == 1
    assert drivers[kl.NUMA1_ROOT_PORT][1] == 1
    assert drivers[kl.GPU_FN0][1] in (-1, 0)


def test_lspci_captured(guest):
    recs = kl.parse_lspci_vmm(guest.files["lspci.txt"])
    for addr in (kl.GPU_FN0, kl.GPU_FN1, kl.EDU, kl.NUMA1_EDU, kl.GPU_ROOT_PORT):
        assert addr in recs, f"{addr} missing from lspci"
    assert recs[kl.GPU_FN0].get("Driver") == "e1000e"
    assert recs[kl.GPU_FN1].get("Driver") == "snd_hda_intel"
    assert (kl.bracket_id(recs[kl.EDU]["Vendor"]), kl.bracket_id(recs[kl.EDU]["Device"])) == kl.EDU_IDS
    assert recs[kl.GPU_FN0]["IOMMUGroup"] == recs[kl.GPU_FN1]["IOMMUGroup"]
    assert recs[kl.NUMA1_EDU].get("NUMANode") == "1"
