"""The guest's physical address space: the 64-bit MMIO window its devices need, the physical
address bits its CPU must have so RAM and that window fit, and the levers that get there.
Pure functions of BAR sizes, RAM and host facts; spec.py feeds them.

The model, each rule checked in the source named (q35 machine types 7.1 and newer):

* Bridge windows. edk2 (MdeModulePkg/Bus/Pci/PciBusDxe/PciResourceSupport.c,
  CalculateResourceAperture) places a bridge's resources largest alignment first, each aligned
  to its own alignment (a BAR's is its size), and rounds the total up to the bridge's own
  1 MiB granularity (CreateResourceMap: 0xFFFFF); the window then takes the largest child's
  alignment. SeaBIOS (src/fw/pciinit.c, pci_bios_check_devices) instead rounds the total up to
  the largest child's alignment (at least PCI_BRIDGE_MEM_MIN, 2 MiB), and from 1.16.3 also
  gives every hotplug port at least top-of-address-space / 2048 of 64-bit space. A bridge's
  64-bit window is its prefetchable one; 64-bit non-prefetchable BARs behind a bridge go
  below 4 GiB (DegradeResource), so only the root bus counts those. OVMF keeps 64-bit BARs
  above 4 GiB even with an option ROM (OvmfPkg/IncompatiblePciDeviceSupportDxe) and pads a
  hotplug port's 64-bit window only when QEMU's pref64-reserve asks (OvmfPkg/PciHotPlugInitDxe
  GetResourcePadding); a window is the larger of padding and contents, not their sum.
* RAM (hw/i386/pc_q35.c, pc_q35_init): RAM of 0xb0000000 (2.75 GiB) and more puts 2 GiB below
  4 GiB and the rest from 4 GiB; less stays below 4 GiB. (The "3 GiB" split is i440fx's.)
* QEMU (hw/i386/pc.c, pc_memory_init, pc_pci_hole64_start, pc_max_used_gpa): the 64-bit hole
  starts at the end of RAM rounded up to 1 GiB and QEMU counts pci-hole64-size past it (q35
  default 32 GiB, hw/pci-host/q35.c Q35_PCI_HOST_HOLE64_SIZE_DEFAULT, set by <pcihole64>);
  with an AMD guest CPU, when that end reaches 0xfd00000000 (1012 GiB, the HyperTransport
  hole) RAM above 4 GiB moves to start at 1 TiB, and with 40 or more phys-bits the hole is
  reserved in E820. It refuses to start when the end passes 2^phys-bits.
* OVMF (OvmfPkg/Library/PlatformInitLib/MemDetect.c): PlatformAddressWidthFromCpuid trusts
  phys-bits of 41 and more, or 36/39 on Intel, 40 on AMD, and caps them at 46 (47 before
  edk2-stable202308). PlatformDynamicMmioWindow (edk2-stable202211 and newer) then makes the
  64-bit window 1/8 of 2^bits at the top, unless the classic window (32 GiB, OvmfPkgX64.dsc
  PcdPciMmio64Size, or opt/ovmf/X-PciMmio64Mb from PlatformGetFirstNonAddress) is not smaller,
  or would not leave room; PlatformReservationConflictCB moves it below the AMD hole. The
  classic window sits above RAM, 1 GiB aligned and aligned to its size's power of two. So
  X-PciMmio64Mb is a minimum: it only wins when it is at least 1/8 of the address space.
* SeaBIOS (src/fw/paravirt.c qemu_detect_physbits, src/fw/pciinit.c pci_setup and
  pci_bios_map_devices, 1.16.3+): same trust rule; the window holds exactly the BARs (1 GiB
  aligned, padded to a multiple of top/8) at the top of 2^bits, capped at 2^44 unless RAM
  above 4 GiB reaches 1 TiB, moved below an E820 reservation. It never reads pci-hole64-size:
  for SeaBIOS <pcihole64> only widens QEMU's _CRS for pcie.0 (room for hotplug) and enters
  QEMU's start check.
* Guest phys-bits: KVM with <maxphysaddr mode='passthrough'/> (libvirt 8.7+, QEMU
  host-phys-bits=on, which -cpu host also defaults to: target/i386/host-cpu.c) gets the
  host's. TCG ignores host-phys-bits; its default is 40 (TCG_PHYS_ADDR_BITS) and it takes
  phys-bits 32..52 since QEMU 6.0 (target/i386/cpu.c x86_cpu_realizefn,
  TARGET_PHYS_ADDR_SPACE_BITS); libvirt refuses mode='emulate' bits above the host CPU's
  (src/qemu/qemu_validate.c qemuValidateDomainDefCpu). TCG's -cpu max is AuthenticAMD.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from gpuvfio.errors import InputError, Refused
from gpuvfio.host.model import Bar

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
FOUR_GIB = 4 * GiB
DEDICATED_BAR_BYTES = 128 * GiB  # a hierarchy with this much BAR space gets a pxb-pcie (KubeVirt VEP 199)
BIG_BAR_BYTES = 16 * GiB  # BARs whose mapping speed depends on the QEMU/kernel versions below
EDK2_BRIDGE_GRANULE = MiB
SEABIOS_BRIDGE_MIN = 2 * MiB
Q35_SPLIT, Q35_LOWMEM = 0xB0000000, 2 * GiB
QEMU_HOLE64_DEFAULT = 32 * GiB
AMD_HT_START, AMD_ABOVE_1TB = 0xFD00000000, TiB
OVMF_CLASSIC_WINDOW = 32 * GiB
OVMF_MAX_BITS = 46
OVMF_FWCFG_MAX_MB = 0x1000000  # PlatformGetFirstNonAddress ignores larger X-PciMmio64Mb values
SEABIOS_TOP_BITS = 44
TCG_DEFAULT_BITS, TCG_MAX_BITS, MIN_BITS = 40, 52, 32
# The CPUID vendor of a TCG guest's CPU: libvirt's mode='maximum' is QEMU's -cpu max, which
# under TCG says AMD (target/i386/cpu.c max_x86_cpu_initfn).
TCG_CPU_VENDOR = "AuthenticAMD"
VENDOR_WORDS = {"genuineintel": "intel", "authenticamd": "amd"}  # CPUID vendor -> the rules' word
FIRMWARES = ("efi", "bios")
VIRT_TYPES = ("kvm", "qemu")

Group = list  # Bars, and lists for bridges below (an emulated switch's downstream ports)


@dataclass
class AddressPlan:
    window_bytes: int | None  # the 64-bit MMIO window wanted (None: no 64-bit BARs)
    need_bytes: int  # what the firmware's packing of the BARs takes, without headroom
    guest_phys_bits: int | None  # None: KVM on a host whose width is unknown (the host's)
    bits_needed: int | None  # the fewest phys-bits that fit (None: none do)
    maxphysaddr: tuple[str, int | None] | None  # ("passthrough", None) | ("emulate", N) | None
    pcihole64_kib: int | None  # <pcihole64> on pcie-root, None: QEMU's 32 GiB default
    ovmf_mmio64_mb: int | None  # -fw_cfg opt/ovmf/X-PciMmio64Mb fallback, None: not needed
    buses: list[int]  # the pxb-pcie (controller index) each group's root port is on, 0: pcie-root
    ram_top: int  # end of guest RAM (bytes)
    features: list[str] = field(default_factory=list)  # versions.MINIMUMS keys this plan relies on
    lines: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        mode, bits = self.maxphysaddr or (None, None)
        return asdict(self) | {"maxphysaddr": {"mode": mode, "bits": bits} if mode else None}


def align_up(value: int, align: int) -> int:
    return -(-value // align) * align if align > 1 else value


def pow2_ceil(value: int) -> int:
    return 1 << (value - 1).bit_length() if value > 1 else 1


def pow2_floor(value: int) -> int:
    return 1 << (value.bit_length() - 1) if value > 0 else 0


def size_text(value: int) -> str:
    """Exact in the largest unit that divides it (below 4096 of them), else to 2 decimals."""
    units = [(u, n) for u, n in ((TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")) if value >= u]
    for unit, name in units:
        if value % unit == 0 and value // unit < 4096:
            return f"{value // unit} {name}"
    return f"{value / units[0][0]:.2f} {units[0][1]}" if units else f"{value} B"


def in_bridge_window(bar: Bar) -> bool:
    """A BAR a bridge's 64-bit (prefetchable) window holds."""
    return bar.kind == "mem" and bar.is_64bit and bar.prefetchable and bar.size > 0


def window_bars(group: Group):
    """The BARs in ``group``'s 64-bit windows, bridges below included."""
    for item in group:
        if isinstance(item, list):
            yield from window_bars(item)
        elif in_bridge_window(item):
            yield item


def pack(items: list[tuple[int, int]]) -> int:
    """End of (size, alignment) items placed largest alignment first, each aligned (edk2)."""
    end = 0
    for size, align in sorted(items, key=lambda item: item[1], reverse=True):
        end = align_up(end, align) + size
    return end


def bridge_window(group: Group, firmware: str = "efi", port_min: int = 0) -> tuple[int, int]:
    """(size, alignment) of the 64-bit window of a bridge holding ``group``; (0, 0) when empty.
    ``port_min``: SeaBIOS's 64-bit reservation for a hotplug port (0: none)."""
    children = []
    for item in group:
        if isinstance(item, list):
            size, align = bridge_window(item, firmware, port_min)
            if size:
                children.append((size, align))
        elif in_bridge_window(item):
            children.append((item.size, item.size))
    if not children and not port_min:
        return 0, 0
    if firmware == "bios":
        align = max([SEABIOS_BRIDGE_MIN, port_min] + [a for _s, a in children])
        return align_up(max(sum(s for s, _a in children), port_min), align), align
    align = max([EDK2_BRIDGE_GRANULE] + [a for _s, a in children])
    return align_up(pack(children), EDK2_BRIDGE_GRANULE), align


def with_headroom(need: int) -> int:
    """The window to ask for: a quarter more than the packing, rounded up to a power of two (the
    firmware aligns its window to one). The room covers a BAR the host resizes (resizable BAR
    via sysfs) before the next start, hotplug, and the firmware allocating root bridges one
    after another rather than in the ideal order."""
    return pow2_ceil(need + need // 4)


def ram_layout(memory_kib: int, *, amd: bool, hole64: int) -> tuple[int, int, int, bool]:
    """(below-4G bytes, start of the rest, end of RAM, moved above the AMD hole)."""
    ram = memory_kib * KiB
    below = Q35_LOWMEM if ram >= Q35_SPLIT else ram
    above = ram - below
    if amd and align_up(FOUR_GIB + above, GiB) + hole64 - 1 >= AMD_HT_START:
        return below, AMD_ABOVE_1TB, AMD_ABOVE_1TB + above, True
    return below, FOUR_GIB, FOUR_GIB + above, False


def firmware_trusts(bits: int, vendor: str) -> bool:
    """OVMF PlatformAddressWidthFromCpuid / SeaBIOS qemu_detect_physbits."""
    return bits >= 41 or (vendor == "intel" and bits in (36, 39)) or (vendor == "amd" and bits == 40)


def ovmf_window(bits: int, vendor: str, ram_top: int, classic: int = OVMF_CLASSIC_WINDOW,
                ht_reserved: bool = False) -> tuple[int, int, int, str]:
    """(base, size, end of what OVMF maps, "dynamic" | "classic")."""
    size = align_up(classic, GiB)
    base = align_up(align_up(ram_top, GiB), pow2_floor(size))
    if not firmware_trusts(bits, vendor):
        return base, size, 1 << bits, "classic"  # OVMF sizes its width from the window's end
    width = min(bits, OVMF_MAX_BITS)
    space, mmio = 1 << width, 1 << (width - 3)
    if size < mmio and base + mmio < space:
        base, size = space - mmio, mmio
        if ht_reserved and base < AMD_ABOVE_1TB and base + size > AMD_HT_START:
            base = (AMD_HT_START - size) & ~(size - 1)
        return base, size, space, "dynamic"
    return base, size, space, "classic"


def seabios_top(bits: int, vendor: str, above: int) -> int:
    """Where SeaBIOS puts the end of its 64-bit window; 0 when it does not trust phys-bits."""
    if not firmware_trusts(bits, vendor):
        return 0
    return 1 << SEABIOS_TOP_BITS if bits > SEABIOS_TOP_BITS and above < TiB else 1 << bits


@dataclass
class Fit:
    """One way the guest's address space works out with ``bits`` phys-bits."""
    bits: int
    below: int  # RAM below 4 GiB
    above_start: int  # where the rest starts (4 GiB, or 1 TiB past the AMD hole)
    ram_top: int
    moved: bool
    hole64: int | None  # <pcihole64> bytes, None: QEMU's default
    need: int  # the firmware's packing of every 64-bit window
    root_need: int  # pcie-root's share of it
    windows: list[tuple[int, int]]  # (size, alignment) per group
    base: int = 0  # the firmware's 64-bit window
    size: int = 0
    how: str = ""  # dynamic | classic | seabios
    fallback_mb: int | None = None  # X-PciMmio64Mb it took


def allocate_in_order(blocks: list[tuple[int, int]]) -> int:
    """The end of ``blocks`` (size, alignment) placed in order, each at the lowest aligned
    address that is free (edk2 PciHostBridgeDxe AllocateResource: from the aperture's base, one
    alignment step at a time, until gDS->AllocateMemorySpace succeeds)."""
    taken: list[tuple[int, int]] = []
    end = 0
    for size, align in blocks:
        base = 0
        for start, stop in sorted(taken):
            base = align_up(base, align)
            if base + size <= start:
                break
            base = max(base, stop)
        base = align_up(base, align)
        taken.append((base, base + size))
        end = max(end, base + size)
    return end


def layout(groups: list[Group], root_bars: list[Bar], firmware: str, port_min: int,
           buses: list[int]) -> tuple[list[tuple[int, int]], int, int]:
    """(window of each group, the root complex's packing, the whole aperture's packing).

    OVMF: each pxb-pcie is a root bridge of its own (QEMU lists it in fw_cfg etc/extra-pci-roots;
    OvmfPkg's PciHostBridgeUtilityGetRootBridges makes them in bus order, pcie.0 first), and
    PciHostBridgeDxe allocates each root bridge's resources as one block, root bridge by root
    bridge in that order, first fit from the window's base (allocate_in_order). QEMU's _CRS for pcie.0
    leaves the pxbs' ranges out (hw/i386/acpi-build.c build_dsdt).
    SeaBIOS puts the resources of every root bus on bus 0's list (src/fw/pciinit.c
    pci_bios_check_devices) and places them largest alignment first, as one packing."""
    windows = [bridge_window(g, firmware, port_min) for g in groups]
    on_bus: dict[int, list[tuple[int, int]]] = {}
    for window, bus in zip(windows, buses):
        if window[0]:
            on_bus.setdefault(bus, []).append(window)
    root_items = [(b.size, b.size) for b in root_bars if b.kind == "mem" and b.is_64bit and b.size]
    root = on_bus.pop(0, []) + root_items
    root_need = align_up(pack(root), EDK2_BRIDGE_GRANULE)
    if firmware == "bios":
        return windows, root_need, pack(root + [w for ws in on_bus.values() for w in ws])
    blocks = [(root_need, max(a for _s, a in root))] if root_need else []
    # The layout numbers pxbs (busNr) in controller order: by index is by bus.
    blocks += [(align_up(pack(ws), EDK2_BRIDGE_GRANULE), max(a for _s, a in ws)) for _bus, ws in sorted(on_bus.items())]
    return windows, root_need, allocate_in_order(blocks)


def try_fit(bits: int, groups: list[Group], root_bars: list[Bar], memory_kib: int, vendor: str,
            firmware: str, buses: list[int], fallback: int | None = None,
            hole_cap: int | None = None) -> Fit | str:
    """The layout with ``bits`` guest phys-bits, or why it does not fit."""
    amd = vendor == "amd"
    above = max(0, memory_kib * KiB - Q35_LOWMEM) if memory_kib * KiB >= Q35_SPLIT else 0
    top = seabios_top(bits, vendor, above) if firmware == "bios" else 0
    port_min = top >> 11 if top and above else 0
    windows, root_need, need = layout(groups, root_bars, firmware, port_min, buses)
    hole = with_headroom(root_need) if root_need else None
    if hole is not None and hole_cap is not None:
        hole = max(min(hole, hole_cap), root_need)
    if hole is not None and hole <= QEMU_HOLE64_DEFAULT:
        hole = None  # QEMU's default already covers it
    hole_bytes = hole or QEMU_HOLE64_DEFAULT
    below, start, ram_top, moved = ram_layout(memory_kib, amd=amd, hole64=hole_bytes)
    fit = Fit(bits, below, start, ram_top, moved, hole, need, root_need, windows)
    qemu_end = align_up(ram_top, GiB) + hole_bytes
    if qemu_end > 1 << bits:
        if hole is not None and hole_cap is None:  # without the headroom it may still start
            return try_fit(bits, groups, root_bars, memory_kib, vendor, firmware, buses, fallback,
                           align_up(root_need, GiB))
        return (f"QEMU refuses to start: RAM ends at {size_text(ram_top)}, plus pci-hole64 "
                f"{size_text(hole_bytes)} = {size_text(qemu_end)} > 2^{bits} = {size_text(1 << bits)}")
    if not need:
        return fit
    ht = amd and bits >= 40
    if firmware == "efi":
        base, size, limit, how = ovmf_window(bits, vendor, ram_top, fallback or OVMF_CLASSIC_WINDOW, ht)
        used_end = base + size
    else:
        size = align_up(need, GiB)
        if top and above:
            size = align_up(size, top >> 3)
        base = align_up(ram_top, GiB)
        if top and base < top - size:
            base = top - size
            if ht and base < AMD_ABOVE_1TB and base + size > AMD_HT_START:
                base -= size
        base = align_up(base, max(a for _s, a in windows + [(0, GiB)]))
        limit, how, used_end = top or 1 << bits, "seabios", base + need
    if size < need:
        return f"the firmware's 64-bit window is {size_text(size)}, the devices need {size_text(need)}"
    if base < align_up(ram_top, GiB):
        return f"the firmware's 64-bit window at {size_text(base)} overlaps RAM (up to {size_text(ram_top)})"
    if used_end > limit:
        return (f"the firmware's 64-bit window [{size_text(base)}, {size_text(used_end)}) ends past "
                f"what it can map ({size_text(limit)})")
    fit.base, fit.size, fit.how = base, size, how
    fit.fallback_mb = fallback // MiB if fallback else None
    if hole is not None and hole > size and hole_cap is None:
        return try_fit(bits, groups, root_bars, memory_kib, vendor, firmware, buses, fallback, size)
    return fit


def fallbacks(need: int) -> list[int]:
    """X-PciMmio64Mb sizes to try, largest first: with headroom, a power of two, the bare need."""
    sizes = [with_headroom(need), pow2_ceil(need), align_up(need, GiB)]
    return [s for i, s in enumerate(sizes) if s not in sizes[:i] and s // MiB <= OVMF_FWCFG_MAX_MB]


def first_fit(tries: list[int], args: tuple, firmware: str, need: int) -> Fit | None:
    """The first of ``tries`` phys-bits that fits from the phys-bits window alone, else the first
    that fits with an X-PciMmio64Mb minimum (OVMF only)."""
    for bits in tries:
        fit = try_fit(bits, *args)
        if isinstance(fit, Fit):
            return fit
    for bits in tries if firmware == "efi" and need else []:
        for size in fallbacks(need):
            fit = try_fit(bits, *args, fallback=size)
            if isinstance(fit, Fit):
                return fit
    return None


def plan_address_space(groups: list[Group], memory_kib: int, *, host_phys_bits: int | None,
                       virt_type: str, firmware: str, cpu_vendor: str | None,
                       root_bars: list[Bar] | None = None, buses: list[int] | None = None) -> AddressPlan:
    """Plan the guest's address space. ``groups``: the 64-bit BARs of each guest hierarchy with
    its own bridge window (a root port; nested lists for an emulated switch's downstream
    ports). ``buses``: the pxb-pcie each group's root port is on (the layout's controller index,
    0 or None: pcie-root). ``root_bars``: 64-bit BARs of devices on pcie.0 itself. Refused, with the numbers,
    when RAM and the window cannot fit in the phys-bits the guest can have."""
    if firmware not in FIRMWARES or virt_type not in VIRT_TYPES:
        raise InputError(f"firmware {firmware!r} / virt type {virt_type!r} (expected {FIRMWARES} / {VIRT_TYPES})")
    kvm = virt_type == "kvm"
    host_vendor = VENDOR_WORDS.get((cpu_vendor or "").lower(), cpu_vendor)
    vendor = (host_vendor or "intel") if kvm else VENDOR_WORDS[TCG_CPU_VENDOR.lower()]
    if buses is None:
        buses = [0] * len(groups)
    if len(buses) != len(groups):
        raise ValueError("one bus per group")
    args = (groups, root_bars or [], memory_kib, vendor, firmware, buses)
    need = layout(groups, root_bars or [], firmware, 0, buses)[2]
    every = list(range(MIN_BITS, TCG_MAX_BITS + 1))
    # the fewest phys-bits that fit from the phys-bits window alone, without X-PciMmio64Mb
    needed = next((f for f in (try_fit(bits, *args) for bits in every) if isinstance(f, Fit)), None)
    fewest = next((f for f in (first_fit([b], args, firmware, need) for b in every) if f), None)
    if kvm:
        tries = [host_phys_bits] if host_phys_bits else []
    else:
        # No <maxphysaddr> keeps TCG's 40 whatever the host; emulate bits stay at or below the host's.
        cap = min(TCG_MAX_BITS, host_phys_bits or TCG_MAX_BITS)
        tries = [TCG_DEFAULT_BITS] + list(range(TCG_DEFAULT_BITS + 1, cap + 1))
    fit = first_fit(tries, args, firmware, need)
    if fit is None and tries:
        bits = tries[-1]
        reason = try_fit(bits, *args)  # a reason: first_fit found no Fit at these bits
        ram = memory_kib * KiB
        limit = (f"this host has {host_phys_bits}" if kvm else
                 f"TCG here can have at most {bits} (libvirt keeps emulate bits at or below the host's)")
        raise Refused(f"the guest cannot fit {size_text(ram)} of RAM and {size_text(need)} of 64-bit BARs "
                      f"in {bits} physical address bits: {reason}; it needs "
                      f"{fewest.bits if fewest else 'more than ' + str(TCG_MAX_BITS)} bits, {limit}",
                      report={"memory_bytes": ram, "need_bytes": need, "bits_available": bits,
                              "bits_needed": fewest.bits if fewest else None, "reason": reason})
    chosen = fit or needed
    ram_top = chosen.ram_top if chosen else ram_layout(memory_kib, amd=vendor == "amd", hole64=QEMU_HOLE64_DEFAULT)[2]
    need = chosen.need if chosen else need  # SeaBIOS's hotplug minimum depends on the bits
    plan = AddressPlan(window_bytes=with_headroom(need) if need else None, need_bytes=need,
                       guest_phys_bits=fit.bits if fit else None, bits_needed=fewest.bits if fewest else None,
                       maxphysaddr=None, pcihole64_kib=None, ovmf_mmio64_mb=None, buses=list(buses),
                       ram_top=ram_top)
    if kvm and need:
        plan.maxphysaddr = ("passthrough", None)
    elif not kvm and fit and fit.bits != TCG_DEFAULT_BITS:
        plan.maxphysaddr = ("emulate", fit.bits)
    if chosen:
        plan.pcihole64_kib = chosen.hole64 // KiB if chosen.hole64 else None
        plan.ovmf_mmio64_mb = chosen.fallback_mb
    plan.features = plan_features(plan, groups, virt_type, firmware)
    plan.lines = describe(plan, chosen, memory_kib, host_phys_bits, kvm, vendor, host_vendor,
                          needed.bits if needed else None)
    return plan


def plan_features(plan: AddressPlan, groups: list[Group], virt_type: str, firmware: str) -> list[str]:
    features = ["phys-bits-check"]
    if plan.maxphysaddr:
        features.append("maxphysaddr")
    if virt_type == "qemu" and plan.maxphysaddr:
        features.append("tcg-phys-bits")
    if firmware == "efi" and plan.need_bytes and not plan.ovmf_mmio64_mb:
        features.append("ovmf-dynamic-window")
    if any(b.size >= BIG_BAR_BYTES for g in groups for b in window_bars(g)):
        features += ["bar-mmap-align", "huge-pfnmap", "huge-pfnmap-dma"]
    return features


def describe(plan: AddressPlan, fit: Fit | None, memory_kib: int, host_bits: int | None, kvm: bool,
             vendor: str, host_vendor: str | None, plain_bits: int | None) -> list[str]:
    lines = []
    least = f"{plan.bits_needed or f'more than {TCG_MAX_BITS}'}"
    if plain_bits != plan.bits_needed:
        least += f" ({plain_bits or 'none'} without X-PciMmio64Mb)"
    if fit:
        for i, (size, align) in enumerate(fit.windows):
            if size:
                own = f" on pxb-pcie {plan.buses[i]}" if plan.buses[i] else " on pcie-root"
                lines.append(f"group {i}: 64-bit window {size_text(size)}, aligned {size_text(align)}{own}")
    if plan.need_bytes:
        lines.append(f"64-bit MMIO: {size_text(plan.need_bytes)} as the firmware packs it; "
                     f"{size_text(plan.window_bytes or 0)} wanted with headroom")
    else:
        lines.append("no 64-bit BARs")
    if fit:
        moved = " (AMD: moved above the HyperTransport hole at 1012 GiB)" if fit.moved else ""
        lines.append(f"RAM {size_text(memory_kib * KiB)}: {size_text(fit.below)} below 4 GiB, the rest from "
                     f"{size_text(fit.above_start)}, ending at {size_text(fit.ram_top)}{moved}")
    if kvm and host_bits is None:
        lines.append(f"host physical address bits unknown (/proc/cpuinfo 'address sizes'): the guest gets "
                     f"the host's and needs at least {least}; not checked")
    elif kvm:
        lines.append(f"guest physical address bits: {host_bits}, the host's (<maxphysaddr mode='passthrough'/>; "
                     f"the fewest that fit: {least})")
    elif fit:
        how = "TCG's default" if fit.bits == TCG_DEFAULT_BITS else f"<maxphysaddr mode='emulate' bits='{fit.bits}'/>"
        lines.append(f"guest physical address bits: {fit.bits} ({how}; TCG ignores the host's)")
    if host_vendor is None and kvm:
        lines.append("host CPU vendor unknown: planned as Intel (no AMD 1 TiB hole)")
    if fit:
        hole = fit.hole64 or QEMU_HOLE64_DEFAULT
        lines.append(f"QEMU start check: RAM end {size_text(fit.ram_top)} + pci-hole64 {size_text(hole)} "
                     f"<= 2^{fit.bits} ({size_text(1 << fit.bits)})")
    if fit and fit.how:
        span = f"{size_text(fit.size)} at {size_text(fit.base)}"
        if fit.how == "dynamic":
            width = min(fit.bits, OVMF_MAX_BITS)
            lines.append(f"OVMF 64-bit window: {span}, 1/8 of 2^{width} (OVMF trusts {fit.bits} phys-bits, "
                         f"capped at {OVMF_MAX_BITS})")
        elif fit.how == "classic" and fit.fallback_mb:
            lines.append(f"OVMF 64-bit window: {span} from opt/ovmf/X-PciMmio64Mb={fit.fallback_mb} "
                         "(qemu:commandline; its phys-bits window is too small)")
        elif fit.how == "classic":
            lines.append(f"OVMF 64-bit window: {span}, its classic default "
                         f"({'phys-bits not trusted' if not firmware_trusts(fit.bits, vendor) else 'no room for 1/8'})")
        else:
            lines.append(f"SeaBIOS 64-bit window: {span} (sized from the BARs; <pcihole64> only widens "
                         "QEMU's _CRS for pcie.0)")
    if plan.pcihole64_kib and fit:
        lines.append(f"<pcihole64> {plan.pcihole64_kib} KiB on pcie-root: its own {size_text(fit.root_need)} "
                     "with headroom")
    return lines


def guest_cpu_vendor(virt_type: str, host_vendor: str | None) -> str | None:
    """The CPUID vendor string the guest's CPU shows: the host's under KVM (host-passthrough),
    QEMU's -cpu max vendor under TCG."""
    return host_vendor if virt_type == "kvm" else TCG_CPU_VENDOR
