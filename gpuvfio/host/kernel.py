"""Kernel-side facts: command line, modules, IOMMU units, interrupt remapping, holders.

All read through the host root. Nothing here changes the host.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from gpuvfio.host.root import HostRoot
from gpuvfio.numbers import hex_uint

VFIO_MODULES = ("vfio", "vfio_pci", "vfio_iommu_type1")


@dataclass(slots=True)
class KernelInfo:
    release: str | None
    cmdline: str
    params: dict[str, list[str]]  # name -> every value given (a flag maps to [""])
    loaded_modules: set[str]
    loadable_modules: set[str]  # in modules.dep or modules.builtin
    builtin_modules: set[str]
    iommu_units: list[str]  # names under /sys/class/iommu
    iommu_groups: int
    interrupts_remapped: bool | None  # None: /proc/interrupts not available
    intel_ir_capable: bool | None
    unsafe_interrupts: bool
    unsafe_noiommu: bool
    framebuffers: list[str] = field(default_factory=list)

    @property
    def iommu_vendor(self) -> str | None:
        names = self.iommu_units
        if any(n.startswith("dmar") for n in names):
            return "intel"
        if any(n.startswith("ivhd") for n in names):
            return "amd"
        if any("smmu" in n for n in names):
            return "arm-smmu"
        return names and "other" or None

    def param(self, name: str) -> str | None:
        values = self.params.get(name)
        return values[-1] if values else None

    def module_available(self, name: str) -> bool:
        return name in self.loaded_modules or name in self.loadable_modules

    def to_json(self) -> dict:
        return {"release": self.release, "cmdline": self.cmdline, "iommu_vendor": self.iommu_vendor,
                "iommu_units": self.iommu_units, "iommu_groups": self.iommu_groups,
                "interrupts_remapped": self.interrupts_remapped,
                "unsafe_interrupts": self.unsafe_interrupts, "unsafe_noiommu": self.unsafe_noiommu,
                "loaded_modules": sorted(self.loaded_modules), "framebuffers": self.framebuffers}


def parse_cmdline(text: str) -> dict[str, list[str]]:
    params: dict[str, list[str]] = {}
    for token in text.split():
        name, _, value = token.partition("=")
        params.setdefault(name.replace("-", "_") if "." not in name else name, []).append(value)
    return params


def _module_name(path: str) -> str:
    base = os.path.basename(path.strip().rstrip(":"))
    for ext in (".ko.zst", ".ko.xz", ".ko.gz", ".ko"):
        if base.endswith(ext):
            base = base[: -len(ext)]
    return base.replace("-", "_")


def read_kernel(host: HostRoot) -> KernelInfo:
    release = host.read(host.path("proc", "sys", "kernel", "osrelease"))
    cmdline = host.read(host.path("proc", "cmdline")) or ""
    modules_text = host.read(host.path("proc", "modules")) or ""
    loaded = {line.split()[0] for line in modules_text.splitlines() if line.strip()}
    loadable: set[str] = set()
    builtin: set[str] = set()
    if release and "/" not in release and release not in (".", ".."):
        moddir = host.path("lib", "modules", release)
        for line in (host.read(os.path.join(moddir, "modules.dep")) or "").splitlines():
            if line.strip():
                loadable.add(_module_name(line.split(":")[0]))
        for line in (host.read(os.path.join(moddir, "modules.builtin")) or "").splitlines():
            if line.strip():
                builtin.add(_module_name(line))
    units = host.listdir(host.sys_path("class", "iommu"))
    groups = len(host.listdir(host.sys_path("kernel", "iommu_groups")))
    interrupts = host.read(host.path("proc", "interrupts"))
    remapped = None if interrupts is None else bool(re.search(r"\bIR-", interrupts))
    intel_ir = None
    for unit in units:
        if unit.startswith("dmar"):
            ecap = host.read(host.sys_path("class", "iommu", unit, "intel-iommu", "ecap"))
            value = hex_uint(ecap) if ecap else None
            if value is not None:
                capable = bool(value & 0x8)  # VT-d spec 11.4.3, Extended Capability Register bit 3: IR.
                intel_ir = capable if intel_ir is None else intel_ir and capable
    unsafe = host.read(host.sys_path("module", "vfio_iommu_type1", "parameters", "allow_unsafe_interrupts"))
    noiommu = host.read(host.sys_path("module", "vfio", "parameters", "enable_unsafe_noiommu_mode"))
    params = parse_cmdline(cmdline)
    for key in ("vfio_iommu_type1.allow_unsafe_interrupts",):
        if params.get(key) and params[key][-1] in ("1", "Y", "y"):
            unsafe = "Y"
    fb_text = host.read(host.path("proc", "fb")) or ""
    framebuffers = [line.split(None, 1)[1] for line in fb_text.splitlines() if len(line.split(None, 1)) == 2]
    return KernelInfo(
        release=release, cmdline=cmdline, params=params, loaded_modules=loaded,
        loadable_modules=loadable, builtin_modules=builtin, iommu_units=units, iommu_groups=groups,
        interrupts_remapped=remapped, intel_ir_capable=intel_ir,
        unsafe_interrupts=(unsafe or "N").upper() in ("Y", "1"),
        unsafe_noiommu=(noiommu or "N").upper() in ("Y", "1"),
        framebuffers=framebuffers,
    )
