"""Idempotent define: a domain that exists is compared, not overwritten, unless asked.

libvirt stores an expanded form of what it is given (UUID, PCI addresses, controllers,
defaults), so comparing whole documents never matches. Two things decide "unchanged":

* the digest of the document gpuvfio rendered, kept in gpuvfio's ``<metadata>`` element:
  a domain defined from other inputs (another GPU, other pages, a newer template) carries
  another digest;
* a structural comparison: every element gpuvfio sets must be in the stored definition with
  at least its attributes and text (libvirt adds its own), matched one to one (two hostdevs
  with swapped guest addresses differ), and the elements gpuvfio owns whole -- host devices,
  disks, interfaces, pinning, NUMA tuning and cells, memory backing, boot and firmware,
  extra QEMU arguments -- must not have extras in the stored definition (a GPU added with
  ``virsh edit`` shows as a removal).

With ``update`` a differing domain is redefined under its existing UUID (community.libvirt's
define / check-mode pattern); the result says what an undo must do: undefine a domain this
call created, or put back the definition it replaced.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from gpuvfio.domain.render import METADATA_NS
from gpuvfio.virt.connection import LibvirtError, libvirt_module
from gpuvfio.virt.lifecycle import lookup

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
# Containers whose listed children gpuvfio decides whole ("*": every child).
OWNED = {
    "": {"memoryBacking", "cputune", "numatune"},
    "devices": {"hostdev", "disk", "interface"},
    "cputune": {"*"},
    "numatune": {"*"},
    "memoryBacking": {"*"},
    "os": {"kernel", "initrd", "cmdline", "loader", "nvram", "firmware"},
    "cpu": {"numa", "topology", "maxphysaddr"},
    "features": {"hyperv", "kvm"},
    f"{{{QEMU_NS}}}commandline": {"*"},
}


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
    root = ET.fromstring(xml)
    element = root.find(f"metadata/{{{METADATA_NS}}}domain")
    return element.get("digest") if element is not None else None


def _short(tag: str) -> str:
    return tag.replace(f"{{{QEMU_NS}}}", "qemu:")


def _describe(element: ET.Element, path: str) -> str:
    attrs = ",".join(f"{k}={v}" for k, v in sorted(element.attrib.items()))
    inner = [c for c in element.iter() if c is not element]
    detail = ""
    source = element.find("source/address")
    if source is not None:
        detail = " source " + ",".join(f"{k}={v}" for k, v in sorted(source.attrib.items()))
    elif element.text and element.text.strip():
        detail = f"={element.text.strip()}"
    elif inner and not attrs:
        detail = " " + ",".join(f"{_short(c.tag)}[{','.join(f'{k}={v}' for k, v in sorted(c.attrib.items()))}]"
                                for c in inner[:3])
    return f"{path}/{_short(element.tag)}" + (f"[{attrs}]" if attrs else "") + detail


def _value_matches(key: str, ours: str, theirs: str | None) -> bool:
    if theirs == ours:
        return True
    # libvirt stores the versioned machine type for an alias: q35 -> pc-q35-7.2
    return key == "machine" and theirs is not None and theirs.startswith(f"pc-{ours}-")


def _matches(wanted: ET.Element, current: ET.Element) -> bool:
    """``current`` has ``wanted``'s tag, attributes and text, and each of its children (one to one)."""
    if wanted.tag != current.tag:
        return False
    if any(not _value_matches(k, v, current.get(k)) for k, v in wanted.attrib.items()):
        return False
    if (wanted.text or "").strip() and (wanted.text or "").strip() != (current.text or "").strip():
        return False
    return _pair(list(wanted), list(current))[0] == []


def _pair(wanted: list[ET.Element], current: list[ET.Element]) -> tuple[list[ET.Element], list[ET.Element]]:
    """Match each wanted element to a distinct current one; (unmatched wanted, unmatched current)."""
    left = list(current)
    missing = []
    for element in wanted:
        found = next((c for c in left if _matches(element, c)), None)
        if found is None:
            missing.append(element)
        else:
            left.remove(found)
    return missing, left


def difference(wanted_xml: str, current_xml: str) -> list[str]:
    """What would change: ``+`` what gpuvfio sets that the definition lacks, ``-`` what the
    definition has in gpuvfio's own parts that gpuvfio would not set, ``~`` a different digest."""
    wanted, current = ET.fromstring(wanted_xml), ET.fromstring(current_xml)
    changes = []
    ours, theirs = digest_of(wanted_xml), digest_of(current_xml)
    if ours != theirs:
        changes.append(f"~ gpuvfio's definition: {theirs or 'none recorded'} -> {ours}")
    changes += _compare(wanted, current, "", "")
    return changes


def _compare(wanted: ET.Element, current: ET.Element, key: str, path: str) -> list[str]:
    changes = []
    owned = OWNED.get(key, set())
    if key == "os" and wanted.get("firmware"):
        # Firmware auto-selection: libvirt fills in the loader and nvram it chose; they are its own.
        owned = owned - {"loader", "nvram"}
    wanted_children = [c for c in wanted if c.tag != "metadata"]
    current_children = [c for c in current if c.tag != "metadata"]
    for element in wanted_children:
        # Containers are compared child by child (readable lines, owned children); others whole.
        twin = next((c for c in current_children if c.tag == element.tag), None)
        if element.tag in OWNED and twin is not None and len(
                [c for c in wanted_children if c.tag == element.tag]) == 1:
            changes += _compare(element, twin, element.tag, f"{path}/{_short(element.tag)}")
            current_children.remove(twin)
            continue
        found = next((c for c in current_children if _matches(element, c)), None)
        if found is None:
            changes.append("+ " + _describe(element, path))
        else:
            current_children.remove(found)
    for element in current_children:
        if "*" in owned or element.tag in owned:
            changes.append("- " + _describe(element, path))
    return changes


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
    name = ET.fromstring(xml).findtext("name")
    dom = lookup(conn, name)
    if dom is None:
        return Definition(name)
    current = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE | libvirt.VIR_DOMAIN_XML_SECURE)
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
    root = ET.fromstring(xml)
    element = root.find("uuid")
    if element is None:
        element = ET.Element("uuid")
        root.insert(1, element)
    element.text = uuid
    for prefix, uri in (("gpuvfio", METADATA_NS), ("qemu", QEMU_NS)):
        ET.register_namespace(prefix, uri)
    return ET.tostring(root, encoding="unicode")
