"""Whether a device came back from a reset as it went in: what ``gpuvfio qualify`` checks after
each one.

The kernel saves a function's config space before a reset and writes it back afterwards
(drivers/pci/pci.c pci_dev_save_and_disable / pci_dev_restore, Linux 5.15 to 6.12), and waits
for the device to answer (pci_dev_wait). So after a good reset:

* config space answers (vendor ID not 0xffff) with the same vendor and device IDs;
* the BAR registers (config 0x10-0x27) read as before, and the kernel still has every BAR
  placed (host.health.return_problem): a device that ignored the restore, or whose BARs
  collapsed, would hand the next tenant a device it cannot map;
* the link trained back: not down, no narrower than before nor than the device and its slot
  allow, and not slower than before (a link that comes back at Gen1 after a bus reset is a
  known way GPUs fail to reset).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpuvfio.address import PciAddress
from gpuvfio.host.health import return_problem
from gpuvfio.host.inventory import read_function
from gpuvfio.host.model import Link
from gpuvfio.host.root import HostRoot

__all__ = ["ResetSnapshot", "snapshot", "after_reset"]

IDS = slice(0x00, 0x04)
BARS = slice(0x10, 0x28)  # the six BAR registers of a type 0 header


@dataclass(frozen=True)
class ResetSnapshot:
    """A device as it was before the resets: its config header's IDs and BAR registers, its link,
    and the width the device and its slot both allow (None: not known)."""

    address: PciAddress
    ids: bytes
    bars: bytes
    link: Link | None
    slot_width: int | None


def _config(host: HostRoot, address: PciAddress) -> bytes:
    device = host.resolve_in_sys(host.sys_path("bus", "pci", "devices", str(address)))
    return host.read_head(os.path.join(device, "config"), 64) or b""


def _link(host: HostRoot, address: PciAddress) -> tuple[Link | None, int | None]:
    fn = read_function(host, address)
    width = fn.link.max_width if fn.link else None
    if width is not None and fn.parents:
        port = read_function(host, fn.parents[-1]).link
        width = min(width, port.max_width or width) if port else width
    return fn.link, width


def snapshot(host: HostRoot, address: PciAddress) -> ResetSnapshot:
    config = _config(host, address)
    link, slot_width = _link(host, address)
    return ResetSnapshot(address, config[IDS], config[BARS], link, slot_width)


def after_reset(host: HostRoot, before: ResetSnapshot) -> str | None:
    """What a reset broke, in words (None: the device came back as it went in)."""
    problem = return_problem(host, before.address)
    if problem:
        return problem
    config = _config(host, before.address)
    if config[IDS] != before.ids:
        return f"its config space reads IDs {config[IDS].hex()} after the reset, {before.ids.hex()} before"
    if config[BARS] != before.bars:
        return "its BAR registers read differently after the reset (config space was not restored)"
    return _link_problem(host, before)


def _link_problem(host: HostRoot, before: ResetSnapshot) -> str | None:
    link, _ = _link(host, before.address)
    was = before.link
    if was is None or was.current_width is None:
        return None  # no link reading before (a function without a PCIe link): nothing to hold it to
    if link is None or link.current_width is None:
        return "its link reading is gone after the reset"
    if link.current_width == 0:
        return "its link is down after the reset (width 0)"
    if link.current_width < was.current_width or (before.slot_width and link.current_width < before.slot_width):
        allowed = f", x{before.slot_width} allowed" if before.slot_width else ""
        return f"its link trained to x{link.current_width} after the reset, x{was.current_width} before{allowed}"
    if was.current_speed_gts and (link.current_speed_gts or 0) < was.current_speed_gts:
        return (f"its link trained to {link.current_speed_gts or '?'} GT/s after the reset, "
                f"{was.current_speed_gts:g} GT/s before")
    return None
