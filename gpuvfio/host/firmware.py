"""The host's UEFI firmware for guests: QEMU's firmware descriptors, which libvirt's firmware
auto-selection reads (``<os firmware='efi'>``; QEMU docs/interop/firmware.json: JSON files in
/etc/qemu/firmware and /usr/share/qemu/firmware, each naming its interface types and targets),
and, on hosts without them, OVMF's images at the paths distributions use."""

from __future__ import annotations

import fnmatch
import os

from gpuvfio.errors import GpuvfioError
from gpuvfio.host.root import HostRoot
from gpuvfio.strictjson import JsonRejected, strict_loads

FIRMWARE_DESCRIPTOR_DIRS = ("etc/qemu/firmware", "usr/share/qemu/firmware")  # the system's search path

# Where distributions install OVMF (code, vars template), most specific first.
OVMF_CANDIDATES = (
    ("usr/share/OVMF/OVMF_CODE_4M.fd", "usr/share/OVMF/OVMF_VARS_4M.fd"),
    ("usr/share/OVMF/OVMF_CODE.fd", "usr/share/OVMF/OVMF_VARS.fd"),
    ("usr/share/edk2/ovmf/OVMF_CODE.fd", "usr/share/edk2/ovmf/OVMF_VARS.fd"),
    ("usr/share/edk2/x64/OVMF_CODE.4m.fd", "usr/share/edk2/x64/OVMF_VARS.4m.fd"),
    ("usr/share/qemu/ovmf-x86_64-code.bin", "usr/share/qemu/ovmf-x86_64-vars.bin"),
)


def find_ovmf(host: HostRoot) -> tuple[str, str] | None:
    """(code, vars template) as the host names them, or None when no OVMF is installed."""
    for code, vars_ in OVMF_CANDIDATES:
        if host.installed(host.path(code)) and host.installed(host.path(vars_)):
            return "/" + code, "/" + vars_
    return None


def uefi_descriptors(host: HostRoot) -> list[str]:
    """The firmware descriptors (as the host names them) libvirt can auto-select for this guest:
    UEFI on x86_64 for q35 without secure boot. libvirt's rules (src/qemu/qemu_interop_config.c
    qemuInteropFetchConfigs, QEMU docs/interop/firmware.json): a file in /etc/qemu/firmware
    hides the one of the same name in /usr/share/qemu/firmware, and an empty file or a link to
    /dev/null there masks it. A descriptor that is not JSON of that shape is not one."""
    chosen: dict[str, str] = {}
    for directory in reversed(FIRMWARE_DESCRIPTOR_DIRS):  # /usr/share first, /etc overrides it
        for name in host.listdir(host.path(directory)):
            if name.endswith(".json"):
                chosen[name] = directory
    found = []
    for name in sorted(chosen):
        path = host.path(chosen[name], name)
        if host.is_link(path):
            continue  # a mask (a link to /dev/null), or a link gpuvfio does not follow
        try:
            data = strict_loads(host.read(path) or "")
        except (JsonRejected, GpuvfioError):
            continue  # empty (a mask), unreadable or not JSON: not one libvirt would use either
        if _usable(data):
            found.append(f"/{chosen[name]}/{name}")
    return found


def _usable(data) -> bool:
    """UEFI, x86_64, a q35 machine, and no feature auto-selection with secure boot off excludes
    (libvirt src/qemu/qemu_firmware.c qemuFirmwareMatchDomain: secure-boot and enrolled-keys)."""
    if not isinstance(data, dict):
        return False
    interfaces, targets, features = data.get("interface-types"), data.get("targets"), data.get("features", [])
    if not (isinstance(interfaces, list) and "uefi" in interfaces and isinstance(targets, list)
            and isinstance(features, list)):
        return False
    if {"secure-boot", "enrolled-keys"} & {f for f in features if isinstance(f, str)}:
        return False
    return any(isinstance(t, dict) and t.get("architecture") == "x86_64" and isinstance(t.get("machines"), list)
               and any(isinstance(m, str) and fnmatch.fnmatchcase("pc-q35-9.0", m) for m in t["machines"])
               for t in targets)
