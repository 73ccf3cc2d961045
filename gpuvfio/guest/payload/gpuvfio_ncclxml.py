"""NCCL's reader of topology XML, rule for rule: what NCCL builds from NCCL_TOPO_FILE.

NCCL does not read XML with an XML parser but with a tokenizer of its own, and it reads its own
dump (NCCL_TOPO_DUMP_FILE) back the same way. The rules below follow NCCL v2.30.7-1 (commit
73cf1122) src/graph/xml.cc ``xmlGetChar``, ``xmlGetValue``, ``xmlGetToken``, ``xmlSkipComment``,
``xmlGetNode``, ``xmlLoadSub``, the ``ncclTopoXmlLoad*`` handlers and ``ncclTopoGetXmlFromFile``,
with the limits of src/graph/xml.h (MAX_STR_LEN 255, MAX_ATTR_COUNT 16, MAX_SUBS 640) and
src/graph/topo.h (NCCL_TOPO_XML_MAX_NODES 256). What follows from them:

- a space ends a name and starts another attribute, so ``<pci a="1" />`` holds a second
  attribute with an empty key and an empty value, and two spaces between attributes do too;
- only ' ', '\\n' and '\\r' are skipped between elements; inside a tag only one ' ' separates
  attributes: a tab anywhere, a newline inside a tag or an ``<?xml ...?>`` declaration is an error;
- a value is quoted (" or '), read raw up to the same quote: no entities are decoded;
- a name of 254 bytes or more is an error (a key of 255, as its '=' is not stored), and so is a
  value of 254; attributes past the 16th are read and dropped;
- elements NCCL has no handler for are skipped with everything in them.

Standard library only (python3 >= 3.6): the in-guest verifier reads NCCL's dump with it, and the
host's tests hold gpuvfio's topology file to it.
"""

import re

MAX_STR_LEN = 255  # xml.h: names, keys and values live in char[MAX_STR_LEN + 1]
MAX_ATTR_COUNT = 16  # xml.h
MAX_SUBS = 640  # xml.h since v2.29.7 (128 in v2.21.5 to v2.29.2, 32 in v2.20.3 and before)
TOPO_XML_MAX_NODES = 256  # topo.h NCCL_TOPO_XML_MAX_NODES: ncclTopoGetSystem's xmlAlloc
TOPO_XML_VERSION = 1  # xml.h NCCL_TOPO_XML_VERSION
MAX_DEPTH = 200  # not NCCL's: a bound on hostile input (NCCL's own files nest 6 deep)

NODE_NONE, NODE_OPEN, NODE_CLOSE, NODE_SINGLE = 0, 1, 2, 3  # xml.h NODE_TYPE_*
TOKEN_ENDS = b" >/\n\r"  # xmlGetToken's loop condition
BLANKS = b" \n\r"  # xmlGetNode skips these (and nothing else) before '<'

# The handlers of the ncclTopoXmlLoad* functions: element -> the elements it keeps inside it.
TOPOLOGY = {
    "system": ("cpu",),  # ncclTopoXmlLoadSystem (after its version check)
    "cpu": ("pci", "nic"),  # ncclTopoXmlLoadCpu
    "pci": ("pci", "gpu", "nic", "pcilink"),  # ncclTopoXmlLoadPci
    "gpu": ("nvlink", "c2c"),  # ncclTopoXmlLoadGpu
    "nic": ("net",),  # ncclTopoXmlLoadNic
    "net": (), "nvlink": (), "c2c": (), "pcilink": (),  # xmlLoadSub(..., NULL, 0)
}


class XmlError(ValueError):
    """NCCL refuses the file: the message is the one its WARN prints."""


class Node(object):
    """An ncclXmlNode: its name, its attributes in order (NCCL keeps duplicates and empty keys),
    its type and the nodes a handler kept under it."""

    __slots__ = ("name", "attrs", "type", "subs", "parent")

    def __init__(self):  # xmlLoadSub memsets each node before xmlGetNode fills it
        self.name, self.attrs, self.type, self.subs, self.parent = "", [], NODE_NONE, [], None

    def get(self, key):
        """xml.h xmlGetAttr: the value of the first attribute named ``key``, else None."""
        for name, value in self.attrs:
            if name == key:
                return value
        return None

    def tree(self):
        """(name, ((key, value), ...), (sub tree, ...)): the tree to compare."""
        return self.name, tuple(self.attrs), tuple(sub.tree() for sub in self.subs)


class _File(object):
    """The bytes NCCL freads one at a time."""

    def __init__(self, data):
        self.data, self.at = data, 0

    def read(self):
        """fread(&c, 1, 1, file): one byte, or None at the end."""
        if self.at >= len(self.data):
            return None
        self.at += 1
        return self.data[self.at - 1:self.at]


def _c_string(chars):
    """What C sees of a char array: up to its first NUL."""
    return bytes(chars).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def get_char(f):
    """xmlGetChar: a byte, or "Unexpected EOF"."""
    c = f.read()
    if c is None:
        raise XmlError("XML Parse : Unexpected EOF")
    return c


def get_value(f):
    """xmlGetValue, after a '=': a quoted value (INT_OK is never defined) and the byte after it."""
    c = get_char(f)
    if c not in (b'"', b"'"):
        raise XmlError("XML Parse : Expected (double) quote.")
    quote, value = c, bytearray()
    while True:
        c = get_char(f)
        if len(value) == MAX_STR_LEN - 1:  # the byte would land at value[MAX_STR_LEN - 1]
            raise XmlError("Error : value %s too long (max %d)" % (_c_string(value), MAX_STR_LEN))
        if c == quote:
            break
        value += c
    return _c_string(value), get_char(f)


def get_token(f, with_value):
    """xmlGetToken: (name, value, last). A '=' ends the name and reads a value (an error where
    none is wanted); otherwise the name ends at ' ', '>', '/', '\\n' or '\\r', which is ``last``
    and is not part of it. ``value`` is None when there was no '='."""
    name = bytearray()
    while True:
        c = get_char(f)
        if c == b"=":
            if not with_value:
                raise XmlError("XML Parse : Unexpected value with name %s" % _c_string(name))
            value, last = get_value(f)
            return _c_string(name), value, last
        if len(name) == MAX_STR_LEN - 1:
            raise XmlError("Error : name %s too long (max %d)" % (_c_string(name), MAX_STR_LEN))
        if c in TOKEN_ENDS:
            return _c_string(name), None, c
        name += c


def skip_comment(f, start, next_char):
    """xmlSkipComment: read on until the last three bytes are "-->", counting the rest of the
    comment's first token (``start``) and the byte that ended it."""
    end = b"..." + start.encode("utf-8", "surrogateescape") + next_char
    while end[-3:] != b"-->":
        c = f.read()
        if c is None:
            raise XmlError("XML Parse error : unterminated comment")
        end += c


def get_node(f, node):
    """xmlGetNode: the next tag into ``node`` (type NODE_NONE at the end of the file)."""
    node.type = NODE_NONE
    c = b" "
    while c in BLANKS:
        c = f.read()
        if c is None:
            return
    if c != b"<":
        raise XmlError("XML Parse error : expecting '<', got '%s'" % c.decode("latin-1"))
    node.name, _, c = get_token(f, False)
    if node.name.startswith("!--"):
        skip_comment(f, node.name[3:], c)
        return get_node(f, node)
    if node.name == "" and c == b"/":
        node.type = NODE_CLOSE
        node.name, _, c = get_token(f, False)  # re-read the name: the first call got the '/'
        if c != b">":
            raise XmlError("XML Parse error : unexpected trailing %s in closing tag %s" % (c.decode("latin-1"), node.name))
        return
    node.type = NODE_OPEN
    while c == b" ":
        key, value, c = get_token(f, True)
        if len(node.attrs) < MAX_ATTR_COUNT:  # the 17th and later are read into a spare slot
            node.attrs.append((key, "" if value is None else value))  # a key without '=': value ""
    if c == b"/":
        node.type = NODE_SINGLE
        _, _, c = get_token(f, False)
    if c != b">":
        raise XmlError("XML Parse : expected >, got '%s'" % c.decode("latin-1"))


class _Xml(object):
    """struct ncclXml: the nodes handlers kept (maxIndex of them), at most maxNodes."""

    def __init__(self, max_nodes):
        self.max_nodes, self.nodes = max_nodes, []

    def room(self):
        """xmlLoadSub's first check on each turn, before it reads a node (even a closing tag)."""
        if len(self.nodes) == self.max_nodes:
            raise XmlError("Error : XML parser is limited to %d nodes" % self.max_nodes)


def _strtol(text):
    """strtol(text, NULL, 0) as xmlGetAttrInt stores it in an int: blanks, a sign, then 0x hex,
    0 octal or decimal digits as far as they go; clamped to a long, then cut to 32 bits."""
    s = text.lstrip(" \t\n\v\f\r")
    negative = s[:1] == "-"
    s = s[1:] if s[:1] in ("+", "-") else s
    if s[:2] in ("0x", "0X") and s[2:3] and s[2:3] in "0123456789abcdefABCDEF":
        base, s = 16, s[2:]
    else:
        base = 8 if s[:1] == "0" else 10
    digits = re.match({16: "[0-9a-fA-F]*", 8: "[0-7]*", 10: "[0-9]*"}[base], s).group(0)
    value = int(digits, base) if digits else 0
    value = (-min(value, 2 ** 63) if negative else min(value, 2 ** 63 - 1)) & 0xFFFFFFFF
    return value - 2 ** 32 if value >= 2 ** 31 else value


def _load_system(node):
    """ncclTopoXmlLoadSystem, before its xmlLoadSub: xmlGetAttrInt(head, "version") must find
    the attribute and read it as NCCL_TOPO_XML_VERSION."""
    version = node.get("version")
    if version is None:
        raise XmlError("Attribute version of node %s not found" % node.name)
    if _strtol(version) != TOPO_XML_VERSION:
        raise XmlError("XML Topology has wrong version %d, %d needed" % (_strtol(version), TOPO_XML_VERSION))


def _deeper(depth):
    """NCCL recurses once per nested element, kept or skipped, with no limit of its own; this
    reader stops at MAX_DEPTH, far beyond any topology, before Python's own recursion limit."""
    if depth > MAX_DEPTH:
        raise XmlError("XML nested deeper than %d elements" % MAX_DEPTH)
    return depth + 1


def load_sub(f, xml, head, handlers, depth=0):
    """xmlLoadSub: read nodes under ``head`` (None: the top of the file) until its closing tag
    (the top: the end of the file). A node a handler names is kept under ``head`` and read by
    that handler; any other is skipped whole. At the top a closing tag ends nothing: it is a
    node like any other."""
    depth = _deeper(depth)
    if head is not None and head.type == NODE_SINGLE:
        return
    while True:
        xml.room()
        node = Node()
        get_node(f, node)
        if node.type == NODE_NONE:
            if head is not None:
                raise XmlError("XML Parse : unterminated %s" % head.name)
            return
        if head is not None and node.type == NODE_CLOSE:
            if node.name != head.name:
                raise XmlError("XML Mismatch : %s / %s" % (head.name, node.name))
            return
        if node.name not in handlers:
            _skip(f, xml, node, depth)
            continue
        if head is not None:
            if len(head.subs) == MAX_SUBS:
                raise XmlError("Error : XML parser is limited to %d subnodes" % MAX_SUBS)
            head.subs.append(node)
        node.parent = head
        xml.nodes.append(node)
        if node.name == "system":
            _load_system(node)
        load_sub(f, xml, node, TOPOLOGY[node.name], depth)


def _skip(f, xml, node, depth):
    """xmlLoadSub(file, xml, node, NULL, 0) for a node no handler takes. That node was not
    counted (maxIndex stays), so each node read below it lands in its own slot, memset first:
    the closing-tag check compares a node with itself, and any closing tag ends the skipped
    element, whatever its name."""
    if node.type == NODE_SINGLE:
        return
    while True:
        xml.room()
        node.__init__()
        get_node(f, node)
        if node.type == NODE_NONE:
            raise XmlError("XML Parse : unterminated %s" % node.name)
        if node.type == NODE_CLOSE:
            return
        _skip(f, xml, node, _deeper(depth))


def load_topology(data, max_nodes=TOPO_XML_MAX_NODES):
    """ncclTopoGetXmlFromFile on the bytes of a file (a str is read as its UTF-8): the
    top-level nodes NCCL keeps, each a <system>, or XmlError with NCCL's reason."""
    if not isinstance(data, bytes):
        data = data.encode("utf-8")
    xml = _Xml(max_nodes)
    load_sub(_File(data), xml, None, ("system",))
    return [node for node in xml.nodes if node.parent is None]
