"""What a Tab offers: candidate devices and libvirt domains, answered at once.

Devices: the functions a passthrough command is for -- NVIDIA GPUs (class 03xx) and NVSwitches
(class 0680) with the other functions of their slots (a GPU's audio and USB-C functions go with
it), and SR-IOV virtual functions -- never bridges or the host's own chipset devices. One
spelling each, in the form being typed: ``BB:SS.F`` for domain 0000 as lspci prints it,
``DDDD:BB:SS.F`` once a domain is typed (or outside domain 0000), ``pci_DDDD_BB_SS_F`` (libvirt's
node-device name) after ``pci_``. The read is light: the names under /sys/bus/pci/devices that
match what was typed, then vendor and class of those only (gpuvfio.host.inventory.read_ids) and
whether a function is a VF.

Domains: only from a libvirt reached over a local socket, read-only, and only for as long as a
person waits on a Tab (COMPLETION_WAIT); a daemon that does not answer offers nothing.
"""

from __future__ import annotations

import threading

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError
from gpuvfio.host.inventory import PCI_DEVICES, list_addresses, read_ids
from gpuvfio.host.model import DISPLAY_CLASS
from gpuvfio.host.root import HostRoot
from gpuvfio.virt.connection import default_uri, libvirt_module

__all__ = ["device_candidates", "domain_candidates", "MAX_COMPLETIONS", "COMPLETION_WAIT"]

MAX_COMPLETIONS = 200
COMPLETION_WAIT = 2.0  # seconds a Tab waits on libvirt
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


def _local(uri: str) -> bool:
    """A URI libvirt reaches over a local socket (or in this process: test:///): a Tab must not
    start ssh or wait on the network."""
    scheme, _, rest = uri.partition(":")
    if "+" in scheme and not scheme.endswith("+unix"):
        return False
    return not rest.startswith("//") or rest[2:3] in ("/", "")


def domain_candidates(uri: str | None, incomplete: str, *, wait: float = COMPLETION_WAIT) -> list[str]:
    """libvirt's domains that start with ``incomplete`` (read-only connection); nothing when
    libvirt is remote, not installed, refuses, or does not answer within ``wait`` seconds."""
    uri = uri or default_uri()
    if not _local(uri):
        return []
    found: list[str] = []

    def ask() -> None:
        try:
            libvirt = libvirt_module()
        except GpuvfioError:
            return
        try:
            conn = libvirt.openReadOnly(uri)
            try:
                found.extend(sorted(d.name() for d in conn.listAllDomains(0) if d.name().startswith(incomplete or "")))
            finally:
                conn.close()
        except libvirt.libvirtError:
            return

    # A daemon can accept and never answer: the question runs beside the Tab, which waits no
    # longer than a person does (a daemon thread: the process ends without it).
    asking = threading.Thread(target=ask, name="complete-domains", daemon=True)
    asking.start()
    asking.join(wait)
    return list(found) if not asking.is_alive() else []
