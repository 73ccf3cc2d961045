"""Recovery the unit lane did not exercise (issue 35 item 3): a bind killed half-way and run
again, then restored; restore's fallback when drivers_probe leaves the device unbound. Each
test fails on the planted bug named in it."""

from __future__ import annotations

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.ops import binding
from gpuvfio.ops.binding import BindPolicy
from tests.conftest import gpu_workstation
from tests.contexts import sim_context
from tests.simkernel import SimKernel

GPU, AUDIO = "0000:01:00.0", "0000:01:00.1"
SLOT = [PciAddress.parse(GPU), PciAddress.parse(AUDIO)]


@pytest.fixture
def host(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    built = gpu_workstation(tmp_path / "host")
    return built, SimKernel(built.root)


class Killed(BaseException):
    """The process dying between two steps: no rollback runs (not a GpuvfioError)."""


def test_a_bind_killed_half_way_run_again_then_restored_gives_back_the_first_originals(host):
    """Planted bug: apply_bind records originals even for a device the journal holds already;
    the second bind then records the half-bound state (no driver, override vfio-pci) as the
    original and restore leaves the GPU without its driver."""
    built, kernel = host

    def die_after_the_unbinds(line: str) -> None:
        if "unbind from snd_hda_intel: done" in line:
            raise Killed()

    with sim_context(built.root, kernel, progress=die_after_the_unbinds) as ctx:
        with pytest.raises(Killed):
            binding.bind(ctx, SLOT, BindPolicy(), uri="none")
    assert kernel.driver_of(GPU) is None and kernel.driver_of(AUDIO) is None  # half-bound
    with sim_context(built.root, kernel) as ctx:
        assert ctx.journal().data["operation"].get("finished") is None  # the mark of the dead run
        binding.bind(ctx, SLOT, BindPolicy(), uri="none")
        assert kernel.driver_of(GPU) == "vfio-pci"
        assert ctx.journal().devices[GPU]["original_driver"] == "nvidia"
        binding.restore(ctx, [])
    assert (kernel.driver_of(GPU), kernel.driver_of(AUDIO)) == ("nvidia", "snd_hda_intel")


def test_restore_binds_explicitly_when_drivers_probe_leaves_the_device_unbound(host):
    """Planted bug: restore stops after drivers_probe (no write to drivers/<original>/bind);
    the GPU stays without a driver and restore reports it failed."""
    built, kernel = host
    with sim_context(built.root, kernel) as ctx:
        binding.bind(ctx, SLOT, BindPolicy(), uri="none")
        kernel.inject("probe", GPU, unclaimed=True)
        done = binding.restore(ctx, [])
    assert done.restored == {GPU: "nvidia", AUDIO: "snd_hda_intel"} and kernel.driver_of(GPU) == "nvidia"
    writes = [path for path, _value in kernel.writes()]
    probe = writes.index("sys/bus/pci/drivers_probe", writes.index(f"sys/bus/pci/drivers/vfio-pci/unbind"))
    assert "sys/bus/pci/drivers/nvidia/bind" in writes[probe:]
