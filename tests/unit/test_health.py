"""Device health on the unit lane: a GPU that comes back from its guest dead (config space
0xffff) or with its BARs gone is kept, marked, refused, and reset only through the kernel's
paths; doctor reports reset methods and D3cold. The simulated kernel plays the device."""

import json
import os

import pytest

from gpuvfio.ops.context import Context
from gpuvfio.bind.journal import Journal
from gpuvfio.host.state import state_dir
from gpuvfio.cli import main
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.host.health import parse_config, unassigned_bars
from gpuvfio.host.root import HostRoot
from gpuvfio.ops.binding import status
from gpuvfio.ops.readiness import doctor_report
from gpuvfio.ops.reset import ResetMethod, reset
from tests.unit.test_binding import AUDIO, GPU, NIC, PORT, A, Host


@pytest.fixture
def h(tmp_path):
    return Host(tmp_path / "host")


def dev(h, address, name):
    return os.path.join(h.root, "sys", "bus", "pci", "devices", address, name)


def reset_of(h, *addresses, **kw):
    with h.context() as ctx:
        return reset(ctx, [A(a) for a in addresses], **kw)


def broken(h) -> dict:
    return Journal.load(state_dir(h.host)).data["broken"]


def doctor(root) -> dict:
    return {c.check_id: c.to_json() for c in doctor_report(Context(host=HostRoot(root))).checks}["device_health"]


def test_dead_gpu_is_kept_marked_and_refused_until_reset(h):
    h.bind(GPU)
    h.kernel.kill(GPU)
    with pytest.raises(GpuvfioError, match="0xffff") as caught:
        h.restore()
    assert GPU in caught.value.report["failed"] and AUDIO in caught.value.report["restored"]
    # Not given to nvidia: a host driver probing a dead device fails or hangs.
    assert h.kernel.driver_of(GPU) == "vfio-pci" and h.kernel.driver_of(AUDIO) == "snd_hda_intel"
    assert "0xffff" in broken(h)[GPU]["reason"]
    with h.context() as ctx:
        assert GPU in status(ctx).broken
    # Still on vfio-pci, yet no domain gets it: bind refuses, dry run or not.
    for dry_run in (True, False):
        with pytest.raises(Refused, match="came back broken"):
            h.bind(GPU, dry_run=dry_run)
    report = reset_of(h, GPU)
    shown = report.to_json()
    assert shown.pop("steps")[0]["path"] == f"/sys/devices/pci0000:00/{PORT}/{GPU}/reset"
    assert shown == {"method": "function", "reset": [f"sys/devices/pci0000:00/{PORT}/{GPU}/reset"],
                     "devices": {GPU: None}, "cleared": [GPU]}
    assert broken(h) == {}
    h.restore()
    assert h.kernel.driver_of(GPU) == "nvidia"


def test_bars_lost_in_the_guest_are_caught(h):
    h.bind(GPU)
    h.kernel.kill(GPU, bars=True)
    assert unassigned_bars(h.host, os.path.realpath(dev(h, GPU, ""))) == [0, 1]
    with pytest.raises(GpuvfioError, match="BARs 0, 1 no longer assigned"):
        h.restore(GPU)
    assert h.kernel.driver_of(GPU) == "vfio-pci" and GPU in broken(h)


def test_a_device_that_does_not_recover_stays_marked(h):
    h.bind(GPU)
    h.kernel.kill(GPU, recovers=False)
    with pytest.raises(GpuvfioError):
        h.restore()
    with pytest.raises(GpuvfioError, match="still broken") as caught:
        reset_of(h, GPU)
    assert caught.value.report["devices"][GPU] and GPU in broken(h)
    # --forget clears the mark only once the device answers again (here: a reseated card).
    with pytest.raises(GpuvfioError, match="still broken"):
        reset_of(h, GPU, forget=True)
    config = dev(h, GPU, "config")
    with open(config, "r+b") as handle:
        handle.write(bytes.fromhex("de10"))
    assert reset_of(h, GPU, forget=True).cleared == [GPU]
    assert [w for w in h.kernel.writes() if w[0].endswith("/reset")] == [[f"sys/devices/pci0000:00/{PORT}/{GPU}/reset",
                                                                          "1\n"]]


def test_bus_reset_only_when_the_whole_bus_is_gpuvfios(h):
    h.bind(GPU)
    h.kernel.kill(GPU)
    with pytest.raises(GpuvfioError):
        h.restore(GPU)  # the audio function stays with gpuvfio
    report = reset_of(h, GPU, bus=True)
    assert report.method == ResetMethod.BUS and report.reset == [f"sys/devices/pci0000:00/{PORT}/reset_subordinate"]
    assert report.devices == {GPU: None, AUDIO: None} and report.cleared == [GPU]
    h.bind(GPU)
    h.restore(AUDIO)  # the audio function goes back to its host driver: the bus is no longer all ours
    with pytest.raises(Refused, match=f"on the bus below {PORT}, gpuvfio resets only devices it holds"):
        reset_of(h, GPU, bus=True)


def test_reset_refuses_what_gpuvfio_does_not_hold(h):
    with pytest.raises(Refused, match="not held: " + NIC):
        reset_of(h, NIC)
    h.bind(GPU)
    with pytest.raises(InputError, match="no such PCI function"):
        reset_of(h, "0000:7f:00.0")
    with pytest.raises(InputError, match="exclude each other"):
        reset_of(h, GPU, bus=True, forget=True)
    assert [w for w in h.kernel.writes() if "reset" in w[0]] == []


def test_reset_needs_a_method_the_kernel_offers(h):
    h.bind(GPU)
    with open(dev(h, GPU, "reset_method"), "w") as handle:
        handle.write("\n")
    with pytest.raises(Refused, match="no reset method.*--bus"):
        reset_of(h, GPU)
    with open(dev(h, GPU, "reset_method"), "w") as handle:
        handle.write("flr bus\n")
    os.unlink(dev(h, GPU, "reset"))  # a kernel without the attribute
    with pytest.raises(Refused, match="the kernel offers no reset"):
        reset_of(h, GPU)


def test_reset_from_the_command_line(h, capsys):
    assert main(["--root", str(h.root), "reset", NIC]) == 1
    assert "not held" in capsys.readouterr().err
    assert main(["--root", str(h.root), "reset", "--bus", "--forget", GPU]) == 2
    assert main(["--root", str(h.root), "reset", "01:0g"]) == 2  # not a device
    assert main(["--root", str(h.root), "reset", "01:00"]) == 1  # a slot: its functions, none held


def test_config_space_parsing():
    assert parse_config(None) == (None, None)
    assert parse_config(b"\xff\xff" + b"\0" * 62) == (False, None)
    header = bytearray(256)
    header[0:2] = b"\xde\x10"
    assert parse_config(bytes(header[:64])) == (True, None)  # non-root readers see 64 bytes
    header[0x34], header[0x40], header[0x41] = 0x40, 0x10, 0x40  # a capability list that loops
    header[0x44:0x48] = (1 << 28).to_bytes(4, "little")
    assert parse_config(bytes(header)) == (True, True)


def test_doctor_reports_health_and_fixes(h):
    got = doctor(h.root)  # the simulated host has no AER counters: errors cannot be seen
    assert got["status"] == "warn" and f"{GPU}, {AUDIO}: no AER counters" in got["summary"] and "pci=noaer" in got["fix"]
    for address in (GPU, AUDIO):
        h.builder.aer(h.builder.functions[A(address)])
    assert doctor(h.root)["status"] == "ok"
    h.bind(GPU)  # idle on vfio-pci with d3cold_allowed 1
    got = doctor(h.root)
    assert got["status"] == "warn" and "D3cold" in got["summary"]
    assert f"echo 0 > /sys/bus/pci/devices/{GPU}/d3cold_allowed" in got["fix"]
    assert "disable_idle_d3=1" in got["fix"]
    with open(dev(h, GPU, "power_state"), "w") as handle:
        handle.write("D3cold\n")
    assert "in D3cold now" in doctor(h.root)["summary"]
    with open(dev(h, AUDIO, "reset_method"), "w") as handle:
        handle.write("\n")
    assert f"{AUDIO} have no reset method" in doctor(h.root)["summary"]
    h.kernel.kill(GPU)
    got = doctor(h.root)
    assert got["status"] == "fail" and "dead, not free" in got["summary"] and "gpuvfio reset" in got["fix"]


def test_doctor_reports_what_health_finds_in_the_counters(h):
    """Issue 38 item 4: doctor's device_health holds the findings of gpuvfio health: fatal
    errors at a GPU's port fail it, lost lanes warn."""
    b = h.builder
    for address in (GPU, AUDIO, PORT):
        b.aer(b.functions[A(address)])
    b.aer(b.functions[A(PORT)], fatal={"SDES": 1})
    got = doctor(h.root)
    assert got["status"] == "fail" and f"{GPU}: its port {PORT}: 1 fatal error(s) (SDES 1) since boot" in \
        got["summary"] and got["fix"].startswith("gpuvfio health")
    b.aer(b.functions[A(PORT)])
    for name, value in (("current_link_speed", "16.0 GT/s PCIe"), ("max_link_speed", "16.0 GT/s PCIe"),
                        ("current_link_width", "4"), ("max_link_width", "16")):
        with open(dev(h, GPU, name), "w") as handle:
            handle.write(value + "\n")
    got = doctor(h.root)
    assert got["status"] == "warn" and f"{GPU}: trained to x4" in got["summary"]


def test_list_json_carries_health(h, capsys):
    assert main(["--root", str(h.root), "list", "--all", "--json"]) == 0
    listed = {f["address"]: f for f in json.loads(capsys.readouterr().out)["devices"]}
    assert listed[GPU]["health"] == {"alive": True, "flr": True, "reset_method": ["flr", "bus"],
                                     "power_state": "D0", "d3cold_allowed": True, "power_control": "auto"}
