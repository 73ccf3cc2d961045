"""Device selectors as admins type them, parsed at the edge (matching is gpuvfio.ops.selection's).

* ``[[DOMAIN:]BUS:]SLOT[.FUNC]``, lspci's ``-s`` form (pciutils lib/filter.c
  pci_filter_parse_slot): a missing function means every function of the slot, a missing bus
  any bus; the domain defaults to 0000 (lspci's would be any domain: gpuvfio names one).
* ``pci_DDDD_BB_SS_F``: libvirt's node-device name (virsh nodedev-list; src/conf/node_device_conf.c
  names PCI devices "pci_%04x_%02x_%02x_%x").
* ``-d [VENDOR]:[DEVICE][:CLASS]``, lspci's ``-d`` (pciutils lib/filter.c pci_filter_parse_id and
  parse_hex_field): up to 4 hex digits a field, an empty field matches anything, an ``x`` is a
  wildcard digit; the digits given are the whole value (``03`` is class 0x0003: the base class
  03 is ``03xx``). The class is base class and subclass, 4 digits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuvfio.address import MAX_FUNCTION, MAX_SLOT, PciAddress, function_beyond
from gpuvfio.errors import InputError
from gpuvfio.numbers import hex_uint

_SLOT = re.compile(r"^(?:(?:(?P<domain>[0-9a-fA-F]{4,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):)?"
                   r"(?P<slot>[0-9a-fA-F]{1,2})(?:\.(?P<function>[0-7]))?$")
_NODEDEV = re.compile(r"^pci_(?P<domain>[0-9a-fA-F]{4,8})_(?P<bus>[0-9a-fA-F]{2})_(?P<slot>[0-9a-fA-F]{2})"
                      r"_(?P<function>[0-7])$")
_IDS = re.compile(r"^(?P<vendor>[0-9a-fA-FxX]{0,4}):(?P<device>[0-9a-fA-FxX]{0,4})(?::(?P<klass>[0-9a-fA-FxX]{1,4}))?$")


def _hex_field(text: str | None) -> tuple[int, int] | None:
    """(value, mask) of a filter field as parse_hex_field reads it; None: matches anything."""
    if not text:
        return None
    value, mask = 0, 0xFFFFFFFF
    for char in text.lower():
        value = (value << 4) | (0 if char == "x" else int(char, 16))
        mask = ((mask << 4) | (0 if char == "x" else 0xF)) & 0xFFFFFFFF
    return value, mask
SELECTOR_HELP = "[[DOMAIN:]BUS:]SLOT[.FUNC] (a slot: all its functions) or pci_DDDD_BB_SS_F"


def _shown(text) -> str:
    return text if isinstance(text, str) and len(text) <= 64 else repr(text)[:64]


@dataclass(frozen=True, slots=True)
class Selector:
    """Which functions a device argument names; None parts match anything."""

    text: str
    domain: int
    bus: int | None
    slot: int
    function: int | None

    @classmethod
    def parse(cls, text: str) -> "Selector":
        value = text.strip() if isinstance(text, str) else ""
        match = _NODEDEV.match(value) or _SLOT.match(value)
        if not value or match is None:
            raise InputError(f"not a PCI address: {_shown(text)!r}{function_beyond(text)} (expected {SELECTOR_HELP}, "
                             "e.g. 01:00 or 0000:01:00.0)")
        slot = int(match["slot"], 16)
        if slot > MAX_SLOT:
            raise InputError(f"PCI slot out of range (max 1f) in {value!r}")
        function = int(match["function"]) if match["function"] is not None else None
        if function is not None and function > MAX_FUNCTION:  # the patterns allow 0-7 only
            raise InputError(f"PCI function out of range (max 7) in {value!r}")
        bus = int(match["bus"], 16) if match["bus"] is not None else None
        return cls(value, int(match["domain"] or "0", 16), bus, slot, function)

    @property
    def address(self) -> PciAddress | None:
        """The one function it names, when it names exactly one."""
        if self.bus is None or self.function is None:
            return None
        return PciAddress(self.domain, self.bus, self.slot, self.function)

    def matches(self, address: PciAddress) -> bool:
        return (address.domain == self.domain and (self.bus is None or address.bus == self.bus)
                and address.slot == self.slot and (self.function is None or address.function == self.function))


@dataclass(frozen=True, slots=True)
class IdFilter:
    """``-d VENDOR:DEVICE[:CLASS]``; None parts match anything."""

    text: str
    vendor: tuple[int, int] | None  # (value, mask); None: any
    device: tuple[int, int] | None
    klass: tuple[int, int] | None  # base class and subclass (the first 4 digits of the class code)

    @classmethod
    def parse(cls, text: str) -> "IdFilter":
        value = text.strip().lower() if isinstance(text, str) else ""
        match = _IDS.match(value)
        if match is None or value in (":", ""):
            raise InputError(f"not a device id filter: {_shown(text)!r} (expected VENDOR:[DEVICE][:CLASS] in hex, "
                             "e.g. 10de: or 10de:2330 or 10de::0302)")
        return cls(value, _hex_field(match["vendor"]), _hex_field(match["device"]), _hex_field(match["klass"]))

    def vendor_fits(self, vendor_id: str) -> bool:
        """The vendor part alone: a function whose vendor does not fit cannot match."""
        return _fits(self.vendor, vendor_id)

    def matches(self, vendor_id: str, device_id: str, class_id: str) -> bool:
        return _fits(self.vendor, vendor_id) and _fits(self.device, device_id) and _fits(self.klass, class_id[:4])


def _fits(field: tuple[int, int] | None, text: str) -> bool:
    if field is None:
        return True
    number = hex_uint(text)
    return number is not None and (number & field[1]) == (field[0] & field[1])
