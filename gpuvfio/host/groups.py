"""IOMMU group viability.

VFIO hands a guest a whole IOMMU group (Documentation/driver-api/vfio.rst, "Groups,
Devices, and IOMMUs"): every endpoint in the group goes with the device. A group is
*viable* for gpuvfio when its endpoints (everything but PCI-to-PCI bridges, which
stay on pcieport) all belong to one physical device (same domain:bus:slot, e.g. a GPU
and its audio function), or are all NVIDIA functions (HGX boards put GPUs and
NVSwitches -- class 0x0680 endpoints, not bridges -- behind shared switches).
"""

from __future__ import annotations

from gpuvfio.address import PciAddress
from gpuvfio.host.model import IommuGroup, PciFunction


def viability(group_id: int, members: list[PciFunction]) -> tuple[bool, list[str]]:
    endpoints = [f for f in members if not f.is_bridge]
    if not endpoints:
        return True, []
    if len({f.address.device for f in endpoints}) == 1 or all(f.is_nvidia for f in endpoints):
        return True, []
    # Which endpoints are foreign: those outside the physical devices that hold the
    # NVIDIA functions; in a group without NVIDIA functions, outside the first device.
    owners = {f.address.device for f in endpoints if f.is_nvidia}
    if not owners:
        owners = {min(f.address for f in endpoints).device}
    foreign = [f for f in endpoints if f.address.device not in owners]
    return False, [f"shares IOMMU group {group_id} with {f.label()}" for f in foreign]


def build_groups(functions: dict[PciAddress, PciFunction]) -> dict[int, IommuGroup]:
    members: dict[int, list[PciFunction]] = {}
    for fn in functions.values():
        if fn.iommu_group is not None:
            members.setdefault(fn.iommu_group, []).append(fn)
    groups = {}
    for group_id in sorted(members):
        fns = sorted(members[group_id], key=lambda f: f.address)
        viable, problems = viability(group_id, fns)
        groups[group_id] = IommuGroup(group_id, [f.address for f in fns], viable, problems)
    return groups
