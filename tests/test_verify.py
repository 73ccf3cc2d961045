"""Host-side verification logic: probe parsing, verifier output, checks from facts."""

import json
import os
import subprocess
import sys

import pytest

from gpuvfio.guest.payload import PROBE, VERIFIER
from gpuvfio.guest.verify import Expected, VerifyError, evaluate, parse_probe, parse_verifier
from tests.conftest import gpu_workstation

H100 = Expected("0000:1b:00.0", "10de", "2330", True, 5, 16)


def probe_text(pci_lines, python="/usr/bin/python3"):
    return "\n".join(["GPUVFIO-PROBE 1", "KERNEL 6.8.0", f"PYTHON3 {python}", *pci_lines,
                      "MODULE nvidia 1", "NVIDIA-VERSION NVRM version: 550.54", "END"]) + "\n"


GPU_LINE = "PCI 0000:01:00.0 0x10de 0x2330 0x030200 nvidia 32.0_GT/s_PCIe 16 32.0_GT/s_PCIe 16"


def verifier_json(h2d=50.0, d2h=48.0, gen=5, width=16, verified=True, cuda=True):
    bw = {"h2d": {"median": h2d, "samples": [h2d]}, "d2h": {"median": d2h, "samples": [d2h]},
          "d2d": {"median": 1500.0, "samples": [1500.0]}, "verified": verified,
          "link_under_load": {"current_gen": gen, "current_width": width, "max_gen": 5, "max_width": 16}}
    data = {"version": 1, "nvml": {"driver_version": "550.54", "cuda_driver_version": 12040, "devices": [
        {"name": "NVIDIA H100", "bus_id": "00000000:01:00.0", "virtualization_mode": "Pass-Through",
         "link_idle": {"current_gen": 1, "current_width": 16, "max_gen": 5, "max_width": 16}}]},
        "cuda": {"driver_version": 12040, "devices": [{"index": 0, "name": "NVIDIA H100",
                                                        "bus_id": "0000:01:00.0"}]} if cuda else None,
        "bandwidth": {"0000:01:00.0": bw} if cuda else {}, "latency": {}, "errors": {} if cuda else
        {"cuda": "libcuda.so.1 not found"}}
    return "noise\nGPUVFIO-VERIFIER " + json.dumps(data) + "\n"


def statuses(report):
    return {c["id"]: c["status"] for c in report["checks"]}


def test_full_pass():
    report = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json()), [H100])
    assert statuses(report) == {"pci_present": "pass", "driver": "pass", "cuda": "pass", "pcie_link": "pass",
                                "h2d_bandwidth": "pass", "d2h_bandwidth": "pass", "data_verified": "pass"}
    assert report["ok"] and report["bandwidth_gbps"]["0000:01:00.0"]["h2d"] == 50.0


def test_slow_link_and_low_bandwidth_fail():
    report = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json(h2d=20.0, gen=4)), [H100])
    got = statuses(report)
    assert got["pcie_link"] == "fail" and got["h2d_bandwidth"] == "fail" and got["d2h_bandwidth"] == "pass"
    link = next(c for c in report["checks"] if c["id"] == "pcie_link")
    assert link["expected"] == "Gen5 x16" and link["observed"] == "Gen4 x16"
    assert not report["ok"]


def test_missing_device_and_driver():
    other = "PCI 0000:00:02.0 0x1af4 0x1041 0x020000 virtio-pci - - - -"
    report = evaluate(parse_probe(probe_text([other])), None, [H100])
    got = statuses(report)
    assert got["pci_present"] == "fail" and got["driver"] == "fail"


def test_no_python_means_skips_with_reasons():
    report = evaluate(parse_probe(probe_text([GPU_LINE], python="none")), None, [H100])
    skipped = {c["id"]: c["reason"] for c in report["checks"] if c["status"] == "skip"}
    assert skipped == {k: "no python3 in the guest" for k in ("cuda", "pcie_link", "h2d_bandwidth", "d2h_bandwidth")}


def test_no_libcuda_is_a_skip_not_a_pass():
    report = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json(cuda=False)), [H100])
    cuda = next(c for c in report["checks"] if c["id"] == "cuda")
    assert cuda["status"] == "skip" and "libcuda" in cuda["reason"]


def test_no_devices_assigned():
    report = evaluate(parse_probe(probe_text([])), None, [])
    assert set(statuses(report).values()) == {"skip"} and report["ok"]


def test_data_corruption_fails():
    report = evaluate(parse_probe(probe_text([GPU_LINE])), parse_verifier(verifier_json(verified=False)), [H100])
    assert statuses(report)["data_verified"] == "fail"


@pytest.mark.parametrize("text", ["", "hello\n", "GPUVFIO-PROBE 1\nKERNEL x\n",
                                  "GPUVFIO-PROBE 1\nPCI 0000:01:00.0 broken\nEND\n"])
def test_garbage_probe(text):
    with pytest.raises(VerifyError):
        parse_probe(text)


@pytest.mark.parametrize("text", ["", "GPUVFIO-VERIFIER {not json\n", 'GPUVFIO-VERIFIER {"version": 9}\n'])
def test_garbage_verifier(text):
    with pytest.raises(VerifyError):
        parse_verifier(text)


@pytest.mark.parametrize("shell", [["/usr/bin/busybox", "sh"], ["/usr/bin/dash"], ["sh"]])
def test_probe_runs_in_posix_shells_against_a_tree(tmp_path, shell):
    if not os.path.exists(shell[0]) and shell[0] != "sh":
        pytest.skip(f"{shell[0]} not installed")
    b = gpu_workstation(tmp_path / "host")
    out = subprocess.run(shell + [PROBE], capture_output=True, text=True, check=True,
                         env={"GPUVFIO_PROBE_ROOT": b.root, "PATH": "/usr/bin:/bin"}).stdout
    facts = parse_probe(out)
    gpu = next(p for p in facts["pci"] if p["address"] == "0000:01:00.0")
    assert (gpu["vendor_id"], gpu["device_id"], gpu["driver"]) == ("10de", "2684", "nvidia")
    assert gpu["link"]["current_speed"] == "16.0 GT/s PCIe" and gpu["link"]["current_width"] == "16"
    assert "nvidia" in facts["modules"]


def test_verifier_runs_here_without_a_gpu():
    """The real verifier on this GPU-less machine: no NVML, no libcuda, said so."""
    out = subprocess.run([sys.executable, VERIFIER], capture_output=True, text=True, check=True).stdout
    data = parse_verifier(out)
    assert data["nvml"] is None and data["cuda"] is None
    assert "libnvidia-ml.so.1" in data["errors"]["nvml"] and "libcuda.so.1" in data["errors"]["cuda"]


def test_probe_fits_a_dropbear_command_line():
    """The probe travels as sh -c's argument; dropbear refuses commands over 9000 bytes."""
    import shlex

    from gpuvfio.guest.payload import PROBE
    from gpuvfio.guest.verify import probe_argv

    with open(PROBE, encoding="utf-8") as handle:
        assert len(shlex.join(probe_argv(handle.read())).encode()) < 8000


def test_banner_poll_says_why_a_server_is_not_ready():
    """While a guest boots, QEMU's user networking accepts and closes at once: not ready. The
    reasons differ and are said (on main every one read "no SSH banner yet")."""
    import socket
    import threading

    from gpuvfio.guest.ssh import banner_state

    def serve(greeting: bytes):
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(1)

        def accept_once():
            conn, _ = server.accept()
            conn.sendall(greeting)
            conn.close()
            server.close()

        threading.Thread(target=accept_once, daemon=True).start()
        return server.getsockname()[1]

    assert banner_state("127.0.0.1", serve(b"SSH-2.0-dropbear_2022.83\r\n")) is None
    assert "closed before an SSH banner" in banner_state("127.0.0.1", serve(b""))
    assert banner_state("127.0.0.1", serve(b"HTTP/1.1 400 Bad Request\r\n")).startswith(
        "not an SSH server (it sent 'HTTP/1.1 400 Bad Requ")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    assert banner_state("127.0.0.1", port) == "connection refused"
    assert "not resolved" in banner_state("no-such-host.invalid", 22)


def test_ssh_errors_say_which(cli, tmp_path):
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)

    def http():
        for _ in range(5):
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.close()

    threading.Thread(target=http, daemon=True).start()
    try:
        result = cli("verify", "--ssh-host", "127.0.0.1", "--ssh-port", str(server.getsockname()[1]),
                     "--timeout", "5")
    finally:
        server.close()
    assert result.code == 1 and "not an SSH server" in result.err
    refused = cli("verify", "--ssh-host", "127.0.0.1", "--ssh-port", "1", "--timeout", "0.5")
    assert refused.code == 1 and "connection refused" in refused.err
    zero = cli("verify", "--ssh-host", "127.0.0.1", "--ssh-port", "0")
    assert zero.code == 2 and "SSH port must be 1-65535" in zero.err  # on main 0 silently became 22
