"""Where the host's UEFI firmware for guests (OVMF) is installed."""

from __future__ import annotations

import os

from gpuvfio.host.root import HostRoot

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
