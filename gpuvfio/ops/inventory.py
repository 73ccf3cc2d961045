"""Inventory services: what ``gpuvfio list`` shows, and opening a host (a directory, or a
recording) for every command. The doctor report and a host's recording are in
gpuvfio.ops.readiness, the host's identity for testbed results in gpuvfio.ops.identity: a command
loads the services it runs, and listing loads neither."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

from gpuvfio.address import PciAddress
from gpuvfio.host.fixture import host_from_record, open_host
from gpuvfio.host.inventory import FunctionIndex, Inventory, read_inventory, read_selected, require_present
from gpuvfio.host.model import NVIDIA_VENDOR, IommuGroup, PciFunction
from gpuvfio.host.pciids import PciIds

if TYPE_CHECKING:  # the annotation only: a Context is passed in, never made here
    from gpuvfio.ops.context import Context

__all__ = ["ListReport", "FunctionIndex", "list_report", "inventory_report", "open_host", "host_from_record"]


@dataclass
class ListReport:
    """gpuvfio list: the functions chosen and the IOMMU groups that hold them (None: the host has
    no IOMMU groups, the IOMMU is off)."""

    devices: list[PciFunction]
    groups: list[IommuGroup] | None

    def to_json(self) -> dict:
        return {"devices": [f.to_json() for f in self.devices],
                "groups": None if self.groups is None else [g.to_json() for g in self.groups]}


def list_report(ctx: Context, *, show_all: bool, only: list[PciAddress] = (),
                index: FunctionIndex | None = None) -> ListReport:
    """What ``gpuvfio list`` shows: devices and the groups that hold them. Only what is shown is
    read whole: every function for ``--all``; else the ids and groups of all (``index``, shared
    with the selection that made ``only``), then the chosen functions and their groups."""
    host = ctx.host
    names = PciIds.load(host)
    if show_all and not only:
        return inventory_report(read_inventory(host, names=names), show_all=True)
    index = index or FunctionIndex(host)
    if only:
        require_present(index.present, only)
        chosen = sorted(set(only))
    else:
        with host.sys_dirs() as dirs:
            chosen = [a for a in index.addresses if index.vendor(a, dirs) == NVIDIA_VENDOR]
    return inventory_report(read_selected(host, chosen, index, names=names), show_all=show_all, only=only)


def inventory_report(inventory: Inventory, *, show_all: bool, only: list[PciAddress] = ()) -> ListReport:
    functions = list(inventory.functions.values())
    if only:
        inventory.require(*only)
        chosen = [inventory.functions[a] for a in sorted(set(only))]
    else:
        chosen = functions if show_all else [f for f in functions if f.is_nvidia]
    if inventory.groups is None:
        groups = None
    elif show_all and not only:
        groups = list(inventory.groups.values())
    else:
        wanted = {f.iommu_group for f in chosen if f.iommu_group is not None}
        groups = [g for gid, g in inventory.groups.items() if gid in wanted]
    return ListReport(chosen, groups)
