"""A DomainSpec as libvirt's domain document (gpuvfio.domain.model), checked with libvirt's
own RelaxNG schema.

Every decision is made in gpuvfio.domain.spec; here it is only laid out, element by element,
in the model the readers of defined domains and the diff use too. The document is validated
against ``/usr/share/libvirt/schemas/domain.rng`` (loaded from the file: the schema uses
includes, which break when loaded from a string).
"""

from __future__ import annotations

import functools
import hashlib
import os

from gpuvfio.domain import device_elements as dev
from gpuvfio.domain import model as m
from gpuvfio.domain.spec import DomainSpec
from gpuvfio.errors import GpuvfioError
from gpuvfio.settings import SCHEMA_ENV
from gpuvfio.user_files import for_another_program

# gpuvfio's element in a domain's <metadata>: the devices it assigned (for detach), where the
# guest's SSH is forwarded, and the digest of the document gpuvfio defined (for define).
METADATA_NS = m.METADATA_NS
DIGEST_PLACEHOLDER = "sha256:" + "0" * 64
DEFAULT_SCHEMAS = "/usr/share/libvirt/schemas"


class InvalidDomainXml(GpuvfioError):
    pass


@functools.lru_cache(maxsize=None)
def _schema(path: str):
    from lxml import etree

    if not for_another_program(path):
        raise GpuvfioError(f"libvirt's RelaxNG schema {path} is missing (install libvirt's schemas, e.g. "
                           f"the libvirt-daemon or libvirt-clients package, or set {SCHEMA_ENV})")
    return etree.RelaxNG(file=path)


def render(spec: DomainSpec) -> str:
    """The document, with the digest of its own text (placeholder in place) in gpuvfio's metadata:
    define compares it with the digest recorded when the domain was defined, so any change to
    what gpuvfio wants shows, whatever libvirt adds to the stored definition."""
    text = m.write_domain(document(spec, DIGEST_PLACEHOLDER))
    return text.replace(DIGEST_PLACEHOLDER, "sha256:" + hashlib.sha256(text.encode()).hexdigest())


def validate(xml: str, kind: str = "domain", *, schemas: str | None = None) -> None:
    """``xml`` against libvirt's RelaxNG schema ``kind`` (under ``schemas``: GPUVFIO_LIBVIRT_SCHEMAS
    from the run's settings, else libvirt's installed ones)."""
    from lxml import etree

    try:
        document = etree.fromstring(xml.encode())
    except etree.XMLSyntaxError as exc:
        raise InvalidDomainXml(f"generated XML does not parse: {exc}") from None
    schema = _schema(os.path.join(schemas or DEFAULT_SCHEMAS, f"{kind}.rng"))
    if not schema.validate(document):
        error = schema.error_log.last_error
        raise InvalidDomainXml(f"generated XML fails libvirt's {kind}.rng at line {error.line}: {error.message}")


def domain_xml(spec: DomainSpec, *, schemas: str | None = None) -> str:
    xml = render(spec)
    validate(xml, schemas=schemas)
    return xml


def document(spec: DomainSpec, digest: str) -> m.Domain:
    """The domain ``spec`` decided, in libvirt's element order (formatdomain)."""
    kib, port = spec.memory_kib, spec.asked.user_net_ssh_port
    record = m.Record(digest=digest, devices=tuple(m.RecordedDevice(a) for a in spec.host_devices),
                      ssh=m.RecordedSsh("127.0.0.1", port) if port else None)
    return m.Domain(
        type=spec.asked.virt_type, name=spec.name, metadata=m.Metadata(record), memory=m.Memory("KiB", kib),
        current_memory=m.CurrentMemory("KiB", kib), memory_backing=_memory_backing(spec),
        vcpu=m.Vcpu(placement="static", count=spec.vcpus), cputune=_cputune(spec), numatune=_numatune(spec),
        os=_os(spec), features=_features(spec), cpu=_cpu(spec), clock=m.Clock("utc"),
        on_poweroff="destroy", on_reboot="restart", on_crash="destroy", devices=_devices(spec),
        qemu_commandline=dev.QemuCommandline(tuple(dev.QemuArg(a) for a in spec.qemu_args)) if spec.qemu_args else None,
        qemu_override=_override(spec))


def _memory_backing(spec: DomainSpec) -> m.MemoryBacking | None:
    if not spec.hugepage_kib:
        return None
    if spec.cells:
        pages = tuple(m.Page(spec.hugepage_kib, "KiB", str(index) if spec.guest_cells else None)
                      for index, _ in enumerate(spec.cells))
    else:
        pages = (m.Page(spec.hugepage_kib, "KiB"),)
    return m.MemoryBacking(m.Hugepages(pages))


def _cputune(spec: DomainSpec) -> m.Cputune | None:
    if not spec.cells:
        return None
    pins = tuple(m.Vcpupin(str(vcpu), str(cell.host_cpus[index]))
                 for cell in spec.cells for index, vcpu in enumerate(cell.vcpus))
    return m.Cputune(pins, m.Emulatorpin(spec.emulator_cpuset))


def _numatune(spec: DomainSpec) -> m.Numatune | None:
    if not spec.cells:
        return None
    memnodes = tuple(m.Memnode(index, "strict", str(cell.node)) for index, cell in enumerate(spec.cells)) \
        if spec.guest_cells else ()
    return m.Numatune(m.NumaMemory("strict", spec.nodeset), memnodes)


def _os(spec: DomainSpec) -> m.Os:
    firmware = m.Firmware(tuple(m.FirmwareFeature(enabled, name) for name, enabled in spec.firmware_features)) \
        if spec.firmware_auto else None
    asked = spec.asked
    kernel = asked.kernel
    return m.Os(firmware="efi" if spec.firmware_auto else None, type=m.OsType("x86_64", "q35", "hvm"),
                firmware_features=firmware,
                loader=m.Loader("yes", "pflash", spec.loader) if spec.loader else None,
                nvram=m.Nvram(spec.nvram_template) if spec.loader else None,
                kernel=kernel, initrd=asked.initrd if kernel else None, cmdline=asked.cmdline if kernel else None)


def _features(spec: DomainSpec) -> m.Features:
    kvm = spec.asked.virt_type == "kvm"
    return m.Features(acpi=True, apic=True,
                      hyperv=m.Hyperv("custom", m.VendorId("on", "gpuvfio0000")) if spec.asked.hide_kvm else None,
                      kvm=m.KvmFeatures(m.Hidden("on")) if spec.asked.hide_kvm else None,
                      ioapic=m.Ioapic("kvm") if kvm else None)


def _cpu(spec: DomainSpec) -> m.Cpu:
    kvm = spec.asked.virt_type == "kvm"
    maxphysaddr = None
    if spec.address and spec.address.maxphysaddr:
        mode, bits = spec.address.maxphysaddr
        maxphysaddr = m.MaxPhysAddr("emulate", bits) if mode == "emulate" else m.MaxPhysAddr("passthrough")
    numa = None
    if spec.guest_cells:
        numa = m.CpuNuma(tuple(
            m.Cell(index, f"{cell.vcpus[0]}-{cell.vcpus[-1]}", cell.memory_kib, "KiB",
                   m.Distances(tuple(m.Sibling(s, v) for s, v in spec.distances[index].items()))
                   if spec.distances else None)
            for index, cell in enumerate(spec.cells)))
    return m.Cpu("host-passthrough" if kvm else "maximum", "none", "off" if kvm else None,
                 m.Topology(spec.sockets, 1, spec.cores, spec.threads), maxphysaddr, numa)


def _pci(address, *, guest: bool = False) -> dev.Address:
    return dev.Address("pci" if guest else None, address.domain, address.bus, address.slot, address.function)


def _controllers(spec: DomainSpec) -> tuple[dev.Controller, ...]:
    hole = spec.address.pcihole64_kib if spec.address else None
    out = [dev.Controller("pci", 0, "pcie-root", pcihole64=dev.Pcihole64("KiB", hole) if hole else None)]
    for c in spec.controllers:
        if c.model == "pcie-expander-bus":
            target = dev.ControllerTarget(bus_nr=c.bus_nr, node=c.cell)
        else:
            target = dev.ControllerTarget(c.chassis, c.port) if c.chassis is not None else None
        address = dev.Address("pci", 0, c.parent, c.slot, 0) if c.parent else None
        out.append(dev.Controller("pci", c.index, c.model, dev.ControllerModel(c.qemu_model), None, target, address))
    return tuple(out)


def _hostdevs(spec: DomainSpec) -> tuple[dev.Hostdev, ...]:
    out, assignment = [], spec.assignment
    for slot in assignment.slots:
        rom = dev.Rom(slot.rom.bar, slot.rom.file) if slot.rom else None
        for index, fn in enumerate(slot.functions):
            first = index == 0
            place = slot.guest_address(fn)
            guest = dev.Address("pci", place.domain, place.bus, place.slot, place.function,
                                multifunction="on" if first and len(slot.functions) > 1 else None)
            out.append(dev.Hostdev("subsystem", "pci", "no", source=dev.Source(address=_pci(fn.address)),
                                   alias=dev.Alias(slot.alias) if first and slot.alias else None,
                                   rom=rom if fn.is_gpu else None, address=guest))
    out += [dev.Hostdev("subsystem", "pci", "no", source=dev.Source(address=_pci(vf))) for vf in assignment.vfs]
    out += [dev.Hostdev("subsystem", "mdev", model="vfio-pci", display="off",
                        source=dev.Source(address=dev.Address(uuid=uuid))) for uuid, _ in assignment.mdevs]
    return tuple(out)


def _devices(spec: DomainSpec) -> dev.Devices:
    asked, disks = spec.asked, []
    if asked.disk:
        disks.append(dev.Disk("file", "disk", dev.DiskDriver("qemu", spec.disk_format, "none", "native", "unmap"),
                            dev.Source(file=asked.disk), dev.Target(dev="vda", bus="virtio")))
    if spec.seed_iso:
        disks.append(dev.Disk("file", "cdrom", dev.DiskDriver("qemu", "raw"), dev.Source(file=spec.seed_iso),
                            dev.Target(dev="sda", bus="sata"), readonly=True))
    interfaces = (dev.Interface("network", source=dev.Source(network=asked.network),
                                model=dev.InterfaceModel("virtio")),) if asked.network else ()
    serial = dev.Serial("pty", dev.Log(asked.console_log, "off") if asked.console_log else None, dev.Target(port=0))
    return dev.Devices(_controllers(spec), _hostdevs(spec), tuple(disks), interfaces, (serial,),
                     (dev.Console("pty", dev.Target(type="serial", port=0)),), dev.Memballoon("none"))


def _override(spec: DomainSpec) -> dev.QemuOverride | None:
    if not spec.cliques:
        return None
    return dev.QemuOverride(tuple(
        dev.QemuDevice(alias, dev.QemuFrontend((dev.QemuProperty("x-nv-gpudirect-clique", "unsigned", str(clique)),)))
        for alias, clique in spec.cliques))
