"""Which libvirt domains (running or only defined) use given PCI functions.

Each definition is read by gpuvfio.virt.defined (one reader of a defined domain). The caller passes the
domains as listed (gpuvfio.virt.defined.read_all or listed); how the connection is chosen, and
what happens when libvirt does not answer, is one policy in gpuvfio.ops.
"""

from __future__ import annotations

from typing import Callable, Iterable

from gpuvfio.address import PciAddress
from gpuvfio.virt.defined import HostDomain


def assignments(domains: Iterable[HostDomain], *, exclude: str | None = None) -> dict[str, list[str]]:
    """Which of ``domains`` assign each PCI address (as text) and each mdev UUID, in their live or
    persistent definition; ``exclude``: a domain not to count."""
    found: dict[str, list[str]] = {}
    for domain in (d for d in domains if d.name != exclude):
        keys = {str(a) for d in domain.definitions for a in d.hostdevs} | {u for d in domain.definitions for u in d.mdevs}
        for key in sorted(keys):
            found.setdefault(key, []).append(domain.name)
    return found


def domains_using(domains: Iterable[HostDomain], addresses: list[PciAddress], *, exclude: str | None = None,
                  mdev_parent: Callable[[str], PciAddress | None] = lambda uuid: None) -> dict[PciAddress, list[str]]:
    """Per address, the domains whose live or persistent definition assigns it, directly or as the
    parent of an mdev they use (``mdev_parent``: the GPU an mdev UUID lives on); ``exclude``: a
    domain not to count, the one an attach is about to replace."""
    used: dict[PciAddress, list[str]] = {a: [] for a in addresses}
    for key, names in assignments(domains, exclude=exclude).items():
        address = PciAddress.try_parse(key) or mdev_parent(key)
        if address in used:
            used[address] += [n for n in names if n not in used[address]]
    return used
