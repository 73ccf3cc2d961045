"""A domain request: what the admin asked for, validated once, whatever interface it came from.

The CLI (gpuvfio xml / attach), the Ansible domain module and the testbed spec all build a
DomainRequest through ``domain_request``, so a spelling accepted by one is accepted by all
(``4K``, ``1g``, ``2MiB`` for pages; ``remote`` for NUMA) and bad input reads the same
everywhere. Policy (placement, pinning, the MMIO window) is decided later, in spec.py.
"""

from __future__ import annotations

import re
import uuid as uuidlib
from dataclasses import field, make_dataclass
from typing import Optional

from gpuvfio.domain.address_space import FIRMWARES, VIRT_TYPES
from gpuvfio.domain.versions import parse_version
from gpuvfio.errors import InputError
from gpuvfio.numbers import shown, uint
from gpuvfio.options import DOMAIN, Option, OptionError, checked, value_shown
from gpuvfio.sizes import MAX_KIB, format_kib, parse_size_kib

NUMA_WORDS = ("auto", "none", "remote")
TOPOLOGY_CHOICES = DOMAIN["topology"].choices  # auto: mirror the host for two or more devices
P2P_CHOICES = DOMAIN["p2p"].choices
MAX_VCPUS = int(DOMAIN["vcpus"].maximum)
MAX_NUMA_NODE = 1023  # CONFIG_NODES_SHIFT is at most 10 on x86-64
# The table's choices are the ones the address planner knows.
assert DOMAIN["firmware"].choices == FIRMWARES and DOMAIN["virt_type"].choices == VIRT_TYPES


def parse_hugepages(text: str) -> str:
    """auto | none | a page size: 4K (= none: the base page), 2M, 1G in any spelling parse_size_kib takes."""
    word = str(text).strip()
    if word.lower() in ("auto", "none"):
        return word.lower()
    try:
        kib = parse_size_kib(word)
    except InputError:
        kib = None
    sizes = {4: "none", 2048: "2M", 1024 * 1024: "1G"}
    if kib not in sizes:
        raise OptionError(f"{{hugepages}} must be auto, none, 4K, 2M or 1G, not {value_shown(text)}")
    return sizes[kib]


def parse_numa(text: str | int) -> str:
    """auto | none | remote (a node without the devices) | a node number."""
    word = str(text).strip().lower()
    if word in NUMA_WORDS:
        return word
    node = uint(word, MAX_NUMA_NODE)
    if node is not None:
        return str(node)
    raise OptionError(f"{{numa}} must be auto, none, remote or a node number, not {value_shown(text)}")


def parse_uuid(text: str) -> str:
    """A UUID in its canonical form (mdev instances, domains)."""
    try:
        return str(uuidlib.UUID(str(text)))
    except ValueError:
        raise InputError(f"not a UUID: {shown(text)}") from None


def validate_name(name: str) -> str:
    """libvirt refuses '/' and newlines in names (virDomainDefParseXML); we also refuse other
    control characters and leading dots; XML-special characters are escaped when rendered."""
    if not isinstance(name, str) or not name or len(name) > 200:
        raise InputError("domain name must be 1 to 200 characters")
    if "/" in name or any(ord(c) < 0x20 or ord(c) == 0x7F for c in name) or name.startswith("."):
        raise InputError(f"domain name {name!r} contains '/', a control character or a leading dot")
    return name


def parse_memory_kib(memory: str | int) -> int:
    """Guest memory in KiB: a size as parse_size_kib takes it (an int is KiB already)."""
    memory_kib = memory if isinstance(memory, int) and not isinstance(memory, bool) else parse_size_kib(str(memory))
    if memory_kib < 1024:
        raise OptionError(f"{{memory}} must be at least 1 MiB, not {value_shown(memory)}")
    if memory_kib > MAX_KIB:
        raise OptionError(f"{{memory}} must be at most {format_kib(MAX_KIB)}, not {value_shown(memory)}")
    return memory_kib


def qemu_version_of(text: str | tuple[int, ...]) -> tuple[int, ...]:
    """What the user types: ``8.1`` or ``9.2.0``, nothing else (libvirt's own answers, with
    distribution suffixes, go through versions.parse_version; a tuple is one already read)."""
    if isinstance(text, tuple):
        return text
    strict = isinstance(text, str) and re.fullmatch(r"[0-9]{1,6}(\.[0-9]{1,6}){1,2}", text.strip()) is not None
    version = parse_version(text.strip()) if strict else None
    if version is None:
        raise OptionError(f"{{qemu_version}} must look like 8.1 or 9.2.0, not {value_shown(text)}")
    return version


# How a declared option's value is read beyond the kind, bounds and choices the table gives it
# (gpuvfio.options.checked): the readers that turn a spelling into what the request holds.
READERS = {"name": validate_name, "memory": parse_memory_kib, "hugepages": parse_hugepages, "numa": parse_numa,
           "uuid": parse_uuid, "qemu_version": qemu_version_of}
FIELDS = {"memory": "memory_kib"}  # where a reader's value lands under a name that says what it holds
_TYPES = {"str": str, "path": str, "int": int, "float": float, "bool": bool, "list": list}


def _read(option: Option, value):
    if value is None:
        return None
    return READERS[option.name](value) if option.name in READERS else checked(option, value)


def _field(option: Option):
    kind = _TYPES[option.kind] if option.required or option.default is not None else Optional[_TYPES[option.kind]]
    if option.required:
        return option.name, kind
    return FIELDS.get(option.name, option.name), kind, field(default=_read(option, option.default))


# What the admin asked for: one field per domain option gpuvfio.options.DOMAIN declares, with
# its table default (read as a request holds it: memory in KiB), and the libvirt version a
# connection tells (not an option). Made from the table, so a new option needs no field here.
DomainRequest = make_dataclass(
    "DomainRequest", [_field(o) for o in DOMAIN] + [("libvirt_version", Optional[tuple], field(default=None))],
    namespace={"__doc__": "A validated domain request (gpuvfio.domain.request.domain_request makes it)."})
DomainRequest.__module__ = __name__


def _cross_checks(values: dict) -> None:
    """The rules between options, which no single declaration holds."""
    get = values.get
    if get("mdev") and get("vgpu"):
        raise OptionError("{mdev} and {vgpu} exclude each other")
    if get("kernel") is None and (get("initrd") or get("cmdline")):
        raise OptionError("{initrd} and {cmdline} need {kernel}")
    if get("disk") and get("kernel"):
        raise OptionError("{disk} and {kernel} exclude each other (one boot source)")
    if (get("loader") is None) != (get("nvram_template") is None):
        raise OptionError("{loader} and {nvram_template} go together (the UEFI code and its variables template)")
    if get("loader") is not None and get("firmware") != "efi":
        raise OptionError("{loader} and {nvram_template} are UEFI firmware: they need {firmware} efi")
    if get("rom_bar") == "off" and get("rom_file") is not None:
        raise OptionError("{rom_bar} off hides the ROM that {rom_file} gives: one of them")
    for name in ("mdev", "vgpu"):
        value = get(name)
        if value is not None and (not value.strip() or any(c in value for c in "\n\0")):
            raise OptionError(f"{{{name}}} needs a vGPU type id or name, not {value_shown(value)}")


def domain_request(name: str, **values) -> DomainRequest:
    """The one validation of a domain request: each option as gpuvfio.options.DOMAIN declares it
    (its table default where it is not given), then the rules between them (bad input:
    InputError, exit 2; OptionError names the options as each interface spells them)."""
    unknown = sorted(set(values) - set(DOMAIN.names()) - {"name"})
    if unknown:
        raise InputError(f"not a domain option: {shown(unknown[0])}")
    given = {key: value for key, value in values.items() if value is not None}  # None: not given
    read = {o.name: _read(o, name if o.name == "name" else given.get(o.name, o.default)) for o in DOMAIN}
    _cross_checks(read)
    return DomainRequest(**{FIELDS.get(key, key): value for key, value in read.items()})
