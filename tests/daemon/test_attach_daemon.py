"""attach / verify / detach on the daemon lane: a real libvirtd, QEMU (TCG) and SSH."""

from __future__ import annotations

import os

import pytest

from tests.lanes import daemon as dl
from tests.lanes import guest as gl

_REASON = dl.skip_reason() or gl.skip_reason()
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)

import libvirt  # noqa: E402

libvirt.registerErrorHandler(lambda *a: None, None)


@pytest.fixture(scope="module")
def image():
    return gl.build_guest()


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    return tmp_path


def args(daemon, image, name, port, *extra):
    return ["attach", "--name", f"gpuvfio-{name}", "--virt-type", "qemu", "--firmware", "bios", "--numa", "none",
            "--hugepages", "none", "--vcpus", "1", "--memory", "256M", "--kernel", image.kernel,
            "--initrd", image.initrd, "--cmdline", gl.KERNEL_CMDLINE, "--user-net-ssh-port", str(port),
            "--ssh-key", image.client_key, "--connect", daemon.uri, "--boot-timeout", "90", *extra]


def known_hosts(tmp_path, image, port):
    path = tmp_path / "known_hosts"
    path.write_text(f"[127.0.0.1]:{port} {image.host_key_line}\n")
    return str(path)


def domains(daemon):
    conn = daemon.connect()
    try:
        return sorted(d.name() for d in conn.listAllDomains(0))
    finally:
        conn.close()


def test_attach_without_devices_verify_and_detach(cli, daemon, image, state):
    port = gl.free_port()
    result = cli(*args(daemon, image, "plain", port, "--known-hosts", known_hosts(state, image, port), "--json"))
    assert result.code == 0, result.err
    report = result.json()
    assert report["ok"] and [s["step"] for s in report["steps"]] == ["define", "start", "find address",
                                                                    "wait for ssh", "verify"]
    checks = {c["id"]: c for c in report["verify"]["checks"]}
    assert checks["pci_present"]["status"] == "skip" and "no devices assigned" in checks["pci_present"]["reason"]
    assert checks["driver"]["status"] == "skip" and "cuda" not in checks  # nothing NVIDIA was assigned
    assert report["verify"]["facts"]["guest_kernel"] == image.kernel_version
    assert report["verify"]["facts"]["python3"] is None  # busybox guest
    assert any(p["vendor_id"] == "1af4" for p in report["verify"]["facts"]["pci"])  # its virtio NIC
    assert "gpuvfio-plain" in domains(daemon)
    # verify again, finding the guest through libvirt (the forwarded port in its XML)
    again = cli("verify", "gpuvfio-plain", "--connect", daemon.uri, "--ssh-key", image.client_key,
                "--known-hosts", known_hosts(state, image, port), "--json")
    assert again.code == 0, again.err
    detached = cli("detach", "gpuvfio-plain", "--connect", daemon.uri, "--timeout", "2", "--json")
    assert detached.code == 0 and detached.json()["undefined"] is True
    assert "gpuvfio-plain" not in domains(daemon)


def test_unknown_host_key_rejected_and_rolled_back(cli, daemon, image, state):
    port = gl.free_port()
    result = cli(*args(daemon, image, "nokey", port))
    assert result.code == 1
    errors = [line for line in result.err.splitlines() if line.startswith("gpuvfio: error:")]
    assert len(errors) == 1 and "unknown host key" in errors[0] and "rolled back: destroy, undefine" in errors[0]
    assert "Traceback" not in result.err
    assert "gpuvfio-nokey" not in domains(daemon)


def test_trust_on_first_use_records_the_key(cli, daemon, image, state):
    port = gl.free_port()
    record = state / "tofu_known_hosts"
    result = cli(*args(daemon, image, "tofu", port, "--trust-on-first-use", "--known-hosts", str(record),
                       "--no-verify", "--json"))
    assert result.code == 0, result.err
    assert "trusted on first use" in result.json()["ssh"]["notes"][0]
    assert record.read_text().split()[1:] == image.host_key_line.split()[:2]
    cli("detach", "gpuvfio-tofu", "--connect", daemon.uri, "--timeout", "1")
    assert "gpuvfio-tofu" not in domains(daemon)


def test_guest_that_never_answers_times_out_cleanly(cli, daemon, image, state):
    port, wrong = gl.free_port(), gl.free_port()
    result = cli(*args(daemon, image, "silent", port, "--ssh-host", "127.0.0.1", "--ssh-port", str(wrong),
                       "--known-hosts", known_hosts(state, image, port), "--boot-timeout", "3"))
    assert result.code == 1 and "did not answer SSH within" in result.err
    assert "gpuvfio-silent" not in domains(daemon)


def test_failing_start_leaves_nothing(cli, daemon, image, state):
    port = gl.free_port()
    bad = args(daemon, image, "nostart", port)
    # A kernel that is there (the plan checks that) but that QEMU cannot load: libvirt's start fails.
    empty = state / "empty-vmlinuz"
    empty.write_bytes(b"")
    bad[bad.index("--kernel") + 1] = str(empty)
    result = cli(*bad)
    assert result.code == 1 and "starting gpuvfio-nostart" in result.err
    assert "gpuvfio-nostart" not in domains(daemon)


def test_name_owned_by_someone_else(cli, daemon, image, state):
    conn = daemon.connect()
    xml = gl.domain_xml("gpuvfio-foreign", image.kernel, image.initrd, gl.free_port())
    dom = conn.defineXML(xml)
    try:
        result = cli(*args(daemon, image, "foreign", gl.free_port()))
        assert result.code == 1 and "not created by gpuvfio" in result.err
        assert dom.isPersistent()  # untouched
    finally:
        dom.undefine()
        conn.close()


def test_a_guest_that_cannot_boot_or_be_reached_is_refused_before_anything_changes(cli, daemon, image, state):
    """Issue 33 item 2, against a real libvirtd: a missing disk, a missing network, nothing to boot
    and no way to SSH are refused by the dry run and by the run, which changes nothing; a sound
    guest is planned with its boot source, network and SSH route checked."""
    common = ["attach", "--name", "gpuvfio-reach", "--virt-type", "qemu", "--firmware", "bios", "--numa", "none",
              "--hugepages", "none", "--vcpus", "1", "--memory", "256M", "--connect", daemon.uri]
    missing = str(state / "missing.img")
    cases = {
        "missing disk": (["--disk", missing, "--user-net-ssh-port", "2299"],
                         f"--disk {missing}: no such file or directory on this machine"),
        "missing network": (["--kernel", image.kernel, "--network", "nosuchnet"],
                            "libvirt network nosuchnet does not exist on this connection"),
        "nothing to boot": (["--user-net-ssh-port", "2299"], "nothing to boot: give --disk IMAGE or --kernel FILE"),
        "no way to ssh": (["--kernel", image.kernel], "no way to the guest's SSH: give --ssh-host"),
    }
    for case, (extra, words) in cases.items():
        dry = cli(*common, *extra, "--dry-run", "--json")
        assert dry.code == 1, (case, dry.err)
        assert any(words in message for message in dry.json()["refused"]), (case, dry.json()["refused"])
        run = cli(*common, *extra, "--ssh-host", "192.0.2.1") if case != "no way to ssh" else cli(*common, *extra)
        assert run.code == 1 and words in run.err, (case, run.err)
    conn = libvirt.open(daemon.uri)
    try:
        assert "gpuvfio-reach" not in [d.name() for d in conn.listAllDomains(0)]
    finally:
        conn.close()
    sound = cli(*args(daemon, image, "reach", 2299), "--dry-run", "--json")
    assert sound.code == 0, sound.err
    checks = {c["id"]: c for c in sound.json()["checks"]}
    assert checks["boot"]["status"] == checks["network"]["status"] == checks["ssh_route"]["status"] == "ok"
