"""gpuvfio health (issue 38 item 1): the PCIe health of the devices the host hands out, from
the kernel's own counters (AER files as drivers/pci/pcie/aer.c writes them, built by
tests/hostbuilder.py), config space and the link, rated ok / degraded / failed. (The reset
and return paths of device health: test_health.py.)"""

from __future__ import annotations

import json
import os

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.host.aer import AerError, Severity, parse_counts
from tests.conftest import gpu_workstation
from tests.hostbuilder import AER_COR_BITS

GPU, AUDIO, SMALL_GPU = "0000:01:00.0", "0000:01:00.1", "0000:04:00.0"
PORT, SMALL_PORT = "0000:00:01.0", "0000:00:1c.4"


def host(tmp_path, *, aer: bool = True):
    """The workstation with AER counters on every PCIe function (all zero)."""
    b = gpu_workstation(tmp_path / "host")
    if aer:
        for address in (GPU, AUDIO, SMALL_GPU, "0000:04:00.1", PORT, SMALL_PORT):
            b.aer(b.functions[PciAddress.parse(address)])
    return b


def fn(b, address: str):
    return b.functions[PciAddress.parse(address)]


def devices(result) -> dict[str, dict]:
    return {d["address"]: d for d in result.json()["devices"]}


def findings(device: dict, check: str) -> list[tuple[str, str]]:
    return [(f["status"], f["message"]) for f in device["findings"] if f["check"] == check]


def test_a_healthy_host_is_ok_and_exits_0(cli, tmp_path):
    b = host(tmp_path)
    result = cli("--root", b.root, "health", "--json")
    assert result.code == 0, result.out + result.err
    report = result.json()
    assert report["ok"] is True and [d["address"] for d in report["devices"]] == [GPU, AUDIO, SMALL_GPU,
                                                                                   "0000:04:00.1"]
    assert all(d["status"] == "ok" for d in report["devices"])
    assert findings(devices(result)[GPU], "aer") == [("ok", "no AER errors since boot")]
    text = cli("--root", b.root, "health")
    assert text.code == 0 and text.out.startswith("device health on ") and f"{GPU} ok (driver nvidia)" in text.out


def test_a_fatal_error_fails_the_device_and_names_its_kinds(cli, tmp_path):
    b = host(tmp_path)
    b.aer(fn(b, GPU), fatal={"MalfTLP": 1, "CmpltTO": 2}, correctable={"BadTLP": 5})
    result = cli("--root", b.root, "health", "--json")
    assert result.code == 1
    gpu = devices(result)[GPU]
    assert gpu["status"] == "failed"
    assert ("failed", "3 fatal error(s) (CmpltTO 2, MalfTLP 1) since boot") in findings(gpu, "aer")
    assert ("ok", "5 correctable error(s) (BadTLP 5) since boot") in findings(gpu, "aer")
    assert gpu["aer"]["self"]["fatal"] == {"total": 3, "kinds": {"CmpltTO": 2, "MalfTLP": 1}}
    assert devices(result)[SMALL_GPU]["status"] == "ok"  # the other GPU is not touched


def test_errors_at_the_port_above_count_for_the_device_below(cli, tmp_path):
    """The kernel counts a link's errors where they were seen: often the root port, not the GPU
    (Documentation/ABI/testing/sysfs-bus-pci-devices-aer-stats)."""
    b = host(tmp_path)
    b.aer(fn(b, PORT), nonfatal={"UnsupReq": 1})
    result = cli("--root", b.root, "health", GPU, "--json")
    assert result.code == 1
    gpu = devices(result)[GPU]
    assert gpu["status"] == "degraded"
    assert findings(gpu, "port_aer") == [("degraded", f"its port {PORT}: 1 nonfatal error(s) (UnsupReq 1) since boot")]
    assert gpu["aer"][PORT]["nonfatal"]["total"] == 1


def test_a_link_that_lost_lanes_is_degraded_a_slower_one_is_not(cli, tmp_path):
    b = host(tmp_path)
    _link(b, GPU, "16.0 GT/s PCIe", 8)  # trained to x8 of x16: lanes lost
    _link(b, SMALL_GPU, "2.5 GT/s PCIe", 4)  # Gen1 of Gen4: idle
    result = cli("--root", b.root, "health", "--json")
    got = devices(result)
    assert findings(got[GPU], "link") == [("degraded", "trained to x8: the device and its slot allow x16 Gen4 "
                                                       "(lanes lost)")]
    assert got[GPU]["status"] == "degraded" and result.code == 1
    assert findings(got[SMALL_GPU], "link")[0][0] == "ok" and got[SMALL_GPU]["status"] == "ok"
    assert "lower the link speed while idle" in findings(got[SMALL_GPU], "link")[0][1]
    _link(b, SMALL_GPU, "2.5 GT/s PCIe", 0)
    assert findings(devices(cli("--root", b.root, "health", "--json"))[SMALL_GPU], "link") == [
        ("failed", "the link is down (width 0)")]


def _link(b, address: str, speed: str, width: int) -> None:
    path = fn(b, address).path
    with open(f"{path}/current_link_speed", "w") as handle:
        handle.write(speed + "\n")
    with open(f"{path}/current_link_width", "w") as handle:
        handle.write(f"{width}\n")


def test_a_gpu_off_the_bus_is_failed_and_listed_never_left_out(cli, tmp_path):
    b = host(tmp_path)
    b.off_the_bus(fn(b, GPU))
    result = cli("--root", b.root, "health", "--json")
    gpu = devices(result)[GPU]
    assert result.code == 1 and gpu["status"] == "failed"
    assert findings(gpu, "config")[0] == ("failed", "config space reads 0xffff while bound to nvidia: the device "
                                                    "fell off the bus (or sits in D3cold and does not come back)")
    listed = cli("--root", b.root, "list", "--json")
    assert GPU in json.dumps(listed.json())  # list shows it too


def test_a_device_back_broken_from_its_guest_is_failed(cli, tmp_path, monkeypatch):
    b = host(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(state))
    (state / "journal.json").write_text(json.dumps({"version": 1, "devices": {}, "broken": {
        GPU: {"reason": "config space reads 0xffff after the guest", "since": 1.0}}}))
    result = cli("--root", b.root, "health", GPU, "--json")
    assert result.code == 1
    assert findings(devices(result)[GPU], "journal") == [
        ("failed", f"came back broken from its last guest (config space reads 0xffff after the guest); "
                   f"gpuvfio reset {GPU}")]


def test_without_aer_counters_health_cannot_vouch(cli, tmp_path):
    """Fail closed: no counters (pci=noaer, no CONFIG_PCIEAER) is not 'no errors'."""
    b = host(tmp_path, aer=False)
    result = cli("--root", b.root, "health", GPU, "--json")
    assert result.code == 1
    gpu = devices(result)[GPU]
    assert gpu["status"] == "degraded" and findings(gpu, "aer")[0][0] == "unknown"


def test_all_adds_what_is_on_vfio_pci(cli, tmp_path):
    b = host(tmp_path)
    b.bind(PciAddress.parse("0000:03:00.0"), "vfio-pci", fn(b, "0000:03:00.0").path)
    b.aer(fn(b, "0000:03:00.0"))
    without = [d["address"] for d in cli("--root", b.root, "health", "--json").json()["devices"]]
    with_all = [d["address"] for d in cli("--root", b.root, "health", "--all", "--json").json()["devices"]]
    assert "0000:03:00.0" not in without and "0000:03:00.0" in with_all


def test_bad_input_is_one_line_and_exit_2(cli, tmp_path):
    b = host(tmp_path)
    result = cli("--root", b.root, "health", "0000:09:00.0")
    assert result.code == 2 and result.err.count("\n") == 1 and "Traceback" not in result.err


@pytest.mark.parametrize("text, words", [
    ("RxErr 0\nBadTLP 1", "no TOTAL_ERR_COR line at its end"),
    ("RxErr 0\nTOTAL_ERR_COR 1\nBadTLP 2", "no TOTAL_ERR_COR line at its end"),
    ("RxErr 0\nRxErr 1\nTOTAL_ERR_COR 1", "RxErr twice"),
    ("RxErr 99999999999999999999\nTOTAL_ERR_COR 1", "a count over 64 bits"),
    ("Rx Err 0\nTOTAL_ERR_COR 0", "line 1 is not NAME COUNT"),
    ("RxErr -1\nTOTAL_ERR_COR 0", "line 1 is not NAME COUNT"),
    ("RxErr 1\r\nTOTAL_ERR_COR 1", "line 1 is not NAME COUNT"),
    ("\n".join(f"Bit{i} 0" for i in range(40)) + "\nTOTAL_ERR_COR 0", "41 lines"),
    ("", "no TOTAL_ERR_COR line at its end"),
])
def test_an_aer_file_not_of_the_kernels_form_is_refused_whole(text, words):
    with pytest.raises(AerError, match=words):
        parse_counts(Severity.CORRECTABLE, text)


def test_the_kernels_form_is_read_with_its_nameless_bits():
    text = "".join(f"{bit} 0\n" for bit in AER_COR_BITS) + "dev_cor_errs_bit[9] 2\nTOTAL_ERR_COR 2\n"
    counts = parse_counts(Severity.CORRECTABLE, text.strip())
    assert counts.total == 2 and counts.kinds == (("dev_cor_errs_bit[9]", 2),)


def test_a_malformed_counter_file_is_unknown_not_ok(cli, tmp_path):
    b = host(tmp_path)
    with open(f"{fn(b, GPU).path}/aer_dev_fatal", "w") as handle:
        handle.write("TOTAL_ERR_FATAL 0\n\x1b[2Jgarbage\n")
    result = cli("--root", b.root, "health", GPU, "--json")
    gpu = devices(result)[GPU]
    assert result.code == 1 and gpu["status"] == "degraded"
    (status, message), = findings(gpu, "aer")
    assert status == "unknown" and "\x1b" not in message


def test_a_recording_keeps_the_counters_and_health_reads_them_the_same(cli, tmp_path):
    """dump-host records the AER files (gpuvfio.host.recording.PCI_ATTRS): a bug report's
    recording says what the live host said."""
    b = host(tmp_path)
    b.aer(fn(b, PORT), correctable={"RxErr": 7, "BadDLLP": 1}, fatal={"DLP": 1})
    out = tmp_path / "ws.host"
    assert cli("--root", b.root, "dump-host", str(out)).code == 0
    live = cli("--root", b.root, "health", "--json")
    recorded = cli("--root", str(out), "health", "--json")
    assert live.code == recorded.code == 1
    assert [d["findings"] for d in recorded.json()["devices"]] == [d["findings"] for d in live.json()["devices"]]
    assert devices(recorded)[GPU]["status"] == "failed"


def test_a_bind_plan_refuses_a_failed_device_and_warns_on_a_degraded_one(cli, tmp_path):
    """Issue 38 item 3: a device with fatal AER errors is refused (--force overrides, the admin
    may bind it to test it), one whose port logged a non-fatal error is a warning; a device
    without counters plans as before (health says what it cannot read)."""
    b = host(tmp_path)
    b.driver("vfio-pci")
    plain = cli("--root", b.root, "bind", GPU, "--dry-run", "--json")
    assert plain.code == 0 and not [c for c in plain.json()["checks"] if c["id"] == "health"]
    b.aer(fn(b, GPU), fatal={"CmpltTO": 1})
    refused = cli("--root", b.root, "bind", GPU, "--dry-run", "--json")
    assert refused.code == 1 and refused.json()["result"] == "refused"
    (health,) = [c for c in refused.json()["checks"] if c["id"] == "health"]
    assert health["status"] == "refuse" and health["message"] == f"{GPU}: 1 fatal error(s) (CmpltTO 1) since boot"
    assert health["overridable"] is True
    assert cli("--root", b.root, "bind", GPU, "--dry-run", "--force", "--json").code == 0
    b.aer(fn(b, GPU))
    b.aer(fn(b, PORT), nonfatal={"UnsupReq": 2})
    warned = cli("--root", b.root, "bind", GPU, "--dry-run", "--json")
    assert warned.code == 0
    assert [(c["status"], c["message"], c["overridable"]) for c in warned.json()["checks"] if c["id"] == "health"] == [
        ("warn", f"{GPU}: its port {PORT}: 2 nonfatal error(s) (UnsupReq 2) since boot", False),
        ("warn", f"{AUDIO}: its port {PORT}: 2 nonfatal error(s) (UnsupReq 2) since boot", False)]


def test_a_kernel_without_counters_adds_nothing_to_a_plan(cli, tmp_path):
    """No AER counters to read is health's and doctor's to report; a plan goes on as before."""
    b = host(tmp_path, aer=False)
    b.driver("vfio-pci")
    plan = cli("--root", b.root, "bind", GPU, "--dry-run", "--json")
    assert plan.code == 0 and [c for c in plan.json()["checks"] if c["id"] == "health"] == []


def test_persist_refuses_a_failed_device_as_bind_does(cli, tmp_path):
    b = host(tmp_path)
    b.driver("vfio-pci")
    b.aer(fn(b, PORT), fatal={"SDES": 1})
    result = cli("--root", b.root, "persist", GPU, "--dry-run", "--json")
    assert result.code == 1 and "1 fatal error(s) (SDES 1) since boot" in result.err


# --- what an attacker's and an admin's review found (each failed before its fix) ---------------------


def test_a_function_without_a_link_of_its_own_is_not_a_link_down(cli, tmp_path):
    """A function whose link reads width 0 of maximum 0 (an SR-IOV VF shows that) has no link to
    rate; it was "failed: the link is down", and bind refused it."""
    b = host(tmp_path)
    for name in ("current_link_width", "max_link_width"):
        with open(f"{fn(b, SMALL_GPU).path}/{name}", "w") as handle:
            handle.write("0\n")
    result = cli("--root", b.root, "health", SMALL_GPU, "--json")
    assert result.code == 0 and findings(devices(result)[SMALL_GPU], "link") == []


def test_a_width_above_its_maximum_is_not_trusted(cli, tmp_path):
    b = host(tmp_path)
    _link(b, GPU, "16.0 GT/s PCIe", 63)  # what an all-ones register read gives
    result = cli("--root", b.root, "health", GPU, "--json")
    assert findings(devices(result)[GPU], "link") == [
        ("unknown", "width x63 above its maximum x16: not a reading to trust")] and result.code == 1


def test_libvirt_not_answering_is_a_note_not_a_finding(cli, tmp_path):
    b = host(tmp_path)
    result = cli("--root", b.root, "health", "--connect", "qemu+unix:///system?socket=/nonexistent/sock", "--json")
    assert result.code == 0, result.out
    assert result.json()["libvirt"].startswith("libvirt did not answer")
    assert all(d["domains"] is None for d in result.json()["devices"])


def test_a_total_below_a_kinds_count_is_refused():
    """aer.c adds one to the total for every report and one to each bit it set: a file with
    MalfTLP 7 and a total of 0 was rated ok."""
    with pytest.raises(AerError, match="MalfTLP counts more than TOTAL_ERR_FATAL"):
        parse_counts(Severity.FATAL, "MalfTLP 7\nSDES 3\nTOTAL_ERR_FATAL 0")


def test_naming_a_bridge_is_bad_input(cli, tmp_path):
    result = cli("--root", host(tmp_path).root, "health", PORT)
    assert result.code == 2 and "is a PCI bridge" in result.err and result.err.count("\n") == 1


def test_counters_that_cannot_be_trusted_warn_in_plans_and_doctor(cli, tmp_path):
    """A FIFO in place of a port's counters: health degrades the GPU; bind said nothing and
    doctor said "ok" (and called planted files "pci=noaer")."""
    b = host(tmp_path)
    b.driver("vfio-pci")
    os.unlink(f"{fn(b, PORT).path}/aer_dev_fatal")
    os.mkfifo(f"{fn(b, PORT).path}/aer_dev_fatal")
    plan = cli("--root", b.root, "bind", GPU, "--dry-run", "--json")
    assert plan.code == 0
    (warning, _audio) = [c for c in plan.json()["checks"] if c["id"] == "health"]
    assert warning["status"] == "warn" and f"its port {PORT}: AER counters unreadable" in warning["message"]
    doctor = {c["id"]: c for c in cli("--root", b.root, "doctor", "--json").json()["checks"]}["device_health"]
    assert doctor["status"] == "warn" and "AER counters unreadable" in doctor["summary"]
    assert "pci=noaer" not in doctor["summary"]


def test_doctor_watches_every_nvidia_function_as_health_does(cli, tmp_path):
    b = host(tmp_path)
    b.aer(fn(b, AUDIO), fatal={"DLP": 1})
    doctor = {c["id"]: c for c in cli("--root", b.root, "doctor", "--json").json()["checks"]}["device_health"]
    assert doctor["status"] == "fail" and f"{AUDIO}: 1 fatal error(s) (DLP 1)" in doctor["summary"]


def test_a_port_missing_from_the_tree_is_not_taken_for_the_device(cli, tmp_path):
    """The port's counters were reported as the device's own "aer" when the port was not in the
    inventory."""
    b = host(tmp_path)
    os.unlink(os.path.join(b.root, "sys", "bus", "pci", "devices", PORT))
    result = cli("--root", b.root, "health", GPU, "--json")
    got = devices(result)[GPU]
    assert findings(got, "aer") == [("ok", "no AER errors since boot")]
    assert [status for status, _ in findings(got, "port_aer")] == ["unknown"]


# --- issue 38 item 3: every plan that hands a device out or resets it carries its health --------

def _testbed_health(cli, root: str, spec) -> tuple[int, list[tuple[str, str]], list[str]]:
    """testbed plan SPEC --json: its exit status, the first variant's health checks, the variants refused."""
    result = cli("--root", root, "testbed", "plan", str(spec), "--json")
    assert result.code in (0, 1), result.err
    checks = result.json()["variants"][0]["checks"]
    return result.code, [(c["status"], c["message"]) for c in checks if c["id"] == "health"], result.json()["refused"]


def test_a_vgpu_variant_judges_its_gpu_as_a_bind_would(cli, tmp_path):
    """A vGPU's GPU stays on its host driver, so no bind judged it: a testbed's vGPU variant (its
    attach plan) planned a guest on a GPU with fatal AER errors. Now refused, the variant's
    force = true warns; a degraded GPU warns."""
    from tests.hostbuilder import HostBuilder
    b = HostBuilder(str(tmp_path / "host"))
    b.iommu("amd")
    b.numa_node(0, list(range(8)), 64)
    t4 = b.function(b.root_bus(numa=0), "0000:82:00.0", "10de", "1eb8", "030200", driver="nvidia")
    b.mdev_types(t4, [("nvidia-230", "GRID T4-16Q", 1, "16 GB")])
    b.aer(t4, fatal={"CmpltTO": 1})
    spec, disk = tmp_path / "spec.toml", tmp_path / "g.qcow2"
    disk.write_bytes(b"")
    body = (f'[guest]\ndisk = "{disk}"\nfirmware = "bios"\n[guest.ssh]\nport = 2222\n[run]\n'
            'gpus = ["0000:82:00.0"]\n[[variant]]\nname = "t4"\nkind = "vgpu"\nprofile = "GRID T4-16Q"\n'
            'numa = "none"\n')
    spec.write_text(body)
    fatal = "0000:82:00.0: 1 fatal error(s) (CmpltTO 1) since boot"
    assert _testbed_health(cli, b.root, spec) == (1, [("refuse", fatal)], ["t4"])
    spec.write_text(body + "force = true\n")
    assert _testbed_health(cli, b.root, spec) == (0, [("warn", fatal)], [])
    spec.write_text(body)
    b.aer(t4, nonfatal={"UnsupReq": 1})
    assert _testbed_health(cli, b.root, spec) == (
        0, [("warn", "0000:82:00.0: 1 nonfatal error(s) (UnsupReq 1) since boot")], [])


def test_a_baremetal_testbed_variant_is_judged_as_a_bind_would(cli, tmp_path):
    """The bare-metal variant runs the verifier on the host's GPU as it is: a GPU whose port
    logged a fatal error made its baseline. Refused now; the variant's force = true warns."""
    b = host(tmp_path)
    b.aer(fn(b, PORT), fatal={"SDES": 1})
    spec = tmp_path / "spec.toml"
    body = ('[guest]\ndisk = "/var/lib/libvirt/images/g.qcow2"\nfirmware = "bios"\n[guest.ssh]\nport = 2222\n[run]\n'
            f'gpus = ["{GPU}"]\n[[variant]]\nname = "bare"\nkind = "baremetal"\n')
    spec.write_text(body)
    port = f"{GPU}: its port {PORT}: 1 fatal error(s) (SDES 1) since boot"
    assert _testbed_health(cli, b.root, spec) == (1, [("refuse", port)], ["bare"])
    spec.write_text(body + "force = true\n")
    assert _testbed_health(cli, b.root, spec) == (0, [("warn", port)], [])


def test_a_reset_plan_names_what_the_reset_is_to_mend_and_refuses_nothing_for_it(tmp_path):
    """Reset is the way back for a failed device: its plan lists the findings as warnings (a
    refusal there would leave no way back), and the run goes ahead."""
    from gpuvfio.ops.reset import plan_reset
    from tests.unit.test_binding import Host
    h = Host(tmp_path / "host")
    h.bind(GPU)
    h.builder.aer(h.builder.functions[PciAddress.parse(GPU)], fatal={"CmpltTO": 1})
    with h.context() as ctx:
        plan = plan_reset(ctx, [PciAddress.parse(GPU)])
    assert not plan.refused
    assert [(c.check_id, c.status.value, c.message) for c in plan.checks if c.check_id == "health"] == [
        ("health", "warn", f"{GPU}: 1 fatal error(s) (CmpltTO 1) since boot")]


def test_a_device_whose_link_capabilities_read_0_has_no_maximum_to_fall_below(cli, tmp_path):
    """Seen in the kernel lane: Linux writes max_link_width 255 and max_link_speed "Unknown" for
    a function whose Link Capabilities read 0 (PCIE_LNK_WIDTH_UNKNOWN; QEMU's virtio functions),
    and health took 255 for a width, so an x1 link under an x32 port was "lanes lost"."""
    b = host(tmp_path)
    path = fn(b, AUDIO).path
    for name, value in (("max_link_width", "255"), ("max_link_speed", "Unknown"), ("current_link_width", "1"),
                        ("current_link_speed", "2.5 GT/s PCIe")):
        with open(f"{path}/{name}", "w") as handle:
            handle.write(value + "\n")
    result = cli("--root", b.root, "health", AUDIO, "--json")
    assert findings(devices(result)[AUDIO], "link") == []
    assert result.code == 0, result.out


def test_a_fatal_error_only_the_root_port_counted_fails_the_devices_below_it(cli, tmp_path):
    """Seen in the kernel lane (Linux 6.1): after a fatal error whose link went down the kernel
    cannot read the sender ("type=Inaccessible"), so the device's aer_dev_fatal stays 0 and only
    its root port's aer_rootport_total_err_fatal counts it. health rated that GPU ok."""
    b = host(tmp_path)
    b.aer_rootport(fn(b, PORT), fatal=1)
    result = cli("--root", b.root, "health", "--json")
    unclaimed = (f"its root port {PORT}: 1 fatal error message(s) since boot that no function below it counted "
                 "(the kernel could not read the sender: its link went down)")
    for address in (GPU, AUDIO):
        assert devices(result)[address]["status"] == "failed"
        assert ("failed", unclaimed) in findings(devices(result)[address], "port_aer")
    assert devices(result)[SMALL_GPU]["status"] == "ok"
    b.aer(fn(b, GPU), fatal={"MalfTLP": 1})  # the sender counted it after all: one finding, its own
    counted = cli("--root", b.root, "health", "--json")
    assert findings(devices(counted)[AUDIO], "port_aer") == [] and devices(counted)[AUDIO]["status"] == "ok"
    assert findings(devices(counted)[GPU], "aer") == [("failed", "1 fatal error(s) (MalfTLP 1) since boot")]
    with open(os.path.join(fn(b, PORT).path, "aer_rootport_total_err_fatal"), "w") as handle:
        handle.write("lots\n")
    bad = cli("--root", b.root, "health", "--json")
    assert findings(devices(bad)[AUDIO], "port_aer") == [
        ("unknown", f"its root port {PORT}: AER totals unreadable: aer_rootport_total_err_fatal: not one count")]
    dump = cli("--root", b.root, "dump-host", "-")
    assert "aer_rootport_total_err_fatal lots" in dump.out


def test_review_mends_a_refusal_force_overrides_says_so_and_a_missing_gpu_is_refused(cli, tmp_path):
    """An attacker's review: the bare-metal variant's refusal said overridable false though the
    variant's force overrides it, and a GPU not on the host planned with exit 0."""
    b = host(tmp_path)
    b.aer(fn(b, GPU), fatal={"CmpltTO": 1})
    spec = tmp_path / "spec.toml"
    body = ('[guest]\ndisk = "/var/lib/libvirt/images/g.qcow2"\n[guest.ssh]\nport = 2222\n[run]\n'
            'gpus = ["{}"]\n[[variant]]\nname = "bare"\nkind = "baremetal"\n')
    spec.write_text(body.format(GPU))
    result = cli("--root", b.root, "testbed", "plan", str(spec), "--json")
    (check,) = [c for c in result.json()["variants"][0]["checks"] if c["id"] == "health"]
    assert (check["status"], check["overridable"]) == ("refuse", True)
    spec.write_text(body.format("0000:09:00.0"))
    missing = cli("--root", b.root, "testbed", "plan", str(spec), "--json")
    assert missing.code in (1, 2), missing.out
    if missing.code == 1:
        assert [c["message"] for c in missing.json()["variants"][0]["checks"] if c["id"] == "health"] == [
            "0000:09:00.0: not on this host"]


def test_a_textfile_that_cannot_be_written_exits_2_so_a_timer_unit_fails(cli, tmp_path):
    """exit 1 means a device is not ok, and the health timer's unit counts it as success; a
    textfile that could not be written (a full disk) exited 1 too, and looked like success."""
    b = host(tmp_path)
    result = cli("--root", b.root, "health", "--textfile", "/sys/gpuvfio.prom")  # sysfs makes no new file
    assert result.code == 2, result.err
    assert result.err == "gpuvfio: error: --textfile: cannot write /sys/gpuvfio.prom: Permission denied\n"


def test_a_vf_whose_pf_failed_is_failed_too(cli, tmp_path):
    """An attacker's review: a VF of a PF with fatal errors was ok, and bind planned it."""
    from tests.hostbuilder import BAR64_PREF, GiB, HostBuilder
    b = HostBuilder(str(tmp_path / "host"))
    b.iommu("intel", 1)
    b.numa_node(0, list(range(4)), 32)
    pf = b.function(b.root_bus(numa=0), "0000:41:00.0", "10de", "2236", "030200", driver="nvidia",
                    bars=[(1, 32 * GiB, BAR64_PREF)])
    (vf,) = b.sriov(pf, 4, ["0000:41:00.4"], "2236", "10de", "030200", driver="vfio-pci", vf_bar=GiB)
    b.aer(pf, fatal={"UncorrIntErr": 3})
    result = cli("--root", b.root, "health", "0000:41:00.4", "--json")
    assert findings(devices(result)["0000:41:00.4"], "pf_aer") == [
        ("failed", "its PF 0000:41:00.0: 3 fatal error(s) (UncorrIntErr 3) since boot")]
    plan = cli("--root", b.root, "bind", "0000:41:00.4", "--dry-run", "--json")
    assert plan.code == 1 and [c["status"] for c in plan.json()["checks"] if c["id"] == "health"] == ["refuse"]
