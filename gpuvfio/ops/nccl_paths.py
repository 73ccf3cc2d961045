"""The path NCCL computes between each pair of a guest's GPUs, on the host and in the guest.

Both sides are computed by one reference of NCCL's own rules (gpuvfio_ncclpaths, NCCL v2.30.7-1
src/graph/topo.cc and paths.cc) on a topology read as NCCL reads it (gpuvfio_ncclxml): the
host's as NCCL's sysfs reader builds it (nccl_topo.host_topology_tree), the guest's from the
topology file gpuvfio writes for it. Where a pair differs, NCCL in the guest would choose its
rings, trees and P2P on another machine than the one the GPUs are in; the plan says so, and
the verifier compares NCCL's own dump in the guest against the host's pairs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from xml.etree import ElementTree as ET

from gpuvfio.address import PciAddress
from gpuvfio.domain import nccl_topo
from gpuvfio.guest.payload import gpuvfio_ncclpaths, gpuvfio_ncclxml
from gpuvfio.host.model import PciFunction
from gpuvfio.host.topology import NCCL_PATH, p2p_rule

__all__ = ["PathPair", "expected_paths", "gpu_pairs", "host_pairs", "p2p_used", "paths_of", "virtual_links"]

ORDER = gpuvfio_ncclpaths.PATH_NAMES


@dataclass(frozen=True)
class PathPair:
    """Two GPUs of a guest (host addresses), NCCL's path type between them on the host and in
    the guest, and whether NCCL uses P2P between them at its default level on each side."""

    a: PciAddress
    b: PciAddress
    host: str
    guest: str | None  # None: the guest's topology does not hold both
    host_p2p: bool
    guest_p2p: bool | None

    @property
    def same(self) -> bool:
        return self.guest == self.host and self.guest_p2p == self.host_p2p

    def kinds(self) -> str:
        """The path on each side, as the plan groups pairs: ``PIX (P2P)`` where both agree."""
        p2p = {True: "P2P", False: "no P2P", None: "?"}
        host = f"{self.host} ({p2p[self.host_p2p]})"
        guest = f"{self.guest} ({p2p[self.guest_p2p]})" if self.guest else "not in the guest's topology"
        return host if self.same else f"host {host}, guest {guest}"

    def to_json(self) -> dict:
        return {"a": str(self.a), "b": str(self.b), "host": self.host, "guest": self.guest,
                "host_p2p": self.host_p2p, "guest_p2p": self.guest_p2p, "same": self.same}


def paths_of(tree: ET.Element) -> dict[tuple[str, str], str]:
    """NCCL's path types between the GPUs of ``tree``, written and read back as NCCL reads it."""
    return gpuvfio_ncclpaths.gpu_paths(gpuvfio_ncclxml.load_topology(nccl_topo.render(tree)))


def p2p_used(path: str, cpu_vendor: str | None, gpus: int) -> bool:
    """Whether NCCL uses P2P over a path of type ``path`` at its default level (host.topology.p2p_rule):
    ncclTopoCheckP2p's ``path->type <= p2pLevel``."""
    level = NCCL_PATH[p2p_rule(cpu_vendor, gpus).farthest].removeprefix("PATH_")
    return ORDER.index(path) <= ORDER.index(level)


def host_pairs(gpus: list[PciFunction], functions: Mapping[PciAddress, PciFunction], cpu_vendor: str | None
               ) -> dict[tuple[PciAddress, PciAddress], str]:
    """NCCL's path type between each pair of ``gpus`` on this host, by host address (host order)."""
    found = paths_of(nccl_topo.host_topology_tree(gpus, functions, cpu_vendor=cpu_vendor))
    return {(a, b): found[(str(a), str(b))] for n, a in enumerate(sorted(f.address for f in gpus))
            for b in sorted(f.address for f in gpus)[n + 1:]}


def gpu_pairs(devices: list[nccl_topo.GuestDevice], guest_tree: ET.Element,
              functions: Mapping[PciAddress, PciFunction], *, host_vendor: str | None,
              guest_vendor: str | None) -> list[PathPair]:
    """Each pair of the GPUs among ``devices`` (the guest's file: ``guest_tree``), host and guest."""
    gpus = [d.port.functions[0] for d in devices if d.port.functions[0].is_nvidia_gpu]
    guest_of = {d.port.functions[0].address: gpuvfio_ncclpaths.bus_name(d.address) for d in devices}
    host = host_pairs(gpus, functions, host_vendor)
    guest = paths_of(guest_tree)
    out = []
    for (a, b), host_type in host.items():
        ga, gb = sorted((guest_of[a], guest_of[b]))
        guest_type = guest.get((ga, gb))
        out.append(PathPair(a, b, host_type, guest_type, p2p_used(host_type, host_vendor, len(gpus)),
                            p2p_used(guest_type, guest_vendor, len(gpus)) if guest_type else None))
    return out


def virtual_links(gpus: list[PciFunction], functions: Mapping[PciAddress, PciFunction]
                  ) -> list[tuple[PciAddress, PciAddress]]:
    """The Broadcom virtual switch links NCCL follows on this host between the switches above
    ``gpus`` (both ends among them: a link elsewhere changes no path between these GPUs). No
    guest has them: QEMU's emulated switches are no Broadcom fabric, and a <pcilink> in the
    guest's file would claim P2P the guest's driver is not told of."""
    chains = {address for gpu in gpus for address in nccl_topo.nccl_chain(gpu)}
    return [(switch, peer) for switch in sorted(chains) if switch in functions
            for peer in functions[switch].switch_links if peer in chains]


def expected_paths(functions: Mapping[PciAddress, PciFunction], addresses: list[PciAddress],
                   cpu_vendor: str | None) -> dict[tuple[str, str], str]:
    """What the verifier holds NCCL's dump in a guest (or on this host) to: NCCL's path type
    between each pair of the NVIDIA GPUs among ``addresses`` on this host, by host address
    (the smaller first)."""
    gpus = [functions[a] for a in dict.fromkeys(addresses) if a in functions and functions[a].is_nvidia_gpu]
    if len(gpus) < 2:
        return {}
    return {(str(a), str(b)): kind for (a, b), kind in host_pairs(gpus, functions, cpu_vendor).items()}
