"""The bundled sample hosts: simulated machines modelled on real, published topologies.

Each ``build_<name>(root)`` writes a sysfs/procfs-shaped tree under ``root`` with
:class:`HostBuilder`; ``tests/make_samples.py`` records them as the fixtures shipped in
``gpuvfio/samples/<name>.host`` (regenerate with ``python tests/make_samples.py
--regenerate``; CI runs ``--check``).

IDs are real (vendor:device pairs from pci.ids, vGPU/mdev type IDs from NVIDIA's vGPU
type tables); bus numbers, link widths and BAR sizes follow what ``lspci -tv`` /
``lspci -vv`` print on such machines. Where the pci.ids shipped with this repository's
test image (2023.04) predates a part, the part's real ID is used anyway and lspci prints
"Device xxxx" for it (noted at the constant).

What is deliberately realistic, because tools get it wrong:
  * IOMMU groups follow drivers/iommu/iommu.c pci_device_group(): a bridge without
    ACS pulls everything below it into its group (Intel client PEG and PCH root ports,
    the NVSwitch root port on the HGX sample); functions of one multifunction device
    share a group; SR-IOV VFs each get their own.
  * A PCIe-to-PCI bridge (the BMC's AST1150) has no driver and aliases its children.
  * 32-bit BAR0 + 64-bit prefetchable BAR1/BAR3 on NVIDIA GPUs, resizable BAR1 on
    consumer cards, SR-IOV VF BARs (resources 7..12) consistent with the VFs' BARs.
  * ``numa_node`` is -1 on the single-node desktop (no ACPI _PXM), like real desktops.
  * Process ``comm`` is truncated to 15 characters, as the kernel does.
"""

from __future__ import annotations

import os

from gpuvfio.address import PciAddress

try:
    from tests.hostbuilder import (BAR32, BAR64_PREF, IO, MEM, MEM64, PREFETCH, SPEED, Function,
                                   GiB, HostBuilder, KiB, MiB, Node)
except ImportError:  # tests/ itself on sys.path (pytest rootdir insertion)
    from hostbuilder import (BAR32, BAR64_PREF, IO, MEM, MEM64, PREFETCH, SPEED, Function,  # type: ignore
                             GiB, HostBuilder, KiB, MiB, Node)

BAR64 = MEM | MEM64  # 64-bit, non-prefetchable (NVMe, NIC register BARs)
BAR32_PREF = MEM | PREFETCH
HUGE_1G, HUGE_2M = 1048576, 2048  # hugepage sizes in kB

# -- PCI IDs ------------------------------------------------------------------------------
NVIDIA, INTEL, AMD, MELLANOX, BROADCOM_LSI, BROADCOM, ASPEED, SAMSUNG, WDC, MATROX = (
    "10de", "8086", "1022", "15b3", "1000", "14e4", "1a03", "144d", "15b7", "102b")
H100_SXM5 = "2330"          # GH100 [H100 SXM5 80GB]
H100_NVSWITCH = "22a3"      # GH100 [H100 NVSwitch]; newer than the 2023.04 pci.ids
A100_PCIE_80G = "20b5"      # GA100 [A100 PCIe 80GB]
A10 = "2236"                # GA102GL [A10]; its VFs carry the same device ID
T4 = "1eb8"                 # TU104GL [Tesla T4]
V100_PCIE_16G = "1db4"      # GV100GL [Tesla V100 PCIe 16GB]
L40S = "26b9"               # AD102GL [L40S]; newer than the 2023.04 pci.ids
RTX_4090, RTX_4090_AUDIO = "2684", "22ba"  # AD102 [GeForce RTX 4090], AD102 HD Audio
RTX_3060, RTX_3060_AUDIO = "2504", "228e"  # GA106 [GeForce RTX 3060 Lite Hash Rate], GA106 HD Audio
CONNECTX7, CONNECTX6DX, MLX5_VF = "1021", "101d", "101e"
PEX890XX = "c030"           # Broadcom PEX890xx PCIe Gen 5 Switch (upstream and downstream ports)
SPR_ROOT_PORT = "352a"      # Sapphire Rapids PCIe root port; newer than the 2023.04 pci.ids
SPR_VTD, SPR_RAS = "09a2", "09a3"  # "Ice Lake Memory Map/VT-d", "Ice Lake RAS": reused by SPR
AST_VGA, AST1150 = "2000", "1150"  # ASPEED Graphics Family, AST1150 PCI-to-PCI Bridge
PM1733, PM9A3 = "a824", "a80a"     # Samsung NVMe PM173X, PM9A1/PM9A3/980PRO
SN850 = "5011"                     # WD Black SN850
ADL_HOST, ADL_PEG16, ADL_PEG4 = "4660", "460d", "464d"  # 12th Gen Core host bridge, PEG x16 #1, PEG x4 #0
ADL_PCH_RP1, ADL_PCH_RP5, ADL_PCH_RP9 = "7ab8", "7abc", "7ab0"  # Alder Lake-S PCH root ports #1, #5, #9
ADL_XHCI, ADL_SRAM, ADL_HECI, ADL_SATA = "7ae0", "7aa7", "7ae8", "7ae2"
Z690_LPC, ADL_HDA, ADL_SMBUS, ADL_SPI = "7a84", "7ad0", "7aa3", "7aa4"
I225_V = "15f3"
ROME_RC, ROME_IOMMU, ROME_DUMMY_HB, ROME_GPP = "1480", "1481", "1482", "1483"  # "Starship/Matisse": Rome and Milan
SKX_DMI3, SKX_ROOT_PORT_A, C620_RP1 = "2020", "2030", "a190"
BCM57416, MEGARAID_3108, G200EW3 = "16d8", "005d", "0536"

# -- classes --------------------------------------------------------------------------------
VGA, DISPLAY_3D, HDA, ETHERNET, NVME, SATA_AHCI, RAID = (
    "030000", "030200", "040300", "020000", "010802", "010601", "010400")
HOST_BRIDGE, ISA_BRIDGE, PCI_BRIDGE, OTHER_BRIDGE = "060000", "060100", "060400", "068000"
SYSTEM_PERIPHERAL, IOMMU_CLASS, USB_XHCI, SMBUS, SERIAL_BUS_OTHER, COMM_OTHER, RAM = (
    "088000", "080600", "0c0330", "0c0500", "0c8000", "078000", "050000")

# NVIDIA GPU BARs: BAR0 registers (32-bit), BAR1 framebuffer aperture and BAR3 (64-bit
# prefetchable); consumer cards also decode a 128-byte I/O BAR5.
def _gpu_bars(bar1: int, io: bool = False) -> list[tuple[int, int, int]]:
    bars = [(0, 16 * MiB, BAR32), (1, bar1, BAR64_PREF), (3, 32 * MiB, BAR64_PREF)]
    return bars + [(5, 128, IO)] if io else bars


# -- helpers: what HostBuilder does not cover -------------------------------------------------
def _put(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text)


def _attr(fn: Function, name: str, value: str) -> None:
    _put(os.path.join(fn.path, name), value + "\n")


def _join_group(b: HostBuilder, fn: Function, gid: int) -> None:
    """Put ``fn`` into IOMMU group ``gid`` (for functions created with group=None)."""
    gdir = b.sys_path("kernel", "iommu_groups", str(gid), "devices")
    os.makedirs(gdir, exist_ok=True)
    os.symlink(os.path.relpath(fn.path, gdir), os.path.join(gdir, str(fn.address)))
    os.symlink(os.path.relpath(os.path.dirname(gdir), fn.path), os.path.join(fn.path, "iommu_group"))
    fn.group = gid


def _resources(fn: Function) -> list[tuple[int, int, int]]:
    with open(os.path.join(fn.path, "resource")) as handle:
        return [tuple(int(x, 16) for x in line.split()) for line in handle]


def _set_resources(fn: Function, bars: dict[int, tuple[int, int, int]]) -> None:
    """Rewrite ``resource``: index -> (start, size, flags)."""
    lines = [(0, 0, 0)] * len(_resources(fn))
    for index, (start, size, flags) in bars.items():
        lines[index] = (start, start + size - 1, flags)
    _attr(fn, "resource", "".join(f"0x{s:016x} 0x{e:016x} 0x{f:016x}\n" for s, e, f in lines).rstrip("\n"))


def _add_resource(fn: Function, index: int, start: int, size: int, flags: int) -> None:
    res = {i: (s, e - s + 1, f) for i, (s, e, f) in enumerate(_resources(fn)) if e}
    res[index] = (start, size, flags)
    _set_resources(fn, res)


def _sriov_vfs(b: HostBuilder, pf: Function, total: int, vf_addresses: list[str], vf_device: str,
               vendor: str, klass: str, driver: str | None,
               vf_bars: list[tuple[int, int, int]]) -> list[Function]:
    """SR-IOV VFs, each in its own IOMMU group (HostBuilder.sriov gives them one group
    argument for all, and "auto" would put VFs sharing the PF's slot into the PF's group).

    ``vf_bars`` are (VF BAR index, size, flags); the PF must already carry resources
    7 + index sized ``total * size``. VF n's BAR starts at PF resource start + n * size
    (PCIe SR-IOV spec 2.1.1.1; drivers/pci/iov.c pci_iov_add_virtfn).
    """
    vfs = b.sriov(pf, total, vf_addresses, vf_device, vendor, klass, driver=driver, group=None)
    pf_res = _resources(pf)
    for n, vf in enumerate(vfs):
        _set_resources(vf, {index: (pf_res[7 + index][0] + n * size, size, flags)
                            for index, size, flags in vf_bars})
        _join_group(b, vf, b.new_group())
    return vfs


def _empty_slot(fn: Function, max_gen: int, max_width: int) -> None:
    """A downstream port with nothing behind it: no link trained (pci-sysfs prints Unknown / 0)."""
    for name, value in (("current_link_speed", "Unknown"), ("current_link_width", "0"),
                        ("max_link_speed", SPEED[max_gen]), ("max_link_width", str(max_width))):
        _attr(fn, name, value)


def _cpu(b: HostBuilder, cpu: int, core: int, package: int, siblings: str) -> None:
    topo = b.sys_path("devices", "system", "cpu", f"cpu{cpu}", "topology")
    _put(os.path.join(topo, "core_id"), f"{core}\n")
    _put(os.path.join(topo, "physical_package_id"), f"{package}\n")
    _put(os.path.join(topo, "thread_siblings_list"), siblings + "\n")


def _hybrid_topology(b: HostBuilder, p_cores: int, e_cores: int) -> list[int]:
    """Intel hybrid (Alder/Raptor Lake) numbering: P-core threads first, siblings adjacent
    (cpu0-1, cpu2-3, ...; core_id steps of 4), then single-threaded E-cores."""
    cpu = 0
    for core in range(p_cores):
        for _thread in range(2):
            _cpu(b, cpu, core * 4, 0, f"{2 * core}-{2 * core + 1}")
            cpu += 1
    for core in range(e_cores):
        _cpu(b, cpu, p_cores * 4 + core, 0, str(cpu))
        cpu += 1
    _put(b.sys_path("devices", "system", "cpu", "online"), f"0-{cpu - 1}\n")
    return list(range(cpu))


def _os_release(b: HostBuilder, text: str) -> None:
    _put(os.path.join(b.root, "etc", "os-release"), text.lstrip("\n"))


def _interrupts(b: HostBuilder, *, remapped: bool) -> None:
    """/proc/interrupts chip names (HostBuilder.iommu(None) leaves the file out)."""
    ioapic, msi = ("IR-IO-APIC", "IR-PCI-MSI") if remapped else ("IO-APIC", "PCI-MSI")
    _put(b.proc("interrupts"),
         f"0: {ioapic} 2-edge timer\n8: {ioapic} 8-edge rtc0\n9: {ioapic} 9-fasteoi acpi\n"
         f"24: {msi} 1572864-edge nvme0q0\n25: {msi} 1048576-edge eno1\n"
         "NMI: Non-maskable interrupts\nLOC: Local timer interrupts\n")


UBUNTU_2204 = """
PRETTY_NAME="Ubuntu 22.04.4 LTS"
NAME="Ubuntu"
VERSION_ID="22.04"
VERSION="22.04.4 LTS (Jammy Jellyfish)"
VERSION_CODENAME=jammy
ID=ubuntu
ID_LIKE=debian
HOME_URL="https://www.ubuntu.com/"
UBUNTU_CODENAME=jammy
"""

UBUNTU_2004 = """
NAME="Ubuntu"
VERSION="20.04.6 LTS (Focal Fossa)"
ID=ubuntu
ID_LIKE=debian
PRETTY_NAME="Ubuntu 20.04.6 LTS"
VERSION_ID="20.04"
HOME_URL="https://www.ubuntu.com/"
VERSION_CODENAME=focal
UBUNTU_CODENAME=focal
"""

DEBIAN_12 = """
PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"
NAME="Debian GNU/Linux"
VERSION_ID="12"
VERSION="12 (bookworm)"
VERSION_CODENAME=bookworm
ID=debian
HOME_URL="https://www.debian.org/"
"""

RHEL_94 = """
NAME="Red Hat Enterprise Linux"
VERSION="9.4 (Plow)"
ID="rhel"
ID_LIKE="fedora"
VERSION_ID="9.4"
PLATFORM_ID="platform:el9"
PRETTY_NAME="Red Hat Enterprise Linux 9.4 (Plow)"
ANSI_COLOR="0;31"
CPE_NAME="cpe:/o:redhat:enterprise_linux:9::baseos"
HOME_URL="https://www.redhat.com/"
"""

UBUNTU_2404 = """
PRETTY_NAME="Ubuntu 24.04.2 LTS"
NAME="Ubuntu"
VERSION_ID="24.04"
VERSION="24.04.2 LTS (Noble Numbat)"
VERSION_CODENAME=noble
ID=ubuntu
ID_LIKE=debian
HOME_URL="https://www.ubuntu.com/"
UBUNTU_CODENAME=noble
"""


# -- 1. dgx-h100 ---------------------------------------------------------------------------
def build_dgx_h100(root: str) -> None:
    """An 8-GPU HGX/DGX H100 server.

    Modelled on the NVIDIA DGX H100 (DGX H100 User Guide: 2x Xeon Platinum 8480C, 56 cores
    each, 2 TiB RAM; 8x H100 SXM5 80GB; 4x NVSwitch; 8x single-port ConnectX-7 for the
    compute fabric, GPUn paired with the CX7 at bus GPU-3: ibp24s0/GPU0 at 0x18 ... and
    2x dual-port ConnectX-7 for storage at 0x29 and 0xaa, "Network Connections" tables).
    GPU bus IDs 1b/43/52/61/9d/c3/d1/df are the ones nvidia-smi prints on DGX H100.
    Each GPU/NIC pair sits behind a Broadcom PEX89xxx switch, as on HGX H100 8-GPU OEM
    boards (one x16 Gen5 uplink per pair; GPU, NIC and a U.2 NVMe below). Switch ports have
    ACS, so GPUs and NICs have groups of their own; the root port feeding the NVSwitches'
    management switch does not, so the 4 NVSwitches (class 0x0680 endpoints on driver
    nvidia) share one group with the bridges above them. The console is the BMC's AST2600.
    """
    b = HostBuilder(root)
    b.osrelease("5.15.0-1042-nvidia")
    _os_release(b, UBUNTU_2204)
    b.cmdline("BOOT_IMAGE=/boot/vmlinuz-5.15.0-1042-nvidia root=UUID=6f2b7c8e-1b4a-4c55-9d0e-3a8e51c2d7f4 ro "
              "console=tty0 console=ttyS0,115200n8 intel_iommu=on iommu=pt default_hugepagesz=1G "
              "hugepagesz=1G hugepages=512 modprobe.blacklist=nouveau nouveau.modeset=0 quiet splash")
    b.modules(["nvidia_peermem", "nvidia_uvm", "nvidia_drm", "nvidia_modeset", "nvidia", "mlx5_ib", "ib_uverbs",
               "ib_core", "mlx5_core", "mlxfw", "nvme", "nvme_core", "ast", "drm_kms_helper", "kvm_intel",
               "kvm", "irqbypass"])
    b.iommu("intel", units=16)  # one DMAR unit per PCIe/accelerator stack, 8 per socket
    b.cpuinfo("Intel(R) Xeon(R) Platinum 8480C", 46, 57)
    b.firmware()  # Ubuntu's ovmf package
    sockets = b.cpu_topology(2, 56, 2)  # 224 CPUs: node0 0-55,112-167; node1 56-111,168-223
    for node in (0, 1):
        b.numa_node(node, sockets[node], 1024, {HUGE_1G: (256, 256)})
    b.framebuffer("astdrmfb")

    # Socket 0, stack 0: VT-d/RAS, the NVSwitch management switch, the BMC.
    rb0 = b.root_bus(0, 0x00, numa=0)
    b.function(rb0, "0000:00:00.0", INTEL, SPR_VTD, SYSTEM_PERIPHERAL, revision="20", reset_method=None,
               multifunction=True)
    b.function(rb0, "0000:00:00.2", INTEL, SPR_RAS, SYSTEM_PERIPHERAL, revision="20", reset_method=None,
               multifunction=True)
    fabric = b.new_group()
    rp = b.bridge(rb0, "0000:00:01.0", INTEL, SPR_ROOT_PORT, secondary_bus=0x01, link=(4, 4), group=fabric)
    up = b.bridge(rp, "0000:01:00.0", BROADCOM_LSI, PEX890XX, secondary_bus=0x02, link=(4, 4), group=fabric)
    for n in range(4):
        ds = b.bridge(up, f"0000:02:{n:02x}.0", BROADCOM_LSI, PEX890XX, secondary_bus=0x03 + n, link=(4, 2),
                      group=fabric)
        b.function(ds, f"0000:{0x03 + n:02x}:00.0", NVIDIA, H100_NVSWITCH, OTHER_BRIDGE, driver="nvidia",
                   subsystem=(NVIDIA, "1796"), link=(4, 2), bars=[(0, 32 * MiB, BAR32)], group=fabric,
                   reset_method="bus")
    bmc_port = b.bridge(rb0, "0000:00:02.0", INTEL, SPR_ROOT_PORT, secondary_bus=0x07, link=(1, 1))
    bmc_group = b.new_group()
    ast_bridge = b.bridge(bmc_port, "0000:07:00.0", ASPEED, AST1150, secondary_bus=0x08, link=(1, 1),
                          group=bmc_group, driver=None)
    b.function(ast_bridge, "0000:08:00.0", ASPEED, AST_VGA, VGA, driver="ast", revision="52", group=bmc_group,
               subsystem=(ASPEED, AST_VGA), bars=[(0, 64 * MiB, BAR32), (1, 256 * KiB, BAR32), (2, 128, IO)],
               boot_vga=True, reset_method=None)

    # Then the stacks in bus order (the kernel numbers groups in enumeration order).
    for socket, rbus, kind in ((0, 0x15, "pair"), (0, 0x28, "storage"), (0, 0x3d, "pair"), (0, 0x4c, "pair"),
                               (0, 0x5b, "pair"), (1, 0x80, "misc"), (1, 0x97, "pair"), (1, 0xa9, "storage"),
                               (1, 0xbd, "pair"), (1, 0xcb, "pair"), (1, 0xd9, "pair")):
        rb = b.root_bus(0, rbus, numa=socket)
        if kind == "pair":
            _hgx_pair(b, rb, rbus)
        elif kind == "storage":  # dual-port CX7 for storage / in-band management
            rp = b.bridge(rb, f"0000:{rbus:02x}:01.0", INTEL, SPR_ROOT_PORT, secondary_bus=rbus + 1,
                          link=(5, 16))
            for fn in (0, 1):
                b.function(rp, f"0000:{rbus + 1:02x}:00.{fn}", MELLANOX, CONNECTX7, ETHERNET,
                           driver="mlx5_core", subsystem=(MELLANOX, "0012"), revision="00", link=(5, 16),
                           bars=[(0, 32 * MiB, BAR64_PREF)], multifunction=True, reset_method="flr bus")
        else:  # socket 1, stack 0: VT-d/RAS again
            for fn, dev in ((0, SPR_VTD), (2, SPR_RAS)):
                b.function(rb, f"0000:{rbus:02x}:00.{fn}", INTEL, dev, SYSTEM_PERIPHERAL, revision="20",
                           reset_method=None, multifunction=True)

    # What the host runs on: the storage ConnectX-7's two ports in a bond carry the default route;
    # each compute ConnectX-7 carries its IPoIB subnet (NCCL's bootstrap and storage traffic).
    dgx = b.functions
    for fn in (0, 1):
        b.net(f"enp41s0f{fn}np{fn}", fn=dgx[PciAddress.parse(f"0000:29:00.{fn}")])
    b.net("bond0", devtype="bond")
    for fn in (0, 1):
        b.upper(f"enp41s0f{fn}np{fn}", "bond0")
    b.route("bond0", "0.0.0.0", "0.0.0.0", "10.10.0.1")
    b.route("bond0", "10.10.0.0", "255.255.252.0")
    for rbus in (0x15, 0x3d, 0x4c, 0x5b, 0x97, 0xbd, 0xcb, 0xd9):
        name = f"ibp{rbus + 3}s0"
        b.net(name, fn=dgx[PciAddress.parse(f"0000:{rbus + 3:02x}:00.0")])
        b.route(name, f"10.{rbus}.0.0", "255.255.0.0")
    b.block("nvme0n1", "259:0", fn=dgx[PciAddress.parse("0000:19:00.0")])
    b.block("nvme0n1p1", "259:1", disk="nvme0n1")
    b.block("nvme0n1p2", "259:2", disk="nvme0n1")
    b.mount("259:2", "/", "/dev/nvme0n1p2", "ext4")
    b.mount("259:1", "/boot/efi", "/dev/nvme0n1p1", "vfat")

    # NVLink as NVML reports it on HGX H100: each GPU's 18 links go to the 4 NVSwitches (5/4/4/5).
    b.nvlink({f"0000:{bus:02x}:00.0": {"0000:03:00.0": 5, "0000:04:00.0": 4, "0000:05:00.0": 4, "0000:06:00.0": 5}
              for bus in (0x1b, 0x43, 0x52, 0x61, 0x9d, 0xc3, 0xd1, 0xdf)})
    gpus = [f"/dev/nvidia{n}" for n in range(8)]
    b.holder(2214, "nvidia-persiste", ["/dev/nvidiactl"] + gpus)  # nvidia-persistenced (comm is 15 chars)
    b.holder(2391, "nv-fabricmanage", ["/dev/nvidiactl", "/dev/nvidia-nvswitchctl"]
             + [f"/dev/nvidia-nvswitch{n}" for n in range(4)] + ["/dev/nvidia-caps/nvidia-cap1"])
    b.holder(2460, "nv-hostengine", ["/dev/nvidiactl", "/dev/nvidia-uvm"] + gpus)  # DCGM



def _hgx_pair(b: HostBuilder, rb: Node, rbus: int) -> None:
    """Root port RB:01.0 -> PEX89xxx upstream port (RB+1) -> downstream ports (RB+2):00-03.0
    -> ConnectX-7 at RB+3, U.2 NVMe at RB+4, an empty slot (RB+5), the H100 at RB+6."""
    rp = b.bridge(rb, f"0000:{rbus:02x}:01.0", INTEL, SPR_ROOT_PORT, secondary_bus=rbus + 1, link=(5, 16))
    up = b.bridge(rp, f"0000:{rbus + 1:02x}:00.0", BROADCOM_LSI, PEX890XX, secondary_bus=rbus + 2, link=(5, 16))
    bus = rbus + 2
    nic_port = b.bridge(up, f"0000:{bus:02x}:00.0", BROADCOM_LSI, PEX890XX, secondary_bus=rbus + 3, link=(5, 16))
    b.function(nic_port, f"0000:{rbus + 3:02x}:00.0", MELLANOX, CONNECTX7, "020700", driver="mlx5_core",
               subsystem=(MELLANOX, "0041"), revision="00", link=(5, 16), bars=[(0, 32 * MiB, BAR64_PREF)])
    nvme_port = b.bridge(up, f"0000:{bus:02x}:01.0", BROADCOM_LSI, PEX890XX, secondary_bus=rbus + 4,
                         link=(4, 4, 5, 4))
    b.function(nvme_port, f"0000:{rbus + 4:02x}:00.0", SAMSUNG, PM1733, NVME, driver="nvme",
               subsystem=(SAMSUNG, "a801"), revision="00", link=(4, 4), bars=[(0, 32 * KiB, BAR64)])
    spare = b.bridge(up, f"0000:{bus:02x}:02.0", BROADCOM_LSI, PEX890XX, secondary_bus=rbus + 5)
    _empty_slot(spare.function, 5, 16)
    gpu_port = b.bridge(up, f"0000:{bus:02x}:03.0", BROADCOM_LSI, PEX890XX, secondary_bus=rbus + 6, link=(5, 16))
    b.function(gpu_port, f"0000:{rbus + 6:02x}:00.0", NVIDIA, H100_SXM5, DISPLAY_3D, driver="nvidia",
               subsystem=(NVIDIA, "16c1"), link=(5, 16), bars=_gpu_bars(128 * GiB))


# -- 2. workstation ------------------------------------------------------------------------
def build_workstation(root: str) -> None:
    """A single-socket desktop with two GeForce cards.

    Modelled on a Core i9-12900KF (8 P-cores with HT + 8 E-cores = 24 threads, no iGPU) on
    a Z690 board (Intel 600-series PCH datasheet: PEG x16 Gen5 + x4 Gen4 from the CPU, PCH
    root ports for the chipset slots, M.2 and LAN; the usual ASUS/MSI block diagrams), the
    layout behind countless VFIO forum posts (lspci -nnk, the iommu_groups listing script
    from the Arch wiki "PCI passthrough via OVMF"). Client PEG and PCH root ports have no
    usable ACS: the RTX 4090 shares its group only with its own audio function and the PEG
    port (viable), while the RTX 3060 in the chipset x4 slot shares a group with the other
    PCH root port and the I225-V NIC behind it (not viable). The 4090 drives the console.
    """
    b = HostBuilder(root)
    b.osrelease("6.1.0-18-amd64")
    _os_release(b, DEBIAN_12)
    b.cmdline("BOOT_IMAGE=/boot/vmlinuz-6.1.0-18-amd64 root=UUID=0b1e44f9-5c5f-4d0e-a7a3-8f6c2d1e9b70 ro quiet "
              "intel_iommu=on")
    b.modules(["nvidia_drm", "nvidia_modeset", "nvidia_uvm", "nvidia", "snd_hda_intel", "snd_hda_codec",
               "igc", "nvme", "nvme_core", "xhci_pci", "ahci", "mei_me", "i2c_i801", "kvm_intel", "kvm",
               "irqbypass"])
    b.iommu("intel", units=1)  # a KF part has no iGPU, so no graphics DMAR unit: just dmar0
    b.cpuinfo("12th Gen Intel(R) Core(TM) i9-12900KF", 39, 48)
    b.firmware()  # Debian's ovmf package
    cpus = _hybrid_topology(b, 8, 8)
    b.numa_node(0, cpus, 64)  # no hugepages reserved
    b.framebuffer("EFI VGA")
    rb = b.root_bus(0, 0x00, numa=-1)  # desktop firmware has no _PXM: numa_node reads -1

    b.function(rb, "0000:00:00.0", INTEL, ADL_HOST, HOST_BRIDGE, revision="02", reset_method=None)
    peg = b.new_group()
    peg_port = b.bridge(rb, "0000:00:01.0", INTEL, ADL_PEG16, secondary_bus=0x01, link=(4, 16, 5, 16), group=peg)
    b.function(peg_port, "0000:01:00.0", NVIDIA, RTX_4090, VGA, driver="nvidia", subsystem=("1043", "889c"),
               link=(4, 16), bars=_gpu_bars(32 * GiB, io=True), boot_vga=True, multifunction=True, group=peg,
               reset_method="bus")
    b.function(peg_port, "0000:01:00.1", NVIDIA, RTX_4090_AUDIO, HDA, driver="snd_hda_intel",
               subsystem=("1043", "889c"), link=(4, 16), bars=[(0, 16 * KiB, BAR32)], multifunction=True,
               group=peg, reset_method="bus")
    m2 = b.new_group()
    m2_port = b.bridge(rb, "0000:00:06.0", INTEL, ADL_PEG4, secondary_bus=0x02, link=(4, 4), group=m2)
    b.function(m2_port, "0000:02:00.0", SAMSUNG, PM9A3, NVME, driver="nvme", subsystem=(SAMSUNG, "a801"),
               revision="00", link=(4, 4), bars=[(0, 16 * KiB, BAR64)], group=m2, reset_method="flr bus")
    b.function(rb, "0000:00:14.0", INTEL, ADL_XHCI, USB_XHCI, driver="xhci_hcd", revision="11",
               bars=[(0, 64 * KiB, BAR64)], multifunction=True, reset_method=None)
    b.function(rb, "0000:00:14.2", INTEL, ADL_SRAM, RAM, revision="11", bars=[(0, 16 * KiB, BAR64)],
               multifunction=True, reset_method=None)
    b.function(rb, "0000:00:16.0", INTEL, ADL_HECI, COMM_OTHER, driver="mei_me", revision="11",
               bars=[(0, 4 * KiB, BAR64)], reset_method=None)
    b.function(rb, "0000:00:17.0", INTEL, ADL_SATA, SATA_AHCI, driver="ahci", revision="11",
               bars=[(0, 8 * KiB, BAR32), (5, 2 * KiB, BAR32)], reset_method=None)
    # PCH root ports #1 (00:1c.0, LAN) and #5 (00:1c.4, ports 5-8 as the chipset x4 slot):
    # one multifunction device without ACS, so one group with everything behind them.
    pch = b.new_group()
    rp1 = b.bridge(rb, "0000:00:1c.0", INTEL, ADL_PCH_RP1, secondary_bus=0x03, link=(2, 1, 3, 1), group=pch)
    b.function(rp1, "0000:03:00.0", INTEL, I225_V, ETHERNET, driver="igc", subsystem=("1043", "87d2"),
               revision="03", link=(2, 1), bars=[(0, 1 * MiB, BAR32), (3, 16 * KiB, BAR32)], group=pch)
    rp5 = b.bridge(rb, "0000:00:1c.4", INTEL, ADL_PCH_RP5, secondary_bus=0x04, link=(4, 4), group=pch)
    b.function(rp5, "0000:04:00.0", NVIDIA, RTX_3060, VGA, driver="nvidia", subsystem=("1462", "3976"),
               link=(4, 4, 4, 16), bars=_gpu_bars(16 * GiB, io=True), boot_vga=False, multifunction=True,
               group=pch, reset_method="bus")
    b.function(rp5, "0000:04:00.1", NVIDIA, RTX_3060_AUDIO, HDA, driver="snd_hda_intel",
               subsystem=("1462", "3976"), link=(4, 4, 4, 16), bars=[(0, 16 * KiB, BAR32)], multifunction=True,
               group=pch, reset_method="bus")
    rp9g = b.new_group()
    rp9 = b.bridge(rb, "0000:00:1d.0", INTEL, ADL_PCH_RP9, secondary_bus=0x05, link=(4, 4), group=rp9g)
    b.function(rp9, "0000:05:00.0", WDC, SN850, NVME, driver="nvme", subsystem=(WDC, "5011"), revision="01",
               link=(4, 4), bars=[(0, 16 * KiB, BAR64)], group=rp9g, reset_method="flr bus")
    for fn, dev, klass, driver, bars in (
            (0, Z690_LPC, ISA_BRIDGE, None, []),
            (3, ADL_HDA, "040380", "snd_hda_intel", [(0, 16 * KiB, BAR64), (4, 1 * MiB, BAR64)]),
            (4, ADL_SMBUS, SMBUS, "i801_smbus", [(0, 256, BAR64), (4, 32, IO)]),
            (5, ADL_SPI, SERIAL_BUS_OTHER, "intel-spi", [(0, 4 * KiB, BAR32)])):
        b.function(rb, f"0000:00:1f.{fn}", INTEL, dev, klass, driver=driver, revision="11", bars=bars,
                   multifunction=True, reset_method=None)

    # What the workstation runs on: its system disk is the SN850 (EFI partition, LUKS holding LVM
    # with root and swap), the PM9A3 is a spare; the I225-V carries the default route; the 4090
    # drives the console (nvidia-drm's framebuffer with fbcon bound, a monitor on DP-1).
    ws = b.functions
    b.block("nvme1n1", "259:0", fn=ws[PciAddress.parse("0000:05:00.0")], sub="nvme/nvme1")
    b.block("nvme1n1p1", "259:1", disk="nvme1n1")
    b.block("nvme1n1p2", "259:2", disk="nvme1n1")
    b.dm("dm-0", "253:0", "luks-3f0c", "CRYPT-LUKS2-3f0c9a4e6b7d4c1f8a2b5d6e7f801234-luks-3f0c", "nvme1n1p2")
    b.dm("dm-1", "253:1", "vg0-root", "LVM-Qx3kz0aVd2b8CwUq1Z8nY2mJ6tJ0vR3yHk9s7Q2nV1dEeWf4gH5iJ6kL7mN8oP9q", "dm-0")
    b.dm("dm-2", "253:2", "vg0-swap", "LVM-Qx3kz0aVd2b8CwUq1Z8nY2mJ6tJ0vR3y7Rk2Lm4Np6Qr8St0Uv2Wx4Yz6Ab8Cd0E", "dm-0")
    b.mount("253:1", "/", "/dev/mapper/vg0-root", "ext4")
    b.mount("259:1", "/boot/efi", "/dev/nvme1n1p1", "vfat")
    b.swap("/dev/dm-2")
    b.block("nvme0n1", "259:3", fn=ws[PciAddress.parse("0000:02:00.0")])
    b.net("enp3s0", fn=ws[PciAddress.parse("0000:03:00.0")])
    b.route("enp3s0", "0.0.0.0", "0.0.0.0", "192.168.1.1")
    b.route("enp3s0", "192.168.1.0", "255.255.255.0")
    b.inet6("enp3s0", "fe80::2e0:4cff:fe68:1a2b", scope=0x20)
    b.fb(ws[PciAddress.parse("0000:01:00.0")], "fb0")
    b.vtconsole("vtcon0", "(S) dummy device", False)
    b.vtconsole("vtcon1", "(M) frame buffer device", True)
    b.drm(ws[PciAddress.parse("0000:01:00.0")], "card1", {"DP-1": True, "HDMI-A-1": False})
    b.holder(1187, "Xorg", ["/dev/nvidiactl", "/dev/nvidia-modeset", "/dev/nvidia0", "/dev/nvidia1"])
    b.holder(1542, "gnome-shell", ["/dev/nvidiactl", "/dev/nvidia-modeset", "/dev/nvidia0"])


# -- 3. epyc-mixed -------------------------------------------------------------------------
def build_epyc_mixed(root: str) -> None:
    """A single-socket AMD EPYC virtualization host with mixed NVIDIA cards.

    Modelled on a 1P EPYC 7763 (Milan, 64 cores, SMT; BIOS NPS2 -> 2 NUMA nodes) board such
    as the Supermicro H12SSL: four root complexes at buses 00/40/80/c0, each with an AMD-Vi
    IOMMU (ivhd0-3, the 1022:1481 functions at RB:00.2) and GPP bridges RB:0x.1 per slot
    (AMD EPYC 7003 PPR; Rome/Milan share the "Starship/Matisse" device IDs). NVIDIA vGPU
    documentation shapes the GPUs: an A10 with SR-IOV (32 VFs; 4 enabled by sriov-manage)
    whose VFs list creatable vGPU types (the vendor-specific VFIO interface of vGPU 17+,
    nvidia/creatable_vgpu_types; type IDs 588-614 from NVIDIA's A10 type table), one VF
    already an A10-4Q, so the others offer only A10-4Q (time-sliced vGPUs on one GPU must
    have one size); a Tesla T4 with legacy mdev types (nvidia-222 ... nvidia-321, "GRID
    T4-*"); an A100 PCIe 80GB bound to vfio-pci through driver_override and held by a
    running QEMU. Everything sits behind ACS-capable root ports: every group is viable.
    """
    b = HostBuilder(root)
    b.osrelease("5.14.0-427.13.1.el9_4.x86_64")
    _os_release(b, RHEL_94)
    b.cmdline("BOOT_IMAGE=(hd0,gpt2)/vmlinuz-5.14.0-427.13.1.el9_4.x86_64 root=/dev/mapper/rhel-root ro "
              "crashkernel=1G-4G:192M,4G-64G:256M,64G-:512M resume=/dev/mapper/rhel-swap rd.lvm.lv=rhel/root "
              "rd.lvm.lv=rhel/swap amd_iommu=on iommu=pt hugepagesz=2M hugepages=65536 "
              "rd.driver.blacklist=nouveau modprobe.blacklist=nouveau")
    b.modules(["nvidia_vgpu_vfio", "nvidia", "mdev", "vfio_pci", "vfio_pci_core", "vfio_iommu_type1", "vfio",
               "iommufd", "kvm_amd", "kvm", "irqbypass", "mlx5_ib", "ib_uverbs", "ib_core", "mlx5_core", "nvme",
               "nvme_core", "ast", "ccp"])
    b.iommu("amd", units=4)
    b.cpuinfo("AMD EPYC 7763 64-Core Processor", 48, 48, vendor="AuthenticAMD")
    b.firmware("usr/share/edk2/ovmf/OVMF_CODE.fd", "usr/share/edk2/ovmf/OVMF_VARS.fd")  # RHEL's edk2-ovmf
    per_socket = b.cpu_topology(1, 64, 2)[0]
    halves = {0: [c for c in per_socket if c % 64 < 32], 1: [c for c in per_socket if c % 64 >= 32]}
    b.remote_distance = 12  # two NPS2 quadrant groups of one socket
    b.numa_node(0, halves[0], 256, {HUGE_2M: (32768, 32768)})
    b.numa_node(1, halves[1], 256, {HUGE_2M: (32768, 24576)})  # 16 GiB backs the A100 guest
    b.framebuffer("astdrmfb")

    def root_complex(rbus: int, numa: int) -> Node:
        rb = b.root_bus(0, rbus, numa=numa)
        b.function(rb, f"0000:{rbus:02x}:00.0", AMD, ROME_RC, HOST_BRIDGE, revision="00", reset_method=None)
        b.function(rb, f"0000:{rbus:02x}:00.2", AMD, ROME_IOMMU, IOMMU_CLASS, revision="00", group=None,
                   reset_method=None)  # the IOMMU itself is in no group
        return rb

    def gpp(rb: Node, rbus: int, slot: int, secondary: int, link: tuple) -> Node:
        b.function(rb, f"0000:{rbus:02x}:{slot:02x}.0", AMD, ROME_DUMMY_HB, HOST_BRIDGE, revision="00",
                   reset_method=None)
        return b.bridge(rb, f"0000:{rbus:02x}:{slot:02x}.1", AMD, ROME_GPP, secondary_bus=secondary, link=link)

    # Root complex 00 (node 0): boot NVMe.
    rb = root_complex(0x00, 0)
    port = gpp(rb, 0x00, 1, 0x01, (4, 4))
    b.function(port, "0000:01:00.0", SAMSUNG, PM1733, NVME, driver="nvme", subsystem=(SAMSUNG, "a801"),
               revision="00", link=(4, 4), bars=[(0, 32 * KiB, BAR64)])

    # Root complex 40 (node 0): A10, SR-IOV with vGPU types on the VFs.
    rb = root_complex(0x40, 0)
    port = gpp(rb, 0x40, 1, 0x41, (4, 16))
    vf_bar0, vf_bar1, vf_bar3 = 16 * MiB, 1 * GiB, 32 * MiB
    a10 = b.function(port, "0000:41:00.0", NVIDIA, A10, DISPLAY_3D, driver="nvidia", subsystem=(NVIDIA, "1482"),
                     link=(4, 16), bars=_gpu_bars(32 * GiB) + [(8, 32 * vf_bar1, BAR64_PREF),
                                                               (10, 32 * vf_bar3, BAR64_PREF)])
    # VF BAR0 x 32 VFs = 512 MiB of 32-bit space: firmware puts it low in the MMIO32 window,
    # below where HostBuilder starts allocating 32-bit BARs (0xc0000000).
    _add_resource(a10, 7, 0xA000_0000, 32 * vf_bar0, BAR32)
    vfs = _sriov_vfs(b, a10, 32, [f"0000:41:00.{n}" for n in range(4, 8)], A10, NVIDIA, DISPLAY_3D, "nvidia",
                     [(0, vf_bar0, BAR32), (1, vf_bar1, BAR64_PREF), (3, vf_bar3, BAR64_PREF)])
    a10_types = [(588, "NVIDIA A10-1B"), (589, "NVIDIA A10-2B"), (590, "NVIDIA A10-1Q"), (591, "NVIDIA A10-2Q"),
                 (592, "NVIDIA A10-3Q"), (593, "NVIDIA A10-4Q"), (594, "NVIDIA A10-6Q"), (595, "NVIDIA A10-8Q"),
                 (596, "NVIDIA A10-12Q"), (597, "NVIDIA A10-24Q"), (598, "NVIDIA A10-1A"),
                 (599, "NVIDIA A10-2A"), (600, "NVIDIA A10-3A"), (601, "NVIDIA A10-4A"), (602, "NVIDIA A10-6A"),
                 (603, "NVIDIA A10-8A"), (604, "NVIDIA A10-12A"), (605, "NVIDIA A10-24A"),
                 (610, "NVIDIA A10-4C"), (611, "NVIDIA A10-6C"), (612, "NVIDIA A10-8C"), (613, "NVIDIA A10-12C"),
                 (614, "NVIDIA A10-24C")]
    assert len(a10_types) == 23
    b.vgpu_types(vfs[0], [], current=593)  # an A10-4Q lives here; nothing more is creatable on this VF
    for vf in vfs[1:]:
        b.vgpu_types(vf, [(593, "NVIDIA A10-4Q")])

    # Root complex 80 (node 1): A100 on vfio-pci, T4 with mdev types.
    rb = root_complex(0x80, 1)
    port = gpp(rb, 0x80, 1, 0x81, (4, 16))
    a100 = b.function(port, "0000:81:00.0", NVIDIA, A100_PCIE_80G, DISPLAY_3D, driver="vfio-pci",
                      subsystem=(NVIDIA, "1533"), link=(4, 16), bars=_gpu_bars(128 * GiB))
    _attr(a100, "driver_override", "vfio-pci")
    port = gpp(rb, 0x80, 3, 0x82, (3, 16, 4, 16))
    t4 = b.function(port, "0000:82:00.0", NVIDIA, T4, DISPLAY_3D, driver="nvidia", subsystem=(NVIDIA, "12a2"),
                    link=(3, 16), bars=_gpu_bars(256 * MiB), reset_method="bus")
    t4_types = [  # (id, name, heads, frl, framebuffer MiB, max resolution)
        (222, "GRID T4-1B", 4, 45, 1024, "5120x2880"), (223, "GRID T4-2B", 4, 45, 2048, "5120x2880"),
        (224, "GRID T4-2B4", 4, 45, 2048, "5120x2880"), (225, "GRID T4-1A", 1, 60, 1024, "1280x1024"),
        (226, "GRID T4-2A", 1, 60, 2048, "1280x1024"), (227, "GRID T4-4A", 1, 60, 4096, "1280x1024"),
        (228, "GRID T4-8A", 1, 60, 8192, "1280x1024"), (229, "GRID T4-16A", 1, 60, 16384, "1280x1024"),
        (230, "GRID T4-1Q", 4, 60, 1024, "5120x2880"), (231, "GRID T4-2Q", 4, 60, 2048, "7680x4320"),
        (232, "GRID T4-4Q", 4, 60, 4096, "7680x4320"), (233, "GRID T4-8Q", 4, 60, 8192, "7680x4320"),
        (234, "GRID T4-16Q", 4, 60, 16384, "7680x4320"), (252, "GRID T4-1B4", 4, 45, 1024, "5120x2880"),
        (319, "GRID T4-4C", 1, 60, 4096, "4096x2160"), (320, "GRID T4-8C", 1, 60, 8192, "4096x2160"),
        (321, "GRID T4-16C", 1, 60, 16384, "4096x2160")]
    b.mdev_types(t4, [(f"nvidia-{tid}", name, 16384 // fb,
                       f"num_heads={heads}, frl_config={frl}, framebuffer={fb}M, max_resolution={res}, "
                       f"max_instance={16384 // fb}")
                      for tid, name, heads, frl, fb, res in t4_types])

    # Root complex c0 (node 1): ConnectX-6 Dx (2 VFs on port 0), the BMC.
    rb = root_complex(0xc0, 1)
    port = gpp(rb, 0xc0, 1, 0xc1, (4, 16))
    cx6 = [b.function(port, f"0000:c1:00.{fn}", MELLANOX, CONNECTX6DX, ETHERNET, driver="mlx5_core",
                      subsystem=(MELLANOX, "0016"), revision="00", link=(4, 16), multifunction=True,
                      bars=[(0, 32 * MiB, BAR64_PREF), (7, 8 * 2 * MiB, BAR64_PREF)])
           for fn in (0, 1)]
    _sriov_vfs(b, cx6[0], 8, ["0000:c1:00.2", "0000:c1:00.3"], MLX5_VF, MELLANOX, ETHERNET, "mlx5_core",
               [(0, 2 * MiB, BAR64_PREF)])
    port = gpp(rb, 0xc0, 3, 0xc2, (2, 1))
    bmc = b.new_group()
    ast_bridge = b.bridge(port, "0000:c2:00.0", ASPEED, AST1150, secondary_bus=0xc3, link=(2, 1), group=bmc,
                          driver=None)
    b.function(ast_bridge, "0000:c3:00.0", ASPEED, AST_VGA, VGA, driver="ast", revision="41", group=bmc,
               subsystem=("15d9", "1b95"), bars=[(0, 64 * MiB, BAR32), (1, 256 * KiB, BAR32), (2, 128, IO)],
               boot_vga=True, reset_method=None)

    b.holder(3120, "nvidia-vgpu-mgr", ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1"])
    b.holder(48211, "qemu-kvm", ["/dev/vfio/vfio", f"/dev/vfio/{a100.group}"])
    b.holder(48377, "qemu-kvm", ["/dev/vfio/vfio", f"/dev/vfio/{vfs[0].group}"])


# -- 4. iommu-off --------------------------------------------------------------------------
def build_iommu_off(root: str) -> None:
    """A host booted with the IOMMU off: no groups, nothing can be passed through.

    Modelled on a Dell PowerEdge R740 (2x Xeon Gold 6148, Skylake-SP, 20 cores each, HT;
    384 GiB) with two Tesla V100 PCIe 16GB in the riser slots at buses 3b and d8 (the
    R740 slot/bus map in Dell's owner's manual; lspci output widely posted), a BCM57416
    rNDC, a PERC H730P (MegaRAID SAS-3 3108) and the iDRAC9's Matrox G200eW3 as console.
    intel_iommu=off stops DMA remapping but not interrupt remapping (the DMAR table still
    drives x2APIC IR), so /proc/interrupts keeps its IR- chips.
    """
    b = HostBuilder(root)
    b.osrelease("5.4.0-169-generic")
    _os_release(b, UBUNTU_2004)
    b.cmdline("BOOT_IMAGE=/vmlinuz-5.4.0-169-generic root=/dev/mapper/ubuntu--vg-ubuntu--lv ro intel_iommu=off "
              "maybe-ubiquity")
    b.modules(["nvidia_uvm", "nvidia_drm", "nvidia_modeset", "nvidia", "bnxt_en", "megaraid_sas", "mgag200",
               "drm_kms_helper", "kvm_intel", "kvm", "irqbypass"])
    b.iommu(None)
    _interrupts(b, remapped=True)
    b.cpuinfo("Intel(R) Xeon(R) Gold 6230 CPU @ 2.10GHz", 46, 48)
    sockets = b.cpu_topology(2, 20, 2)
    for node in (0, 1):
        b.numa_node(node, sockets[node], 192)
    b.framebuffer("mgadrmfb")

    rb = b.root_bus(0, 0x00, numa=0)
    b.function(rb, "0000:00:00.0", INTEL, SKX_DMI3, HOST_BRIDGE, revision="04", reset_method=None)
    port = b.bridge(rb, "0000:00:1c.0", INTEL, C620_RP1, secondary_bus=0x03, link=(1, 1))
    b.function(port, "0000:03:00.0", MATROX, G200EW3, VGA, driver="mgag200", subsystem=("1028", "0716"),
               revision="04", bars=[(0, 16 * MiB, BAR32_PREF), (1, 16 * KiB, BAR32), (2, 8 * MiB, BAR32)],
               boot_vga=True, reset_method=None)
    rb = b.root_bus(0, 0x17, numa=0)
    port = b.bridge(rb, "0000:17:00.0", INTEL, SKX_ROOT_PORT_A, secondary_bus=0x18, link=(3, 8))
    b.function(port, "0000:18:00.0", BROADCOM_LSI, MEGARAID_3108, RAID, driver="megaraid_sas",
               subsystem=("1028", "1f47"), revision="02", link=(3, 8),
               bars=[(0, 256, IO), (1, 64 * KiB, BAR64), (3, 1 * MiB, BAR64)])
    port = b.bridge(rb, "0000:17:02.0", INTEL, "2032", secondary_bus=0x19, link=(3, 8))
    for fn in (0, 1):
        b.function(port, f"0000:19:00.{fn}", BROADCOM, BCM57416, ETHERNET, driver="bnxt_en",
                   subsystem=("1028", "1fea"), revision="01", link=(3, 8), multifunction=True,
                   bars=[(0, 64 * KiB, BAR64_PREF), (2, 64 * KiB, BAR64_PREF), (4, 8 * KiB, BAR64_PREF)])
    for socket, rbus in ((0, 0x3a), (1, 0xd7)):
        rb = b.root_bus(0, rbus, numa=socket)
        port = b.bridge(rb, f"0000:{rbus:02x}:00.0", INTEL, SKX_ROOT_PORT_A, secondary_bus=rbus + 1, link=(3, 16))
        b.function(port, f"0000:{rbus + 1:02x}:00.0", NVIDIA, V100_PCIE_16G, DISPLAY_3D, driver="nvidia",
                   subsystem=(NVIDIA, "1214"), link=(3, 16), bars=_gpu_bars(16 * GiB), reset_method="bus")

    b.holder(1702, "nvidia-persiste", ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1"])


# -- 5. pcie-switch ------------------------------------------------------------------------
def build_pcie_switch(root: str) -> None:
    """A 2-socket PCIe GPU server with one Broadcom PEX89xxx switch behind each CPU.

    Modelled on a Supermicro SYS-421GE-TNRT (X13 dual socket, 4th gen Xeon Scalable) in its
    dual-root configuration: each CPU feeds one PEX89xxx Gen5 switch through an x16 root
    port, and the switch's downstream ports carry the GPU and NIC slots. This one holds
    4x L40S and 2x ConnectX-7, one L40S pair and one CX7 per switch (one NIC per two GPUs,
    as in NVIDIA's 2-8-5 PCIe reference configuration). 2x Xeon Platinum 8462Y+ (32 cores,
    HT), 512 GiB per socket, 192 x 1G hugepages reserved on each node, the BMC's AST2600
    (behind its AST1150 PCIe-to-PCI bridge) as boot VGA, one PM9A3 U.2 on socket 0. The
    L40S is a PCIe Gen4 x16 card: it trains at 16 GT/s on the Gen5 switch ports.

    Socket 0's switch has ACS on its downstream ports: every DSP, GPU and NIC has a group of
    its own. Socket 1's switch runs a configuration whose downstream ports expose no ACS
    (as set up for GPU<->GPU and GPU<->NIC peer-to-peer inside the switch), so its DSPs and
    everything below them share ONE group: both L40S, the CX7 and the three DSPs. The root
    port and the upstream port (which has no BAR) stay alone. This is the grouping of the
    corrected pci_device_group() (Jason Gunthorpe, "iommu: Compute iommu_groups properly for
    PCIe switches", in the "Fix incorrect iommu_groups with PCIe ACS" series), which
    NVIDIA carries in Ubuntu 24.04's linux-nvidia 6.14 kernel (NV-Kernels PR #164, July
    2025; the ABI number in the release string is illustrative). Kernels without that series
    put each non-ACS DSP in a group with its own child only, an isolation hole the series
    closes. Under the same series the AST1150 (no MMIO of its own) is isolated from its
    secondary bus, so the bridge and the AST2600 get separate groups here (the older
    kernels of the other samples put them together).
    """
    b = HostBuilder(root)
    b.osrelease("6.14.0-1013-nvidia")
    _os_release(b, UBUNTU_2404)
    b.cmdline("BOOT_IMAGE=/vmlinuz-6.14.0-1013-nvidia root=UUID=3c9a61d2-7e40-4b8f-a5d1-0e6f2b9c4a17 ro "
              "intel_iommu=on iommu=pt default_hugepagesz=1G hugepagesz=1G hugepages=384 "
              "modprobe.blacklist=nouveau nouveau.modeset=0 console=tty0 console=ttyS1,115200n8")
    b.modules(["nvidia_peermem", "nvidia_uvm", "nvidia_drm", "nvidia_modeset", "nvidia", "mlx5_ib", "ib_uverbs",
               "ib_core", "mlx5_core", "mlxfw", "nvme", "nvme_core", "ast", "drm_shmem_helper",
               "drm_kms_helper", "kvm_intel", "kvm", "irqbypass"])
    b.iommu("intel", units=16)  # one DMAR unit per PCIe/accelerator stack, 8 per socket (as dgx-h100)
    b.cpuinfo("Intel(R) Xeon(R) Platinum 8462Y+", 46, 57)
    b.firmware()  # Ubuntu's ovmf package
    sockets = b.cpu_topology(2, 32, 2)  # 128 CPUs: node0 0-31,64-95; node1 32-63,96-127
    b.remote_distance = 21  # SLIT: two-socket Xeon (the builder's default, said outright)
    for node in (0, 1):
        b.numa_node(node, sockets[node], 512, {HUGE_1G: (192, 192)})
    b.framebuffer("astdrmfb")

    # Socket 0, stack 0: VT-d/RAS and the BMC.
    rb0 = b.root_bus(0, 0x00, numa=0)
    for fn, dev in ((0, SPR_VTD), (2, SPR_RAS)):
        b.function(rb0, f"0000:00:00.{fn}", INTEL, dev, SYSTEM_PERIPHERAL, revision="20", reset_method=None,
                   multifunction=True)
    bmc_port = b.bridge(rb0, "0000:00:02.0", INTEL, SPR_ROOT_PORT, secondary_bus=0x01, link=(1, 1))
    ast_bridge = b.bridge(bmc_port, "0000:01:00.0", ASPEED, AST1150, secondary_bus=0x02, link=(1, 1),
                          driver=None)
    b.function(ast_bridge, "0000:02:00.0", ASPEED, AST_VGA, VGA, driver="ast", revision="52",
               subsystem=("15d9", AST_VGA), bars=[(0, 64 * MiB, BAR32), (1, 256 * KiB, BAR32), (2, 128, IO)],
               boot_vga=True, reset_method=None)

    def switch(rbus: int, acs: bool) -> None:
        """RB:01.0 -> PEX89xxx USP (RB+1) -> DSPs (RB+2):00-02.0 -> L40S, L40S, ConnectX-7.
        Devices are created in the order the kernel adds them (a bus, then the buses below)."""
        rp = b.bridge(b.root_bus(0, rbus, numa=0 if rbus < 0x80 else 1), f"0000:{rbus:02x}:01.0", INTEL,
                      SPR_ROOT_PORT, secondary_bus=rbus + 1, link=(5, 16))
        up = b.bridge(rp, f"0000:{rbus + 1:02x}:00.0", BROADCOM_LSI, PEX890XX, secondary_bus=rbus + 2,
                      link=(5, 16))
        shared = "auto" if acs else b.new_group()
        links = ((4, 16, 5, 16), (4, 16, 5, 16), (5, 16))
        ports = [b.bridge(up, f"0000:{rbus + 2:02x}:{n:02x}.0", BROADCOM_LSI, PEX890XX,
                          secondary_bus=rbus + 3 + n, link=links[n], group=shared) for n in range(3)]
        for n in range(2):
            b.function(ports[n], f"0000:{rbus + 3 + n:02x}:00.0", NVIDIA, L40S, DISPLAY_3D, driver="nvidia",
                       subsystem=(NVIDIA, "1851"), link=(4, 16), bars=_gpu_bars(64 * GiB), group=shared,
                       reset_method="bus")
        b.function(ports[2], f"0000:{rbus + 5:02x}:00.0", MELLANOX, CONNECTX7, ETHERNET, driver="mlx5_core",
                   subsystem=(MELLANOX, "0012"), revision="00", link=(5, 16), bars=[(0, 32 * MiB, BAR64_PREF)],
                   group=shared)

    switch(0x15, acs=True)
    rb = b.root_bus(0, 0x37, numa=0)
    port = b.bridge(rb, "0000:37:01.0", INTEL, SPR_ROOT_PORT, secondary_bus=0x38, link=(4, 4))
    b.function(port, "0000:38:00.0", SAMSUNG, PM9A3, NVME, driver="nvme", subsystem=(SAMSUNG, "a801"),
               revision="00", link=(4, 4), bars=[(0, 32 * KiB, BAR64)])

    # Socket 1, stack 0: VT-d/RAS again; then the switch without ACS.
    rb = b.root_bus(0, 0x80, numa=1)
    for fn, dev in ((0, SPR_VTD), (2, SPR_RAS)):
        b.function(rb, f"0000:80:00.{fn}", INTEL, dev, SYSTEM_PERIPHERAL, revision="20", reset_method=None,
                   multifunction=True)
    switch(0x97, acs=False)

    b.holder(2107, "nvidia-persiste", ["/dev/nvidiactl"] + [f"/dev/nvidia{n}" for n in range(4)])


SAMPLES = {
    "dgx-h100": build_dgx_h100,
    "workstation": build_workstation,
    "epyc-mixed": build_epyc_mixed,
    "iommu-off": build_iommu_off,
    "pcie-switch": build_pcie_switch,
}
