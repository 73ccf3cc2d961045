"""What a Tab offers for a device: candidates answered at once (a domain's name:
gpuvfio.ops.domain_completion, which only the guest commands load).

Devices: the functions a passthrough command is for -- NVIDIA GPUs (class 03xx) and NVSwitches
(class 0680) with the other functions of their slots (a GPU's audio and USB-C functions go with
it), and SR-IOV virtual functions -- never bridges or the host's own chipset devices. One
spelling each, in the form being typed: ``BB:SS.F`` for domain 0000 as lspci prints it,
``DDDD:BB:SS.F`` once a domain is typed (or outside domain 0000), ``pci_DDDD_BB_SS_F`` (libvirt's
node-device name) after ``pci_``. The read is light: the names under /sys/bus/pci/devices that
match what was typed, then, slot by slot until a Tab's worth is found, vendor and class of
those (one ``uevent`` read each: gpuvfio.host.inventory.read_ids_and_physfn) and whether a
function is a VF, all in one pass over the directories.
"""

from __future__ import annotations

from itertools import groupby

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError
from gpuvfio.host.inventory import list_addresses, read_ids_and_physfn
from gpuvfio.host.model import DISPLAY_CLASS
from gpuvfio.host.root import HostRoot

__all__ = ["device_candidates", "MAX_COMPLETIONS"]

MAX_COMPLETIONS = 200
NVIDIA = "10de"
NVSWITCH_CLASS = "0680"


def _spellings(address: PciAddress) -> tuple[str, str, str]:
    full = str(address)
    short = full[len("0000:"):] if full.startswith("0000:") else full
    return short, full, "pci_" + full.replace(":", "_").replace(".", "_")


def _form(typed: str) -> int:
    """Which spelling is being typed: 0 short (lspci's), 1 full, 2 libvirt's node-device name."""
    if typed.startswith("pci_"):
        return 2
    return 1 if typed.count(":") >= 2 else 0


def device_candidates(root: str | None, incomplete: str) -> list[str]:
    """The candidate devices that start with ``incomplete``, one spelling each (see above).
    Never raises: a host that cannot be read offers nothing."""
    typed = (incomplete or "").lower()
    try:
        host = HostRoot(root or None)
        addresses = list_addresses(host)
    except (GpuvfioError, OSError):
        return []
    form = _form(typed)
    matching = [a for a in addresses if _spellings(a)[form].startswith(typed)]
    if not matching and form == 0:  # "0000" or "0001:..." typed without two colons yet
        form, matching = 1, [a for a in addresses if str(a).startswith(typed)]
    chosen: list[PciAddress] = []
    with host.sys_dirs() as dirs:
        # A slot's functions are together in address order: each slot is decided whole, and the
        # walk stops once a Tab's worth is found (the rest would not be shown).
        for _slot, group in groupby(matching, key=lambda a: a.device):
            members, kinds = list(group), []
            for address in members:
                try:
                    kinds.append(read_ids_and_physfn(host, address, dirs))
                except (GpuvfioError, OSError):
                    kinds.append(None)
            chosen += _offered(members, kinds)
            if len(chosen) >= MAX_COMPLETIONS:
                break
    return [_spellings(a)[form] for a in chosen][:MAX_COMPLETIONS]


def _offered(members: list[PciAddress], kinds: list[tuple[str, str, str, bool] | None]) -> list[PciAddress]:
    """The functions of one slot to offer, from each one's (vendor, device, class, is a VF), None
    where it could not be read: all of them where one is an NVIDIA GPU or NVSwitch (a GPU's audio
    and USB-C functions go with it, whatever they are), else its SR-IOV virtual functions (each
    passed through on its own)."""
    if any(kind and kind[0] == NVIDIA and kind[2].startswith((DISPLAY_CLASS, NVSWITCH_CLASS)) for kind in kinds):
        return members
    return [address for address, kind in zip(members, kinds) if kind and kind[3]]
