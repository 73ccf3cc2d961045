"""verify_guest over real SSH, every verdict: probe and verifier both run in the "guest".

The "guest" is this machine behind dropbear (tests/lanes/hypervisor.py) with the stand-in
CUDA/NVML/NCCL libraries on its LD_LIBRARY_PATH and the probe reading a host tree with
NVIDIA GPUs (GPUVFIO_PROBE_ROOT), so the verifier's code path (sent on python3's stdin)
runs end to end and the host judges what came back; the tiny daemon-lane guest has no
python3. The expectation is the host's (expectations() from an inventory), as attach makes it.
"""

from __future__ import annotations

import os
import shutil

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.guest.expect import expectations, gates
from gpuvfio.guest.ssh import Session, SshTarget
from gpuvfio.guest.verify import verify_guest
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.root import HostRoot
from tests.hostbuilder import HostBuilder
from tests.lanes import hypervisor as hv

if hv.skip_reason():
    pytest.skip(hv.skip_reason(), allow_module_level=True)
SMALL = ("--size-mib", "4", "--copies", "2", "--samples", "3")
ANY = gates(min_gbps=0.001)  # the stand-in's memcpy is no PCIe link


def gpu_tree(root, gpus: int) -> str:
    """A host with ``gpus`` H100s at 0000:0N:00.0, each behind its own Gen5 x16 root port."""
    b = HostBuilder(str(root))
    b.iommu("intel", 1)
    cpus = b.cpu_topology(1, 4, 1)
    b.numa_node(0, cpus[0], 16)
    rb = b.root_bus(numa=0)
    for n in range(1, gpus + 1):
        port = b.bridge(rb, f"0000:00:0{n}.0", "8086", "a70d", secondary_bus=n, link=(5, 16))
        b.function(port, f"0000:0{n}:00.0", "10de", "2330", "030200", driver="nvidia", link=(5, 16))
    b.modules(["nvidia"])
    return b.root


def judge(tmp_path, libdir, gpus=1, **env):
    tree = gpu_tree(tmp_path / "tree", gpus)
    expected = expectations(read_inventory(HostRoot(tree)), [PciAddress.parse(f"0000:0{n}:00.0")
                                                              for n in range(1, gpus + 1)])
    server = hv.start(str(tmp_path / "hv"), env={"LD_LIBRARY_PATH": libdir, "GPUVFIO_PROBE_ROOT": tree,
                                                 "FAKECUDA_NDEV": str(gpus), **env})
    try:
        target = SshTarget("127.0.0.1", server.port, "root", server.client_key, server.known_hosts)
        with Session(target) as session:
            report = verify_guest(session, expected, timeout=300, gates=ANY, verifier_args=SMALL).to_json()
    finally:
        server.stop()
    return report, {c["id"]: c for c in report["checks"]}


def test_a_healthy_gpu_passes_and_nothing_stays_behind(tmp_path, fakecuda_libdir):
    before = set(os.listdir("/tmp"))
    report, checks = judge(tmp_path, fakecuda_libdir)
    assert report["ok"], report["checks"]
    assert {k: c["status"] for k, c in checks.items()} == {
        "pci_present": "pass", "driver": "pass", "nvml": "pass", "cuda": "pass", "pcie_link": "pass",
        "h2d_bandwidth": "pass", "d2h_bandwidth": "pass", "bidir_bandwidth": "pass", "data_verified": "pass",
        "compute": "pass"}
    assert checks["pcie_link"]["expected"] == "Gen5 x16" and report["facts"]["guest_kernel"] == os.uname().release
    assert report["facts"]["nvml"]["devices"][0]["name"] == "FAKE CUDA (not a GPU)"
    assert not [p for p in set(os.listdir("/tmp")) - before if "gpuvfio" in p]


@pytest.mark.parametrize("env, check_id, status, words", [
    ({"FAKECUDA_INIT_ERROR": "100"}, "cuda", "fail", "CUDA_ERROR_NO_DEVICE"),
    ({"FAKENVML_INIT_ERROR": "9"}, "nvml", "fail", "NVML error 9"),
    ({"FAKECUDA_CORRUPT": "1"}, "data_verified", "fail", "mismatching"),
    ({"FAKECUDA_ZERO_TIME": "1"}, "h2d_bandwidth", "fail", "cuEventElapsedTime"),
    ({"FAKECUDA_WIDTH": "8"}, "pcie_link", "fail", "trained below"),
    ({"FAKECUDA_MIG": "1"}, "cuda", "expected", "MIG"),
])
def test_each_verdict_through_ssh(tmp_path, fakecuda_libdir, env, check_id, status, words):
    report, checks = judge(tmp_path, fakecuda_libdir, **env)
    assert checks[check_id]["status"] == status and words in checks[check_id]["reason"], checks[check_id]
    assert report["ok"] is (status == "expected")


def test_an_old_driver_through_ssh(tmp_path, fakecuda_old_libdir):
    report, checks = judge(tmp_path, fakecuda_old_libdir)
    assert checks["h2d_bandwidth"]["status"] == "fail" and "driver too old" in checks["h2d_bandwidth"]["reason"]


def test_two_gpus_through_ssh(tmp_path, fakecuda_libdir):
    report, checks = judge(tmp_path, fakecuda_libdir, gpus=2)
    assert report["ok"], report["checks"]
    assert checks["p2p"]["status"] == "pass" and checks["nccl_allreduce"]["status"] == "pass"
    corrupt, checks = judge(tmp_path / "again", fakecuda_libdir, gpus=2, FAKECUDA_P2P_CORRUPT="1")
    assert checks["p2p"]["status"] == "fail" and not corrupt["ok"]


@pytest.mark.skipif(not any(line.startswith("root:") and line.rstrip().endswith("/bash")
                            for line in open("/etc/passwd", encoding="utf-8")),
                    reason="needs root's login shell to be bash (BASH_ENV)")
def test_a_guest_without_python_fails_closed(tmp_path, fakecuda_libdir):
    """A PATH without python3 in the guest: the GPU could not be checked, so it is not passed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "readlink", "uname", "head", "dmesg", "grep", "tail", "cat"):
        if shutil.which(tool):
            os.symlink(shutil.which(tool), bin_dir / tool)
    # dropbear gives sessions its own PATH; bash (root's shell) then reads $BASH_ENV before the
    # command -- or, where it decides sshd started it, ~/.bashrc instead and never $BASH_ENV (bash
    # 5.2 shell.c run_startup_files: SSH_CLIENT set or stdin a socket, at SHLVL 1; seen with
    # Debian 13's dropbear 2025.89 and a lane run without SHLVL). Both say the same.
    no_python = f"PATH={bin_dir}\nexport PATH\n"
    env_file = tmp_path / "no-python.sh"
    env_file.write_text(no_python)
    home = tmp_path / "hv" / "home"  # the hypervisor's root home (hypervisor.start)
    home.mkdir(parents=True)
    (home / ".bashrc").write_text(no_python)
    report, checks = judge(tmp_path, fakecuda_libdir, BASH_ENV=str(env_file))
    assert report["facts"]["python3"] is None
    assert checks["cuda"]["status"] == "fail" and "no python3" in checks["cuda"]["reason"] and not report["ok"]


def test_what_a_guest_sends_is_bounded(tmp_path):
    """Issue 34 item 4: 300 MB of probe output took the host to 669 MB resident. A real SSH
    server on 127.0.0.1 floods: past OUTPUT_LIMIT the command is refused in one line, and a
    streamed command keeps only its tail; memory stays near the limit, not the flood."""
    import tracemalloc

    from gpuvfio.guest.ssh import OUTPUT_LIMIT, SshError

    server = hv.start(str(tmp_path / "hv"))
    flood = ["head", "-c", str(3 * OUTPUT_LIMIT), "/dev/zero"]
    try:
        target = SshTarget("127.0.0.1", server.port, "root", server.client_key, server.known_hosts)
        with Session(target) as session:
            tracemalloc.start()
            try:
                with pytest.raises(SshError) as info:
                    session.run_bytes(flood, timeout=120)
                _now, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert str(info.value).endswith("sent more than 16 MiB of output; refused")
            assert "\n" not in str(info.value)
            assert peak < 2 * OUTPUT_LIMIT + (8 << 20), peak
            seen = []
            status, out, _err = session.run_bytes(flood, timeout=120, on_output=lambda c: seen.append(len(c)))
            assert status == 0 and sum(seen) == 3 * OUTPUT_LIMIT
            assert OUTPUT_LIMIT <= len(out) < OUTPUT_LIMIT + (1 << 20)
            status, out, _err = session.run_bytes(["echo", "still usable"], timeout=30)
            assert (status, out) == (0, b"still usable\n")
    finally:
        server.stop()
