"""What libvirt's ``virt-host-validate qemu`` checks that matters for device assignment, as doctor
checks (tools/virt-host-validate-qemu.c virHostValidateQEMU): KVM itself usable, cgroup device
control (virt-host-validate warns; so does doctor), and secure-guest support as information;
the IOMMU checks are gpuvfio.host.doctor's own, which go further. doctor adds /dev/vfio/vfio,
which virt-host-validate does not look at.

* Hardware virtualization: the vmx (Intel VT-x) or svm (AMD-V) CPU flag in /proc/cpuinfo
  (virHostValidateHasCPUFlag), then /dev/kvm present (virHostValidateDeviceExists). Without
  them QEMU emulates the CPU (TCG): no KVM, no vfio device assignment at speed.
* /dev/vfio/vfio is the VFIO container (Documentation/driver-api/vfio.rst); it appears when
  the vfio module loads, which gpuvfio bind does.
* cgroup device control: libvirt confines a guest's device access through the cgroup
  ``devices`` controller (v1) or a BPF device program (v2; libvirt probes for it, gpuvfio reads
  /proc/cgroups, where CONFIG_CGROUP_DEVICE shows as the devices line with enabled=1,
  Documentation/admin-guide/cgroup-v1/devices.rst). Without it guests still run, unconfined:
  a warning, as virt-host-validate gives.
* Secure guests (AMD SEV: kvm_amd's ``sev`` parameter; Intel TDX: kvm_intel's ``tdx``):
  information only, passthrough does not need them.

A recorded host (gpuvfio dump-host) keeps the virtualization flags of /proc/cpuinfo, the
names of /dev/kvm and /dev/vfio/vfio (no device nodes) and /proc/cgroups, so these checks
answer the same on the recording as on the host.
"""

from __future__ import annotations

import os

from gpuvfio.host.checks import FAIL, OK, SKIP, WARN, Check
from gpuvfio.host.kernel import KernelInfo
from gpuvfio.host.root import HostRoot

VIRT_FLAGS = ("vmx", "svm")  # Intel VT-x, AMD-V
RECORDED_FLAGS = VIRT_FLAGS + ("hypervisor", "sev", "sev_es", "sev_snp", "tdx_host_platform")
DEV_NODES = (("dev", "kvm"), ("dev", "vfio", "vfio"))
SECURE_PARAMS = (("kvm_amd", "sev", "AMD SEV"), ("kvm_intel", "tdx", "Intel TDX"))


def cpu_flags(host: HostRoot) -> set[str] | None:
    """The first processor's flags (None: /proc/cpuinfo has no flags line)."""
    text = host.read(host.path("proc", "cpuinfo")) or ""
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return None


def _exists(host: HostRoot, *parts: str) -> bool:
    return host.exists(host.path(*parts))


def check_kvm(host: HostRoot, kernel: KernelInfo) -> Check:
    flags = cpu_flags(host)
    if flags is None:
        return Check("kvm", FAIL, "cannot tell whether KVM is usable: /proc/cpuinfo has no flags line "
                                  "(a recording from an older gpuvfio)", "record the host again: gpuvfio dump-host OUT")
    found = [f for f in VIRT_FLAGS if f in flags]
    if not found:
        nested = " (this host is itself a guest: its hypervisor does not pass VT-x/AMD-V on)" \
            if "hypervisor" in flags else ""
        return Check("kvm", FAIL, f"no hardware virtualization (no vmx/svm CPU flag){nested}: QEMU can only "
                                  "emulate the CPU (TCG), far too slow for GPU work",
                     "enable Intel VT-x / AMD-V (SVM) in the firmware setup; on a VM, nested virtualization "
                     "on its host")
    module = "kvm_intel" if found[0] == "vmx" else "kvm_amd"
    if not _exists(host, "dev", "kvm"):
        loaded = module in kernel.loaded_modules
        return Check("kvm", FAIL, f"{found[0]} present but no /dev/kvm"
                     + (f" although {module} is loaded" if loaded else f": {module} is not loaded"),
                     f"modprobe {module}" if not loaded else "check dmesg for kvm errors (disabled by the firmware?)")
    return Check("kvm", OK, f"KVM usable: {found[0]} CPU flag, /dev/kvm present")


def check_vfio_device(host: HostRoot, kernel: KernelInfo) -> Check:
    if _exists(host, "dev", "vfio", "vfio"):
        return Check("vfio_device", OK, "/dev/vfio/vfio present (the VFIO container)")
    if "vfio" in kernel.loaded_modules:
        return Check("vfio_device", FAIL, "the vfio module is loaded but /dev/vfio/vfio is missing",
                     "check udev and dmesg; ls -l /dev/vfio")
    return Check("vfio_device", SKIP, "/dev/vfio/vfio appears when the vfio module loads (gpuvfio bind loads it)")


def check_cgroup_devices(host: HostRoot) -> Check:
    text = host.read(host.path("proc", "cgroups"))
    if text is None:
        return Check("cgroup_devices", FAIL, "cannot tell: /proc/cgroups is not readable",
                     "record the host again: gpuvfio dump-host OUT")
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "devices":
            if parts[3] == "1":
                return Check("cgroup_devices", OK, "cgroup device control available (libvirt confines the guest's "
                                                   "device access)")
            return Check("cgroup_devices", WARN, "the cgroup devices controller is disabled: libvirt cannot "
                                                 "confine the guest's device access",
                         "remove cgroup_disable=devices from the kernel command line")
    return Check("cgroup_devices", WARN, "no cgroup devices controller in this kernel (CONFIG_CGROUP_DEVICE): libvirt "
                                         "cannot confine the guest's device access",
                 "use a kernel built with CONFIG_CGROUP_DEVICE=y")


def check_secure_guest(host: HostRoot) -> Check:
    enabled = []
    for module, param, name in SECURE_PARAMS:
        value = (host.read(host.sys_path("module", module, "parameters", param)) or "").strip()
        if value in ("1", "Y", "y"):
            enabled.append(name)
    if enabled:
        return Check("secure_guest", OK, f"information: {', '.join(enabled)} enabled for confidential guests")
    return Check("secure_guest", OK, "information: no AMD SEV / Intel TDX enabled (confidential guests only; "
                                     "passthrough does not need them)")
