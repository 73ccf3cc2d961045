"""``gpuvfio vgpu types / create / remove``: vGPU instances, journaled like binding.

Legacy mdev (drivers/vfio/mdev/mdev_sysfs.c): writing a UUID to
``<parent>/mdev_supported_types/<type>/create`` makes ``/sys/bus/mdev/devices/<uuid>``;
writing 1 to its ``remove`` destroys it. SR-IOV vGPU (NVIDIA vGPU 17+): writing a type
id to ``<vf>/nvidia/current_vgpu_type`` gives the VF that profile; 0 clears it.
Every instance gpuvfio creates is recorded in the journal (``mdevs``, ``vgpus``) before
the write, so ``gpuvfio vgpu remove`` and ``gpuvfio restore`` can undo it.
"""

from __future__ import annotations

import json
import os
import uuid as uuidlib
from dataclasses import dataclass, field
from enum import Enum

from gpuvfio.address import PciAddress
from gpuvfio.bind.journal import Journal
from gpuvfio.bind.sysfs_write import SysfsWriter
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.host.inventory import Inventory
from gpuvfio.host.root import HostRoot
from gpuvfio.planning import Step
from gpuvfio.vgpu.types import (MdevTypeOffer, OfferedTypes, SriovTypeOffer, TypesKind, VfInUse, existing_mdev,
                                mdev_dir, mig_backed, pick_mdev, pick_vf)


def types(inventory: Inventory, address: PciAddress) -> OfferedTypes:
    fn = inventory.require(address)[0]
    if fn.physfn is not None:  # a VF lists no types of its own: its physical function offers them
        return OfferedTypes(str(address), TypesKind.VF, [], [], [], physfn=str(fn.physfn))
    legacy = [MdevTypeOffer(m.type_id, m.name, m.available_instances, m.description) for m in fn.mdev_types]
    sriov: dict[int, tuple[str, list[str]]] = {}
    for vf_address in fn.vfs:
        vf = inventory.functions.get(vf_address)
        if vf is None:
            continue
        for vtype in vf.vgpu_creatable or []:
            _name, free = sriov.setdefault(vtype.type_id, (vtype.name, []))
            if not vf.vgpu_current:
                free.append(str(vf_address))
    in_use = [VfInUse(str(v), inventory.functions[v].vgpu_current) for v in fn.vfs
              if v in inventory.functions and inventory.functions[v].vgpu_current]
    kind = TypesKind.MDEV if legacy else (TypesKind.SRIOV if fn.vfs else TypesKind.NONE)
    return OfferedTypes(str(address), kind, legacy,
                        [SriovTypeOffer(type_id, name, free, mig_backed(name))
                         for type_id, (name, free) in sorted(sriov.items())], in_use)


def mdevctl_rel(parent: str, uuid: str) -> str:
    """mdevctl's store for persistent mdevs: /etc/mdevctl.d/<parent>/<uuid>, JSON (beneath the root)."""
    return "/".join(("etc", "mdevctl.d", parent, uuid))


def mdevctl_path(host: HostRoot, parent: str, uuid: str) -> str:
    return host.tree.path(mdevctl_rel(parent, uuid))


def persist_mdev(host: HostRoot, parent: str, uuid: str, type_id: str) -> str:
    """Define the mdev the way ``mdevctl define --auto`` does (same file, same JSON), so
    mdevctl's udev/systemd integration recreates it at boot; atomic write."""
    body = json.dumps({"mdev_type": type_id, "start": "auto", "attrs": []}, indent=2)
    host.tree.write(mdevctl_rel(parent, uuid), body)
    return mdevctl_path(host, parent, uuid)


class Outcome(str, Enum):
    CREATED = "created"
    EXISTS = "exists"  # there already, with that type: nothing done
    REMOVED = "removed"


@dataclass
class InstanceResult:
    """A vGPU instance made, found, or removed: an mdev (by UUID) or an SR-IOV VF's type."""

    kind: str  # "mdev" | "sriov"
    instance: str  # the mdev UUID, or the VF address
    outcome: Outcome
    type_id: str | int | None = None
    parent: str | None = None
    persisted: str | None = None  # mdevctl's file, when --persist wrote one
    note: str | None = None
    persist_asked: bool = False
    steps: list[Step] = field(default_factory=list)  # the plan's steps, as carried out

    def to_json(self) -> dict:
        out = {"kind": self.kind, "uuid" if self.kind == "mdev" else "vf": self.instance}
        if self.outcome is not Outcome.REMOVED:
            out.update(type=self.type_id, parent=self.parent)
        out["result"] = self.outcome.value
        if self.persist_asked:
            out["persisted"] = self.persisted
        if self.note:
            out["note"] = self.note
        out["steps"] = [s.to_json() for s in self.steps]
        return out


@dataclass(frozen=True)
class Creation:
    """A vGPU instance decided, before anything is written (gpuvfio vgpu create, its --dry-run,
    a testbed's vGPU variant)."""

    kind: str  # "mdev" (legacy) | "sriov" (a type on a VF)
    parent: PciAddress
    type_id: str | int
    instance: str | None  # the mdev UUID (None: a random one at creation) or the VF address
    exists: bool = False  # already there with that type: nothing to do

    def describe(self) -> str:
        if self.kind == "mdev":
            return (f"write {self.instance or 'a new random UUID'} to {self.parent}'s mdev_supported_types/"
                    f"{self.type_id}/create")
        return f"{self.instance}: nvidia/current_vgpu_type <- {self.type_id}"


def decide_create(host: HostRoot, inventory: Inventory, address: PciAddress, wanted: str,
                  uuid: str | None = None) -> Creation:
    """Which instance ``create`` makes (a type and availability checked; an mdev UUID in use with
    another type refused); reads only."""
    fn = inventory.require(address)[0]
    if fn.mdev_types:
        uuid = str(uuidlib.UUID(uuid)) if uuid else None
        if uuid is not None and host.exists(mdev_dir(host, uuid)):
            current = host.link_name(os.path.join(host.resolve_in_sys(mdev_dir(host, uuid)), "mdev_type"))
            named = next((m.type_id for m in fn.mdev_types if wanted in (m.type_id, m.name)), None)
            if named is not None and current == named:
                return Creation("mdev", address, named, uuid, exists=True)
            raise Refused(f"mdev {uuid} already exists with type {current}")
        return Creation("mdev", address, pick_mdev(inventory, address, wanted), uuid)  # type and availability
    if fn.vfs:
        vf = pick_vf(inventory, address, wanted, reuse=False)
        vf_fn = inventory.functions[vf]
        type_id = next((t.type_id for t in vf_fn.vgpu_creatable or [] if wanted in (str(t.type_id), t.name)),
                       vf_fn.vgpu_current)
        return Creation("sriov", address, type_id, str(vf), exists=vf_fn.vgpu_current == type_id)
    raise Refused(f"{address} offers no vGPU types (no mdev_supported_types, no SR-IOV VFs)")


def make(host: HostRoot, inventory: Inventory, creation: Creation, *, persist: bool, writer: SysfsWriter,
         journal: Journal) -> InstanceResult:
    """Make the instance ``creation`` decided (decide_create, under the run lock the caller
    holds), journaled in ``journal``; with ``persist`` an mdev is also defined in mdevctl's
    store."""
    if creation.kind == "mdev":
        result = _create_mdev(host, creation, writer, journal)
        if persist:
            result.persist_asked = True
            result.persisted = persist_mdev(host, result.parent, result.instance, result.type_id)
            journal.data["mdevs"].setdefault(result.instance, {})["persisted"] = result.persisted
            journal.save()
        return result
    result = _create_sriov(host, inventory, creation, writer, journal)
    if persist:
        result.persist_asked = True
        result.note = ("SR-IOV vGPU types are runtime state (nvidia/current_vgpu_type); set them "
                       "again at boot, e.g. from a unit running gpuvfio vgpu create")
    return result


def _create_mdev(host, creation: Creation, writer, journal) -> InstanceResult:
    address, type_id = creation.parent, creation.type_id
    uuid = creation.instance or str(uuidlib.uuid4())
    if creation.exists:
        return InstanceResult("mdev", uuid, Outcome.EXISTS, type_id, str(address))
    journal.data.setdefault("mdevs", {})[uuid] = {"parent": str(address), "type": type_id, "state": "creating"}
    journal.save()
    writer.write(host.sys_path("bus", "pci", "devices", str(address), "mdev_supported_types", type_id, "create"),
                 uuid)
    if not host.exists(mdev_dir(host, uuid)):
        raise GpuvfioError(f"wrote {uuid} to {type_id}/create but /sys/bus/mdev/devices/{uuid} did not appear")
    journal.data["mdevs"][uuid]["state"] = "created"
    journal.save()
    return InstanceResult("mdev", uuid, Outcome.CREATED, type_id, str(address))


def _create_sriov(host, inventory, creation: Creation, writer, journal) -> InstanceResult:
    vf, type_id, address = PciAddress.parse(creation.instance), creation.type_id, creation.parent
    if creation.exists:
        return InstanceResult("sriov", str(vf), Outcome.EXISTS, type_id, str(address))
    journal.data.setdefault("vgpus", {})[str(vf)] = {"parent": str(address), "type": type_id,
                                                     "previous": inventory.functions[vf].vgpu_current or 0}
    journal.save()
    path = host.sys_path("bus", "pci", "devices", str(vf), "nvidia", "current_vgpu_type")
    writer.write(path, str(type_id))
    if (host.read(path) or "").strip() != str(type_id):
        raise GpuvfioError(f"{vf}: current_vgpu_type reads back {host.read(path)!r}, not {type_id}")
    return InstanceResult("sriov", str(vf), Outcome.CREATED, type_id, str(address))


def remove_instance(host: HostRoot, journal: Journal, instance: str, writer: SysfsWriter) -> InstanceResult:
    mdevs, vgpus = journal.data.setdefault("mdevs", {}), journal.data.setdefault("vgpus", {})
    address = PciAddress.try_parse(instance)
    if address is not None:
        key = str(address)
        if key not in vgpus:
            raise InputError(f"{key} has no vGPU type set by gpuvfio (see gpuvfio status)")
        path = host.sys_path("bus", "pci", "devices", key, "nvidia", "current_vgpu_type")
        writer.write(path, str(vgpus[key].get("previous", 0)))
        del vgpus[key]
        journal.save()
        return InstanceResult("sriov", key, Outcome.REMOVED)
    try:
        uuid = str(uuidlib.UUID(instance))
    except ValueError:
        raise InputError(f"not an mdev UUID or a VF address: {instance!r}") from None
    if uuid not in mdevs:
        raise InputError(f"mdev {uuid} was not created by gpuvfio (see gpuvfio status)")
    if host.exists(mdev_dir(host, uuid)):
        writer.write(os.path.join(host.resolve_in_sys(mdev_dir(host, uuid)), "remove"), "1")
    host.tree.remove(mdevctl_rel(mdevs[uuid].get("parent", "-"), uuid))
    del mdevs[uuid]
    journal.save()
    return InstanceResult("mdev", uuid, Outcome.REMOVED)


@dataclass(frozen=True)
class VgpuInstance:
    """A vGPU instance on the host, as ``mdevctl list`` shows an mdev (SR-IOV vGPUs too): its type,
    parent GPU, whether gpuvfio created it and whether it is persisted."""

    kind: str  # "mdev" | "sriov"
    instance: str  # the mdev UUID, or the VF address
    parent: str
    type_id: str | int
    by_gpuvfio: bool
    persisted: bool | None  # in mdevctl's store (None: an SR-IOV type, runtime state only)
    type_name: str | None = None  # an SR-IOV type's name
    domains: list[str] | None = None  # the libvirt domains using it (None: libvirt not asked)

    def to_json(self) -> dict:
        out: dict = {"kind": self.kind, "instance": self.instance, "parent": self.parent, "type": self.type_id}
        if self.kind == "sriov":
            out["type_name"] = self.type_name
        out.update(by_gpuvfio=self.by_gpuvfio, persisted=self.persisted,
                   domains=list(self.domains) if self.domains is not None else None)
        return out


def existing_instances(host: HostRoot, inventory: Inventory, journal: Journal) -> list[VgpuInstance]:
    """Every vGPU instance on the host, as ``mdevctl list`` shows mdevs, plus SR-IOV vGPUs: each
    with its type, parent GPU, whether gpuvfio created it (journal) and whether it is persisted
    (mdevctl's store). Reads the host, changes nothing."""
    found = []
    for uuid in sorted(host.listdir(host.sys_path("bus", "mdev", "devices"))):
        try:
            uuidlib.UUID(uuid)
        except ValueError:
            continue  # not an mdev name; nothing gpuvfio would have made
        existing = existing_mdev(host, uuid)
        if existing is None:
            continue
        parent, type_id = existing
        found.append(VgpuInstance("mdev", uuid, str(parent), type_id, uuid in journal.data["mdevs"],
                                  host.exists(mdevctl_path(host, str(parent), uuid))))
    for address, fn in sorted(inventory.functions.items()):
        if fn.physfn is not None and fn.vgpu_current:
            # A VF whose type is set may list no creatable types any more: its siblings name it.
            names = {t.type_id: t.name for v in inventory.functions.values() if v.physfn == fn.physfn
                     for t in v.vgpu_creatable or []}
            found.append(VgpuInstance("sriov", str(address), str(fn.physfn), fn.vgpu_current,
                                      str(address) in journal.data["vgpus"], None,
                                      type_name=names.get(fn.vgpu_current)))
    return found
