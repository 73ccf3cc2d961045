"""Idempotent define: a domain that exists is compared, not overwritten, unless asked.

libvirt stores an expanded form of what it is given (UUID, PCI addresses, defaults), so
"same XML" means: every element and attribute gpuvfio sets is present with the same
value in the domain's inactive XML. The difference lists what would change; with
``update`` the domain is redefined under its existing UUID (community.libvirt's
define/check-mode pattern).
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET

from gpuvfio.errors import GpuvfioError


class LibvirtError(GpuvfioError):
    """A libvirt call failed; carries libvirt's own message."""


def default_uri() -> str:
    return os.environ.get("LIBVIRT_DEFAULT_URI") or "qemu:///system"


def _facts(xml: str) -> set[str]:
    """Each element as 'path[attrs]=text'; namespaces kept, metadata ignored."""
    facts: set[str] = set()

    def walk(element, path):
        if element.tag == "metadata":
            return
        attrs = ",".join(f"{k}={v}" for k, v in sorted(element.attrib.items()))
        text = (element.text or "").strip()
        here = f"{path}/{element.tag}[{attrs}]"
        facts.add(f"{here}={text}" if text else here)
        for child in element:
            walk(child, here)

    walk(ET.fromstring(xml), "")
    return facts


def difference(wanted: str, current: str) -> list[str]:
    """What ``wanted`` sets that ``current`` lacks (as '+ fact' lines)."""
    ours, theirs = _facts(wanted), _facts(current)
    return [f"+ {fact}" for fact in sorted(ours - theirs)]


def _connect(uri: str):
    import libvirt

    libvirt.registerErrorHandler(lambda *args: None, None)
    try:
        return libvirt, libvirt.open(uri)
    except libvirt.libvirtError as exc:
        raise LibvirtError(f"cannot connect to libvirt at {uri}: {exc.get_error_message()}") from None


def define(xml: str, uri: str, *, update: bool = False, dry_run: bool = False) -> dict:
    name = ET.fromstring(xml).findtext("name")
    libvirt, conn = _connect(uri)
    try:
        try:
            dom = conn.lookupByName(name)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                raise LibvirtError(f"looking up {name}: {exc.get_error_message()}") from None
            dom = None
        if dom is None:
            if dry_run:
                return {"name": name, "result": "would_define", "changes": []}
            try:
                conn.defineXML(xml)
            except libvirt.libvirtError as exc:
                raise LibvirtError(f"libvirt refused to define {name}: {exc.get_error_message()}") from None
            return {"name": name, "result": "defined", "changes": []}
        current = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
        changes = difference(xml, current)
        if not changes:
            return {"name": name, "result": "unchanged", "changes": []}
        if not update or dry_run:
            return {"name": name, "result": "differs", "changes": changes}
        root = ET.fromstring(xml)
        if root.find("uuid") is None:
            uuid = ET.Element("uuid")
            uuid.text = dom.UUIDString()
            root.insert(1, uuid)
        try:
            conn.defineXML(ET.tostring(root, encoding="unicode"))
        except libvirt.libvirtError as exc:
            raise LibvirtError(f"libvirt refused to redefine {name}: {exc.get_error_message()}") from None
        return {"name": name, "result": "updated", "changes": changes}
    finally:
        conn.close()
