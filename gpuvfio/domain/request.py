"""A domain request: what the admin asked for, validated once, whatever interface it came from.

The CLI (gpuvfio xml / attach), the Ansible domain module and the testbed spec all build a
DomainRequest through ``domain_request``, so a spelling accepted by one is accepted by all
(``4K``, ``1g``, ``2MiB`` for pages; ``remote`` for NUMA) and bad input reads the same
everywhere. Policy (placement, pinning, the MMIO window) is decided later, in spec.py.
"""

from __future__ import annotations

import os
import re
import uuid as uuidlib
from dataclasses import dataclass

from gpuvfio.domain.address_space import FIRMWARES, VIRT_TYPES
from gpuvfio.domain.versions import parse_version
from gpuvfio.errors import InputError
from gpuvfio.numbers import shown, uint
from gpuvfio.options import DOMAIN
from gpuvfio.sizes import MAX_KIB, format_kib, parse_size_kib

NUMA_WORDS = ("auto", "none", "remote")
TOPOLOGY_CHOICES = DOMAIN["topology"].choices  # auto: mirror the host for two or more devices
P2P_CHOICES = DOMAIN["p2p"].choices
MAX_VCPUS = int(DOMAIN["vcpus"].maximum)
MAX_NUMA_NODE = 1023  # CONFIG_NODES_SHIFT is at most 10 on x86-64


@dataclass
class DomainRequest:
    name: str
    vcpus: int = 4
    memory_kib: int = 8 * 1024 * 1024
    hugepages: str = "auto"  # auto | none | 2M | 1G
    numa: str = "auto"  # auto | none | remote | a node number
    firmware: str = "efi"  # efi | bios
    hide_kvm: bool = False
    mdev: str | None = None
    vgpu: str | None = None
    uuid: str | None = None
    disk: str | None = None
    kernel: str | None = None
    initrd: str | None = None
    cmdline: str | None = None
    network: str | None = None
    virt_type: str = "kvm"  # kvm | qemu (TCG, for hosts without KVM such as the test lanes)
    user_net_ssh_port: int | None = None  # QEMU user networking, host 127.0.0.1:PORT -> guest:22
    console_log: str | None = None  # the guest's serial console, also written to this host file
    force: bool = False
    topology: str = "auto"  # auto | mirror | flat
    p2p: str = "auto"  # auto | off | force: QEMU's x-nv-gpudirect-clique for GPUs the host can route P2P between
    qemu_version: tuple[int, ...] | None = None  # from the libvirt connection, or --qemu-version offline
    libvirt_version: tuple[int, ...] | None = None  # from the libvirt connection only
    loader: str | None = None  # UEFI code image, with nvram_template; None: libvirt auto-selects
    nvram_template: str | None = None
    rom_bar: str | None = None  # on | off: the GPUs' ROM BAR shown to the guest (libvirt <rom bar=>)
    rom_file: str | None = None  # a ROM image the guest sees instead of the GPU's own


def parse_hugepages(text: str) -> str:
    """auto | none | a page size: 4K (= none: the base page), 2M, 1G in any spelling parse_size_kib takes."""
    word = str(text).strip()
    if word.lower() in ("auto", "none"):
        return word.lower()
    try:
        kib = parse_size_kib(word)
    except InputError:
        kib = None
    sizes = {4: "none", 2048: "2M", 1024 * 1024: "1G"}
    if kib not in sizes:
        raise InputError(f"hugepages must be auto, none, 4K, 2M or 1G, not {text!r}")
    return sizes[kib]


def parse_numa(text: str | int) -> str:
    """auto | none | remote (a node without the devices) | a node number."""
    word = str(text).strip().lower()
    if word in NUMA_WORDS:
        return word
    node = uint(word, MAX_NUMA_NODE)
    if node is not None:
        return str(node)
    raise InputError(f"numa must be auto, none, remote or a node number, not {text!r}")


def _qemu_version(text: str) -> tuple[int, ...]:
    """What the user types: ``8.1`` or ``9.2.0``, nothing else (libvirt's own answers, with
    distribution suffixes, go through versions.parse_version)."""
    strict = isinstance(text, str) and re.fullmatch(r"[0-9]{1,6}(\.[0-9]{1,6}){1,2}", text.strip()) is not None
    version = parse_version(text.strip()) if strict else None
    if version is None:
        raise InputError(f"QEMU version must look like 8.1 or 9.2.0, not {text!r}")
    return version


def parse_uuid(text: str) -> str:
    """A UUID in its canonical form (mdev instances, domains)."""
    try:
        return str(uuidlib.UUID(str(text)))
    except ValueError:
        raise InputError(f"not a UUID: {text!r}") from None


def validate_name(name: str) -> str:
    """libvirt refuses '/' and newlines in names (virDomainDefParseXML); we also refuse other
    control characters and leading dots; XML-special characters are escaped when rendered."""
    if not isinstance(name, str) or not name or len(name) > 200:
        raise InputError("domain name must be 1 to 200 characters")
    if "/" in name or any(ord(c) < 0x20 or ord(c) == 0x7F for c in name) or name.startswith("."):
        raise InputError(f"domain name {name!r} contains '/', a control character or a leading dot")
    return name


def _absolute(path: str | None, what: str) -> str | None:
    if path is None:
        return None
    if not isinstance(path, str) or not os.path.isabs(path) or any(c in path for c in "\n\0"):
        raise InputError(f"{what} must be an absolute path: {path!r}")
    return path


def _choice(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise InputError(f"{what} must be {' or '.join(allowed)}, not {value!r}")
    return value


def domain_request(name: str, *, vcpus: int = 4, memory: str | int = "8G", hugepages: str = "auto",
                   numa: str | int = "auto", firmware: str = "efi", virt_type: str = "kvm", hide_kvm: bool = False,
                   mdev: str | None = None, vgpu: str | None = None, uuid: str | None = None,
                   disk: str | None = None, kernel: str | None = None, initrd: str | None = None,
                   cmdline: str | None = None, network: str | None = None, user_net_ssh_port: int | None = None,
                   console_log: str | None = None, force: bool = False, topology: str = "auto",
                   p2p: str = "auto", qemu_version: str | tuple[int, ...] | None = None,
                   loader: str | None = None, nvram_template: str | None = None, rom_bar: str | None = None,
                   rom_file: str | None = None) -> DomainRequest:
    """The one validation of a domain request (bad input: InputError, exit 2)."""
    if isinstance(vcpus, bool) or not isinstance(vcpus, int) or not 1 <= vcpus <= MAX_VCPUS:
        raise InputError(f"vcpus must be an integer between 1 and {MAX_VCPUS}, not {vcpus!r}")
    memory_kib = memory if isinstance(memory, int) and not isinstance(memory, bool) else parse_size_kib(str(memory))
    if memory_kib < 1024:
        raise InputError(f"memory must be at least 1 MiB, not {shown(memory)}")
    if memory_kib > MAX_KIB:
        raise InputError(f"memory must be at most {format_kib(MAX_KIB)}, not {shown(memory)}")
    if mdev and vgpu:
        raise InputError("--mdev and --vgpu exclude each other")
    if kernel is None and (initrd or cmdline):
        raise InputError("--initrd and --cmdline need --kernel")
    if disk and kernel:
        raise InputError("--disk and --kernel exclude each other (one boot source)")
    if cmdline is not None and any(c in cmdline for c in "\n\0"):
        raise InputError("--cmdline must be one line")
    if uuid is not None:
        uuid = parse_uuid(uuid)
    port = user_net_ssh_port
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise InputError(f"user-net SSH port must be 1-65535, not {port!r}")
    if network is not None and (not network or any(c in network for c in "/\n\0")):
        raise InputError(f"not a libvirt network name: {network!r}")
    if (loader is None) != (nvram_template is None):
        raise InputError("--loader and --nvram-template go together (the UEFI code and its variables template)")
    if loader is not None and firmware != "efi":
        raise InputError("--loader/--nvram-template are UEFI firmware: they need --firmware efi")
    if rom_bar is not None and rom_bar not in ("on", "off"):
        raise InputError(f"--rom-bar must be on or off, not {rom_bar!r}")
    if rom_bar == "off" and rom_file is not None:
        raise InputError("--rom-bar off hides the ROM that --rom-file gives: one of them")
    for label, value in (("--mdev", mdev), ("--vgpu", vgpu)):
        if value is not None and (not value.strip() or any(c in value for c in "\n\0")):
            raise InputError(f"{label} needs a vGPU type id or name, not {value!r}")
    return DomainRequest(
        name=validate_name(name), vcpus=vcpus, memory_kib=memory_kib, hugepages=parse_hugepages(hugepages),
        numa=parse_numa(numa), firmware=_choice(firmware, FIRMWARES, "firmware"), hide_kvm=bool(hide_kvm),
        mdev=mdev, vgpu=vgpu, uuid=uuid, disk=_absolute(disk, "--disk"), kernel=_absolute(kernel, "--kernel"),
        initrd=_absolute(initrd, "--initrd"), cmdline=cmdline, network=network,
        virt_type=_choice(virt_type, VIRT_TYPES, "virt type"), user_net_ssh_port=user_net_ssh_port,
        console_log=_absolute(console_log, "--console-log"), force=bool(force),
        topology=_choice(topology, TOPOLOGY_CHOICES, "topology"), p2p=_choice(p2p, P2P_CHOICES, "p2p"),
        qemu_version=qemu_version if isinstance(qemu_version, tuple) or qemu_version is None
        else _qemu_version(qemu_version), loader=_absolute(loader, "--loader"),
        nvram_template=_absolute(nvram_template, "--nvram-template"), rom_bar=rom_bar,
        rom_file=_absolute(rom_file, "--rom-file"))
