"""What the host expects to find in a guest: one entry per function it assigned.

The expectation comes from the host, never from the guest: the functions gpuvfio recorded
in the domain (or ``verify --expect-device ADDR``), or ``--expect VENDOR:DEVICE[xN]`` for a
guest gpuvfio did not define. Each function is checked by what it is: a display or 3D
controller needs the NVIDIA driver and a CUDA device; an HDMI audio function, a USB-C
controller and the like need only to be present. The PCIe link an NVIDIA GPU should train
in the guest is what its host slot allows: the lower of the GPU's and its upstream port's
capability (a Gen5 GPU in a Gen4 slot runs at Gen4). The guest cannot tell: QEMU's emulated
root ports claim 16 GT/s x32 and switch ports 2.5 GT/s x1 whatever the hardware (QEMU
hw/pci-bridge/gen_pcie_root_port.c, hw/pci-bridge/xio3130_downstream.c).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError
from gpuvfio.host.inventory import Inventory
from gpuvfio.numbers import finite, uint

# Usable GB/s per lane and direction after line coding (PCIe base spec: 8b/10b to Gen2,
# 128b/130b from Gen3; Gen6 FLIT ~242/256).
LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


@dataclass(frozen=True)
class HealthyLink:
    """What healthy x16 cards of one PCIe generation measure per direction: pinned host memory on
    the GPU's NUMA node, copy-engine copies (bandwidthTest, nvbandwidth), the low end of what
    the cited runs show."""
    gen: int
    x16_gbps: float
    source: str


# The floors come from measurements, not from one share of the raw rate: Gen3 cards reach a
# smaller share of their 15.75 GB/s (76-82 %) than Gen5 cards of their 63.0 (84-90 %), so 76.2 %
# of the raw rate, right at Gen5, put the Gen3 floor (12.0 GB/s) where healthy cards measure.
HEALTHY = {
    3: HealthyLink(3, 12.0, "P100 PCIe bandwidthTest pinned, local NUMA: 12.15 H2D, 12.89 D2H "
                   "(mpicbg-scicomp/gearshifft#82); V100: 12 GB/s (ZaidQureshi/bam#54)"),
    4: HealthyLink(4, 23.9, "nvbandwidth v0.2 CE, 8x RTX 4090: 23.90-26.38 H2D, 26.25-27.11 D2H "
                   "(NVIDIA/nvbandwidth#15); A100: 24.8-25 GB/s (bam#54)"),
    5: HealthyLink(5, 53.0, "nvbandwidth CE on H100/H200, bare metal and VMs: 53-57 GB/s; 8x H100 "
                   "SM copies D2H: 52.77 (NVIDIA/nvbandwidth#24)"),
}
# The floor is this share of what healthy cards measure, scaled to the slot's width (a lane of a
# narrower link carries the same payload per TLP): 10.8 / 21.5 / 47.7 GB/s at Gen3 / 4 / 5 x16,
# the last where large clouds gate H100/H200 VMs (48-52 GB/s). Below it something is wrong: a
# slot trained down, remote NUMA memory, an IOMMU in translated mode under load.
HEALTHY_SHARE = 0.9
# Generations no cited run covers (Gen1-2, Gen6) keep the share of the raw rate that the floor
# is at Gen5, the best measured: 0.9 x 53.0 / 63.0, 75.7 %.
RAW_SHARE = HEALTHY_SHARE * HEALTHY[5].x16_gbps / (LANE_GBPS[5] * 16)
VGPU_WITHOUT_CUDA = re.compile(r"-\d+[AB]$")  # A-series (vApps) and B-series (vPC) profiles
_EXPECT = re.compile(r"^([0-9a-fA-F]{4}):([0-9a-fA-F]{4})(?:x([0-9]{1,3}))?$")


@dataclass(frozen=True)
class Expected:
    address: str | None  # the host function; None for --expect VENDOR:DEVICE
    vendor_id: str
    device_id: str
    class_id: str | None  # None: not known on this host (--expect)
    link_gen: int | None  # what the host slot lets it train, None: unknown
    link_width: int | None
    link_source: str | None = None
    vgpu_profile: str | None = None
    driver_version: str | None = None  # the guest driver this GPU needs (an HGX host's Fabric Manager version)
    clique: int | None = None  # the P2P clique the plan gave it (x-nv-gpudirect-clique)

    @property
    def is_nvidia(self) -> bool:
        return self.vendor_id == "10de"

    @property
    def kind(self) -> str:
        """gpu (display/3D controller: driver and CUDA), or present (everything else)."""
        if self.class_id is None:
            return "gpu" if self.is_nvidia else "present"
        return "gpu" if self.is_nvidia and self.class_id[:2] == "03" else "present"

    @property
    def slot(self) -> str | None:
        return self.address.rsplit(".", 1)[0] if self.address else None

    @property
    def function(self) -> str | None:
        return self.address.rsplit(".", 1)[1] if self.address else None

    def to_json(self) -> dict:
        return dict(asdict(self), kind=self.kind)


@dataclass(frozen=True)
class Gates:
    """Acceptance gates, overridable per run: by default a share of what healthy cards of the
    slot's generation measure (HEALTHY); ``link_efficiency``: a share of the raw rate instead;
    ``min_gbps``: an absolute floor in GB/s per direction."""
    link_efficiency: float | None = None
    min_gbps: float | None = None

    def floor(self, gen: int | None, width: int | None) -> float | None:
        if self.min_gbps is not None:
            return self.min_gbps
        if not gen or not width or gen not in LANE_GBPS:
            return None
        if self.link_efficiency is None and gen in HEALTHY:
            return HEALTHY_SHARE * HEALTHY[gen].x16_gbps * width / 16
        share = RAW_SHARE if self.link_efficiency is None else self.link_efficiency
        return share * LANE_GBPS[gen] * width

    def describe(self, gen: int | None, width: int | None) -> str:
        if self.min_gbps is not None:
            return f">= {self.min_gbps:.1f} GB/s (--min-gbps)"
        floor = self.floor(gen, width)
        if self.link_efficiency is not None:
            return f">= {floor:.1f} GB/s ({self.link_efficiency:.0%} of Gen{gen} x{width})"
        if gen in HEALTHY:
            return (f">= {floor:.1f} GB/s ({HEALTHY_SHARE:.0%} of the {floor / HEALTHY_SHARE:.1f} GB/s healthy "
                    f"Gen{gen} x{width} cards measure)")
        return f">= {floor:.1f} GB/s ({RAW_SHARE:.0%} of Gen{gen} x{width}: no measured source for Gen{gen})"

    def to_json(self) -> str:
        """The rule, as attach's plan and verify's JSON state it."""
        if self.min_gbps is not None:
            return f">= {self.min_gbps:g} GB/s per direction (--min-gbps)"
        if self.link_efficiency is not None:
            return f">= {self.link_efficiency:.1%} of each GPU's host slot link per direction"
        floors = ", ".join(f"Gen{gen} x16 {self.floor(gen, 16):.1f} GB/s" for gen in sorted(HEALTHY))
        return (f">= {HEALTHY_SHARE:.0%} per direction of what healthy cards of the host slot's generation "
                f"measure, scaled to its width ({floors}); other generations {RAW_SHARE:.1%} of the raw rate")


def gates(*, link_efficiency: float | None = None, min_gbps: float | None = None) -> Gates:
    if link_efficiency is not None and (not finite(link_efficiency) or not 0 < link_efficiency <= 1):
        raise InputError(f"link efficiency must be a fraction in (0, 1], not {link_efficiency!r}")
    if min_gbps is not None and (not finite(min_gbps) or min_gbps <= 0):
        raise InputError(f"minimum bandwidth must be a positive number of GB/s, not {min_gbps!r}")
    return Gates(None if link_efficiency is None else float(link_efficiency),
                 None if min_gbps is None else float(min_gbps))


def expectations(inventory: Inventory, addresses: list[PciAddress]) -> list[Expected]:
    """One entry per host function, with the link its slot allows."""
    out = []
    for address in addresses:
        fn = inventory.require(address)[0]
        gen = width = source = None
        link = fn.link
        if fn.is_nvidia and link and link.max_gen and link.max_width:
            gen, width = link.max_gen, link.max_width
            source = f"{address} Gen{gen} x{width}"
            port = inventory.functions.get(fn.parents[-1]) if fn.parents else None
            if port is not None and port.link and port.link.max_gen and port.link.max_width:
                gen, width = min(gen, port.link.max_gen), min(width, port.link.max_width)
                source += f", its slot ({port.address}) Gen{port.link.max_gen} x{port.link.max_width}"
        out.append(Expected(str(address), fn.vendor_id, fn.device_id, fn.class_id, gen, width, source,
                            _vgpu_profile(inventory, fn)))
    return out


def _vgpu_profile(inventory: Inventory, fn) -> str | None:
    """The vGPU profile an SR-IOV VF carries (NVIDIA's current_vgpu_type), by name."""
    if not fn.vgpu_current:
        return None
    for owner in (fn, inventory.functions.get(fn.physfn) if fn.physfn else None):
        for vgpu_type in (owner.vgpu_creatable or []) if owner else []:
            if vgpu_type.type_id == fn.vgpu_current:
                return vgpu_type.name
    return f"vGPU type {fn.vgpu_current}"


def parse_expect(values: list[str]) -> list[Expected]:
    """``--expect VENDOR:DEVICE[xN]`` (repeatable): N functions with those IDs, class unknown
    (an NVIDIA one counts as a GPU), link unknown (no gate from the slot)."""
    out = []
    for value in values:
        match = _EXPECT.match(value.strip())
        if not match:
            raise InputError(f"--expect takes VENDOR:DEVICE or VENDOR:DEVICExN (e.g. 10de:2335x4), not {value!r}")
        count = uint(match.group(3) or "1")
        if not 1 <= count <= 64:
            raise InputError(f"--expect {value}: the count must be 1-64")
        out += [Expected(None, match.group(1).lower(), match.group(2).lower(), None, None, None)] * count
    return out


def cuda_not_expected(exp: Expected) -> str | None:
    """Why this function is not expected to show a CUDA device, where NVIDIA says so."""
    if exp.vgpu_profile and VGPU_WITHOUT_CUDA.search(exp.vgpu_profile.strip()):
        return (f"vGPU profile {exp.vgpu_profile} is A- or B-series: NVIDIA supports CUDA only on C- and "
                "Q-series vGPUs (NVIDIA vGPU software user guide, 'CUDA Toolkit and OpenCL support')")
    return None
