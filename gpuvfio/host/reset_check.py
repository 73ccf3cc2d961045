"""Whether a device came back from a reset as it went in: what ``gpuvfio qualify`` checks after
each one.

The kernel saves a function's config space before a reset and writes it back afterwards
(drivers/pci/pci.c pci_dev_save_and_disable / pci_dev_restore, Linux 5.15 to 6.12), and waits
for the device to answer (pci_dev_wait). So after a good reset:

* config space answers (vendor ID not 0xffff) with the same vendor and device IDs;
* the BAR registers (config 0x10-0x27) read as before, and the kernel still has every BAR
  placed (host.health.return_problem): a device that ignored the restore, or whose BARs
  collapsed, would hand the next tenant a device it cannot map;
* the link trained back: not down and no narrower than before. It is held to what it was, not
  to what the slot allows (a link trained narrow before is that host's fault, not the model's
  reset: health reports it), and its speed is not held at all: GPUs lower it while idle, as
  health says, and the next load trains it up. A function without a link of its own (an SR-IOV
  VF, Link Capabilities reading 0) is not held to one.

A device that no longer answers (0xffff), or whose sysfs entry is gone, is ``dead``: qualify
stops there and marks it broken.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError
from gpuvfio.host.health import return_problem
from gpuvfio.host.inventory import read_function
from gpuvfio.host.root import HostRoot

__all__ = ["AfterReset", "ResetSnapshot", "snapshot", "after_reset"]

IDS = slice(0x00, 0x04)
BARS = slice(0x10, 0x28)  # the six BAR registers of a type 0 header


@dataclass(frozen=True)
class ResetSnapshot:
    """A device as it was before the resets: its config header's IDs and BAR registers, and its
    link's current width (None: no link of its own to hold it to)."""

    address: PciAddress
    ids: bytes
    bars: bytes
    width: int | None


@dataclass(frozen=True)
class AfterReset:
    problem: str | None  # what the reset broke (None: it came back as it went in)
    dead: bool = False  # it no longer answers, or is gone


def _config(host: HostRoot, address: PciAddress) -> bytes:
    try:
        device = host.resolve_in_sys(host.sys_path("bus", "pci", "devices", str(address)))
        return host.read_head(os.path.join(device, "config"), 64) or b""
    except GpuvfioError:
        return b""  # gone from sysfs, or no longer readable


def _width(host: HostRoot, address: PciAddress) -> int | None:
    fn = read_function(host, address)
    link = fn.link
    if fn.physfn is not None or link is None or not link.current_width or link.max_width == 0:
        return None
    return link.current_width


def snapshot(host: HostRoot, address: PciAddress) -> ResetSnapshot:
    config = _config(host, address)
    return ResetSnapshot(address, config[IDS], config[BARS], _width(host, address))


def after_reset(host: HostRoot, before: ResetSnapshot) -> AfterReset:
    """What a reset broke, in words, and whether the device is dead."""
    config = _config(host, before.address)
    if len(config) < BARS.stop:
        return AfterReset("its config space cannot be read after the reset: the device is gone", dead=True)
    problem = return_problem(host, before.address)
    if problem:
        return AfterReset(problem, dead="0xffff" in problem)
    if config[IDS] != before.ids:
        return AfterReset(f"its config space reads IDs {config[IDS].hex()} after the reset, {before.ids.hex()} "
                          "before")
    if config[BARS] != before.bars:
        return AfterReset("its BAR registers read differently after the reset (config space was not restored)")
    return AfterReset(_link_problem(host, before))


def _link_problem(host: HostRoot, before: ResetSnapshot) -> str | None:
    if before.width is None:
        return None  # no link of its own before: nothing to hold it to
    fn = read_function(host, before.address)
    width = fn.link.current_width if fn.link else None
    if not width:
        return "its link is down after the reset (width 0 or no reading)"
    if width < before.width:
        return f"its link trained to x{width} after the reset, x{before.width} before"
    return None
