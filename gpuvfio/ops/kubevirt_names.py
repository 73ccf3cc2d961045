"""The resource names NVIDIA's kubevirt-gpu-device-plugin registers, computed as it computes them.

Reimplemented from NVIDIA/kubevirt-gpu-device-plugin v1.6.0 (commit d26f2374),
pkg/device_plugin/device_plugin.go:

* ``locateVendor`` scans a pci.ids file to the first line that starts with ``10de``;
* ``getDeviceName(id)`` then reads on: a line starting with ``#`` is skipped, the first line
  that does not start with a tab ends the search (the next vendor: no name), and the first line
  that starts with ``"\\t" + id`` gives the name: the rest of that line, ``strings.TrimSpace``,
  ``strings.ToUpper``, ``/`` and ``.`` turned into ``_``, each ``\\s+`` run into one ``_``, then
  every character outside ``[a-zA-Z0-9_.]`` deleted;
* ``createDevicePlugins`` uses the id itself when that name is empty, and registers
  ``nvidia.com/<name>`` (generic_device_plugin.go ``DeviceNamespace``);
* a vGPU type is keyed by ``readVgpuIDFromFileFunc``: ``mdev_type/name`` with its newlines
  trimmed and each ``\\s+`` run turned into ``_``; that key goes through ``getDeviceName`` too
  (it names no device line, so the key itself is the name).

The plugin reads only the pci.ids bundled in its image (``pciIdsFilePath = "/usr/pci.ids"``,
copied from the repository's utils/pci.ids), never the host's. gpuvfio ships the names it
derives from the v1.6.0 copy as a generated table (gpuvfio/host/nvidia_ids.txt, which also tells
gpuvfio what each NVIDIA device is, written by tests/make_plugin_names.py); another image's
/usr/pci.ids can be read instead.

Go's semantics kept: RE2's ``\\s`` is ``[\\t\\n\\f\\r ]`` (no ``\\v``); ``TrimSpace`` trims
``unicode.IsSpace``; ``ToUpper`` maps each rune to one rune (``ß`` stays, then is deleted);
``bufio.Scanner`` drops one ``\\r`` before a newline and stops at a line of 64 KiB or more.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Iterator

from gpuvfio.errors import InputError
from gpuvfio.files import HOST_TEXT_LIMIT
from gpuvfio.host import nvidia_ids
from gpuvfio.user_files import read_regular

NVIDIA_VENDOR = "10de"
NAMESPACE = "nvidia.com"  # generic_device_plugin.go DeviceNamespace
PLUGIN = "NVIDIA/kubevirt-gpu-device-plugin v1.6.0"
PLUGIN_COMMIT = "d26f2374d3c3f4785f52689cf954d1eea6202fb5"
PLUGIN_PCI_IDS_BLOB = "6fb8865340a0aec2d9aa2c1763cf885fffd52af3"  # git rev-parse v1.6.0:utils/pci.ids
SCAN_TOKEN_LIMIT = 64 * 1024  # bufio.MaxScanTokenSize: a longer line stops the scanner

# unicode.IsSpace: the Latin-1 spaces and the White_Space property (Python's str.isspace adds
# \x1c-\x1f, which Go does not trim).
_GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
            "\u2028\u2029\u202f\u205f\u3000"
_RE2_SPACE = re.compile("[\t\n\f\r ]+")  # RE2's \s
_DROPPED = re.compile("[^a-zA-Z0-9_.]+")
_DEVICE_LINE = re.compile(r"\t([0-9a-f]{4})  (.*)", re.ASCII | re.DOTALL)
_HEADER = re.compile(r"#\s*(Version|Date):\s*(.*?)\s*$")
# Kubernetes IsExtendedResourceName (pkg/apis/core/helper/helpers.go, v1.31): not a native
# resource (it holds a "/" and no "kubernetes.io/"), and "requests." + the name is a qualified
# name (apimachinery pkg/util/validation IsQualifiedName): one "/" at most, the prefix a DNS-1123
# subdomain (253 characters at most), the name segment 63 characters at most, alphanumeric at
# both ends, [-A-Za-z0-9_.] between.
_NAME_SEGMENT = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]", re.ASCII)
NAME_SEGMENT_MAX = 63
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", re.ASCII)
DNS1123_SUBDOMAIN_MAX = 253
QUOTA_PREFIX = "requests."  # core.DefaultResourceRequestsPrefix


def _upper(char: str) -> str:
    """unicode.ToUpper of one rune: its simple mapping, never more than one rune."""
    upper = char.upper()
    return upper if len(upper) == 1 else char


def derive(rest: str) -> str:
    """getDeviceName's steps on what follows ``"\\t" + id`` on a pci.ids line."""
    name = "".join(_upper(c) for c in rest.strip(_GO_SPACE))
    name = _RE2_SPACE.sub("_", name.replace("/", "_").replace(".", "_"))
    return _DROPPED.sub("", name)


def scan_lines(data: bytes) -> Iterator[bytes]:
    """bufio.Scanner with ScanLines: lines without their newline and one \\r before it; the
    scan ends (as on ErrTooLong) at a line of SCAN_TOKEN_LIMIT bytes or more."""
    start = 0
    while start < len(data):
        end = data.find(b"\n", start)
        line = data[start:end if end >= 0 else len(data)]
        if len(line) >= SCAN_TOKEN_LIMIT:
            return
        yield line[:-1] if line.endswith(b"\r") else line  # dropCR, at EOF too
        if end < 0:
            return
        start = end + 1


@dataclass(frozen=True)
class _Block:
    lines: tuple[bytes, ...]  # what getDeviceName reads after locateVendor, comments left out; the
    # last one, when it has no tab, is the next vendor's line that ends the search
    first: dict[bytes, int]  # "\t" + four bytes -> the first line starting so (the scan's answer)


@functools.lru_cache(maxsize=4)
def _block(data: bytes) -> _Block | None:
    lines = scan_lines(data)
    for line in lines:  # locateVendor
        if line.startswith(NVIDIA_VENDOR.encode()):
            break
    else:
        return None
    block: list[bytes] = []
    for line in lines:
        if line.startswith(b"#"):
            continue
        block.append(line)
        if not line.startswith(b"\t"):
            break
    first: dict[bytes, int] = {}
    for index, line in enumerate(block):
        first.setdefault(line[:5], index)
    return _Block(tuple(block), first)


def device_name(pci_ids: bytes, key: str) -> str:
    """getDeviceName(key) over a pci.ids file: the derived name, or "" (no vendor block, no
    line for ``key``). The lines are scanned once per file; a key of four bytes is looked up by
    its line's first five bytes, which is the first line the scan would stop at."""
    block = _block(pci_ids)
    if block is None:
        return ""
    prefix = b"\t" + key.encode("utf-8", "surrogateescape")
    if len(prefix) == 5:
        index = block.first.get(prefix)
    else:
        index = next((i for i, line in enumerate(block.lines) if line.startswith(prefix) or
                      not line.startswith(b"\t")), None)
    if index is None or not block.lines[index].startswith(b"\t"):
        return ""
    line = block.lines[index]
    return derive(line[len(prefix):].decode("utf-8", "replace"))


def vgpu_key(type_name: str) -> str:
    """readVgpuIDFromFileFunc: ``mdev_type/name`` with newlines trimmed, whitespace runs as ``_``."""
    return _RE2_SPACE.sub("_", type_name.strip("\n"))


def valid_resource_name(resource: str) -> bool:
    """Whether Kubernetes takes ``resource`` (``domain/name``) as an extended resource name."""
    if "/" not in resource or "kubernetes.io/" in resource or resource.startswith(QUOTA_PREFIX):
        return False  # IsNativeResource, or a name the quota prefix would double
    parts = (QUOTA_PREFIX + resource).split("/")
    if len(parts) != 2:
        return False
    prefix, segment = parts
    return len(prefix) <= DNS1123_SUBDOMAIN_MAX and _DNS1123_SUBDOMAIN.fullmatch(prefix) is not None and \
        len(segment) <= NAME_SEGMENT_MAX and _NAME_SEGMENT.fullmatch(segment) is not None


def repaired(segment: str) -> str:
    """A valid name segment close to ``segment`` (for KubeVirt's own plugin, which takes any):
    characters Kubernetes refuses dropped, cut to 63, trimmed to alphanumerics at both ends."""
    kept = re.sub(r"[^-A-Za-z0-9_.]", "", segment, flags=re.ASCII)[:NAME_SEGMENT_MAX]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", kept, flags=re.ASCII)


@dataclass(frozen=True)
class PluginNames:
    """Where the plugin's names come from: the bundled table, or a pci.ids file a user gave
    (another plugin image's /usr/pci.ids), read through the same algorithm."""

    source: str  # what the names come from, in words
    version: str | None  # the pci.ids "Version:" line
    date: str | None
    table: dict[str, str] = field(default_factory=dict)  # device id -> derived name, the file's order
    pci_ids: bytes | None = None  # a pci.ids file to scan instead of the table

    def name(self, key: str) -> str:
        """getDeviceName(key): "" when the plugin finds no name. From the table, the scan's first
        device line whose ``"\\t" + id`` starts with ``"\\t" + key``, for keys without spaces:
        a shorter key matches inside an id, and the line's rest follows it."""
        if self.pci_ids is not None:
            return device_name(self.pci_ids, key)
        if len(key) > 4 or " " in key:
            return ""  # device lines are "\t" + four hex digits + two spaces
        if len(key) == 4:
            return self.table.get(key, "")
        for device, derived in self.table.items():
            if device.startswith(key):
                rest = device[len(key):]
                return f"{rest.upper()}_{derived}"  # rest is never empty: four-byte keys were looked up above
        return ""

    def resource(self, device_id: str) -> str:
        """``nvidia.com/<name>`` the plugin registers for an NVIDIA device id (the id when unnamed)."""
        return f"{NAMESPACE}/{self.name(device_id) or device_id}"

    def vgpu_resource(self, type_name: str) -> str:
        """``nvidia.com/<key>`` the plugin registers for vGPU instances of ``mdev_type/name``."""
        key = vgpu_key(type_name)
        return f"{NAMESPACE}/{self.name(key) or key}"

    def describe(self) -> str:
        return f"{self.source} (pci.ids Version: {self.version or 'unknown'})"

    def to_json(self) -> dict:
        return {"source": self.source, "version": self.version, "date": self.date}


def pci_ids_header(data: bytes) -> tuple[str | None, str | None]:
    """(Version, Date) from a pci.ids file's leading comment."""
    found: dict[str, str] = {}
    for line in (raw.decode("utf-8", "replace") for raw in scan_lines(data)):
        if not line.startswith("#") and line.strip():
            break
        match = _HEADER.match(line)
        if match and match.group(1) not in found:
            found[match.group(1)] = match.group(2)
    return found.get("Version"), found.get("Date")


def nvidia_device_lines(data: bytes) -> dict[str, str]:
    """Every device line of the plugin's NVIDIA block, id -> derived name, in the file's order
    (what getDeviceName can find). A device line not in pci.ids' form ("\\t" + four lower-case
    hex digits + two spaces + a name) is an error: the table's lookup relies on that form."""
    lines = (raw.decode("utf-8", "replace") for raw in scan_lines(data))
    for line in lines:
        if line.startswith(NVIDIA_VENDOR):
            break
    else:
        raise InputError("no NVIDIA (10de) vendor line: not a pci.ids file")
    names: dict[str, str] = {}
    for line in lines:
        if line.startswith("#") or line.startswith("\t\t"):
            continue
        if not line.startswith("\t"):
            break
        match = _DEVICE_LINE.fullmatch(line)
        if match is None or not match.group(2).strip(_GO_SPACE):
            raise InputError(f"not a pci.ids device line: {line!r}")
        names.setdefault(match.group(1), derive(match.group(2)))
    return names


def table_text(data: bytes) -> str:
    """The bundled table's text, made from the plugin's pci.ids (tests/make_plugin_names.py)."""
    version, date = pci_ids_header(data)
    lines = ["# NVIDIA PCI device id -> the name NVIDIA's kubevirt-gpu-device-plugin registers for it under",
             "# nvidia.com/ (getDeviceName, pkg/device_plugin/device_plugin.go; an empty name: the id itself).",
             f"# plugin: {PLUGIN}",
             f"# plugin-commit: {PLUGIN_COMMIT}",
             f"# pci.ids: utils/pci.ids at that commit, git blob {PLUGIN_PCI_IDS_BLOB}",
             f"# pci.ids-version: {version or 'unknown'}",
             f"# pci.ids-date: {date or 'unknown'}",
             "# Generated by tests/make_plugin_names.py from that file with gpuvfio.ops.kubevirt_names; do not edit."]
    lines += [f"{device}\t{name}" for device, name in nvidia_device_lines(data).items()]
    return "\n".join(lines) + "\n"


def parse_table(text: str) -> PluginNames:
    """The names of a table in the shipped table's form (gpuvfio.host.nvidia_ids.parse)."""
    return _plugin_names(*nvidia_ids.parse(text))


def _plugin_names(header: dict[str, str], table: dict[str, str]) -> PluginNames:
    return PluginNames(source=f"{header.get('plugin', PLUGIN)}'s bundled pci.ids",
                       version=header.get("pci.ids-version"), date=header.get("pci.ids-date"), table=dict(table))


def table_path() -> str:
    return nvidia_ids.table_path()


@functools.lru_cache(maxsize=1)
def bundled() -> PluginNames:
    """The names from the table shipped with gpuvfio (the plugin's v1.6.0 pci.ids)."""
    return _plugin_names(*nvidia_ids.table())


def from_pci_ids(path: str) -> PluginNames:
    """The names another plugin image would register: its /usr/pci.ids, copied out to ``path``."""
    data = read_regular(path, HOST_TEXT_LIMIT)
    if data is None:
        raise InputError(f"no such file: {path}")
    if _block(data) is None:
        raise InputError(f"{path} has no NVIDIA (10de) vendor line: not a pci.ids file")
    version, date = pci_ids_header(data)
    return PluginNames(source=f"the pci.ids file {path}", version=version, date=date, pci_ids=data)
