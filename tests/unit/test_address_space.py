"""The address-space planner and the version table: numbers derived by hand in the comments,
from the rules in gpuvfio/domain/address_space.py's docstring (edk2, SeaBIOS, QEMU, libvirt)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuvfio.domain import versions
from gpuvfio.domain.address_space import (OVMF_CLASSIC_WINDOW, AddressPlan, bridge_window, ovmf_window, pack,
                                          allocate_in_order, plan_address_space, ram_layout, size_text)
from gpuvfio.errors import InputError, Refused
from gpuvfio.host.model import IORESOURCE_MEM, IORESOURCE_MEM_64, IORESOURCE_PREFETCH, Bar

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
PREF64 = IORESOURCE_MEM | IORESOURCE_MEM_64 | IORESOURCE_PREFETCH


def gpu(bar1: int) -> list[Bar]:
    """An NVIDIA GPU: BAR0 16 MiB 32-bit (below 4 GiB, not in the 64-bit window), BAR1 the
    framebuffer aperture and BAR3 32 MiB, both 64-bit prefetchable; a ROM that does not count."""
    return [Bar(0, 0, 16 * MiB, IORESOURCE_MEM), Bar(1, 0, bar1, PREF64), Bar(3, 0, 32 * MiB, PREF64),
            Bar(6, 0, 512 * KiB, IORESOURCE_MEM | IORESOURCE_PREFETCH)]


H100 = gpu(128 * GiB)  # H100 SXM
L40S = gpu(64 * GiB)
RTX4090 = gpu(32 * GiB)  # with resizable BAR at 32 GiB
A10 = gpu(16 * GiB)

TIB_KIB = 1024 ** 3  # 1 TiB of RAM in KiB
H100_WINDOW = 128 * GiB + 32 * MiB
# 8 root ports of 128 GiB + 32 MiB, each aligned to 128 GiB: 7 x 256 GiB + the last one.
EIGHT_H100 = 7 * 256 * GiB + H100_WINDOW


def plan(groups, memory_kib, **kw):
    kw.setdefault("virt_type", "kvm")
    kw.setdefault("firmware", "efi")
    kw.setdefault("cpu_vendor", "GenuineIntel")
    return plan_address_space(groups, memory_kib, **kw)


# -- bridge windows -------------------------------------------------------------------------

def test_edk2_bridge_window_places_bars_largest_first_and_rounds_to_1_mib():
    # 128 GiB at 0, 32 MiB at 128 GiB: 128 GiB + 32 MiB, already 1 MiB aligned; BAR0 (32-bit),
    # the ROM and VF BARs stay out.
    vf = Bar(7, 0, 8 * GiB, PREF64)
    assert bridge_window(H100 + [vf]) == (H100_WINDOW, 128 * GiB)
    assert bridge_window([Bar(0, 0, 16 * MiB, IORESOURCE_MEM)]) == (0, 0)
    assert bridge_window([Bar(2, 0, 64 * KiB, PREF64)]) == (MiB, MiB)  # the 1 MiB granule


def test_seabios_bridge_window_rounds_to_the_largest_alignment():
    # SeaBIOS: ALIGN(128 GiB + 32 MiB, 128 GiB) = 256 GiB.
    assert bridge_window(H100, "bios") == (256 * GiB, 128 * GiB)
    # A hotplug port's 2^44 >> 11 = 8 GiB minimum: an A10 (16 GiB + 32 MiB) still rounds to 32 GiB,
    # an empty port gets the 8 GiB.
    assert bridge_window(A10, "bios", 8 * GiB) == (32 * GiB, 16 * GiB)
    assert bridge_window([], "bios", 8 * GiB) == (8 * GiB, 8 * GiB)


def test_a_switch_packs_its_downstream_windows_not_its_bars():
    # Two L40S under one emulated switch: each downstream port 64 GiB + 32 MiB aligned 64 GiB;
    # the second starts at 128 GiB: 192 GiB + 32 MiB. Flat (one bridge) it would be 128 GiB + 64 MiB.
    assert bridge_window([L40S, L40S]) == (192 * GiB + 32 * MiB, 64 * GiB)
    assert bridge_window(L40S + L40S) == (128 * GiB + 64 * MiB, 64 * GiB)


@given(st.lists(st.integers(20, 40), min_size=1, max_size=12))
def test_packing_powers_of_two_largest_first_leaves_no_gap(orders):
    sizes = [1 << o for o in orders]
    assert pack([(s, s) for s in sizes]) == sum(sizes)


# -- RAM, QEMU, OVMF ------------------------------------------------------------------------

def test_q35_ram_split_and_the_amd_hole():
    # Below 2.75 GiB all RAM stays below 4 GiB; from there 2 GiB below, the rest from 4 GiB.
    assert ram_layout(2 * 1024 * 1024, amd=False, hole64=32 * GiB) == (2 * GiB, 4 * GiB, 4 * GiB, False)
    assert ram_layout(3 * 1024 * 1024, amd=False, hole64=32 * GiB) == (2 * GiB, 4 * GiB, 5 * GiB, False)
    # 1 TiB on AMD: 4 GiB + 1022 GiB = 1026 GiB, + 32 GiB hole passes 1012 GiB: RAM from 1 TiB.
    assert ram_layout(TIB_KIB, amd=True, hole64=32 * GiB) == (2 * GiB, TiB, TiB + 1022 * GiB, True)
    # 512 GiB: 514 GiB + 32 GiB stays below 1012 GiB.
    assert ram_layout(TIB_KIB // 2, amd=True, hole64=32 * GiB)[3] is False


def test_ovmf_window_trust_rules():
    # 39 bits on Intel is trusted: 1/8 of 512 GiB at the top.
    assert ovmf_window(39, "intel", 66 * GiB) == (448 * GiB, 64 * GiB, 512 * GiB, "dynamic")
    # 40 bits on Intel is not (QEMU's old default): the classic 32 GiB above RAM, aligned to 32 GiB.
    assert ovmf_window(40, "intel", 66 * GiB) == (96 * GiB, OVMF_CLASSIC_WINDOW, 1 << 40, "classic")
    # 40 on AMD is: 128 GiB at 896 GiB crosses the reserved HyperTransport hole, so it moves to
    # (1012 GiB - 128 GiB) rounded down to 128 GiB = 768 GiB.
    assert ovmf_window(40, "amd", 18 * GiB, ht_reserved=True) == (768 * GiB, 128 * GiB, TiB, "dynamic")
    # 48 bits: capped at 46, 8 TiB at 56 TiB.
    assert ovmf_window(48, "amd", TiB + 1022 * GiB) == (56 * TiB, 8 * TiB, 64 * TiB, "dynamic")
    # X-PciMmio64Mb at least 1/8 of the space wins: 2 TiB above RAM aligned to 2 TiB.
    assert ovmf_window(42, "intel", 1026 * GiB, 2 * TiB) == (2 * TiB, 2 * TiB, 4 * TiB, "classic")


# -- whole plans ----------------------------------------------------------------------------

def test_eight_h100_on_a_46_bit_sapphire_rapids():
    p = plan([H100] * 8, TIB_KIB, host_phys_bits=46, buses=list(range(1, 9)))  # a pxb-pcie each
    assert p.need_bytes == EIGHT_H100  # 1920 GiB + 32 MiB
    assert p.window_bytes == 4 * TiB  # (1920 GiB + 32 MiB) * 1.25 = 2400 GiB -> 4 TiB
    assert p.buses == list(range(1, 9))
    assert p.maxphysaddr == ("passthrough", None) and p.guest_phys_bits == 46
    # Nothing on pcie-root: its default hole; OVMF's 8 TiB at 56 TiB holds 1920 GiB: no fallback.
    assert p.pcihole64_kib is None and p.ovmf_mmio64_mb is None
    assert p.ram_top == 1026 * GiB  # 4 GiB + (1 TiB - 2 GiB)
    # 42 bits would do with X-PciMmio64Mb=2 TiB at 2 TiB (RAM ends at 1026 GiB); 41 cannot:
    # a 2 TiB window aligned to 2 TiB ends at 4 TiB.
    assert p.bits_needed == 42
    assert any("8 TiB at 56 TiB" in line for line in p.lines)
    assert "ovmf-dynamic-window" in p.features and "maxphysaddr" in p.features


def test_eight_h100_on_a_48_bit_epyc_move_ram_above_1_tib():
    p = plan([H100] * 8, TIB_KIB, host_phys_bits=48, cpu_vendor="AuthenticAMD", buses=list(range(1, 9)))
    assert p.guest_phys_bits == 48
    # 1026 GiB + 32 GiB passes 1012 GiB: 1022 GiB of RAM from 1 TiB, ending at 2046 GiB.
    assert p.ram_top == TiB + 1022 * GiB
    assert any("HyperTransport" in line for line in p.lines)
    assert any("8 TiB at 56 TiB" in line and "capped at 46" in line for line in p.lines)


def test_unknown_host_bits_are_said_and_not_refused():
    p = plan([H100] * 8, TIB_KIB, host_phys_bits=None, buses=list(range(1, 9)))
    assert p.guest_phys_bits is None and p.maxphysaddr == ("passthrough", None)
    # 44 bits give OVMF 2 TiB >= 1920 GiB + 32 MiB without a fallback; 42 need one.
    assert p.bits_needed == 42 and p.ovmf_mmio64_mb is None
    assert any("unknown" in line and "42 (44 without X-PciMmio64Mb)" in line for line in p.lines)
    # 48 TiB of RAM ends at 48 TiB + 2 GiB: OVMF's 46-bit cap still has 8 TiB at 56 TiB above it.
    assert plan([H100], 48 * TIB_KIB, host_phys_bits=None).bits_needed == 46
    # 64 TiB ends past 2^46, all OVMF maps: no phys-bits fit, and without the host's width no refusal.
    p = plan([H100], 64 * TIB_KIB, host_phys_bits=None)
    assert p.bits_needed is None and any("more than 52" in line for line in p.lines)


def test_rtx4090_on_a_39_bit_desktop_fits_in_ovmfs_64_gib():
    p = plan([RTX4090], 64 * 1024 * 1024, host_phys_bits=39)
    assert p.need_bytes == 32 * GiB + 32 * MiB and p.buses == [0]
    assert p.window_bytes == 64 * GiB  # 40 GiB + 40 MiB -> 64 GiB
    # On pcie-root: 64 GiB of hole; RAM ends at 66 GiB, + 64 GiB = 130 GiB <= 512 GiB.
    assert p.pcihole64_kib == 64 * 1024 * 1024
    assert p.ovmf_mmio64_mb is None  # 1/8 of 2^39 = 64 GiB at 448 GiB holds 32 GiB + 32 MiB
    assert p.guest_phys_bits == 39


def test_two_4090s_on_39_bits_need_the_ovmf_minimum():
    # Root ports at 0 and 64 GiB: 96 GiB + 32 MiB > OVMF's 64 GiB. X-PciMmio64Mb = 128 GiB
    # (120 GiB -> 128 GiB): base = 66 GiB aligned to 128 GiB = 128 GiB, end 256 GiB <= 512 GiB.
    p = plan([RTX4090, RTX4090], 64 * 1024 * 1024, host_phys_bits=39)
    assert p.need_bytes == 96 * GiB + 32 * MiB
    assert p.ovmf_mmio64_mb == 128 * 1024 and p.pcihole64_kib == 128 * 1024 * 1024
    assert "ovmf-dynamic-window" not in p.features
    assert any("X-PciMmio64Mb=131072" in line for line in p.lines)


def test_two_tib_of_ram_cannot_fit_39_bits():
    with pytest.raises(Refused) as caught:
        plan([RTX4090], 2 * TIB_KIB, host_phys_bits=39)
    message = str(caught.value)
    # RAM ends at 4 GiB + 2046 GiB = 2050 GiB > 512 GiB; 42 bits (4 TiB) hold it and 64 GiB of hole.
    assert "2 TiB of RAM" in message and "2050 GiB" in message
    assert "needs 42 bits" in message and "this host has 39" in message
    assert caught.value.report["bits_needed"] == 42 and caught.value.report["bits_available"] == 39


def test_a_single_h100_on_39_bits_is_refused_with_the_numbers():
    # 128 GiB + 32 MiB: OVMF's 64 GiB is too small; X-PciMmio64Mb = 256 GiB goes to 66 GiB rounded
    # up to 256 GiB and ends at 512 GiB = 2^39: it fits. With 300 GiB of RAM (ending at 302 GiB)
    # 256 GiB would start at 512 GiB, and 129 GiB at 384 GiB ends at 513 GiB: refused.
    assert plan([H100], 64 * 1024 * 1024, host_phys_bits=39).ovmf_mmio64_mb == 256 * 1024
    with pytest.raises(Refused, match="39 physical address bits"):
        plan([H100], 300 * 1024 * 1024, host_phys_bits=39)


def test_tcg_raises_phys_bits_with_maxphysaddr_emulate():
    # TCG: AMD 'max' CPU, default 40 -> OVMF 128 GiB; 44 bits give 2 TiB >= 1920 GiB + 32 MiB.
    p = plan([H100] * 8, 16 * 1024 * 1024, host_phys_bits=46, virt_type="qemu")
    assert p.maxphysaddr == ("emulate", 44) and p.guest_phys_bits == 44 and p.ovmf_mmio64_mb is None
    assert "tcg-phys-bits" in p.features


def test_tcg_emulate_bits_stay_at_or_below_the_hosts():
    # libvirt refuses emulate bits above the host's 42: 42 with X-PciMmio64Mb = 2 TiB at 2 TiB.
    p = plan([H100] * 8, 16 * 1024 * 1024, host_phys_bits=42, virt_type="qemu")
    assert p.maxphysaddr == ("emulate", 42) and p.ovmf_mmio64_mb == 2 * 1024 * 1024
    # A 39-bit host leaves TCG only its default 40: 1 TiB cannot hold 1920 GiB.
    with pytest.raises(Refused, match="TCG here can have at most 40"):
        plan([H100] * 8, 16 * 1024 * 1024, host_phys_bits=39, virt_type="qemu")


def test_tcg_seabios_a10_keeps_the_default_bits():
    # SeaBIOS: the A10's port window ALIGN(16 GiB + 32 MiB, 16 GiB) = 32 GiB. TCG's AMD 40 bits are
    # trusted: the window is 32 GiB padded to 1 TiB / 8 = 128 GiB at 1 TiB - 128 GiB = 896 GiB,
    # which touches the reserved 1012 GiB hole, so it moves down one size to 768 GiB.
    p = plan([A10], 8 * 1024 * 1024, host_phys_bits=46, virt_type="qemu", firmware="bios")
    assert p.maxphysaddr is None and p.guest_phys_bits == 40
    assert p.need_bytes == 32 * GiB and p.ovmf_mmio64_mb is None
    assert p.pcihole64_kib == 64 * 1024 * 1024  # 32 GiB * 1.25 -> 64 GiB, above QEMU's 32 GiB
    assert any("SeaBIOS 64-bit window: 128 GiB at 768 GiB" in line for line in p.lines)


def test_kvm_seabios_caps_its_window_at_2_to_the_44():
    # 48 host bits and under 1 TiB of RAM: SeaBIOS ends its window at 16 TiB, padded to 2 TiB.
    p = plan([A10], 8 * 1024 * 1024, host_phys_bits=48, firmware="bios", cpu_vendor="AuthenticAMD")
    assert any("2 TiB at 14 TiB" in line for line in p.lines)


def test_pcihole64_drops_its_headroom_before_qemu_would_refuse():
    # 41 bits (2 TiB), SeaBIOS, 1950 GiB of RAM ending at 1952 GiB. The 4090's port: ALIGN(32 GiB +
    # 32 MiB, 32 GiB) = 64 GiB; with headroom 128 GiB, and 1952 + 128 > 2048 GiB would stop QEMU;
    # the bare 64 GiB gives 2016 GiB. SeaBIOS pads to 256 GiB but cannot go below RAM: it starts at
    # 1952 GiB and the BARs end at 2016 GiB <= 2 TiB.
    p = plan([RTX4090], 1950 * 1024 * 1024, host_phys_bits=41, firmware="bios")
    assert p.pcihole64_kib == 64 * 1024 * 1024 and p.need_bytes == 64 * GiB
    assert any("256 GiB at 1952 GiB" in line for line in p.lines)


def test_an_a10_needs_no_pcihole64_and_root_bars_count():
    virtio = Bar(4, 0, 16 * KiB, PREF64)
    p = plan([A10], 16 * 1024 * 1024, host_phys_bits=46, root_bars=[virtio])
    # 16 GiB + 32 MiB + 16 KiB -> 1 MiB granule: 16 GiB + 33 MiB; * 1.25 -> 32 GiB = QEMU's default.
    assert p.need_bytes == 16 * GiB + 33 * MiB and p.pcihole64_kib is None


def test_groups_on_pxbs_stay_out_of_pcie_roots_hole():
    switch = [L40S, L40S]  # 128 GiB + 64 MiB of BARs under one switch
    p = plan([H100, switch, RTX4090, L40S], TIB_KIB // 4, host_phys_bits=46, buses=[1, 2, 0, 0])
    assert p.buses == [1, 2, 0, 0]
    # pcie-root keeps the 4090 and one L40S: 64 GiB + 32 MiB at 0, then 32 GiB + 32 MiB at 96 GiB.
    assert p.pcihole64_kib == 256 * 1024 * 1024  # (128 GiB + 32 MiB) * 1.25 -> 256 GiB
    assert any("group 0:" in line and "on pxb-pcie 1" in line for line in p.lines)
    assert any("group 2:" in line and "on pcie-root" in line for line in p.lines)
    # All on pcie-root: its hole takes all four, 448 GiB + 96 MiB packed -> 1 TiB with headroom.
    everything = plan([H100, switch, RTX4090, L40S], TIB_KIB // 4, host_phys_bits=46)
    assert everything.pcihole64_kib == 1024 ** 3
    # Two groups on one pxb are packed together, as one root bridge: the L40S's 64 GiB + 32 MiB
    # at 0, the 4090's 32 GiB + 32 MiB at 96 GiB (its 32 GiB alignment); pcie-root keeps QEMU's default.
    shared = plan([RTX4090, L40S], 64 * 1024 * 1024, host_phys_bits=46, buses=[1, 1])
    assert shared.pcihole64_kib is None and shared.need_bytes == 128 * GiB + 32 * MiB
    apart = plan([RTX4090, L40S], 64 * 1024 * 1024, host_phys_bits=46, buses=[1, 2])
    assert apart.need_bytes == 128 * GiB + 32 * MiB
    with pytest.raises(ValueError):
        plan([RTX4090, L40S], 64 * 1024 * 1024, host_phys_bits=46, buses=[1])


def test_no_64_bit_bars():
    p = plan([[Bar(0, 0, 16 * MiB, IORESOURCE_MEM)]], 8 * 1024 * 1024, host_phys_bits=46, cpu_vendor=None)
    assert (p.window_bytes, p.need_bytes, p.maxphysaddr, p.pcihole64_kib) == (None, 0, None, None)
    assert p.guest_phys_bits == 46 and p.features == ["phys-bits-check"]
    assert any("vendor unknown" in line for line in p.lines)


def test_json_and_bad_input():
    p = plan([RTX4090], 64 * 1024 * 1024, host_phys_bits=39)
    data = p.to_json()
    assert data["maxphysaddr"] == {"mode": "passthrough", "bits": None}
    assert set(data) == {"window_bytes", "need_bytes", "guest_phys_bits", "bits_needed", "maxphysaddr",
                         "pcihole64_kib", "ovmf_mmio64_mb", "buses", "ram_top", "features", "lines"}
    assert isinstance(p, AddressPlan)
    with pytest.raises(InputError):
        plan([A10], 1024, host_phys_bits=46, firmware="uefi")
    assert size_text(H100_WINDOW) == "128.03 GiB" and size_text(1026 * GiB) == "1026 GiB"


@pytest.mark.parametrize("groups,kw", [([H100] * 8, {}), ([A10], {"firmware": "bios"}),
                                        ([RTX4090], {"virt_type": "qemu"})])
def test_plan_features_are_in_the_version_table(groups, kw):
    p = plan(groups, 64 * 1024 * 1024, host_phys_bits=46, **kw)
    assert set(p.features) <= set(versions.BY_FEATURE)


# -- versions -------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("8.1", (8, 1, 0)), ("9.2.0", (9, 2, 0)), ("7.2.0 (Debian 1:7.2+dfsg-7)", (7, 2, 0)),
    ("QEMU emulator version 8.2.2 (Debian 1:8.2.2+ds-0ubuntu1)", (8, 2, 2)), (9000000, (9, 0, 0)),
    ("9000000", (9, 0, 0)), (10010002, (10, 10, 2)), ("2022.11-6", (2022, 11, 0)), ("", None), (None, None),
    ("unknown", None)])
def test_parse_version(text, expected):
    assert versions.parse_version(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("6.1.0-18-amd64", (6, 1, 0)), ("5.15.0-91-generic", (5, 15, 0)), ("6.12.9+bpo-amd64", (6, 12, 9)),
    ("6.8.0-rc3\n", (6, 8, 0)), ("6.15", (6, 15, 0)), ("", None), (None, None)])
def test_kernel_version(text, expected):
    assert versions.kernel_version(text) == expected


def test_check_against_debian_12():
    have = {"qemu": versions.parse_version("7.2.0 (Debian 1:7.2+dfsg-7)"), "libvirt": versions.parse_version(9000000),
            "kernel": versions.kernel_version("6.1.0-18-amd64"), "ovmf": None}
    rows = {r.feature: r for r in versions.check(have, ["nv-clique-turing", "qemu-override", "maxphysaddr",
                                                         "reset-method", "huge-pfnmap", "gen5-root-port",
                                                         "bar-mmap-align", "ovmf-dynamic-window"])}
    assert {f: r.status for f, r in rows.items()} == {
        "nv-clique-turing": "missing", "qemu-override": "ok", "maxphysaddr": "ok", "reset-method": "ok",
        "huge-pfnmap": "missing", "gen5-root-port": "missing", "bar-mmap-align": "missing",
        "ovmf-dynamic-window": "unknown"}
    assert rows["nv-clique-turing"].needed == "QEMU 8.1.0" and rows["nv-clique-turing"].have == "QEMU 7.2.0"
    assert rows["ovmf-dynamic-window"].have is None
    assert "f9e54c3a2f5b" in rows["huge-pfnmap"].to_json()["why"]
    # A two-part version counts as .0; exactly the minimum is ok.
    assert versions.check({"kernel": (6, 15)}, ["huge-pfnmap-dma"])[0].status == "ok"
    with pytest.raises(ValueError, match="unknown feature"):
        versions.check({}, ["warp-drive"])


def test_the_table_covers_the_issue():
    table = {(m.component, m.version[:2], m.feature) for m in versions.MINIMUMS}
    assert {("qemu", (8, 1), "nv-clique-turing"), ("qemu", (9, 0), "gen5-root-port"),
            ("qemu", (9, 2), "bar-mmap-align"), ("kernel", (5, 15), "reset-method"),
            ("kernel", (6, 12), "huge-pfnmap"), ("kernel", (6, 15), "huge-pfnmap-dma"),
            ("libvirt", (8, 2), "qemu-override"), ("libvirt", (8, 7), "maxphysaddr")} <= table
    assert all(m.component in versions.COMPONENTS and m.why for m in versions.MINIMUMS)
    assert len(versions.BY_FEATURE) == len(versions.MINIMUMS)


def test_ovmf_places_root_bridges_in_bus_order_first_fit():
    """PciHostBridgeDxe allocates root bridge by root bridge in bus order, each first fit from
    the window's base: a 4090 on the first pxb at 0 pushes the H100 on the second to 128 GiB, so
    256 GiB + 32 MiB are needed, not the 192 GiB a largest-first packing would say."""
    p = plan([RTX4090, H100], 16 * 1024 * 1024, host_phys_bits=46, buses=[1, 2])
    assert p.need_bytes == 256 * GiB + 32 * MiB
    # The other order packs tightly: the H100 at 0, the 4090 at 160 GiB (its 32 GiB alignment).
    assert plan([H100, RTX4090], 16 * 1024 * 1024, host_phys_bits=46, buses=[1, 2]).need_bytes == 192 * GiB + 32 * MiB
    # A gap left earlier is taken by a later block that fits in it.
    assert allocate_in_order([(32 * GiB, 32 * GiB), (128 * GiB, 128 * GiB), (64 * GiB, 64 * GiB)]) == 256 * GiB
    assert allocate_in_order([(GiB, GiB), (128 * GiB, 128 * GiB), (2 * GiB, 2 * GiB)]) == 256 * GiB
    assert allocate_in_order([]) == 0
    # SeaBIOS packs every root bus's resources as one list, largest alignment first: its bridge
    # windows round up to their largest child (H100: 256 GiB, 4090: 64 GiB), 256 + 64 GiB.
    bios = plan([RTX4090, H100], 16 * 1024 * 1024, host_phys_bits=46, buses=[1, 2], firmware="bios")
    assert bios.need_bytes == 320 * GiB


# -- edges mutation testing found untested (docs/mutation.md) ------------------------------------

def test_the_small_helpers_at_their_edges():
    from gpuvfio.domain.address_space import fallbacks, pow2_ceil, pow2_floor
    assert [pow2_ceil(v) for v in (0, 1, 2, 3, 4, 5, 1 << 40)] == [1, 1, 2, 4, 4, 8, 1 << 40]
    assert [pow2_floor(v) for v in (0, 1, 2, 3, 4, 5)] == [0, 1, 2, 2, 4, 4]
    assert [size_text(v) for v in (512, 3 * MiB, 5 * KiB, 4095 * MiB, 4096 * MiB)] == [
        "512 B", "3 MiB", "5 KiB", "4095 MiB", "4 GiB"]
    # largest alignment first, not largest size: a 3 GiB window aligned to 1 GiB after a 2 GiB BAR
    assert pack([(3 * GiB, GiB), (2 * GiB, 2 * GiB)]) == 5 * GiB
    # X-PciMmio64Mb past 16 TiB is ignored by OVMF (PlatformGetFirstNonAddress): 16 TiB itself is the last
    assert fallbacks(16 * TiB) == [16 * TiB] and fallbacks(3 * GiB) == [4 * GiB, 3 * GiB]


def test_bad_firmware_and_buses_are_named():
    with pytest.raises(InputError, match="firmware 'uefi' / virt type 'kvm'"):
        plan([A10], 8 * 1024 * 1024, host_phys_bits=46, firmware="uefi")
    with pytest.raises(ValueError, match="one bus per group"):
        plan([A10], 8 * 1024 * 1024, host_phys_bits=46, buses=[0, 1])


def test_qemu_starts_when_ram_and_the_hole_end_exactly_at_the_top():
    """QEMU (hw/i386/pc.c pc_memory_init) refuses when the last used address, end - 1, is past
    2^bits - 1: RAM ending at 32 GiB plus the 32 GiB pci-hole64 is exactly 2^36 and starts."""
    fits = plan([], 30 * 1024 * 1024, host_phys_bits=36)
    assert (fits.guest_phys_bits, fits.ram_top) == (36, 32 * GiB)


def test_a_plan_says_when_no_width_fits_without_x_pcimmio64mb():
    """An 8 TiB BAR is past OVMF's largest phys-bits window (1/8 of 2^46): only an
    X-PciMmio64Mb size fits it, and the plan says that no width fits without one."""
    fits = plan([gpu(8 * TiB)], 64 * 1024 * 1024, host_phys_bits=48)
    assert fits.ovmf_mmio64_mb == 16 * 1024 * 1024
    assert any("the fewest that fit: 45 (none without X-PciMmio64Mb)" in line for line in fits.lines)


def test_the_window_headroom_is_a_quarter_before_the_power_of_two():
    from gpuvfio.domain.address_space import with_headroom
    # 13 GiB + a quarter is 16.25 GiB: the next power of two is 32 GiB (a fifth would stay at 16)
    assert with_headroom(13 * GiB) == 32 * GiB
    assert with_headroom(12 * GiB) == 16 * GiB


def test_ram_below_the_q35_split_stays_below_4_gib_whole():
    """pc_q35_init: under 0xb0000000 all of RAM is below 4 GiB, 1 GiB or 2.5 GiB alike; the rest
    of the space starts at 4 GiB with nothing in it."""
    assert ram_layout(1024 * 1024, amd=False, hole64=32 * GiB) == (GiB, 4 * GiB, 4 * GiB, False)
    assert ram_layout(5 * 512 * 1024, amd=False, hole64=32 * GiB) == (5 * GiB // 2, 4 * GiB, 4 * GiB, False)


def test_ram_moves_above_1_tib_when_the_last_address_reaches_the_amd_hole():
    """pc_max_used_gpa is the hole's start (RAM's end rounded up to 1 GiB) + pci-hole64-size - 1;
    RAM moves when that is at or past 0xfd00000000 (1012 GiB). 976 GiB above 4 GiB ends at 980
    GiB: + 32 GiB - 1 is one byte short of the hole; a byte more of hole64 reaches it."""
    above_976 = (976 + 2) * 1024 * 1024  # 2 GiB below 4 GiB, 976 GiB above
    assert ram_layout(above_976, amd=True, hole64=32 * GiB)[3] is False
    assert ram_layout(above_976, amd=True, hole64=32 * GiB + 1)[3] is True
    assert ram_layout(above_976 + 1024 * 1024, amd=True, hole64=32 * GiB)[3] is True
    assert ram_layout(above_976 + 1024 * 1024, amd=False, hole64=32 * GiB)[3] is False


def test_ovmf_takes_the_dynamic_window_only_when_it_is_larger_and_leaves_room():
    """PlatformDynamicMmioWindow: PcdPciMmio64Size < MmioWindowSize and PcdPciMmio64Base +
    MmioWindowSize < AddrSpace, both strict. 41 bits: the dynamic window is 256 GiB."""
    # an X-PciMmio64Mb window of exactly 256 GiB is not smaller: classic, above RAM
    assert ovmf_window(41, "intel", 8 * GiB, 256 * GiB) == (256 * GiB, 256 * GiB, 2 * TiB, "classic")
    # 39 bits: RAM to 448 GiB puts the classic base at 448 GiB; + 64 GiB is the whole 512 GiB
    assert ovmf_window(39, "intel", 448 * GiB) == (448 * GiB, 32 * GiB, 512 * GiB, "classic")
    assert ovmf_window(39, "intel", 416 * GiB) == (448 * GiB, 64 * GiB, 512 * GiB, "dynamic")


def test_seabios_caps_its_window_at_2_to_the_44_until_ram_above_4_gib_reaches_1_tib():
    from gpuvfio.domain.address_space import seabios_top
    assert seabios_top(46, "intel", TiB - 1) == 1 << 44
    assert seabios_top(46, "intel", TiB) == 1 << 46
    assert seabios_top(44, "intel", 0) == 1 << 44
    assert seabios_top(40, "intel", 0) == 0  # not trusted


def test_seabios_pads_its_window_only_when_ram_reaches_above_4_gib():
    """SeaBIOS pads the 64-bit window to top/8 when there is RAM above 4 GiB; 2.5 GiB is under
    q35's split, so all of it is below 4 GiB and the window is the BARs' 2 GiB, at the top."""
    lines = plan([gpu(GiB)], 5 * 512 * 1024, host_phys_bits=40, firmware="bios", cpu_vendor="AuthenticAMD").lines
    assert "SeaBIOS 64-bit window: 2 GiB at 1020 GiB" in "\n".join(lines)
    lines = plan([gpu(GiB)], 3 * 1024 * 1024, host_phys_bits=40, firmware="bios", cpu_vendor="AuthenticAMD").lines
    assert "SeaBIOS 64-bit window: 128 GiB at 768 GiB" in "\n".join(lines)


def test_no_width_past_52_bits_is_offered():
    """QEMU's TARGET_PHYS_ADDR_SPACE_BITS is 52: a 2 PiB BAR with 2 TiB of RAM would fit in 53
    bits, and the plan says it needs more than 52 rather than naming a width no CPU has."""
    with pytest.raises(Refused, match="it needs more than 52 bits, this host has 52"):
        plan([gpu(1 << 51)], 2 * TIB_KIB, host_phys_bits=52, firmware="bios")
