"""Minimum versions of QEMU, the kernel, libvirt and OVMF for what a domain plan relies on,
and the check that prints them against what a host has.

Each entry names where the version was confirmed. Corrections to the issue's list: before
QEMU 8.1 the clique capability goes at 0xC8, where Turing and newer GPUs have MSI-X, and adding
it fails the device's realize, so QEMU does not start the VM (not a guest crash); the Gen5 link
speeds are x-speed values 32/64 of pcie-root-port and the downstream
port, whose x-speed/x-width properties date from QEMU 4.0 (they stopped at 16 GT/s); big-BAR
mapping needs the kernel's huge pfnmap (6.12, faults) and QEMU 9.2's aligned mmaps together,
and 6.15 makes DMA-mapping those BARs fast. Added: QEMU 6.0 (TCG phys-bits), 7.1 (the
phys-bits start check and AMD 1 TiB hole the planner models), OVMF edk2-stable202211 (the
dynamic window) and libvirt 9.3 (<maxphysaddr limit=>).

Distribution kernels and QEMU builds backport fixes: a version below the minimum is "missing"
by number, which the printed reason lets a user weigh.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuvfio.numbers import uint

COMPONENTS = ("qemu", "kernel", "libvirt", "ovmf")
NAMES = {"qemu": "QEMU", "kernel": "kernel", "libvirt": "libvirt", "ovmf": "OVMF (edk2)"}


@dataclass(frozen=True)
class Minimum:
    component: str
    version: tuple[int, int, int]
    feature: str
    why: str


MINIMUMS: tuple[Minimum, ...] = (
    Minimum("qemu", (6, 0, 0), "tcg-phys-bits",
            "TCG takes phys-bits other than 40 (target/i386/cpu.c x86_cpu_realizefn; "
            "'target/i386: allow modifying TCG phys-addr-bits', March 2021)"),
    Minimum("qemu", (7, 1, 0), "phys-bits-check",
            "QEMU refuses to start when RAM + pci-hole64 pass phys-bits and moves RAM above 1 TiB on AMD "
            "(hw/i386/pc.c pc_memory_init, enforce_amd_1tb_hole for q35 7.1+); older QEMU starts and the "
            "guest breaks later"),
    Minimum("qemu", (8, 1, 0), "nv-clique-turing",
            "x-nv-gpudirect-clique on Turing and newer: the capability goes at 0xD4 because these GPUs have "
            "MSI-X at 0xC8; before 8.1 adding it fails and the VM does not start (hw/vfio/pci-quirks.c "
            "vfio_add_nv_gpudirect_cap, 'Support alternate offset for GPUDirect Cliques', June 2023)"),
    Minimum("qemu", (9, 0, 0), "gen5-root-port",
            "root/downstream port x-speed=32 (Gen5) or 64 (Gen6) with x-width: 'pcie: Support PCIe Gen5/Gen6 "
            "link speeds' (qapi/common.json PCIELinkSpeed, hw/pci/pcie.c); 4.0-8.2 stop at 16 GT/s"),
    Minimum("qemu", (9, 2, 0), "bar-mmap-align",
            "BAR mmaps aligned so the kernel maps big BARs with 1 GiB pages: faster VM start "
            "(hw/vfio/helpers.c vfio_region_mmap, 'vfio/helpers: Align mmaps' 00b519c0bca0)"),
    Minimum("kernel", (5, 15, 0), "reset-method",
            "sysfs reset_method lists and orders a device's resets (Documentation/ABI/testing/sysfs-bus-pci; "
            "d88f521da3ef 'PCI: Allow userspace to query and set device reset mechanism')"),
    Minimum("kernel", (6, 12, 0), "huge-pfnmap",
            "vfio-pci faults BARs in with PMD/PUD mappings (f9e54c3a2f5b 'vfio/pci: implement huge_fault "
            "support'); before it a big BAR maps 4 KiB at a time"),
    Minimum("kernel", (6, 15, 0), "huge-pfnmap-dma",
            "vfio type1 DMA-maps a huge-mapped BAR a mapping at a time: ~1 s for 32 GiB becomes under 1 ms "
            "(0fd06844de5d 'vfio/type1: Use mapping page mask for pfnmaps')"),
    Minimum("libvirt", (8, 2, 0), "qemu-override",
            "<qemu:override><qemu:frontend> sets x-nv-gpudirect-clique on a -device given as JSON "
            "(docs/drvqemu.rst)"),
    Minimum("libvirt", (8, 7, 0), "maxphysaddr",
            "<cpu><maxphysaddr mode='passthrough'|'emulate' bits=/> (docs/formatdomain.rst)"),
    Minimum("libvirt", (9, 3, 0), "maxphysaddr-limit",
            "<maxphysaddr mode='passthrough' limit=/> caps the host's bits (docs/formatdomain.rst)"),
    Minimum("ovmf", (2022, 11, 0), "ovmf-dynamic-window",
            "OVMF sizes its 64-bit window from trusted phys-bits (OvmfPkg/Library/PlatformInitLib/"
            "MemDetect.c PlatformDynamicMmioWindow, edk2-stable202211); older builds keep 32 GiB unless "
            "opt/ovmf/X-PciMmio64Mb says more"),
)
BY_FEATURE = {m.feature: m for m in MINIMUMS}


@dataclass(frozen=True)
class Row:
    feature: str
    needed: str  # "QEMU 8.1.0"
    have: str | None  # "QEMU 7.2.0", None when unknown
    status: str  # ok | missing | unknown
    why: str

    def to_json(self) -> dict:
        return {"feature": self.feature, "needed": self.needed, "have": self.have,
                "status": self.status, "why": self.why}


_VERSION = re.compile(r"([0-9]+)\.([0-9]+)(?:\.([0-9]+))?", re.ASCII)


def _triple(match) -> tuple[int, int, int] | None:
    """(major, minor, micro) of a _VERSION match; None without one, or with a part of more than
    20 digits (no version has one)."""
    if not match:
        return None
    parts = (uint(match.group(1)), uint(match.group(2)), uint(match.group(3) or "0"))
    return None if None in parts else parts


def parse_version(text: str | int | None) -> tuple[int, int, int] | None:
    """(major, minor, micro) from '8.1', '9.2.0', 'QEMU emulator version 7.2.0 (Debian 1:7.2+dfsg-7)',
    '2022.11-6', or libvirt's getVersion()/getLibVersion() number (9000000 -> (9, 0, 0));
    None when there is none."""
    number = text if isinstance(text, int) else None
    if isinstance(text, str) and len(text.strip()) >= 7:
        number = uint(text.strip())
    if number is not None:
        return number // 1_000_000, number // 1000 % 1000, number % 1000
    return _triple(_VERSION.search(text or ""))


def kernel_version(osrelease: str | None) -> tuple[int, int, int] | None:
    """(major, minor, patch) from /proc/sys/kernel/osrelease ('6.1.0-18-amd64', '6.8.0-rc3')."""
    return _triple(re.match(r"\s*" + _VERSION.pattern, osrelease or "", re.ASCII))


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def check(versions: dict[str, tuple | None], features: list[str]) -> list[Row]:
    """One row per feature: what it needs, what ``versions`` (component -> tuple or None) has."""
    unknown = [f for f in features if f not in BY_FEATURE]
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}; known: {sorted(BY_FEATURE)}")
    rows = []
    for feature in features:
        minimum = BY_FEATURE[feature]
        name = NAMES[minimum.component]
        have = versions.get(minimum.component)
        if have is None:
            status = "unknown"
        else:
            padded = tuple(have) + (0,) * (3 - len(have))
            status = "ok" if padded >= minimum.version else "missing"
        rows.append(Row(feature, f"{name} {version_text(minimum.version)}",
                        f"{name} {version_text(have)}" if have is not None else None, status, minimum.why))
    return rows
