"""The libvirt domain elements gpuvfio writes and reads, each declared once.

libvirt's domain XML format (https://libvirt.org/formatdomain.html), as far as gpuvfio sets
or asks it; element and attribute order is libvirt's. Devices are declared in gpuvfio.domain.device_elements. The same classes are written by
gpuvfio.domain.render (what a DomainSpec decided), read back from libvirt by
gpuvfio.virt.defined (who uses a device, pins, placement, SSH, firmware) and compared by
gpuvfio.virt.define; what gpuvfio owns in a definition is the ``owned`` (or ``owned_unless``)
declaration of a field here, not a list kept elsewhere. Parts libvirt adds (UUID, controllers,
guest addresses, MACs) are read where gpuvfio asks about them and otherwise left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuvfio.domain.device_elements import Devices, Hostdev, QemuCommandline, QemuOverride
from gpuvfio.domain.elements import (INT, METADATA_NS, QEMU_NS, YES_NO, Codec, Element, Foreign, attr, child,
                                     children, flag, format_document, leaf, others, parse_document, text)

__all__ = ["Domain", "METADATA_NS", "QEMU_NS", "read_domain", "write_domain"]

# libvirt stores the versioned machine type for an alias: q35 -> pc-q35-7.2.
MACHINE = Codec(str, lambda raw: raw,
                lambda ours, theirs: theirs == ours or (theirs is not None and theirs.startswith(f"pc-{ours}-")))


# -- gpuvfio's own record, in <metadata> ------------------------------------------------------

@dataclass(frozen=True)
class RecordedDevice(Element):
    TAG = "gpuvfio:device"
    address: str | None = attr()


@dataclass(frozen=True)
class RecordedSsh(Element):
    TAG = "gpuvfio:ssh"
    host: str | None = attr()
    port: int | None = attr(codec=INT)


@dataclass(frozen=True)
class Record(Element):
    """What gpuvfio assigned (for detach), where the guest's SSH is forwarded, and the digest of
    the document gpuvfio defined (for define)."""

    TAG = "gpuvfio:domain"
    OPEN_WHEN_EMPTY = True
    digest: str | None = attr()
    devices: tuple[RecordedDevice, ...] = children(RecordedDevice)
    ssh: RecordedSsh | None = child(RecordedSsh)


@dataclass(frozen=True)
class Metadata(Element):
    TAG = "metadata"
    record: Record | None = child(Record)


# -- memory and CPUs ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Memory(Element):
    TAG = "memory"
    unit: str | None = attr()
    kib: int | None = text(INT)


@dataclass(frozen=True)
class CurrentMemory(Memory):
    TAG = "currentMemory"


@dataclass(frozen=True)
class Page(Element):
    TAG = "page"
    size: int | None = attr(codec=INT)
    unit: str | None = attr()
    nodeset: str | None = attr()


@dataclass(frozen=True)
class Hugepages(Element):
    TAG = "hugepages"
    pages: tuple[Page, ...] = children(Page)


@dataclass(frozen=True)
class MemoryBacking(Element):
    TAG = "memoryBacking"
    PARTS = True
    hugepages: Hugepages | None = child(Hugepages, owned=True)
    rest: tuple[Foreign, ...] = others()


@dataclass(frozen=True)
class Vcpu(Element):
    TAG = "vcpu"
    placement: str | None = attr()
    cpuset: str | None = attr()
    count: int | None = text(INT)


@dataclass(frozen=True)
class IothreadId(Element):
    TAG = "iothread"
    id: str | None = attr()


@dataclass(frozen=True)
class IothreadIds(Element):
    TAG = "iothreadids"
    threads: tuple[IothreadId, ...] = children(IothreadId)


@dataclass(frozen=True)
class Vcpupin(Element):
    TAG = "vcpupin"
    vcpu: str | None = attr()
    cpuset: str | None = attr()


@dataclass(frozen=True)
class Emulatorpin(Element):
    TAG = "emulatorpin"
    cpuset: str | None = attr()


@dataclass(frozen=True)
class Iothreadpin(Element):
    TAG = "iothreadpin"
    iothread: str | None = attr()
    cpuset: str | None = attr()


@dataclass(frozen=True)
class Cputune(Element):
    TAG = "cputune"
    PARTS = True
    vcpupins: tuple[Vcpupin, ...] = children(Vcpupin, owned=True)
    emulatorpin: Emulatorpin | None = child(Emulatorpin, owned=True)
    iothreadpins: tuple[Iothreadpin, ...] = children(Iothreadpin, owned=True)
    rest: tuple[Foreign, ...] = others()


@dataclass(frozen=True)
class NumaMemory(Element):
    TAG = "memory"
    mode: str | None = attr()
    nodeset: str | None = attr()


@dataclass(frozen=True)
class Memnode(Element):
    TAG = "memnode"
    cellid: int | None = attr(codec=INT)
    mode: str | None = attr()
    nodeset: str | None = attr()


@dataclass(frozen=True)
class Numatune(Element):
    TAG = "numatune"
    PARTS = True
    memory: NumaMemory | None = child(NumaMemory, owned=True)
    memnodes: tuple[Memnode, ...] = children(Memnode, owned=True)
    rest: tuple[Foreign, ...] = others()


# -- boot --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OsType(Element):
    TAG = "type"
    arch: str | None = attr()
    machine: str | None = attr(codec=MACHINE)
    value: str | None = text()


@dataclass(frozen=True)
class FirmwareFeature(Element):
    TAG = "feature"
    enabled: bool | None = attr(codec=YES_NO)
    name: str | None = attr()


@dataclass(frozen=True)
class Firmware(Element):
    TAG = "firmware"
    features: tuple[FirmwareFeature, ...] = children(FirmwareFeature)


@dataclass(frozen=True)
class Loader(Element):
    TAG = "loader"
    readonly: str | None = attr()
    type: str | None = attr()
    path: str | None = text()


@dataclass(frozen=True)
class Nvram(Element):
    TAG = "nvram"
    template: str | None = attr()
    path: str | None = text()


@dataclass(frozen=True)
class Os(Element):
    TAG = "os"
    PARTS = True
    firmware: str | None = attr()  # efi: libvirt's firmware auto-selection
    type: OsType | None = child(OsType)
    firmware_features: Firmware | None = child(Firmware, owned=True)
    # With auto-selection libvirt fills in the loader and nvram it chose: they are its own.
    loader: Loader | None = child(Loader, owned_unless="firmware")
    nvram: Nvram | None = child(Nvram, owned_unless="firmware")
    kernel: str | None = leaf("kernel", owned=True)
    initrd: str | None = leaf("initrd", owned=True)
    cmdline: str | None = leaf("cmdline", owned=True)


@dataclass(frozen=True)
class Hidden(Element):
    """``<kvm><hidden state='on'/>``: the KVM hypervisor hidden from standard MSR-based discovery."""

    TAG = "hidden"
    state: str | None = attr()


@dataclass(frozen=True)
class VendorId(Element):
    TAG = "vendor_id"
    state: str | None = attr()
    value: str | None = attr()


@dataclass(frozen=True)
class Hyperv(Element):
    TAG = "hyperv"
    mode: str | None = attr()
    vendor_id: VendorId | None = child(VendorId)


@dataclass(frozen=True)
class KvmFeatures(Element):
    TAG = "kvm"
    hidden: Hidden | None = child(Hidden)


@dataclass(frozen=True)
class Ioapic(Element):
    TAG = "ioapic"
    driver: str | None = attr()


@dataclass(frozen=True)
class Features(Element):
    TAG = "features"
    PARTS = True
    acpi: bool = flag("acpi")
    apic: bool = flag("apic")
    hyperv: Hyperv | None = child(Hyperv, owned=True)
    kvm: KvmFeatures | None = child(KvmFeatures, owned=True)
    ioapic: Ioapic | None = child(Ioapic)


@dataclass(frozen=True)
class Topology(Element):
    TAG = "topology"
    sockets: int | None = attr(codec=INT)
    dies: int | None = attr(codec=INT)
    cores: int | None = attr(codec=INT)
    threads: int | None = attr(codec=INT)


@dataclass(frozen=True)
class MaxPhysAddr(Element):
    TAG = "maxphysaddr"
    mode: str | None = attr()
    bits: int | None = attr(codec=INT)


@dataclass(frozen=True)
class Sibling(Element):
    TAG = "sibling"
    id: int | None = attr(codec=INT)
    value: int | None = attr(codec=INT)


@dataclass(frozen=True)
class Distances(Element):
    TAG = "distances"
    siblings: tuple[Sibling, ...] = children(Sibling)


@dataclass(frozen=True)
class Cell(Element):
    TAG = "cell"
    id: int | None = attr(codec=INT)
    cpus: str | None = attr()
    memory: int | None = attr(codec=INT)
    unit: str | None = attr()
    distances: Distances | None = child(Distances)


@dataclass(frozen=True)
class CpuNuma(Element):
    TAG = "numa"
    cells: tuple[Cell, ...] = children(Cell)


@dataclass(frozen=True)
class Cpu(Element):
    TAG = "cpu"
    PARTS = True
    mode: str | None = attr()
    check: str | None = attr()
    migratable: str | None = attr()
    topology: Topology | None = child(Topology, owned=True)
    maxphysaddr: MaxPhysAddr | None = child(MaxPhysAddr, owned=True)
    numa: CpuNuma | None = child(CpuNuma, owned=True)


@dataclass(frozen=True)
class Clock(Element):
    TAG = "clock"
    offset: str | None = attr()


# -- the domain --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Domain(Element):
    TAG = "domain"
    PARTS = True
    DECLARES = ("qemu",)
    type: str | None = attr()
    name: str | None = leaf("name")
    uuid: str | None = leaf("uuid")
    metadata: Metadata | None = child(Metadata, compared=False)
    memory: Memory | None = child(Memory)
    current_memory: CurrentMemory | None = child(CurrentMemory)
    memory_backing: MemoryBacking | None = child(MemoryBacking, owned=True)
    vcpu: Vcpu | None = child(Vcpu)
    iothreads: str | None = leaf("iothreads")  # as written: gpuvfio.virt.pins refuses what is not a count
    iothreadids: IothreadIds | None = child(IothreadIds)
    cputune: Cputune | None = child(Cputune, owned=True)
    numatune: Numatune | None = child(Numatune, owned=True)
    os: Os | None = child(Os)
    features: Features | None = child(Features)
    cpu: Cpu | None = child(Cpu)
    clock: Clock | None = child(Clock)
    on_poweroff: str | None = leaf("on_poweroff")
    on_reboot: str | None = leaf("on_reboot")
    on_crash: str | None = leaf("on_crash")
    devices: Devices | None = child(Devices)
    qemu_commandline: QemuCommandline | None = child(QemuCommandline)
    qemu_override: QemuOverride | None = child(QemuOverride)

    @property
    def record(self) -> Record | None:
        return self.metadata.record if self.metadata is not None else None

    @property
    def hostdevs(self) -> tuple[Hostdev, ...]:
        return self.devices.hostdevs if self.devices is not None else ()


def read_domain(xml: str) -> Domain:
    """A domain's definition (libvirt's, or gpuvfio's own document) as the model; UnreadableXml
    when it is not one."""
    return parse_document(Domain, xml)


def write_domain(domain: Domain) -> str:
    return format_document(domain)
