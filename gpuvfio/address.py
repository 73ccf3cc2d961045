"""The one PCI address type. Parsed and validated at the edge, formatted in one place.

Linux names PCI functions ``DDDD:BB:SS.F`` (drivers/pci/probe.c, pci_setup_device ->
dev_set_name "%04x:%02x:%02x.%d"). The domain is printed with *at least* four hex
digits: Intel VMD exposes domains from 0x10000 up, so 5+ digit domains are real.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuvfio.errors import InputError

_ADDRESS = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{4,8}):)?"
    r"(?P<bus>[0-9a-fA-F]{1,2}):(?P<slot>[0-9a-fA-F]{1,2})\.(?P<function>[0-7])$"
)

MAX_SLOT = 0x1F
MAX_FUNCTION = 7
# An address whose only fault is its function (01:00.9): the refusal says why (PCI has 8
# functions a device, 0-7: the 3-bit function number of the PCI Local Bus Specification 3.0, 3.2.2.3.1).
_FUNCTION_BEYOND = re.compile(r"^(?:(?:[0-9a-fA-F]{4,8}[:_])?[0-9a-fA-F]{1,2}[:_])?[0-9a-fA-F]{1,2}[._]"
                              r"(?P<function>[89a-fA-F]|[0-9a-fA-F]{2,3})$")


def function_beyond(text: object) -> str:
    """What a refusal adds where ``text`` would be an address but for its function F: "(a PCI
    function is 0-7, not F)" with a leading space; else ""."""
    value = text.strip().removeprefix("pci_") if isinstance(text, str) else ""
    match = _FUNCTION_BEYOND.match(value)
    return f" (a PCI function is 0-{MAX_FUNCTION}, not {match['function']})" if match else ""


@dataclass(frozen=True, order=True)
class PciAddress:
    """A PCI function address; ordering is numeric (domain, bus, slot, function)."""

    domain: int
    bus: int
    slot: int
    function: int

    def __post_init__(self) -> None:
        if not 0 <= self.domain <= 0xFFFFFFFF:
            raise InputError(f"PCI domain out of range: {self.domain:#x}")
        if not 0 <= self.bus <= 0xFF:
            raise InputError(f"PCI bus out of range: {self.bus:#x}")
        if not 0 <= self.slot <= MAX_SLOT:
            raise InputError(f"PCI slot out of range (max 0x1f): {self.slot:#x}")
        if not 0 <= self.function <= MAX_FUNCTION:
            raise InputError(f"PCI function out of range (max 7): {self.function}")

    @classmethod
    def parse(cls, text: str) -> "PciAddress":
        """Parse ``DDDD:BB:SS.F`` or ``BB:SS.F`` (domain 0); raise InputError otherwise."""
        match = _ADDRESS.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            shown = text if isinstance(text, str) and len(text) <= 64 else repr(text)[:64]
            raise InputError(
                f"not a PCI address: {shown!r}{function_beyond(text)} (expected DDDD:BB:SS.F, e.g. 0000:01:00.0)"
            )
        slot = int(match["slot"], 16)
        if slot > MAX_SLOT:
            raise InputError(f"PCI slot out of range (max 1f) in {text.strip()!r}")
        return cls(int(match["domain"] or "0", 16), int(match["bus"], 16), slot, int(match["function"]))

    @classmethod
    def try_parse(cls, text: str) -> "PciAddress | None":
        """Parse a sysfs directory name; None when it is not a PCI function name."""
        try:
            return cls.parse(text)
        except InputError:
            return None

    @property
    def device(self) -> tuple[int, int, int]:
        """The physical device (domain, bus, slot) this function belongs to."""
        return (self.domain, self.bus, self.slot)

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}.{self.function:x}"

    def __repr__(self) -> str:
        return f"PciAddress('{self}')"
