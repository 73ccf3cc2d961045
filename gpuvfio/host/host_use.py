"""What the host itself runs on, per PCI function: the disks it mounts and swaps on, the network
interfaces that carry its addresses and routes, the console it shows. A bind that takes such a
function from its driver takes that from the host (gpuvfio.bind.plan refuses it).

Asked of the kernel, not guessed from a device's class, and all of it read from the root, so a
recording carries it and a test builds it (the layouts are the kernel's, Linux 6.1 and later):

* storage: ``/sys/class/block/NAME`` links to the block device's directory beneath the function
  that owns it (``.../0000:05:00.0/nvme/nvme0/nvme0n1/nvme0n1p3``; a disk behind a SATA/SAS
  controller sits under ``ata*/host*/target*``). NVMe's native multipath puts the namespace's
  head under ``/sys/devices/virtual/nvme-subsystem/nvme-subsysN``, whose ``nvmeM`` links lead
  to its controllers (drivers/nvme/host/core.c). Up the stack: each block device's ``holders/``
  (device-mapper: LUKS, LVM, multipath; md RAID; Documentation/ABI/stable/sysfs-block), a
  mapping's ``dm/name`` and ``dm/uuid`` (its target by the uuid's prefix, as dmsetup and
  cryptsetup write it), an array's ``md/level``. In use: mounted (``/proc/1/mountinfo``, by
  device number, or by its source for btrfs, whose mounts show an anonymous device number),
  a member of a mounted btrfs (``/sys/fs/btrfs/UUID/devices``), or active swap (``/proc/swaps``).
* network: ``/sys/class/net/IF`` beneath its function; up the stack through ``upper_*`` and
  ``master`` links (bond, team, bridge, VLAN: Documentation/ABI/testing/sysfs-class-net); in use
  where an interface carries a route (``/proc/1/net/route``, ``ipv6_route``) or a global IPv6
  address (``if_inet6``); IPv4 addresses show as their subnet routes. PID 1's ``net`` and
  ``mountinfo`` are the host's own namespaces (``/proc/net`` and ``/proc/self`` are links).
* console: a framebuffer (``/sys/class/graphics/fbN``) of the function while the framebuffer
  console is bound (``/sys/class/vtconsole/vtconN``: ``bind`` 1, name "frame buffer device"),
  and a DRM connector of the function that is enabled (``/sys/class/drm/cardN-*``: a display
  is lit).

A tree without ``sys/class/block``, ``sys/class/net``, ``proc/1/mountinfo``, ``proc/swaps`` or
``proc/1/net/route`` cannot say what the host uses: that is an error (fail closed), never a
"nothing".
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections import deque
from dataclasses import dataclass
from enum import Enum

from gpuvfio.address import PciAddress
from gpuvfio.errors import HostReadError
from gpuvfio.host.root import HostRoot
from gpuvfio.text import printable

__all__ = ["UseKind", "HostUse", "HostUseReader", "REQUIRED", "CLASSES", "PROC_FILES"]

# What must be there for the question to be answerable (fail closed).
REQUIRED = (("sys", "class", "block"), ("sys", "class", "net"), ("proc", "1", "mountinfo"), ("proc", "swaps"),
            ("proc", "1", "net", "route"))
CLASSES = ("block", "net", "graphics", "drm", "vtconsole")
PROC_FILES = (("proc", "1", "mountinfo"), ("proc", "swaps"), ("proc", "1", "net", "route"),
              ("proc", "1", "net", "ipv6_route"), ("proc", "1", "net", "if_inet6"))
# Devices or interfaces followed up from one function: a physical volume holds hundreds of LVs, a
# port carries up to 4094 VLANs; past this the answer is "cannot tell", never "unused".
MAX_STACK = 8192
# A function's directory name: a VMD domain has five hex digits (10000:e1:00.0).
_PCI = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
# A dm device's kind, by its uuid's prefix (cryptsetup: CRYPT-LUKS2-..., lvm2: LVM-..., multipath:
# mpath-..., kpartx: partN-...).
_DM_KINDS = (("CRYPT-LUKS", "LUKS"), ("CRYPT-", "dm-crypt"), ("LVM-", "LVM"), ("mpath-", "multipath"),
             ("part", "partition"))
_NET_KINDS = {"bond": "bond", "bridge": "bridge", "vlan": "VLAN", "team": "team", "macvlan": "macvlan"}


class UseKind(str, Enum):
    STORAGE = "storage"
    NETWORK = "network"
    CONSOLE = "console"


@dataclass(frozen=True, slots=True)
class HostUse:
    """One thing the host loses with ``address``: the chain from the function's own device up
    to what the host uses (``("nvme0n1p3", "LUKS luks-3f0c", "LVM vg0-root")``) and what that is
    (``"mounted on /"``)."""

    address: PciAddress
    kind: UseKind
    chain: tuple[str, ...]
    loses: str

    def describe(self) -> str:
        """``0000:05:00.0: nvme0n1p3 holds LUKS luks-3f0c, which holds LVM vg0-root, which is
        mounted on /``; every name escaped for a terminal (a recording's names are not trusted)."""
        verb = "holds" if self.kind is UseKind.STORAGE else "is in"
        text = printable(self.chain[0])
        for i, link in enumerate(self.chain[1:]):
            text += (" " if i == 0 else ", which ") + f"{verb} {printable(link)}"
        text += (", which " if len(self.chain) > 1 else " ") + printable(self.loses)
        return f"{self.address}: {text}"

    def to_json(self) -> dict:
        return {"address": str(self.address), "kind": self.kind.value, "chain": list(self.chain),
                "loses": self.loses}


@dataclass(frozen=True, slots=True)
class _Entry:
    """A class device (``nvme0n1p3``, ``eno1``): the functions it hangs from, and its directory
    relative to ``<root>/sys`` as its class link names it (never followed further)."""

    owners: frozenset[PciAddress]
    rel: str


class HostUseReader:
    """What the host uses, read once from the root; ``uses(address)`` for each function a plan
    takes. Raises HostReadError where the tree cannot answer (fail closed)."""

    def __init__(self, host: HostRoot) -> None:
        self.host = host
        missing = ["/".join(parts) for parts in REQUIRED if not host.exists(host.path(*parts))]
        if missing:
            raise HostReadError(f"cannot tell what the host itself uses: no {', '.join(missing)} in this host's "
                                "tree (a recording made before gpuvfio read them: record the host again)")
        self.entries = {cls: self._class(cls) for cls in CLASSES}
        self._mounts = _mountinfo(self._proc_text("proc", "1", "mountinfo"))
        self._swaps = _swaps(self._proc_text("proc", "swaps"))
        self._btrfs = self._btrfs_members()
        self._routes = _routes(self._proc_text("proc", "1", "net", "route"),
                               self._proc_text("proc", "1", "net", "ipv6_route"))
        self._addresses = _global_ipv6(self._proc_text("proc", "1", "net", "if_inet6"))

    # -- reading ----------------------------------------------------------------------------
    def _proc_text(self, *parts: str) -> str:
        return self.host.read(self.host.path(*parts)) or ""

    def _attr(self, entry: _Entry, *name: str) -> str | None:
        return self.host.read(self.host.sys_path(*entry.rel.split("/"), *name))

    def _class(self, cls: str) -> dict[str, _Entry]:
        directory = self.host.sys_path("class", cls)
        found = {}
        for name in self.host.listdir(directory):
            target = self.host.raw_link(os.path.join(directory, name))
            if target is None:  # the kernel makes every class entry a link
                continue
            rel = _inside_sys(f"class/{cls}/{name}", target)
            found[name] = _Entry(frozenset(self._owners(rel)), rel)
        return found

    def _owners(self, rel: str) -> set[PciAddress]:
        parts = rel.split("/")
        pci = [PciAddress.parse(p) for p in parts if _PCI.fullmatch(p)]
        if pci:
            return {pci[-1]}  # the nearest function above the device: its own
        if "nvme-subsystem" in parts[:-2]:  # a multipath head: the subsystem's controllers own it
            subsystem = "/".join(parts[:parts.index("nvme-subsystem") + 2])
            owners = set()
            for name in self.host.listdir(self.host.sys_path(*subsystem.split("/"))):
                target = self.host.raw_link(self.host.sys_path(*subsystem.split("/"), name)) \
                    if re.fullmatch(r"nvme\d+", name) else None
                if target is not None:
                    ctrl = _inside_sys(f"{subsystem}/{name}", target).split("/")
                    owners |= {PciAddress.parse(p) for p in ctrl if _PCI.fullmatch(p)}
            return owners
        return set()

    def _btrfs_members(self) -> dict[str, str]:
        """Block device name -> the mounted btrfs filesystem (its uuid) it is a member of."""
        fs = self.host.sys_path("fs", "btrfs")
        members = {}
        for uuid in self.host.listdir(fs):
            for name in self.host.listdir(os.path.join(fs, uuid, "devices")):
                members.setdefault(name, uuid)
        return members

    # -- asking -----------------------------------------------------------------------------
    def uses(self, address: PciAddress) -> list[HostUse]:
        """Everything the host loses with ``address``, the default route first."""
        found = self._storage(address) + self._network(address) + self._console(address)
        return sorted(found, key=lambda use: "default route" not in use.loses)

    def owned(self, cls: str, address: PciAddress) -> list[str]:
        return sorted(name for name, entry in self.entries[cls].items() if address in entry.owners)

    def _storage(self, address: PciAddress) -> list[HostUse]:
        block = self.entries["block"]
        found, said = [], set()
        owned = self.owned("block", address)
        for start in owned:
            for chain in self._stack(start, self._holders, block):
                device = chain[-1]
                for loses in self._block_uses(device):
                    if (device, loses) not in said:
                        said.add((device, loses))
                        found.append(HostUse(address, UseKind.STORAGE,
                                             tuple(self._block_label(n, i == 0) for i, n in enumerate(chain)), loses))
        disks = [name for name in owned if not name.startswith(("loop", "ram", "zram"))]
        pools = sorted({source.partition("/")[0] for _dev, source, _point, fstype in self._mounts if fstype == "zfs"})
        if disks and pools:
            # ZFS opens its vdevs itself: the kernel lists no holder, and its mounts name the pool,
            # not a device. Whether these disks are in it cannot be read here: fail closed.
            found.append(HostUse(address, UseKind.STORAGE, (disks[0],), f"may be in the mounted ZFS pool "
                                 f"{', '.join(pools)} (ZFS's disks have no holders in sysfs: gpuvfio cannot tell)"))
        return found

    def _stack(self, start: str, up, known: dict) -> list[tuple[str, ...]]:
        """Every chain from ``start`` up the stack (breadth first, each device once); a stack of
        more than MAX_STACK devices is an error, not a shorter answer."""
        chains, seen, todo = [], {start}, deque([(start,)])
        while todo:
            chain = todo.popleft()
            chains.append(chain)
            for name in up(chain[-1]):
                if name not in seen and name in known:
                    if len(seen) >= MAX_STACK:
                        raise HostReadError(f"more than {MAX_STACK} devices stacked on {printable(start)}")
                    seen.add(name)
                    todo.append(chain + (name,))
        return chains

    def _holders(self, name: str) -> list[str]:
        entry = self.entries["block"][name]
        return self.host.listdir(self.host.sys_path(*entry.rel.split("/"), "holders"))

    def _block_label(self, name: str, first: bool) -> str:
        entry = self.entries["block"][name]
        if first:
            return name
        dm_name = self._attr(entry, "dm", "name")
        if dm_name is not None:
            uuid = self._attr(entry, "dm", "uuid") or ""
            kind = next((k for prefix, k in _DM_KINDS if uuid.startswith(prefix)), "device-mapper")
            return f"{kind} {dm_name}"
        level = self._attr(entry, "md", "level")
        return f"md {name} ({level})" if level else name

    def _block_uses(self, name: str) -> list[str]:
        entry = self.entries["block"][name]
        sources = {f"/dev/{name}"}
        dm_name = self._attr(entry, "dm", "name")
        if dm_name:
            sources.add(f"/dev/mapper/{dm_name}")
        number = self._attr(entry, "dev")
        points = [point for dev, source, point, _fstype in self._mounts if dev == number or source in sources]
        uses = []
        if points:
            shown = ", ".join(points[:3]) + (f" and {len(points) - 3} more" if len(points) > 3 else "")
            uses.append(f"is mounted on {shown}")
        if sources & self._swaps:
            uses.append("is active swap")
        if name in self._btrfs:
            uses.append(f"is in the mounted btrfs filesystem {self._btrfs[name]}")
        return uses

    def _network(self, address: PciAddress) -> list[HostUse]:
        net = self.entries["net"]
        found, said = [], set()
        for start in self.owned("net", address):
            for chain in self._stack(start, self._uppers, net):
                loses = self._net_use(chain[-1])
                if loses and chain[-1] not in said:
                    said.add(chain[-1])
                    found.append(HostUse(address, UseKind.NETWORK,
                                         tuple(self._net_label(n, i == 0) for i, n in enumerate(chain)), loses))
        return found

    def _uppers(self, name: str) -> list[str]:
        entry = self.entries["net"][name]
        directory = self.host.sys_path(*entry.rel.split("/"))
        names = [n[len("upper_"):] for n in self.host.listdir(directory) if n.startswith("upper_")]
        master = self.host.link_name(os.path.join(directory, "master"))
        return sorted(set(names) | ({master} if master else set()))

    def _net_label(self, name: str, first: bool) -> str:
        if first:
            return name
        uevent = self._attr(self.entries["net"][name], "uevent") or ""
        kind = next((_NET_KINDS.get(line[len("DEVTYPE="):], "") for line in uevent.splitlines()
                     if line.startswith("DEVTYPE=")), "")
        return f"{kind} {name}" if kind else name

    def _net_use(self, name: str) -> str | None:
        routes = self._routes.get(name, [])
        defaults = sorted(r[len("default route "):] for r in routes if r.startswith("default route "))
        if defaults:  # (IPv4 ...) before (IPv6 ...)
            many = len(defaults) > 1
            return f"carries the default route{'s' if many else ''} (" + "; ".join(d[1:-1] for d in defaults) + ")"
        if routes:
            return f"carries {len(routes)} route{'s' if len(routes) > 1 else ''} ({', '.join(routes[:3])})"
        addresses = self._addresses.get(name, [])
        if addresses:
            return f"carries the address{'es' if len(addresses) > 1 else ''} {', '.join(addresses[:3])}"
        return None

    def _console(self, address: PciAddress) -> list[HostUse]:
        found = []
        consoles = []
        for name, entry in sorted(self.entries["vtconsole"].items()):
            label = self._attr(entry, "name") or ""
            if self._attr(entry, "bind") == "1" and "frame buffer" in label:
                consoles.append(f"{name}: {label}")
        for fb in self.owned("graphics", address):
            if consoles and re.fullmatch(r"fb\d+", fb):
                found.append(HostUse(address, UseKind.CONSOLE, (fb,),
                                     f"carries the host's text console ({'; '.join(consoles)})"))
        for connector in self.owned("drm", address):
            if "-" in connector and self._attr(self.entries["drm"][connector], "enabled") == "enabled":
                found.append(HostUse(address, UseKind.CONSOLE, (connector,), "is lit (a display is enabled on it)"))
        return found


def _inside_sys(where: str, target: str) -> str:
    """A class link's target as a path relative to ``<root>/sys``; a link out of sys is a tree
    that is not what it claims (sysfs's links are relative and stay inside)."""
    rel = os.path.normpath(os.path.join(os.path.dirname(where), target))
    if os.path.isabs(target) or rel == ".." or rel.startswith("../"):
        raise HostReadError(f"sys/{printable(where)} links outside sys (to {printable(target)})")
    return rel


def _mountinfo(text: str) -> list[tuple[str, str, str, str]]:
    """(major:minor, source, mount point, filesystem type) of each mount (proc(5): the fields
    before the separator ``-``, then the filesystem type and the source)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        if "-" not in fields[6:] or len(fields) < 10:
            continue
        rest = fields[fields.index("-", 6) + 1:]
        mounts.append((fields[2], rest[1] if len(rest) > 1 else "", fields[4], rest[0] if rest else ""))
    return mounts


def _swaps(text: str) -> set[str]:
    return {line.split()[0] for line in text.splitlines()[1:] if line.split()}


def _routes(ipv4: str, ipv6: str) -> dict[str, list[str]]:
    """Interface -> its routes in words ("default route (IPv4 via 10.0.0.1)", "10.0.0.0/24"),
    from /proc/net/route (hex, host byte order: little-endian on x86-64 and arm64) and
    /proc/net/ipv6_route; IPv6 link-local, multicast and host routes say nothing of use."""
    routes: dict[str, list[str]] = {}
    for line in ipv4.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8 or fields[0] == "lo":
            continue
        try:
            dest, gateway, mask = (ipaddress.IPv4Address(int(f, 16).to_bytes(4, "little")) for f in
                                   (fields[1], fields[2], fields[7]))
        except ValueError:
            continue
        if int(dest) == 0 and int(mask) == 0:
            routes.setdefault(fields[0], []).insert(0, f"default route (IPv4 via {gateway})")
        else:
            prefix = bin(int(mask)).count("1")
            routes.setdefault(fields[0], []).append(f"{dest}/{prefix}")
    for line in ipv6.splitlines():
        fields = line.split()
        if len(fields) < 10 or fields[9] == "lo":
            continue
        try:
            dest, plen = ipaddress.IPv6Address(int(fields[0], 16)), int(fields[1], 16)
            gateway = ipaddress.IPv6Address(int(fields[4], 16))
        except ValueError:
            continue
        if plen == 0 and int(dest) == 0:
            via = f" via {gateway}" if int(gateway) else ""
            routes.setdefault(fields[9], []).insert(0, f"default route (IPv6{via})")
        elif plen < 128 and not (dest.is_link_local or dest.is_multicast):
            routes.setdefault(fields[9], []).append(f"{dest}/{plen}")
    return routes


def _global_ipv6(text: str) -> dict[str, list[str]]:
    """Interface -> its global and site-scoped IPv6 addresses (/proc/net/if_inet6: address,
    index, prefix length, scope, flags, name; scope 0x00 global, 0x40 site; link-local 0x20 is
    on every interface that is up and says nothing of use)."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[5] == "lo":
            continue
        try:
            address, scope = ipaddress.IPv6Address(int(fields[0], 16)), int(fields[3], 16)
        except ValueError:
            continue
        if scope in (0x00, 0x40):
            found.setdefault(fields[5], []).append(str(address))
    return found
