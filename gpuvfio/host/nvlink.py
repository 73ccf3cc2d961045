"""NVLink between GPUs, as ``nvidia-smi topo -m`` shows it (``NV#``): read from NVML on the live
host, else from a recording under the root, which ``dump-host`` writes so that fixtures carry it.

Only NVML knows NVLink; sysfs has nothing of it. NVML ("NvLink Methods" in nvml.h) answers per
GPU and per link 0..NVML_NVLINK_MAX_LINKS-1: ``nvmlDeviceGetNvLinkState`` (NVML_FEATURE_ENABLED:
the link is up; NVML_ERROR_NOT_SUPPORTED or NVML_ERROR_INVALID_ARGUMENT: the GPU has no such
link), ``nvmlDeviceGetNvLinkRemotePciInfo_v2`` (the PCI function at the far end) and
``nvmlDeviceGetNvLinkRemoteDeviceType`` (NVML_NVLINK_DEVICE_TYPE_GPU, _IBMNPU, _SWITCH, _UNKNOWN).
NVML sees only the GPUs bound to the nvidia driver: a GPU on vfio-pci is not read, and its
NVLink stays unknown -- never "none".

How many links join two GPUs (the ``#`` of ``NV#``): the links between them; or, when both
reach NVSwitches, the smaller of their switch-link counts, since a switch baseboard carries any
pair's traffic over all of each GPU's switch links (nvidia-smi shows NV18 between every pair of
H100 SXM5 on an HGX H100 baseboard: 18 NVLink4 links per GPU to 4 NVSwitches; NVIDIA's HGX H100
and NVSwitch documentation).

The recording is ``<root>/var/lib/gpuvfio-fixture/nvlink.json``, a path no real host has
(gpuvfio's own state is ``var/lib/gpuvfio``)::

    {"format": "gpuvfio-nvlink", "version": 1, "driver": "550.54.15",
     "gpus": {"0000:1b:00.0": [{"link": 0, "remote": "0000:03:00.0", "type": "switch"}, ...]}}

one entry per GPU that was read (an empty list: it has no active link), the active links only;
or, when the recorded host's NVLink could not be read, ``{"format": ..., "version": 1,
"not_read": "why"}``. A recording is input from anyone (a bug report's fixture) and gpuvfio runs
as root: it is read fail-closed -- bad JSON, NaN, duplicate keys, a wrong shape, or an address
that is not an NVIDIA GPU of this host is one line and exit 2. Two GPUs may disagree on the
links between them (each end reports its own state; a link going down is seen from one end
first): the links both ends report up are counted. A switch's address may lie outside this
host's PCIe (the NVLink switch trays of an NVL72 rack are not on a node's PCIe); it is only
checked to be well formed and not a GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError, HostReadError, InputError
from gpuvfio.host.inventory import read_ids
from gpuvfio.host.model import NVIDIA_VENDOR
from gpuvfio.host.root import HostRoot
from gpuvfio.strictjson import JsonRejected, strict_loads

RECORD = ("var", "lib", "gpuvfio-fixture", "nvlink.json")
RECORD_PATH = "/".join(RECORD)
FORMAT, VERSION = "gpuvfio-nvlink", 1
MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS of current nvml.h (older headers have fewer)
MAX_GPUS = 1024
MAX_BYTES = 1 << 20
MAX_MODULE = 255  # module ids number a baseboard's GPU sockets (1-8 on HGX)
# NVML_NVLINK_DEVICE_TYPE_* (nvml.h) -> the recording's words
REMOTE_TYPES = {0x00: "gpu", 0x01: "npu", 0x02: "switch"}
TYPES = ("gpu", "npu", "switch", "unknown")


class NvmlUnusable(GpuvfioError):
    """NVML cannot be asked (not installed, not initialised, a call failed): NVLink is unknown."""


@dataclass(frozen=True, slots=True)
class NvLink:
    link: int  # the GPU's link number
    remote: PciAddress  # the function at the far end
    kind: str  # gpu, switch, npu (IBM POWER9's NVLink), unknown

    def to_json(self) -> dict:
        return {"link": self.link, "remote": str(self.remote), "type": self.kind}


@dataclass(slots=True)
class NvLinkReading:
    """What is known of NVLink. ``source``: "nvml", "recording", or None (not read: ``reason``
    says why). A recording may itself say its host was not read (source "recording", reason set).
    ``gpus``: the GPUs whose links were read; a GPU not in it is unknown, not link-less."""

    source: str | None
    gpus: dict[PciAddress, tuple[NvLink, ...]] = field(default_factory=dict)
    reason: str | None = None
    driver: str | None = None
    # GPU -> its module id on the baseboard (nvmlDeviceGetModuleId): how the Fabric Manager names
    # GPUs in its partitions, which on HGX H100 carry no PCI bus id (gpuvfio.host.fabric).
    modules: dict[PciAddress, int] = field(default_factory=dict)

    def module_map(self) -> dict[int, PciAddress]:
        return {module: gpu for gpu, module in self.modules.items()}

    @property
    def read(self) -> bool:
        return self.source is not None and self.reason is None

    def switch_links(self, gpu: PciAddress) -> int:
        return sum(1 for link in self.gpus.get(gpu, ()) if link.kind == "switch")

    def links_between(self, a: PciAddress, b: PciAddress) -> int | None:
        """The ``#`` of ``NV#`` between two GPUs; 0: no NVLink; None: not known."""
        if a not in self.gpus or b not in self.gpus:
            return None
        direct = min(_count_to(self.gpus[a], b), _count_to(self.gpus[b], a))  # up at both ends
        if direct:
            return direct
        on_a, on_b = self.switch_links(a), self.switch_links(b)
        if on_a and on_b:
            return min(on_a, on_b)
        if any(link.kind == "unknown" for link in self.gpus[a] + self.gpus[b]):
            return None  # links whose far end NVML could not name: they may well join the two
        return 0

    def to_record(self) -> dict:
        """The recording of this reading (``dump-host``)."""
        record: dict = {"format": FORMAT, "version": VERSION}
        if self.driver:
            record["driver"] = self.driver
        if self.source is None or self.reason is not None:
            record["not_read"] = self.reason or "not read"
        else:
            record["gpus"] = {str(gpu): [link.to_json() for link in links]
                              for gpu, links in sorted(self.gpus.items())}
            if self.modules:
                record["modules"] = {str(gpu): module for gpu, module in sorted(self.modules.items())}
        return record


def _count_to(links: tuple[NvLink, ...], remote: PciAddress) -> int:
    return sum(1 for link in links if link.kind == "gpu" and link.remote == remote)


# -- the host's NVIDIA GPUs and the nvidia driver -------------------------------------------------
def nvidia_gpus(host: HostRoot) -> set[PciAddress]:
    """NVIDIA functions of the display class (03xx) under ``sys/bus/pci/devices``, their ids read
    as the inventory reads them (one ``uevent`` each, in one pass over held directories)."""
    addresses = [PciAddress.try_parse(name) for name in host.listdir(host.sys_path("bus", "pci", "devices"))]
    found = set()
    with host.sys_dirs() as dirs:
        for address in filter(None, addresses):
            vendor, _device, klass = read_ids(host, address, dirs)
            if vendor == NVIDIA_VENDOR and klass.startswith("03"):
                found.add(address)
    return found


def nvidia_bound(host: HostRoot) -> list[PciAddress]:
    """Functions bound to the nvidia driver (``sys/bus/pci/drivers/nvidia/<address>`` links)."""
    names = host.listdir(host.sys_path("bus", "pci", "drivers", "nvidia"))
    return [a for a in (PciAddress.try_parse(n) for n in names) if a is not None]


def is_live(host: HostRoot) -> bool:
    return host.root == "/"


# -- reading -----------------------------------------------------------------------------------
def read_nvlink(host: HostRoot) -> NvLinkReading:
    """NVLink of ``host``: NVML when it is the live host with GPUs on the nvidia driver, else the
    recording under the root, else not read (with the reason)."""
    if is_live(host):
        if not nvidia_bound(host):
            reason = "no device is bound to the nvidia driver (NVML sees only GPUs on it)"
        else:
            try:
                return read_live()
            except NvmlUnusable as exc:
                reason = str(exc)
        recorded = read_recording(host)
        return recorded if recorded is not None else NvLinkReading(None, reason=reason)
    recorded = read_recording(host)
    if recorded is not None:
        return recorded
    return NvLinkReading(None, reason=f"the root is not the live host and holds no NVLink recording "
                                      f"({RECORD_PATH}, written by dump-host)")


def read_live() -> NvLinkReading:
    try:
        import pynvml
    except ImportError:
        raise NvmlUnusable("pynvml is not installed (pip install nvidia-ml-py)") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnusable(f"NVML is not available ({exc})") from None
    try:
        return read_from_nvml(pynvml)
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _bus_id(value) -> PciAddress:
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
    address = PciAddress.try_parse(text)
    if address is None:
        raise NvmlUnusable(f"NVML gave a PCI bus id gpuvfio cannot read: {text[:40]!r}")
    return address


def read_from_nvml(nvml) -> NvLinkReading:
    """Every GPU's active links through ``nvml``: the pynvml module (or anything with its
    interface), initialised by the caller."""
    absent = (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_INVALID_ARGUMENT)
    max_links = min(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", MAX_LINKS)), MAX_LINKS)
    gpus: dict[PciAddress, list[NvLink]] = {}
    modules: dict[PciAddress, int] = {}
    where = "nvmlSystemGetDriverVersion"
    try:
        driver = nvml.nvmlSystemGetDriverVersion()
        driver = driver.decode("ascii", "replace") if isinstance(driver, bytes) else str(driver)
        where = "nvmlDeviceGetCount"
        for index in range(nvml.nvmlDeviceGetCount()):
            where = f"GPU {index}"
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            gpu = _bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
            where = str(gpu)
            links = gpus.setdefault(gpu, [])
            module = _module_id(nvml, handle, absent)
            if module is not None:
                modules[gpu] = module
            for number in range(max_links):
                try:
                    state = nvml.nvmlDeviceGetNvLinkState(handle, number)
                except nvml.NVMLError as exc:
                    if getattr(exc, "value", None) in absent:
                        continue
                    raise
                if state != nvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, number).busId)
                try:
                    kind = REMOTE_TYPES.get(nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, number), "unknown")
                except nvml.NVMLError as exc:
                    if getattr(exc, "value", None) not in absent + (nvml.NVML_ERROR_FUNCTION_NOT_FOUND,):
                        raise
                    kind = ""
                links.append(NvLink(number, remote, kind))
    except nvml.NVMLError as exc:
        raise NvmlUnusable(f"NVML failed reading NVLink ({where}: {exc})") from None
    # A far end NVML cannot type (drivers without nvmlDeviceGetNvLinkRemoteDeviceType, or
    # NVML_NVLINK_DEVICE_TYPE_UNKNOWN) is a GPU when NVML lists it; anything else stays unknown.
    result = {gpu: tuple(NvLink(link.link, link.remote, "gpu" if link.remote in gpus else "unknown")
                         if link.kind in ("", "unknown") else link for link in links)
              for gpu, links in gpus.items()}
    driver = driver.strip()[:64]
    if len(set(modules.values())) != len(modules):
        modules = {}  # two GPUs claiming one module: not a baseboard's numbering, so none
    return NvLinkReading("nvml", result, driver=driver if driver and driver.isprintable() else None,
                         modules=modules)


def _module_id(nvml, handle, absent) -> int | None:
    """The GPU's module id on an HGX baseboard (nvmlDeviceGetModuleId, NVML 12.x); None where the
    driver or the GPU has none (PCIe cards, older drivers)."""
    query = getattr(nvml, "nvmlDeviceGetModuleId", None)
    if query is None:
        return None
    try:
        value = query(handle)
    except nvml.NVMLError as exc:
        if getattr(exc, "value", None) in absent + (nvml.NVML_ERROR_FUNCTION_NOT_FOUND,):
            return None
        raise
    return value if type(value) is int and 0 <= value <= MAX_MODULE else None


# -- the recording -----------------------------------------------------------------------------
def read_recording(host: HostRoot) -> NvLinkReading | None:
    """The recording under the root, checked against the host; None when there is none."""
    path = host.config_path(*RECORD)
    data = host.read_head(path, MAX_BYTES + 1)
    if data is None:
        if host.is_dir(path):
            raise HostReadError(f"cannot read the NVLink recording {RECORD_PATH}: it is a directory")
        return None
    if len(data) > MAX_BYTES:
        raise InputError(f"NVLink recording {RECORD_PATH}: larger than {MAX_BYTES} bytes")
    return parse_recording(data, nvidia_gpus(host))


def _bad(what: str) -> InputError:
    return InputError(f"NVLink recording {RECORD_PATH}: {what}")


def _text(value, what: str, limit: int) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > limit or not value.isprintable():
        raise _bad(f"{what} must be one line of at most {limit} printable characters")
    return value


def _address(value, what: str) -> PciAddress:
    address = PciAddress.try_parse(value) if isinstance(value, str) and len(value) <= 16 else None
    if address is None:
        raise _bad(f"{what} is not a PCI address: {str(value)[:40]!r}")
    return address


def parse_recording(data: bytes, host_gpus: set[PciAddress]) -> NvLinkReading:
    """A recording's bytes, checked fail-closed; ``host_gpus``: the host's NVIDIA GPUs."""
    try:
        record = strict_loads(data)
    except JsonRejected as exc:
        raise _bad(str(exc)) from None
    if not isinstance(record, dict):
        raise _bad("not a JSON object")
    unknown = sorted(set(record) - {"format", "version", "driver", "gpus", "modules", "not_read"})
    if unknown:
        raise _bad(f"unknown key {unknown[0][:40]!r}")
    if record.get("format") != FORMAT or type(record.get("version")) is not int or record["version"] != VERSION:
        raise _bad(f"not a {FORMAT} version {VERSION} record")
    driver = _text(record["driver"], "driver", 64) if "driver" in record else None
    if ("gpus" in record) == ("not_read" in record):
        raise _bad("needs exactly one of gpus and not_read")
    if "not_read" in record:
        return NvLinkReading("recording", reason=_text(record["not_read"], "not_read", 500), driver=driver)
    entries = record["gpus"]
    if not isinstance(entries, dict) or len(entries) > MAX_GPUS:
        raise _bad(f"gpus must be an object of at most {MAX_GPUS} GPUs")
    gpus: dict[PciAddress, tuple[NvLink, ...]] = {}
    for key, links in entries.items():
        gpu = _address(key, "a GPU")
        if gpu in gpus:
            raise _bad(f"GPU {gpu} appears twice")
        if gpu not in host_gpus:
            raise _bad(f"{gpu} is not an NVIDIA GPU of this host")
        gpus[gpu] = _links(gpu, links, host_gpus)
    return NvLinkReading("recording", gpus, driver=driver, modules=_modules(record.get("modules", {}), gpus))


def _modules(entries, gpus: dict[PciAddress, tuple[NvLink, ...]]) -> dict[PciAddress, int]:
    if not isinstance(entries, dict) or len(entries) > MAX_GPUS:
        raise _bad(f"modules must be an object of at most {MAX_GPUS} GPUs")
    modules: dict[PciAddress, int] = {}
    for key, module in entries.items():
        gpu = _address(key, "a GPU")
        if gpu not in gpus:
            raise _bad(f"modules: {gpu} is not one of the recorded GPUs")
        if type(module) is not int or not 0 <= module <= MAX_MODULE or module in modules.values():
            raise _bad(f"modules: {gpu} needs a module id of its own, 0-{MAX_MODULE}")
        modules[gpu] = module
    return modules


def _links(gpu: PciAddress, links, host_gpus: set[PciAddress]) -> tuple[NvLink, ...]:
    if not isinstance(links, list) or len(links) > MAX_LINKS:
        raise _bad(f"{gpu}: links must be a list of at most {MAX_LINKS}")
    result, numbers = [], set()
    for item in links:
        if not isinstance(item, dict) or set(item) != {"link", "remote", "type"}:
            raise _bad(f"{gpu}: each link is an object with exactly link, remote and type")
        number, kind = item["link"], item["type"]
        if type(number) is not int or not 0 <= number < MAX_LINKS or number in numbers:
            raise _bad(f"{gpu}: link numbers are distinct integers 0-{MAX_LINKS - 1}")
        numbers.add(number)
        if kind not in TYPES:
            raise _bad(f"{gpu}: link {number} has type {str(kind)[:20]!r} (one of {', '.join(TYPES)})")
        remote = _address(item["remote"], f"{gpu} link {number}'s remote")
        if remote.device == gpu.device:
            raise _bad(f"{gpu}: link {number} leads to the GPU itself")
        if kind == "gpu" and remote not in host_gpus:
            raise _bad(f"{gpu}: link {number} leads to {remote}, which is not an NVIDIA GPU of this host")
        if kind in ("switch", "npu") and remote in host_gpus:
            raise _bad(f"{gpu}: link {number} leads to the GPU {remote} but says {kind}")
        result.append(NvLink(number, remote, kind))
    return tuple(sorted(result, key=lambda link: link.link))


def record_text(host: HostRoot) -> str | None:
    """What ``dump-host`` records of NVLink: the reading, or on the live host with NVIDIA GPUs
    why it could not be read; None when there is nothing to record (a tree without a recording)."""
    reading = read_nvlink(host)
    if reading.source is None and not (is_live(host) and nvidia_gpus(host)):
        return None
    return json.dumps(reading.to_record(), sort_keys=True, separators=(",", ":"))
