"""Idempotent define: a domain that exists is compared, not overwritten, unless asked.

libvirt stores an expanded form of what it is given (UUID, PCI addresses, controllers,
defaults), so comparing whole documents never matches. Two things decide "unchanged":

* the digest of the document gpuvfio rendered, kept in gpuvfio's ``<metadata>`` element:
  a domain defined from other inputs (another GPU, other pages, a newer version) carries
  another digest;
* a structural comparison of both definitions read into gpuvfio.domain.model: every value
  gpuvfio sets must be in the stored definition (libvirt adds its own), lists matched one to
  one (two hostdevs with swapped guest addresses differ), and the parts the model declares
  ``owned`` -- host devices, disks, interfaces, pinning, NUMA tuning and cells, memory
  backing, boot and firmware, extra QEMU arguments -- must not hold extras in the stored
  definition (a GPU added with ``virsh edit`` shows as a removal).

With ``update`` a differing domain is redefined under its existing UUID (community.libvirt's
define / check-mode pattern); the result says what an undo must do: undefine a domain this
call created, or put back the definition it replaced.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from gpuvfio.domain import elements, model
from gpuvfio.virt.connection import LibvirtError, libvirt_module
from gpuvfio.virt.lifecycle import lookup


@dataclass
class DefineResult:
    name: str
    result: str  # defined | updated
    changes: list[str] = field(default_factory=list)
    previous_xml: str | None = None  # the definition an update replaced (for an undo)

    @property
    def created(self) -> bool:
        return self.result == "defined"

    def to_json(self) -> dict:
        return {"name": self.name, "result": self.result, "changes": self.changes}


def digest_of(xml: str) -> str | None:
    record = model.read_domain(xml).record
    return record.digest if record is not None else None


def difference(wanted_xml: str, current_xml: str) -> list[str]:
    """What would change: ``+`` what gpuvfio sets that the definition lacks, ``-`` what the
    definition has in gpuvfio's own parts that gpuvfio would not set, ``~`` a different digest."""
    wanted, current = model.read_domain(wanted_xml), model.read_domain(current_xml)
    changes = []
    ours = wanted.record.digest if wanted.record else None
    theirs = current.record.digest if current.record else None
    if ours != theirs:
        changes.append(f"~ gpuvfio's definition: {theirs or 'none recorded'} -> {ours}")
    return changes + elements.difference(wanted, current)


@dataclass(frozen=True)
class Definition:
    """What libvirt holds under the name of ``xml``: nothing (``current_xml`` None), or its
    inactive definition, its UUID and the differences from ``xml``."""

    name: str
    current_xml: str | None = None
    uuid: str | None = None
    changes: tuple[str, ...] = ()


def current_definition(conn, xml: str) -> Definition:
    """Ask libvirt what it holds under the name of ``xml``; changes nothing."""
    libvirt = libvirt_module()
    name = model.read_domain(xml).name
    dom = lookup(conn, name)
    if dom is None:
        return Definition(name)
    try:  # with its secrets (a graphics password), so that a rollback redefines it whole
        current = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE | libvirt.VIR_DOMAIN_XML_SECURE)
    except libvirt.libvirtError as exc:
        if exc.get_error_code() != libvirt.VIR_ERR_OPERATION_DENIED:
            raise LibvirtError(f"reading {name}'s definition: {exc.get_error_message()}") from None
        # A read-only connection (a dry run's) may not read secrets; gpuvfio owns none of them,
        # so the difference is the same, and a dry run redefines nothing.
        current = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
    return Definition(name, current, dom.UUIDString(), tuple(difference(xml, current)))


def define(conn, xml: str, held: Definition) -> DefineResult:
    """Define ``xml`` on ``conn`` against ``held`` (what current_definition read under the run
    lock): created new, or redefined under the existing UUID (libvirt refuses a name under
    another UUID)."""
    libvirt = libvirt_module()
    if held.current_xml is None:
        try:
            conn.defineXML(xml)
        except libvirt.libvirtError as exc:
            raise LibvirtError(f"libvirt refused to define {held.name}: {exc.get_error_message()}") from None
        return DefineResult(held.name, "defined")
    try:
        conn.defineXML(with_uuid(xml, held.uuid))
    except libvirt.libvirtError as exc:
        raise LibvirtError(f"libvirt refused to redefine {held.name}: {exc.get_error_message()}") from None
    return DefineResult(held.name, "updated", list(held.changes), previous_xml=held.current_xml)


def with_uuid(xml: str, uuid: str) -> str:
    """``xml`` with ``<uuid>`` set: libvirt refuses to redefine a name under another UUID."""
    return model.write_domain(dataclasses.replace(model.read_domain(xml), uuid=uuid))
