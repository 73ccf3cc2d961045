"""What a Tab offers for a device: candidates answered at once (a domain's name:
gpuvfio.ops.domain_completion, which only the guest commands load).

Devices: the functions a passthrough command is for -- NVIDIA GPUs (class 03xx) and NVSwitches
(class 0680) with the other functions of their slots (a GPU's audio and USB-C functions go with
it), and SR-IOV virtual functions -- never bridges or the host's own chipset devices. One
spelling each, in the form being typed: ``BB:SS.F`` for domain 0000 as lspci prints it,
``DDDD:BB:SS.F`` once a domain is typed (or outside domain 0000), ``pci_DDDD_BB_SS_F`` (libvirt's
node-device name) after ``pci_``. The read is light: the names under /sys/bus/pci/devices that
match what was typed, then vendor and class of those only (gpuvfio.host.inventory.read_ids) and
whether a function is a VF.
"""

from __future__ import annotations

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError
from gpuvfio.host.inventory import PCI_DEVICES, list_addresses, read_ids
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
    wanted_slots: set[tuple[int, int, int]] = set()
    chosen = []
    for address in matching:
        try:
            vendor, _device, class_id = read_ids(host, address)
        except (GpuvfioError, OSError):
            continue
        if vendor == NVIDIA and (class_id.startswith(DISPLAY_CLASS) or class_id.startswith(NVSWITCH_CLASS)):
            wanted_slots.add(address.device)
        elif host.raw_link(host.sys_path(*PCI_DEVICES, str(address), "physfn")) is not None:
            chosen.append(address)  # an SR-IOV virtual function: passed through on its own
    # The other functions of a GPU's or NVSwitch's slot go with it (whatever they match).
    chosen += [a for a in matching if a.device in wanted_slots]
    return [_spellings(a)[form] for a in sorted(set(chosen))][:MAX_COMPLETIONS]
