"""vGPU profiles: legacy mdev types and NVIDIA SR-IOV vGPU types (vGPU 17+, no mdev bus).

Legacy (T4, V100, A100 on older drivers): ``<PF>/mdev_supported_types/<type>/create``
takes a UUID (Documentation/driver-api/vfio-mediated-device.rst).
SR-IOV (Ada/Hopper, vGPU 17+ on 6.8+ kernels): each VF lists
``nvidia/creatable_vgpu_types`` and takes a type id in ``nvidia/current_vgpu_type``;
the VF itself is then passed through as a PCI device (managed='no').

MIG-backed types (A100/A30/H100/H200 in MIG mode) are SR-IOV types too; NVIDIA names them
``<GPU>-<slices>-<GB>C`` ("NVIDIA A100-3-20C": 3 compute slices, 20 GB; a trailing "ME"
adds the media engines). The driver lists one on a VF only while MIG mode is on and a
GPU instance of that profile is free (NVIDIA vGPU user guide, "Configuring a GPU for
MIG-backed vGPUs"); gpuvfio does not repartition GPUs, it says what is missing.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from enum import Enum

from gpuvfio.address import PciAddress
from gpuvfio.errors import Refused
from gpuvfio.host.inventory import Inventory
from gpuvfio.host.model import PciFunction
from gpuvfio.host.root import HostRoot
from gpuvfio.numbers import uint


_MIG_BACKED = re.compile(r"-([1-8])-([0-9]{1,4})C(ME)?$", re.ASCII)  # GB of a GPU instance: 1-4 digits


@dataclass(frozen=True)
class MigProfile:
    """What a MIG-backed vGPU type's name says: GPU slices, memory, the media engines."""

    slices: int
    memory_gb: int
    media: bool

    def to_json(self) -> dict:
        return {"slices": self.slices, "memory_gb": self.memory_gb, "media": self.media}


def mig_backed(name: str | None) -> MigProfile | None:
    """The MIG profile a vGPU type name says it is, else None (not MIG-backed)."""
    match = _MIG_BACKED.search(name or "")
    if not match:
        return None
    return MigProfile(uint(match.group(1)), uint(match.group(2)), bool(match.group(3)))


class TypesKind(str, Enum):
    """How a function offers vGPU types."""

    MDEV = "mdev"  # legacy: mdev_supported_types on the GPU
    SRIOV = "sriov"  # SR-IOV: types on its VFs
    VF = "vf"  # a VF itself: its physical function lists them
    NONE = "none"


@dataclass(frozen=True)
class MdevTypeOffer:
    """A legacy mdev type the GPU offers (mdev_supported_types/<id>)."""

    type_id: str
    name: str | None
    available_instances: int | None
    description: str | None

    def to_json(self) -> dict:
        return {"id": self.type_id, "name": self.name, "available_instances": self.available_instances,
                "description": self.description}


@dataclass(frozen=True)
class SriovTypeOffer:
    """An SR-IOV vGPU type the GPU's VFs can take, and the VFs free to take it."""

    type_id: int
    name: str
    free_vfs: list[str]
    mig: MigProfile | None

    @property
    def available_instances(self) -> int:
        return len(self.free_vfs)

    def to_json(self) -> dict:
        return {"id": self.type_id, "name": self.name, "free_vfs": list(self.free_vfs),
                "mig_backed": self.mig.to_json() if self.mig is not None else None,
                "available_instances": self.available_instances}


@dataclass(frozen=True)
class VfInUse:
    vf: str
    type_id: int

    def to_json(self) -> dict:
        return {"vf": self.vf, "type": self.type_id}


@dataclass(frozen=True)
class OfferedTypes:
    """``gpuvfio vgpu types``: the vGPU types a function offers (a VF names its physical function)."""

    address: str
    kind: TypesKind
    mdev_types: list[MdevTypeOffer]
    sriov_types: list[SriovTypeOffer]
    sriov_in_use: list[VfInUse]
    physfn: str | None = None  # a VF's physical function

    def to_json(self) -> dict:
        out: dict = {"address": self.address, "kind": self.kind.value}
        if self.kind is TypesKind.VF:
            out["physfn"] = self.physfn
        out.update(mdev_types=[m.to_json() for m in self.mdev_types],
                   sriov_types=[t.to_json() for t in self.sriov_types],
                   sriov_in_use=[u.to_json() for u in self.sriov_in_use])
        return out


def _gpu(inventory: Inventory, address: PciAddress) -> PciFunction:
    fn = inventory.require(address)[0]
    return fn


def pick_mdev(inventory: Inventory, address: PciAddress, wanted: str, *, check_available: bool = True) -> str:
    """The mdev type id for ``wanted`` (an id like nvidia-222 or a name like 'GRID T4-1Q');
    with ``check_available``, one instance of it must still be free."""
    fn = _gpu(inventory, address)
    if not fn.mdev_types:
        raise Refused(f"{address} offers no mdev types (legacy vGPU needs the NVIDIA vGPU host driver)")
    for mdev in fn.mdev_types:
        if wanted in (mdev.type_id, mdev.name):
            if check_available and mdev.available_instances is not None and mdev.available_instances < 1:
                raise Refused(f"{address}: mdev type {mdev.type_id} ({mdev.name}) has no available instances")
            return mdev.type_id
    offered = ", ".join(f"{m.type_id} ({m.name})" for m in fn.mdev_types)
    raise Refused(f"{address} does not offer mdev type {wanted!r}; it offers: {offered}")


def mdev_dir(host: HostRoot, uuid: str) -> str:
    return host.sys_path("bus", "mdev", "devices", uuid)


def existing_mdev(host: HostRoot, uuid: str) -> tuple[PciAddress, str] | None:
    """(parent, type id) of the mdev ``uuid`` when it exists (drivers/vfio/mdev/mdev_sysfs.c: the
    device sits under its parent's directory and links ``mdev_type`` to its type)."""
    path = mdev_dir(host, uuid)
    if not host.exists(path):
        return None
    real = host.resolve_in_sys(path)
    parent = PciAddress.try_parse(os.path.basename(os.path.dirname(real)))
    type_id = host.link_name(os.path.join(real, "mdev_type"))
    if parent is None or type_id is None:
        return None
    return parent, type_id


def _type_id(fn: PciFunction, wanted: str) -> int | None:
    for vtype in fn.vgpu_creatable or []:
        if wanted in (str(vtype.type_id), vtype.name):
            return vtype.type_id
    return None


def pick_vf(inventory: Inventory, address: PciAddress, wanted: str, *, reuse: bool = True) -> PciAddress:
    """A VF of GPU ``address`` for SR-IOV vGPU type ``wanted`` (id or name): with ``reuse``, one
    already set to that type first; else a free VF (current type 0) that can take it."""
    pf = _gpu(inventory, address)
    vfs = [inventory.functions[v] for v in pf.vfs if v in inventory.functions]
    if not vfs:
        raise Refused(f"{address} has no SR-IOV VFs enabled (SR-IOV vGPU needs them: "
                         "the NVIDIA sriov-manage script enables them)")
    # A VF whose type is set lists no creatable types any more: learn the id from the others.
    ids = {t.type_id for vf in vfs for t in vf.vgpu_creatable or [] if wanted in (str(t.type_id), t.name)}
    wanted_id = uint(wanted, 0xFFFFFFFF)
    if wanted_id is not None:
        ids.add(wanted_id)
    for vf in vfs if reuse else []:
        if vf.vgpu_current and vf.vgpu_current in ids:
            return vf.address
    for vf in vfs:
        if not vf.vgpu_current and _type_id(vf, wanted) is not None:
            return vf.address
    offered = sorted({f"{t.type_id} ({t.name})" for vf in vfs for t in vf.vgpu_creatable or []})
    hint = ""
    mig = mig_backed(wanted)
    if mig:
        hint = (f"; {wanted!r} is MIG-backed ({mig.slices} GPU slice(s), {mig.memory_gb} GB): the driver "
                "offers it only with MIG mode on and a free GPU instance of that size "
                f"(nvidia-smi -i <gpu> -mig 1, then nvidia-smi mig -cgi <profile>)")
    raise Refused(f"no VF of {address} can take vGPU type {wanted!r}; creatable: "
                     f"{', '.join(offered) or 'none'}{hint}")
