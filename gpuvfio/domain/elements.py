"""Declared XML elements: one declaration of an element formats it, parses it and compares it.

virtinst's XMLProperty and Nova's libvirt config objects, in the small. An element is a frozen
dataclass that names its tag (``TAG``) and declares each attribute, text, child and list of
children with a field (attr, text, leaf, flag, child, children, others). From that one
declaration:

* format_document() writes the document gpuvfio defines, in its house style: two-space
  indents, single-quoted attributes, ``<tag/>`` for an empty element, markupsafe's escapes
  (the escapes jinja2's autoescape wrote, so digests of unchanged documents stay the same);
* parse_document() reads a definition libvirt hands back into the same classes: what is not
  declared is not read, except in a class with an ``others`` field, which keeps every child
  it does not declare (a part gpuvfio decides whole, where anything else is a difference);
* difference() compares what gpuvfio wants with what libvirt holds: every value gpuvfio sets
  must be there (libvirt adds its own), lists are matched one to one, and a part declared
  ``owned`` must hold nothing gpuvfio would not set (one declared ``owned_unless`` an attribute
  is libvirt's to fill in while gpuvfio sets that attribute).

Namespaced tags are written with their prefix (``qemu:arg``); NAMESPACES maps the prefixes.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

from gpuvfio.errors import GpuvfioError
from gpuvfio.numbers import hex_uint, uint

__all__ = ["Element", "Foreign", "Codec", "TEXT", "INT", "hex_codec", "YES_NO", "attr", "text", "leaf", "flag",
           "child", "children", "others", "format_document", "parse_document", "difference", "owned_fields",
           "UnreadableXml", "NAMESPACES", "DOCUMENT_LIMIT"]

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
METADATA_NS = "https://gpuvfio.invalid/xmlns/domain/1"
NAMESPACES = {"qemu": QEMU_NS, "gpuvfio": METADATA_NS}
_PREFIXES = {uri: prefix for prefix, uri in NAMESPACES.items()}
# A definition libvirt hands back is a few KiB; even a guest with hundreds of devices stays far
# below this. Anything larger is not a domain this host defined.
DOCUMENT_LIMIT = 4 << 20
# Children of one element: libvirt's own vCPU limit (VIR_DOMAIN_CPUMASK_LEN's cpusets, QEMU's
# 4096 vCPUs on x86) bounds the longest list gpuvfio reads, one <vcpupin> per vCPU. More is not
# a definition libvirt wrote; the bound also holds a difference's one-to-one matching (pair),
# about linear where elements differ in the values they set, quadratic where many are alike.
CHILDREN_LIMIT = 4096
_KEY = "gpuvfio.xml"


class UnreadableXml(GpuvfioError):
    """A document that is not XML, too large, or not the element asked for."""


def _equal(ours, theirs) -> bool:
    return ours == theirs


@dataclass(frozen=True)
class Codec:
    """How a value is written (``write``) and read back (``read``: None for text it cannot be);
    ``same``: whether what libvirt holds is the value gpuvfio set (equality unless told)."""

    write: Callable[[Any], str]
    read: Callable[[str], Any]
    same: Callable[[Any, Any], bool] = _equal


TEXT = Codec(str, lambda raw: raw)
INT = Codec(str, uint)
YES_NO = Codec(lambda value: "yes" if value else "no", {"yes": True, "no": False}.get)


def hex_codec(width: int, upper: int) -> Codec:
    """``0x`` and at least ``width`` hex digits, as libvirt writes PCI addresses; read back up to ``upper``."""
    return Codec(lambda value: f"0x{value:0{width}x}", lambda raw: hex_uint(raw, upper))


@dataclass(frozen=True)
class Declared:
    kind: str  # attr | text | leaf | flag | child | children | others
    name: str | None = None  # the attribute's name or the leaf's / flag's tag
    codec: Codec = TEXT
    owned: bool = False  # gpuvfio decides this part whole: what else libvirt holds there differs
    owned_unless: str | None = None  # owned, except while this attribute field of the element holds a value
    compared: bool = True
    cls: type | None = None  # the Element class of a child or children field


def _declare(kind: str, default=None, factory=None, **how) -> Any:
    metadata = {_KEY: Declared(kind, **how)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def attr(name: str | None = None, codec: Codec = TEXT) -> Any:
    """An attribute (``name``: the field's own name by default)."""
    return _declare("attr", name=name, codec=codec)


def text(codec: Codec = TEXT) -> Any:
    """The element's text."""
    return _declare("text", codec=codec)


def leaf(tag: str, codec: Codec = TEXT, *, owned: bool = False) -> Any:
    """A child element that holds only text: ``<tag>value</tag>``."""
    return _declare("leaf", name=tag, codec=codec, owned=owned)


def flag(tag: str) -> Any:
    """An empty child element that is there or not: ``<tag/>``."""
    return _declare("flag", default=False, name=tag)


def child(cls: type, *, owned: bool = False, owned_unless: str | None = None, compared: bool = True) -> Any:
    """At most one child element of class ``cls`` (``compared``: False for parts a difference
    leaves alone, such as <metadata>; ``owned_unless``: owned, except while the element's
    attribute field of that name holds a value)."""
    return _declare("child", cls=cls, owned=owned or owned_unless is not None, owned_unless=owned_unless,
                    compared=compared)


def children(cls: type, *, owned: bool = False) -> Any:
    """Every child element of class ``cls``, in order."""
    return _declare("children", factory=tuple, cls=cls, owned=owned)


def others() -> Any:
    """Every child no other field declares: the element is gpuvfio's whole, so each is a difference."""
    return _declare("others", factory=tuple, owned=True)


class Element:
    """An XML element declared as a frozen dataclass of attr/text/leaf/flag/child/children fields."""

    TAG: ClassVar[str]
    # Compared part by part (a container: each declared part on its own line of a difference),
    # rather than whole (the element matches, or it is missing).
    PARTS: ClassVar[bool] = False
    # Prefixes declared on this element when used anywhere beneath it (libvirt's qemu namespace
    # on <domain>).
    DECLARES: ClassVar[tuple[str, ...]] = ()
    # Written as an open and a close tag on two lines even when empty (gpuvfio's metadata record
    # always was: the digests of the documents it defined before stay the same).
    OPEN_WHEN_EMPTY: ClassVar[bool] = False


@dataclass(frozen=True)
class Foreign:
    """A child gpuvfio does not declare, kept where the parent is gpuvfio's whole."""

    tag: str
    attrib: tuple[tuple[str, str], ...] = ()
    text: str | None = None
    children: tuple["Foreign", ...] = ()
    open_when_empty: bool = False


def _parts(cls) -> list[tuple[dataclasses.Field, Declared]]:
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


@functools.cache
def owned_fields(cls: type) -> Mapping[str, str | None]:
    """The fields of ``cls`` declared owned (parts gpuvfio decides whole, where what else libvirt
    holds is a difference), each with the attribute field that yields it to libvirt while that
    holds a value (``owned_unless``), or None where it is always owned."""
    return types.MappingProxyType({f.name: d.owned_unless for f, d in _parts(cls) if d.owned})


@functools.cache
def _known_tags(cls) -> frozenset[str]:
    """The tags of the children ``cls`` declares: its declaration alone decides them."""
    return frozenset(d.name if d.kind in ("leaf", "flag") else d.cls.TAG
                     for _, d in _parts(cls) if d.kind in ("leaf", "flag", "child", "children"))


# ---------------------------------------------------------------------------------------------
# A plain view: tag, attributes in declared order, text, children. Formatting and the lines of
# a difference are written from it; a Foreign child is already one.

def view(element: "Element | Foreign") -> Foreign:
    """``element`` as a plain tree (attribute values written by their codecs)."""
    if isinstance(element, Foreign):
        return element
    attrib, body, inner = [], None, []
    for f, d in _parts(type(element)):
        value = getattr(element, f.name)
        if not _set(d, value):
            continue
        if d.kind == "attr":
            attrib.append((d.name or f.name, d.codec.write(value)))
        elif d.kind == "text":
            body = d.codec.write(value)
        elif d.kind == "leaf":
            inner.append(Foreign(d.name, text=d.codec.write(value)))
        elif d.kind == "flag":
            inner.append(Foreign(d.name))
        elif d.kind == "child":
            inner.append(view(value))
        else:  # children, others
            inner += [view(item) for item in value]
    return Foreign(element.TAG, tuple(attrib), body, tuple(inner), element.OPEN_WHEN_EMPTY)


def _escape(value: str) -> str:
    # markupsafe's escapes, as jinja2's autoescape wrote them (documents gpuvfio defined before
    # keep their digests), and the whitespace an XML reader would otherwise normalise (XML 1.0
    # sections 2.11 and 3.3.3: a CR becomes a newline, a tab or newline in an attribute a space),
    # so libvirt reads the very value gpuvfio wrote.
    return (value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace("'", "&#39;").replace('"', "&#34;").replace("\t", "&#9;").replace("\n", "&#10;")
            .replace("\r", "&#13;"))


def _prefix(tag: str) -> str | None:
    return tag.split(":", 1)[0] if ":" in tag and not tag.startswith("{") else None


def _uses(node: Foreign, prefix: str) -> bool:
    return _prefix(node.tag) == prefix or any(_uses(c, prefix) for c in node.children)


def format_document(root: Element) -> str:
    """The document of ``root``, with the namespaces it declares where they are used."""
    tree = view(root)
    used = tuple(p for p in root.DECLARES if _uses(tree, p))
    tree = dataclasses.replace(tree, attrib=tree.attrib + tuple((f"xmlns:{p}", NAMESPACES[p]) for p in used))
    lines: list[str] = []
    _write(tree, 0, frozenset(used), lines)
    return "\n".join(lines) + "\n"


def _write(node: Foreign, depth: int, scope: frozenset[str], lines: list[str]) -> None:
    attrib = node.attrib
    own = _prefix(node.tag)
    if own is not None and own not in scope and own in NAMESPACES:
        attrib = ((f"xmlns:{own}", NAMESPACES[own]),) + attrib
        scope = scope | {own}
    indent = "  " * depth
    opening = f"{indent}<{node.tag}" + "".join(f" {k}='{_escape(v)}'" for k, v in attrib)
    if node.children or (node.open_when_empty and node.text is None):
        lines.append(opening + ">")
        for item in node.children:
            _write(item, depth + 1, scope, lines)
        lines.append(f"{indent}</{node.tag}>")
    elif node.text is not None:
        lines.append(f"{opening}>{_escape(node.text)}</{node.tag}>")
    else:
        lines.append(opening + "/>")


# ---------------------------------------------------------------------------------------------
# Reading a definition back.

def parse_document(cls: type, xml: str):
    """``xml`` (a definition libvirt handed back, or one gpuvfio wrote) as ``cls``; UnreadableXml
    for anything that is not XML, is larger than DOCUMENT_LIMIT, or is another element."""
    if not isinstance(xml, str) or len(xml) > DOCUMENT_LIMIT:
        raise UnreadableXml(f"definition is not a document of at most {DOCUMENT_LIMIT} characters")
    if "<!DOCTYPE" in xml:
        # libvirt writes no document type; its internal entities could expand elements past the
        # size limit (expat bounds only amplification above 100 times).
        raise UnreadableXml("definition carries a document type (<!DOCTYPE>), which libvirt never writes")
    try:
        root = ET.fromstring(xml)
    except (ET.ParseError, UnicodeError) as exc:
        raise UnreadableXml(f"definition is not XML ({type(exc).__name__})") from None
    crowded = next((node for node in root.iter() if len(node) > CHILDREN_LIMIT), None)
    if crowded is not None:
        raise UnreadableXml(f"definition has more than {CHILDREN_LIMIT} children in one <{_tag(crowded)[:40]}>")
    if _tag(root) != cls.TAG:
        raise UnreadableXml(f"definition is <{_tag(root)[:40]}>, not <{cls.TAG}>")
    return _parse(cls, root)


def _tag(node: ET.Element) -> str:
    tag = node.tag if isinstance(node.tag, str) else ""
    if tag.startswith("{"):
        uri, _, local = tag[1:].partition("}")
        return f"{_PREFIXES[uri]}:{local}" if uri in _PREFIXES else tag
    return tag


def _text(node: ET.Element | None) -> str | None:
    """The element's text as written (a number with spaces around it is not one libvirt wrote),
    or None where it holds only the indentation between children."""
    value = node.text if node is not None else None
    return value if value and value.strip() else None


def _parse(cls: type, node: ET.Element):
    kids = [(k, _tag(k)) for k in node]
    values: dict[str, Any] = {}
    for f, d in _parts(cls):
        if d.kind == "attr":
            raw = node.get(d.name or f.name)
            values[f.name] = None if raw is None else d.codec.read(raw)
        elif d.kind == "text":
            raw = _text(node)
            values[f.name] = None if raw is None else d.codec.read(raw)
        elif d.kind == "leaf":
            raw = next((_text(k) for k, tag in kids if tag == d.name), None)
            values[f.name] = None if raw is None else d.codec.read(raw)
        elif d.kind == "flag":
            values[f.name] = any(tag == d.name for _, tag in kids)
        elif d.kind == "child":
            values[f.name] = next((_parse(d.cls, k) for k, tag in kids if tag == d.cls.TAG), None)
        elif d.kind == "children":
            values[f.name] = tuple(_parse(d.cls, k) for k, tag in kids if tag == d.cls.TAG)
        else:
            known = _known_tags(cls)
            values[f.name] = tuple(_foreign(k, 0) for k, tag in kids if tag not in known)
    return cls(**values)


def _foreign(node: ET.Element, depth: int) -> Foreign:
    inner = tuple(_foreign(k, depth + 1) for k in node) if depth < 4 else ()
    return Foreign(_tag(node), tuple(node.attrib.items()), _text(node), inner)


# ---------------------------------------------------------------------------------------------
# What differs between what gpuvfio wants and what libvirt holds.

def _set(d: Declared, value) -> bool:
    """Whether a field holds something: a value, a flag that is there, a non-empty list."""
    if d.kind in ("flag", "children", "others"):
        return bool(value)
    return value is not None


def matches(ours, theirs) -> bool:
    """``theirs`` holds every value ``ours`` sets (libvirt may add its own), children one to one."""
    if isinstance(ours, Foreign) or theirs is None or type(ours) is not type(theirs):
        return ours == theirs
    for f, d in _parts(type(ours)):
        mine, held = getattr(ours, f.name), getattr(theirs, f.name)
        if not d.compared or not _set(d, mine):
            continue
        if d.kind in ("attr", "text", "leaf") and not d.codec.same(mine, held):
            return False
        if d.kind == "flag" and not held:
            return False
        if d.kind == "child" and not matches(mine, held):
            return False
        if d.kind in ("children", "others") and pair(mine, held)[0]:
            return False
    return True


def pair(ours, theirs) -> tuple[list, list]:
    """Match each of ``ours``, in order, to the first of ``theirs`` not yet taken that it matches:
    (ours unmatched, theirs unmatched), each in its own order.

    The greedy scan, without the scan where it can: while the lists agree place by place each
    takes the one in its own place (the first left); after that each looks only at those that
    hold the same values in the fields it sets (_Unpaired: about linear unless many are alike),
    and at every one left where a value cannot be a key."""
    ours, theirs = list(ours), list(theirs)
    agree, both = 0, min(len(ours), len(theirs))
    while agree < both and matches(ours[agree], theirs[agree]):
        agree += 1
    if agree in (len(ours), len(theirs)):  # one list is used up: the rest of the other is unmatched
        return ours[agree:], theirs[agree:]
    unpaired = _Unpaired(theirs, agree)
    missing = [item for item in ours[agree:] if not unpaired.take(item)]
    return missing, unpaired.left()


class _Unpaired:
    """``theirs`` from ``start`` on, not yet taken, indexed by the values an element of ours sets:
    one index for each shape (class and fields set) asked, built on first use."""

    def __init__(self, theirs: list, start: int):
        self.theirs, self.start = theirs, start
        self.taken = [False] * len(theirs)
        self.indexes: dict[tuple, dict | None] = {}

    def take(self, item) -> bool:
        """Take the first one left that ``item`` matches; False where none does."""
        position = next((n for n in self._candidates(item)
                         if not self.taken[n] and matches(item, self.theirs[n])), None)
        if position is not None:
            self.taken[position] = True
        return position is not None

    def _candidates(self, item):
        """In order, the positions of every one left that ``item`` could match (and some taken)."""
        shape = _shape(item)
        if shape not in self.indexes:
            self.indexes[shape] = self._index(shape)
        index = self.indexes[shape]
        try:
            found = index.get(_key(item, shape), ()) if index is not None else None
        except TypeError:  # a value that cannot be a key
            found = None
        if found is None:
            return range(self.start, len(self.theirs))
        while found and self.taken[found[0]]:
            found.popleft()
        return found

    def _index(self, shape: tuple) -> dict | None:
        """Positions of those of ``shape``'s class, in order, by their values in its fields."""
        index: dict[Any, collections.deque] = {}
        try:
            for n in range(self.start, len(self.theirs)):
                if type(self.theirs[n]) is shape[0]:
                    index.setdefault(_key(self.theirs[n], shape), collections.deque()).append(n)
        except TypeError:
            return None
        return index

    def left(self) -> list:
        return [t for t, taken in zip(self.theirs[self.start:], self.taken[self.start:]) if not taken]


_NO_MATCH = object()  # in a key of theirs where a child one of ours sets is missing or another class


def _shape(element) -> tuple:
    """The class of ``element`` and, for each field it sets that a match holds equal, its name and
    how: None (a value), True (a flag that is there) or the shape of a child element. A Foreign
    element has no fields: it matches only an equal one."""
    if isinstance(element, Foreign):
        return (Foreign, None)
    fields = []
    for name, kind in _keyed_fields(type(element)):
        value = getattr(element, name)
        if kind == "child" and value is not None:
            fields.append((name, _shape(value)))
        elif kind == "flag" and value:
            fields.append((name, True))
        elif kind == "value" and value is not None:
            fields.append((name, None))
    return (type(element), tuple(fields))


def _key(element, shape: tuple):
    """What ``element`` and one of ours of ``shape`` hold equal wherever they match."""
    if shape[1] is None:
        return element
    key = []
    for name, how in shape[1]:
        value = getattr(element, name)
        if how is None:
            key.append(value)
        elif how is True:
            key.append(bool(value))
        else:
            key.append(_key(value, how) if type(value) is how[0] else _NO_MATCH)
    return tuple(key)


@functools.cache
def _keyed_fields(cls) -> tuple[tuple[str, str], ...]:
    """(name, value | flag | child) of each compared field a match holds equal: attributes, texts
    and leaves whose codec compares by equality, flags (there in both) and child elements."""
    kinds = {"attr": "value", "text": "value", "leaf": "value", "flag": "flag", "child": "child"}
    return tuple((f.name, kinds[d.kind]) for f, d in _parts(cls) if d.compared and d.kind in kinds
                 and (kinds[d.kind] != "value" or d.codec.same is _equal))


def describe(element, path: str) -> str:
    """One line naming ``element`` at ``path``: its attributes and its source address, its text, or
    (without attributes) its first few parts."""
    node = view(element)
    attrs = ",".join(f"{k}={v}" for k, v in sorted(node.attrib))
    inner = list(_descendants(node))
    source = next((a for s in node.children if s.tag == "source" for a in s.children if a.tag == "address"), None)
    detail = ""
    if source is not None:
        detail = " source " + ",".join(f"{k}={v}" for k, v in sorted(source.attrib))
    elif node.text:
        detail = f"={node.text}"
    elif inner and not attrs:
        detail = " " + ",".join(f"{c.tag}[{','.join(f'{k}={v}' for k, v in sorted(c.attrib))}]" for c in inner[:3])
    return f"{path}/{node.tag}" + (f"[{attrs}]" if attrs else "") + detail


def _descendants(node: Foreign):
    for item in node.children:
        yield item
        yield from _descendants(item)


def difference(wanted: Element, current: Element, path: str = "") -> list[str]:
    """``+`` what ``wanted`` sets that ``current`` lacks, ``-`` what ``current`` holds in an owned
    part that ``wanted`` would not set. A PARTS child is compared part by part beneath its path;
    anything else whole."""
    changes: list[str] = []
    for f, d in _parts(type(wanted)):
        ours, theirs = getattr(wanted, f.name), getattr(current, f.name)
        if not d.compared:
            continue
        if d.kind in ("attr", "text"):
            if _set(d, ours) and not d.codec.same(ours, theirs):
                changes.append(f"+ {path or '/' + wanted.TAG}[{d.name or f.name}={d.codec.write(ours)}]")
            continue
        owned = _owned_in(wanted, f.name)
        if d.kind in ("children", "others"):
            missing, extra = pair(ours, theirs)
            changes += ["+ " + describe(_as_node(d, m), path) for m in missing]
            changes += ["- " + describe(_as_node(d, e), path) for e in extra if owned]
        elif _set(d, ours) and d.kind == "child" and d.cls.PARTS and theirs is not None:
            changes += difference(ours, theirs, f"{path}/{d.cls.TAG}")
        elif _set(d, ours) and not _single_matches(d, ours, theirs):
            changes.append("+ " + describe(_as_node(d, ours), path))
            if owned and _set(d, theirs):
                changes.append("- " + describe(_as_node(d, theirs), path))
        elif not _set(d, ours) and owned and _set(d, theirs):
            changes.append("- " + describe(_as_node(d, theirs), path))
    return changes


def _owned_in(element: Element, name: str) -> bool:
    """Whether ``element``'s field ``name`` is gpuvfio's whole here: declared owned, and not
    yielded to libvirt by its ``owned_unless`` attribute holding a value (an empty one is none)."""
    owned = owned_fields(type(element))
    return name in owned and not (owned[name] is not None and getattr(element, owned[name]))


def _single_matches(d: Declared, ours, theirs) -> bool:
    if d.kind == "leaf":
        return d.codec.same(ours, theirs)
    if d.kind == "flag":
        return bool(theirs)
    return matches(ours, theirs)


def _as_node(d: Declared, value) -> "Element | Foreign":
    """A leaf or flag field's value as the element it is written as."""
    if d.kind == "leaf":
        return Foreign(d.name, text=d.codec.write(value))
    if d.kind == "flag":
        return Foreign(d.name)
    return value
