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
# Share of the link a pinned copy-engine copy must reach. 0.762 x Gen5 x16 (63.0 GB/s) = 48 GB/s
# per direction: the floor large clouds' health checks require of an H200 VM. Healthy hosts reach
# 80-90 % (nvbandwidth on H100/H200 PCIe Gen5: 53-57 GB/s); below this, something is wrong
# (a slot trained down, remote NUMA memory, an IOMMU in translated mode under load).
LINK_EFFICIENCY = 0.762
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
    """Acceptance gates, overridable per run: the share of the link a copy must reach, or an
    absolute floor in GB/s per direction."""
    link_efficiency: float = LINK_EFFICIENCY
    min_gbps: float | None = None

    def floor(self, gen: int | None, width: int | None) -> float | None:
        if self.min_gbps is not None:
            return self.min_gbps
        if not gen or not width or gen not in LANE_GBPS:
            return None
        return self.link_efficiency * LANE_GBPS[gen] * width

    def describe(self, gen: int | None, width: int | None) -> str:
        if self.min_gbps is not None:
            return f">= {self.min_gbps:.1f} GB/s (--min-gbps)"
        return f">= {self.floor(gen, width):.1f} GB/s ({self.link_efficiency:.0%} of Gen{gen} x{width})"


def gates(*, link_efficiency: float = LINK_EFFICIENCY, min_gbps: float | None = None) -> Gates:
    if not finite(link_efficiency) or not 0 < link_efficiency <= 1:
        raise InputError(f"link efficiency must be a fraction in (0, 1], not {link_efficiency!r}")
    if min_gbps is not None and (not finite(min_gbps) or min_gbps <= 0):
        raise InputError(f"minimum bandwidth must be a positive number of GB/s, not {min_gbps!r}")
    return Gates(float(link_efficiency), None if min_gbps is None else float(min_gbps))


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
