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


def _elements(xml: str) -> list[tuple[str, dict, str]]:
    """(tag path, attributes, text) of every element; metadata ignored."""
    out: list[tuple[str, dict, str]] = []

    def walk(element, path):
        if element.tag == "metadata":
            return
        here = f"{path}/{element.tag}"
        out.append((here, dict(element.attrib), (element.text or "").strip()))
        for child in element:
            walk(child, here)

    walk(ET.fromstring(xml), "")
    return out


def _value_matches(key: str, ours: str, theirs: str | None) -> bool:
    if theirs == ours:
        return True
    # libvirt stores the versioned machine type for an alias: q35 -> pc-q35-7.2
    return key == "machine" and theirs is not None and theirs.startswith(f"pc-{ours}-")


def difference(wanted: str, current: str) -> list[str]:
    """What ``wanted`` sets that ``current`` lacks: every element of ours needs one at the
    same tag path in ``current`` carrying at least our attributes and our text (libvirt
    adds defaults, addresses and model attributes of its own)."""
    index: dict[str, list[tuple[dict, str]]] = {}
    for path, attrs, text in _elements(current):
        index.setdefault(path, []).append((attrs, text))
    missing = []
    for path, attrs, text in _elements(wanted):
        candidates = index.get(path, [])
        if not any((not text or text == their_text)
                   and all(_value_matches(k, v, their_attrs.get(k)) for k, v in attrs.items())
                   for their_attrs, their_text in candidates):
            shown = ",".join(f"{k}={v}" for k, v in sorted(attrs.items()))
            missing.append(f"+ {path}[{shown}]" + (f"={text}" if text else ""))
    return missing


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
