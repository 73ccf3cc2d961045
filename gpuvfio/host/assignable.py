"""Can a PCI function be handed to a guest, and what goes with it: one policy for binding
(gpuvfio bind, attach) and for domain XML (gpuvfio xml), so the two cannot disagree.

* VFIO hands out whole IOMMU groups (Documentation/driver-api/vfio.rst): the group must
  exist (the IOMMU is on) and be viable (gpuvfio.host.groups).
* A physical function with SR-IOV VFs enabled is not passed through whole: its VFs may be
  in use (an SR-IOV vGPU on one of them), and VFs sit in the PF's slot, so "the slot's
  functions" would take them along. libvirt's virhostdev refuses a PF whose VFs are
  assigned for the same reason; the VFs go first (echo 0 > sriov_numvfs).
* What a guest gets for one device: the functions of its physical slot (GPU, audio,
  USB-C), never the VFs that share the slot number; a VF alone is just itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError
from gpuvfio.host.inventory import Inventory
from gpuvfio.host.model import PciFunction


@dataclass(slots=True, frozen=True)
class Problem:
    check_id: str
    message: str
    overridable: bool = False  # bind --force may override it (a foreign device in the group)


def endpoint(inventory: Inventory, address: PciAddress) -> PciFunction:
    """The function at ``address``; bad input when there is none or it is a bridge."""
    fn = inventory.require(address)[0]
    if fn.is_bridge:
        raise InputError(f"{address} is a PCI bridge; give the address of a device behind it")
    return fn


def problems(inventory: Inventory, address: PciAddress, together: Iterable[PciAddress] = ()) -> list[Problem]:
    """Why ``address`` cannot be passed through as it is (empty: it can). ``together``: the other
    devices of the same request (one guest, one bind). A group that is not viable on its own
    is fine when every device it shares with is asked for too: the group then goes whole."""
    fn = endpoint(inventory, address)
    found: list[Problem] = []
    if inventory.groups is None:
        found.append(Problem("iommu", "the IOMMU is off: there are no IOMMU groups, vfio-pci cannot isolate "
                                      f"{address} (see gpuvfio doctor)"))
    else:
        group = inventory.group_of(address)
        if group is None:
            found.append(Problem("iommu", f"{address} has no IOMMU group"))
        elif not group.viable:
            asked = {a.device for a in together} | {address.device}
            foreign = [inventory.functions[m] for m in group.devices
                       if not inventory.functions[m].is_bridge and m.device not in asked]
            if foreign:
                found.append(Problem("group_viable", f"group {group.group_id} is not viable: "
                                     + "; ".join(f"shares IOMMU group {group.group_id} with {f.label()}"
                                                 for f in foreign)
                                     + " -- passing it through would take that device from the host",
                                     overridable=True))
    if fn.sriov_num_vfs:
        found.append(Problem("sriov", f"{address} has {fn.sriov_num_vfs} SR-IOV VFs enabled (a vGPU or a guest "
                                      "may use them); disable them first (echo 0 > sriov_numvfs)"))
    return found


def whole_group(inventory: Inventory, address: PciAddress, together: Iterable[PciAddress]) -> bool:
    """``address``'s group is not viable on its own, but every device in it is asked for."""
    group = inventory.group_of(address)
    return (group is not None and not group.viable
            and not any(p.check_id == "group_viable" for p in problems(inventory, address, together)))


def slot_functions(inventory: Inventory, address: PciAddress) -> list[PciFunction]:
    """The functions a guest gets for ``address``: its physical slot without bridges and VFs,
    or the VF alone."""
    fn = endpoint(inventory, address)
    if fn.physfn is not None:
        return [fn]
    return [f for a, f in sorted(inventory.functions.items())
            if a.device == address.device and not f.is_bridge and f.physfn is None]
