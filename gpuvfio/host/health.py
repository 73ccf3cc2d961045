"""Device health: whether a function answers, how the kernel can reset it, where its power is.

* Config space (drivers/pci/pci-sysfs.c, ``config``): a function that reads 0xffff as its
  vendor ID does not answer -- gone from the bus, or in D3cold and not coming back. Such a
  device is dead, not free: it is neither given to a host driver nor bound again.
* Reset: ``reset_method`` lists what the kernel will use, in order (drivers/pci/pci.c,
  pci_reset_fn_methods): trust it over the FLR bit alone -- the kernel notes that the T4 has
  neither PM nor FLR reset (quirks), and offers ``bus`` only when no other function shares the
  bus. The FLR bit (PCIe DevCap bit 28) is reported next to it.
* Power (Documentation/ABI/testing/sysfs-bus-pci): ``power_state`` (D0..D3cold),
  ``d3cold_allowed``; ``power/control`` (runtime PM, "auto" lets an idle device suspend).
  vfio-pci puts idle devices into low power; some GPUs do not come back from D3cold, so the
  fix is per device at once (``d3cold_allowed`` 0, or ``power/control`` on), or
  ``vfio_pci.disable_idle_d3=1``, which only takes effect when the module loads.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from gpuvfio.host.root import HostRoot, SysDir
from gpuvfio.numbers import hex_uint

PCI_CAPABILITY_LIST = 0x34
PCI_CAP_ID_EXP = 0x10  # PCI Express capability (PCIe base spec 7.5.3)
PCI_EXP_DEVCAP = 4
PCI_EXP_DEVCAP_FLR = 1 << 28


@dataclass(slots=True)
class Health:
    alive: bool | None  # None: config space not readable
    flr: bool | None  # FLR advertised in PCIe DevCap; None: no PCIe capability seen
    reset_method: list[str] | None  # None: the kernel has no reset_method (before 5.15)
    power_state: str | None
    d3cold_allowed: bool | None
    power_control: str | None

    def to_json(self) -> dict:
        return {"alive": self.alive, "flr": self.flr, "reset_method": self.reset_method,
                "power_state": self.power_state, "d3cold_allowed": self.d3cold_allowed,
                "power_control": self.power_control}


def parse_config(data: bytes | None) -> tuple[bool | None, bool | None]:
    """(alive, FLR advertised) from config space bytes."""
    if not data or len(data) < 2:
        return None, None
    (vendor,) = struct.unpack_from("<H", data, 0)
    if vendor == 0xFFFF:
        return False, None
    if len(data) < 0x40:  # a non-root reader sees only the header
        return True, None
    pointer, seen = data[PCI_CAPABILITY_LIST] & 0xFC, set()
    while pointer and pointer + 8 <= len(data) and pointer not in seen:
        seen.add(pointer)
        if data[pointer] == PCI_CAP_ID_EXP:
            (devcap,) = struct.unpack_from("<I", data, pointer + PCI_EXP_DEVCAP)
            return True, bool(devcap & PCI_EXP_DEVCAP_FLR)
        pointer = data[pointer + 1] & 0xFC
    return True, None


def read_health(directory: SysDir, reset_method: list[str] | None) -> Health:
    """Health of the function whose sysfs directory is open as ``directory``."""
    alive, flr = parse_config(directory.data("config", 256, head=True))
    d3cold = directory.text("d3cold_allowed")
    return Health(alive=alive, flr=flr, reset_method=reset_method,
                  power_state=directory.text("power_state"),
                  d3cold_allowed=None if d3cold is None else d3cold == "1",
                  power_control=directory.text_in("power", "control"))


# include/linux/ioport.h: a memory BAR the kernel could not place is flagged IORESOURCE_UNSET and
# shown in ``resource`` with start 0 (drivers/pci/pci-sysfs.c resource_show).
IORESOURCE_IO = 0x100
IORESOURCE_MEM = 0x200
IORESOURCE_UNSET = 0x20000000
STANDARD_BARS = 6  # lines 0-5 of ``resource``; then the ROM and, on bridges, the windows


def unassigned_bars(host: HostRoot, device_dir: str) -> list[int]:
    """The standard BARs the device has but the kernel left unassigned."""
    text = host.read(os.path.join(device_dir, "resource"))
    missing = []
    for index, line in enumerate((text or "").splitlines()[:STANDARD_BARS]):
        fields = [hex_uint(field) for field in line.split()]
        if len(fields) != 3 or None in fields:
            continue
        start, end, flags = fields
        if flags & (IORESOURCE_IO | IORESOURCE_MEM) and end > start and (flags & IORESOURCE_UNSET or start == 0):
            missing.append(index)
    return missing


def return_problem(host: HostRoot, address) -> str | None:
    """Why a function back from a guest is not fit for a host driver (None: it is): config space
    reading 0xffff, or BARs the kernel no longer has placed."""
    device = host.resolve_in_sys(host.sys_path("bus", "pci", "devices", str(address)))
    alive = parse_config(host.read_head(os.path.join(device, "config"), 64))[0]
    if alive is False:
        return "config space reads 0xffff: the device did not come back"
    missing = unassigned_bars(host, device)
    if missing:
        return f"BAR{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} no longer assigned"
    return None
