"""Human names for PCI IDs from the system's pci.ids (packages pci.ids / hwdata).

gpuvfio never bundles or hand-writes an ID table for the names it shows (the table it ships,
gpuvfio/host/nvidia_ids.txt, generated from NVIDIA's plugin's pci.ids, gives the KubeVirt export
its names and the P2P rules each NVIDIA device's architecture and line: gpuvfio.host.nvidia_ids). The
database file is searched in ``GPUVFIO_PCI_IDS``, then under the host root, then on the system
running gpuvfio.
Lookups are lazy: the file is read once and only the vendor blocks asked for are
searched (a full parse of ~36k lines would dominate a small inventory).
"""

from __future__ import annotations

import re

from gpuvfio.files import HOST_TEXT_LIMIT
from gpuvfio.user_files import read_regular
from gpuvfio.host.root import HostRoot

PCI_IDS_LIMIT = HOST_TEXT_LIMIT  # pci.ids was 1.4 MB in 2024
_CANDIDATES = ("usr/share/misc/pci.ids", "usr/share/hwdata/pci.ids", "usr/share/pci.ids")
_TOP_LEVEL = re.compile(rb"\n(?:[0-9a-f]{4}|C [0-9a-f]{2})  ")


class PciIds:
    def __init__(self, data: bytes | None) -> None:
        self._data = data or b""
        self._vendor_cache: dict[str, tuple[int, int] | None] = {}
        self._class_cache: dict[str, tuple[int, int] | None] = {}
        self._device_cache: dict[tuple[str, str], str | None] = {}
        self._classes_at: int | None = None

    @classmethod
    def load(cls, host: HostRoot | None = None) -> "PciIds":
        """The first database found: GPUVFIO_PCI_IDS (a regular file), the host root's (links
        followed as the host follows them, inside the root), this system's. A FIFO, a device or
        a file over PCI_IDS_LIMIT where one is expected is an error, never waited on or read whole."""
        hosts = [host or HostRoot("/")]
        named = hosts[0].settings.pci_ids  # GPUVFIO_PCI_IDS, read when the host was built
        if named:
            data = read_regular(named, PCI_IDS_LIMIT)
            if data is not None:
                return cls(b"\n" + data)
        if hosts[0].root != "/":
            hosts.append(HostRoot("/"))
        for where in hosts:
            for candidate in _CANDIDATES:
                data = where.read_head(where.config_path(candidate), PCI_IDS_LIMIT, head=False)
                if data is not None:
                    return cls(b"\n" + data)
        return cls(None)

    def _classes_start(self) -> int:
        """Where the class list begins (pci.ids keeps it after every vendor, near the end): a
        class is searched from there, not through the 1.4 MB of vendors each time."""
        if self._classes_at is None:
            self._classes_at = max(self._data.find(b"\nC "), 0)
        return self._classes_at

    @property
    def available(self) -> bool:
        return bool(self._data)

    def _block(self, key: bytes, cache: dict, cache_key: str, begin: int = 0) -> tuple[int, int] | None:
        if cache_key in cache:
            return cache[cache_key]
        start = self._data.find(key, begin)
        span = None
        if start >= 0:
            start += 1
            nxt = _TOP_LEVEL.search(self._data, start + len(key) - 1)
            span = (start, nxt.start() if nxt else len(self._data))
        cache[cache_key] = span
        return span

    @staticmethod
    def _name(line_start: int, data: bytes, prefix_len: int) -> str:
        end = data.find(b"\n", line_start)
        return data[line_start + prefix_len:end if end >= 0 else None].decode("utf-8", "replace").strip()

    def vendor(self, vendor_id: str) -> str | None:
        span = self._block(b"\n" + vendor_id.encode() + b"  ", self._vendor_cache, vendor_id)
        return self._name(span[0], self._data, 6) if span else None

    def device(self, vendor_id: str, device_id: str) -> str | None:
        key = (vendor_id, device_id)
        if key not in self._device_cache:
            self._device_cache[key] = self._device(vendor_id, device_id)
        return self._device_cache[key]

    def _device(self, vendor_id: str, device_id: str) -> str | None:
        span = self._block(b"\n" + vendor_id.encode() + b"  ", self._vendor_cache, vendor_id)
        if not span:
            return None
        pos = self._data.find(b"\n\t" + device_id.encode() + b"  ", span[0], span[1])
        return self._name(pos + 1, self._data, 7) if pos >= 0 else None

    def class_name(self, class_id: str) -> str | None:
        """Name for a 6-hex-digit class code: the subclass name, else the class name."""
        base, sub = class_id[0:2], class_id[2:4]
        span = self._block(b"\nC " + base.encode() + b"  ", self._class_cache, base, self._classes_start())
        if not span:
            return None
        name = self._name(span[0], self._data, 5)
        pos = self._data.find(b"\n\t" + sub.encode() + b"  ", span[0], span[1])
        if pos < 0:
            return name
        # The subclass name, as lspci prints it in its Class field.
        return self._name(pos + 1, self._data, 5)
