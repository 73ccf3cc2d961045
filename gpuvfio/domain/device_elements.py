"""The device elements of a libvirt domain gpuvfio writes and reads (``<devices>`` and QEMU's
``<qemu:commandline>`` / ``<qemu:override>``), each declared once; gpuvfio.domain.model
puts them in the domain. libvirt's formats: https://libvirt.org/formatdomain.html#devices
and "QEMU command-line passthrough" (https://libvirt.org/drvqemu.html#pass-through-of-arbitrary-qemu-commands).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuvfio.address import MAX_FUNCTION, MAX_SLOT
from gpuvfio.domain.elements import INT, Element, Foreign, attr, child, children, flag, hex_codec, leaf, others, text

PCI_DOMAIN, PCI_BUS = hex_codec(4, 0xFFFFFFFF), hex_codec(2, 0xFF)
PCI_SLOT, PCI_FUNCTION = hex_codec(2, MAX_SLOT), hex_codec(1, MAX_FUNCTION)
PORT = hex_codec(1, 0xFF)


# -- devices -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Address(Element):
    """A PCI address (a host function's source, or a guest slot with ``type='pci'``), or an
    mdev's UUID."""

    TAG = "address"
    type: str | None = attr()
    domain: int | None = attr(codec=PCI_DOMAIN)
    bus: int | None = attr(codec=PCI_BUS)
    slot: int | None = attr(codec=PCI_SLOT)
    function: int | None = attr(codec=PCI_FUNCTION)
    uuid: str | None = attr()
    multifunction: str | None = attr()


@dataclass(frozen=True)
class ControllerModel(Element):
    TAG = "model"
    name: str | None = attr()


@dataclass(frozen=True)
class Pcihole64(Element):
    TAG = "pcihole64"
    unit: str | None = attr()
    kib: int | None = text(INT)


@dataclass(frozen=True)
class ControllerTarget(Element):
    TAG = "target"
    chassis: int | None = attr(codec=INT)
    port: int | None = attr(codec=PORT)
    bus_nr: int | None = attr("busNr", INT)
    node: int | None = leaf("node", INT)


@dataclass(frozen=True)
class Controller(Element):
    TAG = "controller"
    type: str | None = attr()
    index: int | None = attr(codec=INT)
    model: str | None = attr()
    model_name: ControllerModel | None = child(ControllerModel)
    pcihole64: Pcihole64 | None = child(Pcihole64)
    target: ControllerTarget | None = child(ControllerTarget)
    address: Address | None = child(Address)


@dataclass(frozen=True)
class Source(Element):
    """A device's source: a host address, a file, or a libvirt network."""

    TAG = "source"
    file: str | None = attr()
    network: str | None = attr()
    address: Address | None = child(Address)


@dataclass(frozen=True)
class Alias(Element):
    TAG = "alias"
    name: str | None = attr()


@dataclass(frozen=True)
class Rom(Element):
    TAG = "rom"
    bar: str | None = attr()
    file: str | None = attr()


@dataclass(frozen=True)
class Hostdev(Element):
    TAG = "hostdev"
    mode: str | None = attr()
    type: str | None = attr()
    managed: str | None = attr()
    model: str | None = attr()
    display: str | None = attr()
    source: Source | None = child(Source)
    alias: Alias | None = child(Alias)
    rom: Rom | None = child(Rom)
    address: Address | None = child(Address)


@dataclass(frozen=True)
class DiskDriver(Element):
    TAG = "driver"
    name: str | None = attr()
    type: str | None = attr()
    cache: str | None = attr()
    io: str | None = attr()
    discard: str | None = attr()


@dataclass(frozen=True)
class Target(Element):
    """A disk's, serial port's or console's target."""

    TAG = "target"
    type: str | None = attr()
    dev: str | None = attr()
    bus: str | None = attr()
    port: int | None = attr(codec=INT)


@dataclass(frozen=True)
class Disk(Element):
    TAG = "disk"
    type: str | None = attr()
    device: str | None = attr()
    driver: DiskDriver | None = child(DiskDriver)
    source: Source | None = child(Source)
    target: Target | None = child(Target)
    readonly: bool = flag("readonly")


@dataclass(frozen=True)
class Mac(Element):
    TAG = "mac"
    address: str | None = attr()


@dataclass(frozen=True)
class InterfaceModel(Element):
    TAG = "model"
    type: str | None = attr()


@dataclass(frozen=True)
class Interface(Element):
    TAG = "interface"
    type: str | None = attr()
    mac: Mac | None = child(Mac)
    source: Source | None = child(Source)
    model: InterfaceModel | None = child(InterfaceModel)


@dataclass(frozen=True)
class Log(Element):
    TAG = "log"
    file: str | None = attr()
    append: str | None = attr()


@dataclass(frozen=True)
class Serial(Element):
    TAG = "serial"
    type: str | None = attr()
    log: Log | None = child(Log)
    target: Target | None = child(Target)


@dataclass(frozen=True)
class Console(Element):
    TAG = "console"
    type: str | None = attr()
    target: Target | None = child(Target)


@dataclass(frozen=True)
class Memballoon(Element):
    TAG = "memballoon"
    model: str | None = attr()


@dataclass(frozen=True)
class Devices(Element):
    TAG = "devices"
    PARTS = True
    controllers: tuple[Controller, ...] = children(Controller)
    hostdevs: tuple[Hostdev, ...] = children(Hostdev, owned=True)
    disks: tuple[Disk, ...] = children(Disk, owned=True)
    interfaces: tuple[Interface, ...] = children(Interface, owned=True)
    serials: tuple[Serial, ...] = children(Serial)
    consoles: tuple[Console, ...] = children(Console)
    memballoon: Memballoon | None = child(Memballoon)


# -- QEMU's namespace --------------------------------------------------------------------------

@dataclass(frozen=True)
class QemuArg(Element):
    TAG = "qemu:arg"
    value: str | None = attr()


@dataclass(frozen=True)
class QemuCommandline(Element):
    TAG = "qemu:commandline"
    PARTS = True
    args: tuple[QemuArg, ...] = children(QemuArg, owned=True)
    rest: tuple[Foreign, ...] = others()


@dataclass(frozen=True)
class QemuProperty(Element):
    TAG = "qemu:property"
    name: str | None = attr()
    type: str | None = attr()
    value: str | None = attr()


@dataclass(frozen=True)
class QemuFrontend(Element):
    TAG = "qemu:frontend"
    properties: tuple[QemuProperty, ...] = children(QemuProperty)


@dataclass(frozen=True)
class QemuDevice(Element):
    TAG = "qemu:device"
    alias: str | None = attr()
    frontend: QemuFrontend | None = child(QemuFrontend)


@dataclass(frozen=True)
class QemuOverride(Element):
    TAG = "qemu:override"
    devices: tuple[QemuDevice, ...] = children(QemuDevice)
