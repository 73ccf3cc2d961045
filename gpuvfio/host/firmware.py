"""The host's UEFI firmware for guests: QEMU's firmware descriptors, which libvirt's firmware
auto-selection reads (``<os firmware='efi'>``; QEMU docs/interop/firmware.json: JSON files in
/etc/qemu/firmware and /usr/share/qemu/firmware, each naming its interface types and targets),
and, on hosts without them, OVMF's images at the paths distributions use."""

from __future__ import annotations

import os

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
        if os.path.exists(host.path(code)) and os.path.exists(host.path(vars_)):
            return "/" + code, "/" + vars_
    return None


def uefi_descriptors(host: HostRoot) -> list[str]:
    """The firmware descriptors (as the host names them) for UEFI on x86_64: what libvirt can
    auto-select from. A descriptor that is not JSON of that shape is not one."""
    found = []
    for directory in FIRMWARE_DESCRIPTOR_DIRS:
        for name in sorted(host.listdir(host.path(directory))):
            if not name.endswith(".json"):
                continue
            try:
                data = strict_loads(host.read(host.path(directory, name)) or "")
            except JsonRejected:
                continue
            if not isinstance(data, dict):
                continue
            interfaces, targets = data.get("interface-types"), data.get("targets")
            if (isinstance(interfaces, list) and "uefi" in interfaces and isinstance(targets, list)
                    and any(isinstance(t, dict) and t.get("architecture") == "x86_64" for t in targets)):
                found.append(f"/{directory}/{name}")
    return found
