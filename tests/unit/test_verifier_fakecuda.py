"""The in-guest verifier's CUDA/NVML/NCCL code paths, run against a stand-in library (not a GPU).

There is no NVIDIA hardware on the unit lane; tests/fakecuda implements the driver-API, NVML
and NCCL entry points the verifier calls, with host memory, a monotonic clock and streams
that really queue behind the spin kernel (a verifier that waits before releasing the flag
gets CUDA_ERROR_LAUNCH_TIMEOUT there, as a GPU would make it wait for the spin's timeout).
So argument types, call order, event timing, the whole-buffer data checks, the failure
modes and the JSON shape are exercised for real. Bandwidth numbers from it mean nothing.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from gpuvfio.guest.checks import evaluate
from gpuvfio.guest.expect import Expected, gates
from gpuvfio.guest.payload import VERIFIER
from gpuvfio.guest.verify import VerifyError, parse_probe, parse_verifier

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
SMALL = ["--size-mib", "4", "--copies", "2", "--samples", "3", "--warmups", "1", "--hops", "500",
         "--overhead-count", "100", "--nccl-iters", "2"]
GPU = Expected("0000:1b:00.0", "10de", "2330", "030200", 5, 16, "0000:1b:00.0 Gen5 x16")
ANY = gates(min_gbps=0.001)  # the stand-in's memcpy is no PCIe link


def run(libdir, *extra, env=None):
    proc = subprocess.run([sys.executable, VERIFIER, *SMALL, *extra], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LD_LIBRARY_PATH": libdir, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return parse_verifier(proc.stdout)


def probe(buses=("01",)):
    lines = [f"PCI|0000:{b}:00.0|0x10de|0x2330|0x030200|nvidia|-|-|-|-|0000:00:0{i + 1}.0" for i, b in enumerate(buses)]
    return parse_probe("\n".join(["GPUVFIO-PROBE 1", "PYTHON3 /usr/bin/python3", *lines, "END"]) + "\n")


def judged(data, expected=(GPU,), buses=("01",)):
    report = evaluate(probe(buses), data, list(expected), gates=ANY)
    return report, {c["id"]: c for c in report["checks"]}


def test_measures_like_nvbandwidth_and_checks_every_buffer(fakecuda_libdir):
    data = run(fakecuda_libdir)
    assert data["errors"] == {}
    assert data["method"]["copies"] == 2 and data["method"]["warmups"] == 1 and data["method"]["pinned"] is True
    bw = data["bandwidth"]["0000:01:00.0"]
    assert bw["verified"] is True and bw["mismatches"] == {"h2d": 0, "d2d": 0, "d2h": 0, "bidir": 0}
    for key in ("h2d", "d2h", "d2d", "bidir_h2d", "bidir_d2h", "bidir_total"):
        assert len(bw[key]["samples"]) == 3 and bw[key]["median"] > 0, key
    assert bw["bidir_total"]["median"] > bw["bidir_h2d"]["median"]
    assert bw["link_under_load"] == {"current_gen": 5, "current_width": 16, "max_gen": 5, "max_width": 16}
    assert bw["host_memory_policy"].startswith("none")  # no such PCI device on this machine: no node
    lat = data["latency"]["0000:01:00.0"]
    assert lat["hops"] == 500 and lat["median_us"] > 0 and len(lat["samples_us"]) == 3
    over = data["copy_overhead"]["0000:01:00.0"]
    assert over["count"] == 100 and over["min_us"] <= over["p50_us"] <= over["p99_us"] <= over["max_us"]
    compute = data["compute"]["0000:01:00.0"]
    assert compute["verified"] is True and compute["elements"] == (4 << 20) // 4 and compute["gflops"] > 0
    assert data["p2p"] is None and data["nccl"] is None  # one GPU
    report, checks = judged(data)
    assert report["ok"], report["checks"]


def test_corrupted_copy_is_caught(fakecuda_libdir):
    data = run(fakecuda_libdir, env={"FAKECUDA_CORRUPT": "1"})
    bw = data["bandwidth"]["0000:01:00.0"]
    assert bw["verified"] is False and bw["mismatches"]["h2d"] == 1  # one flipped byte: one 64-bit word
    report, checks = judged(data)
    assert checks["data_verified"]["status"] == "fail" and "mismatching" in checks["data_verified"]["reason"]


def test_narrow_link_under_load_fails_the_check(fakecuda_libdir):
    report, checks = judged(run(fakecuda_libdir, env={"FAKECUDA_WIDTH": "8"}))
    assert checks["pcie_link"]["status"] == "fail" and checks["pcie_link"]["observed"] == "Gen5 x8"


@pytest.mark.parametrize("env, check_id, words", [
    ({"FAKECUDA_INIT_ERROR": "100"}, "cuda", "CUDA_ERROR_NO_DEVICE"),
    ({"FAKECUDA_INIT_ERROR": "802"}, "cuda", "CUDA_ERROR_SYSTEM_NOT_READY"),
    ({"FAKECUDA_NODEV": "1"}, "cuda", "CUDA sees 0 of the 1"),
    ({"FAKENVML_INIT_ERROR": "9"}, "nvml", "NVML error 9"),
    ({"FAKECUDA_ZERO_TIME": "1"}, "h2d_bandwidth", "cuEventElapsedTime gave 0.0 ms"),
])
def test_failure_modes_fail_with_the_drivers_words(fakecuda_libdir, env, check_id, words):
    data = run(fakecuda_libdir, env=env)
    report, checks = judged(data)
    assert checks[check_id]["status"] == "fail" and words in checks[check_id]["reason"], checks[check_id]
    assert not report["ok"]


def test_missing_symbols_are_reported_not_fatal(fakecuda_old_libdir):
    """An old driver without cuMemHostGetDevicePointer_v2 and cuGetErrorName: JSON all the same."""
    data = run(fakecuda_old_libdir)
    assert data["cuda"]["devices"] and "cuMemHostGetDevicePointer_v2" in data["errors"]["bandwidth 0000:01:00.0"]
    report, checks = judged(data)
    assert checks["h2d_bandwidth"]["status"] == "fail" and "driver too old" in checks["h2d_bandwidth"]["reason"]


def test_mig_without_instances_is_expected_not_failed(fakecuda_libdir):
    report, checks = judged(run(fakecuda_libdir, env={"FAKECUDA_MIG": "1"}))
    assert checks["cuda"]["status"] == "expected" and "MIG" in checks["cuda"]["reason"]


TWO = [Expected("0000:1b:00.0", "10de", "2330", "030200", 5, 16, "x"),
       Expected("0000:2b:00.0", "10de", "2330", "030200", 5, 16, "x")]


def test_two_gpus_peer_matrix_peer_copies_and_allreduce(fakecuda_libdir):
    data = run(fakecuda_libdir, env={"FAKECUDA_NDEV": "2"})
    assert data["errors"] == {}
    assert data["p2p"]["access"] == [[False, True], [True, False]]
    pairs = data["p2p"]["bandwidth"]
    assert set(pairs) == {"0000:01:00.0->0000:02:00.0", "0000:02:00.0->0000:01:00.0"}
    assert all(p["verified"] and p["median"] > 0 for p in pairs.values())
    nccl = data["nccl"]
    assert nccl["devices"] == 2 and [r["bytes"] for r in nccl["results"]] == [4 << 20]
    result = nccl["results"][0]
    assert result["verified"] and abs(result["busbw_gbps"] - result["algbw_gbps"] * 2 * 1 / 2) < 1e-9
    report, checks = judged(data, TWO, ("01", "02"))
    assert checks["p2p"]["status"] == "pass" and checks["nccl_allreduce"]["status"] == "pass", report["checks"]


def test_four_gpus_busbw_is_nccl_tests_formula(fakecuda_libdir):
    data = run(fakecuda_libdir, env={"FAKECUDA_NDEV": "4"})
    result = data["nccl"]["results"][0]
    assert result["verified"] and abs(result["busbw_gbps"] - result["algbw_gbps"] * 2 * 3 / 4) < 1e-9
    assert len(data["p2p"]["bandwidth"]) == 12


@pytest.mark.parametrize("env, check_id, status", [
    ({"FAKECUDA_P2P_CORRUPT": "1"}, "p2p", "fail"), ({"FAKECUDA_NOPEER": "1"}, "p2p", "skip"),
    ({"FAKENCCL_CORRUPT": "1"}, "nccl_allreduce", "fail"), ({"FAKENCCL_ERROR": "2"}, "nccl_allreduce", "fail")])
def test_peer_and_nccl_failure_modes(fakecuda_libdir, env, check_id, status):
    report, checks = judged(run(fakecuda_libdir, env={"FAKECUDA_NDEV": "2", **env}), TWO, ("01", "02"))
    assert checks[check_id]["status"] == status, checks[check_id]


def test_no_nccl_in_the_guest_is_a_skip(fakecuda_nonccl_libdir):
    data = run(fakecuda_nonccl_libdir, env={"FAKECUDA_NDEV": "2"})
    report, checks = judged(data, TWO, ("01", "02"))
    assert checks["nccl_allreduce"]["status"] == "skip" and "libnccl.so.2" in checks["nccl_allreduce"]["reason"]


def test_embedded_ptx_is_kernels_cu_and_loads_on_pascal_and_newer(tmp_path):
    """kernels.ptx is kernels.cu compiled (nvcc 13's oldest target, then lowered to PTX ISA 5.0
    / sm_60 as kernels.cu says), and ptxas takes it for Turing and Hopper."""
    from gpuvfio.guest.payload import KERNELS_PTX

    nvcc, ptxas = shutil.which("nvcc"), shutil.which("ptxas")
    if not nvcc or not ptxas:
        pytest.skip("nvcc/ptxas not installed (the CUDA toolkit is on the CI machine)")
    source = os.path.join(os.path.dirname(VERIFIER), "kernels.cu")
    out = tmp_path / "k.ptx"
    subprocess.run([nvcc, "--ptx", "-arch=compute_75", "-o", str(out), source], check=True, timeout=120)
    made = out.read_text()
    made = made[made.index(".version"):].replace(".version " + made.split(".version ")[1].split()[0], ".version 5.0", 1)
    made = made.replace(".target sm_75", ".target sm_60", 1)
    normal = [line for line in made.splitlines() if line.strip() and not line.strip().startswith("// .globl")]
    with open(KERNELS_PTX, encoding="utf-8") as handle:
        assert handle.read().splitlines() == normal
    for arch in ("sm_75", "sm_90"):
        subprocess.run([ptxas, f"-arch={arch}", KERNELS_PTX, "-o", str(tmp_path / f"{arch}.cubin")], check=True,
                       timeout=120)
    with open(KERNELS_PTX, encoding="utf-8") as handle:
        head = handle.read().split("\n", 2)
    assert head[:2] == [".version 5.0", ".target sm_60"]


def test_the_program_sent_on_stdin_carries_its_kernels(fakecuda_libdir):
    """What verify_guest sends (python3 -): the kernels travel inside the program."""
    from gpuvfio.guest.payload import verifier_program

    proc = subprocess.run([sys.executable, "-", *SMALL], input=verifier_program(), capture_output=True, timeout=120,
                          cwd="/", env={**os.environ, "LD_LIBRARY_PATH": fakecuda_libdir})
    data = parse_verifier(proc.stdout.decode())
    assert data["errors"] == {} and data["compute"]["0000:01:00.0"]["verified"] is True


def test_host_memory_goes_to_the_gpus_numa_node_read_under_root(tmp_path, fakecuda_libdir):
    """The verifier reads /sys under --root (as the probe does under GPUVFIO_PROBE_ROOT): a GPU on
    node 0 of a two-node guest gets its pinned buffers under MPOL_PREFERRED with that node's CPUs."""
    sys_dir = tmp_path / "sys"
    (sys_dir / "bus" / "pci" / "devices" / "0000:01:00.0").mkdir(parents=True)
    (sys_dir / "bus" / "pci" / "devices" / "0000:01:00.0" / "numa_node").write_text("0\n")
    for node, cpus in ((0, "0"), (1, "1")):
        (sys_dir / "devices" / "system" / "node" / f"node{node}").mkdir(parents=True)
        (sys_dir / "devices" / "system" / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    bw = run(fakecuda_libdir, "--root", str(tmp_path))["bandwidth"]["0000:01:00.0"]
    assert bw["host_numa_node"] == 0 and bw["host_memory_policy"] == "preferred node 0, CPUs of that node"
    (sys_dir / "devices" / "system" / "node" / "node1" / "cpulist").unlink()
    (sys_dir / "devices" / "system" / "node" / "node1").rmdir()
    bw = run(fakecuda_libdir, "--root", str(tmp_path))["bandwidth"]["0000:01:00.0"]
    assert bw["host_numa_node"] == 0 and bw["host_memory_policy"] == "none (one NUMA node in the guest)"


def topo_file(path, links, switch=None):
    """An NCCL topology file as gpuvfio writes it: a <pci> per GPU with its link attributes,
    under the <pci> of an emulated switch where ``switch`` names its bus id."""
    nodes = "".join(f'    <pci busid="{bus}" class="0x030200" vendor="0x10de" device="0x2330" link_speed="{speed}" '
                    f'link_width="{width}"/>\n' for bus, (speed, width) in links.items())
    if switch:
        nodes = f'    <pci busid="{switch}" class="0x060400" link_speed="32.0 GT/s PCIe" link_width="16">\n{nodes}    </pci>\n'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'<system version="1">\n  <cpu numaid="0" affinity="0000000f" arch="x86_64">\n{nodes}'
                    '  </cpu>\n</system>\n')
    return path


LINKS = {"0000:01:00.0": ("16.0 GT/s PCIe", "8"), "0000:02:00.0": ("16.0 GT/s PCIe", "8")}


def attached(root, links=LINKS, switch=None, conf=b"NCCL_TOPO_FILE=/etc/gpuvfio/nccl-topo.xml\n"):
    """A guest as attach leaves it under ``root``: gpuvfio's file, and /etc/nccl.conf naming it."""
    topo_file(root / "etc" / "gpuvfio" / "nccl-topo.xml", links, switch)
    if conf is not None:
        (root / "etc" / "nccl.conf").write_bytes(conf)


def test_the_allreduce_runs_with_gpuvfios_file_and_reports_nccls_view(tmp_path, fakecuda_libdir):
    """gpuvfio's file, which the guest's /etc/nccl.conf names, is what NCCL loads for the
    all-reduce, run without the NCCL_* variables the verifier was started with (reported: NCCL
    ranks them above the file); NCCL's dump (NCCL_TOPO_DUMP_FILE) shows the links it took,
    beside the file's."""
    attached(tmp_path)
    data = run(fakecuda_libdir, "--root", str(tmp_path), env={"FAKECUDA_NDEV": "2", "NCCL_TOPO_FILE": "/elsewhere",
                                                             "HOME": "/home/user"})
    topology = data["nccl"]["topology"]
    assert topology["file"] == "/etc/gpuvfio/nccl-topo.xml" and topology["source"] == "/etc/nccl.conf"
    assert topology["gpuvfio_file"] == "/etc/gpuvfio/nccl-topo.xml"
    assert {"source": "environment", "key": "NCCL_TOPO_FILE", "value": "/elsewhere"} in topology["above"]
    want = {bus: {"link_speed": speed, "link_width": width} for bus, (speed, width) in LINKS.items()}
    assert topology["planned"] == want and topology["nccl"] == want and topology["error"] is None
    report, checks = judged(data, TWO, ("01", "02"))
    assert checks["nccl_topology"]["status"] == "pass" and report["ok"]
    assert checks["nccl_topology"]["observed"] == "0000:01:00.0 16.0 GT/s PCIe x8, 0000:02:00.0 16.0 GT/s PCIe x8"
    assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("gpuvfio-nccl-")
                and os.path.exists(os.path.join(tempfile.gettempdir(), n, "topology.xml"))]


def test_nccl_that_did_not_load_the_file_is_a_warning(tmp_path, fakecuda_libdir):
    path = topo_file(tmp_path / "topo.xml", LINKS)
    data = run(fakecuda_libdir, "--nccl-topo-file", str(path), env={"FAKECUDA_NDEV": "2", "FAKENCCL_IGNORE_TOPO": "1"})
    report, checks = judged(data, TWO, ("01", "02"))
    topology = checks["nccl_topology"]
    assert topology["status"] == "warn" and report["ok"]  # a warning, not a failed guest
    assert "0000:01:00.0 link_speed '32.0 GT/s PCIe', the file '16.0 GT/s PCIe'" in topology["reason"]
    assert topology["expected"].startswith("0000:01:00.0 16.0 GT/s PCIe x8")
    assert topology["observed"].startswith("0000:01:00.0 32.0 GT/s PCIe x16")
    # A file naming other bus ids than the guest shows: said per GPU.
    topo_file(path, {"0000:0a:00.0": ("16.0 GT/s PCIe", "8")})
    report, checks = judged(run(fakecuda_libdir, "--nccl-topo-file", str(path), env={"FAKECUDA_NDEV": "2"}),
                            TWO, ("01", "02"))
    assert checks["nccl_topology"]["status"] == "warn"
    assert "0000:0a:00.0: not in NCCL's view" in checks["nccl_topology"]["reason"]
    assert "0000:01:00.0: not in the file" in checks["nccl_topology"]["reason"]


def test_without_a_file_nccls_view_is_shown_and_the_check_skipped(tmp_path, fakecuda_libdir):
    data = run(fakecuda_libdir, "--root", str(tmp_path), env={"FAKECUDA_NDEV": "2"})
    topology = data["nccl"]["topology"]
    assert topology["file"] is None and topology["planned"] is None
    assert topology["nccl"]["0000:02:00.0"] == {"link_speed": "32.0 GT/s PCIe", "link_width": "16"}
    report, checks = judged(data, TWO, ("01", "02"))
    assert checks["nccl_topology"]["status"] == "skip" and "no NCCL topology file" in checks["nccl_topology"]["reason"]


def the_program(monkeypatch):
    """The verifier as the guest runs it: a top-level program beside gpuvfio_nvapi.py and
    gpuvfio_ncclxml.py (loaded here without a name in sys.modules, and its helper modules taken
    out again afterwards)."""
    import importlib.util

    monkeypatch.syspath_prepend(os.path.dirname(VERIFIER))
    for helper in ("gpuvfio_nvapi", "gpuvfio_ncclxml", "gpuvfio_ncclpaths", "gpuvfio_ncclconf"):
        monkeypatch.setitem(sys.modules, helper, None)
        del sys.modules[helper]  # imported afresh below; monkeypatch takes it out at the end
    spec = importlib.util.spec_from_file_location("gpuvfio_verifier_under_test", VERIFIER)
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    return program


def test_the_verifiers_file_is_the_one_attach_writes(monkeypatch):
    from gpuvfio.domain.nccl_topo import GUEST_FILE

    assert the_program(monkeypatch).PLAN_TOPO_FILE == GUEST_FILE


def test_nccls_dump_is_read_as_nccl_writes_it(monkeypatch):
    """ncclTopoDumpXmlRec (src/graph/xml.cc, v2.30.7-1) writes values unescaped, a <gpu> under the
    GPU's <pci>, NVLinks under the <gpu>: read tag by tag."""
    gpu_links = the_program(monkeypatch).gpu_links

    dump = ('<system version="1">\n  <cpu host_hash="0x1" numaid="0" vendor="A&B">\n'
            '    <pci busid="0000:0A:00.0" class="0x060400" link_speed="32.0 GT/s PCIe" link_width="16">\n'
            '      <pci busid="0000:0b:00.0" class="0x030200" link_speed="16.0 GT/s PCIe" link_width="16">\n'
            '        <gpu dev="0" sm="90" rank="0" gdr="1">\n'
            '          <nvlink target="0000:0c:00.0" count="4" tclass="0x030200"/>\n'
            '          <nvlink target="0000:0d:00.0" count="2" tclass="0x030200"/>\n'
            '        </gpu>\n      </pci>\n'
            '      <pci busid="0000:0c:00.0" class="" link_speed="" link_width="0">\n'
            '        <gpu dev="1" sm="90" rank="1" gdr="1"/>\n      </pci>\n'
            '      <pci busid="0000:0e:00.0" class="0x020000" link_speed="16.0 GT/s PCIe" link_width="16"/>\n'
            '    </pci>\n  </cpu>\n</system>\n')
    assert gpu_links(dump) == {"0000:0b:00.0": {"link_speed": "16.0 GT/s PCIe", "link_width": "16", "nvlink": 6},
                               "0000:0c:00.0": {"link_speed": "", "link_width": "0"}}


def test_nccls_paths_in_the_guest_are_held_to_the_hosts(tmp_path, fakecuda_libdir):
    """The verifier computes NCCL's path type between each pair of GPUs of NCCL's dump (by NCCL's
    rules, gpuvfio_ncclpaths); the host's pairs are the truth. The same passes; a NCCL that never
    loaded the file (its GPUs straight under the CPU: PHB) fails where the host says PIX, and so
    does a dump without paths (closed)."""
    attached(tmp_path, switch="0000:00:05.0")
    data = run(fakecuda_libdir, "--root", str(tmp_path), env={"FAKECUDA_NDEV": "2"})
    assert data["nccl"]["topology"]["paths"] == [["0000:01:00.0", "0000:02:00.0", "PIX"]]
    host = {("0000:1b:00.0", "0000:2b:00.0"): "PIX"}

    def paths_check(data, want=host):
        report = evaluate(probe(("01", "02")), data, TWO, gates=ANY, nccl_paths=want)
        return {c["id"]: c for c in report["checks"]}["nccl_paths"]

    passed = paths_check(data)
    assert (passed["status"], passed["expected"], passed["observed"]) == ("pass", "1 pair(s) as on the host", "1 the same")
    ignored = run(fakecuda_libdir, "--root", str(tmp_path), env={"FAKECUDA_NDEV": "2", "FAKENCCL_IGNORE_TOPO": "1"})
    failed = paths_check(ignored)
    assert failed["status"] == "fail" and "0000:1b:00.0 <-> 0000:2b:00.0: host PIX, guest PHB" in failed["reason"]
    data["nccl"]["topology"]["paths"] = None
    assert paths_check(data)["status"] == "fail"
    data["nccl"]["topology"]["paths"] = []
    assert "guest not in NCCL view" in paths_check(data)["reason"]
    del data["nccl"]
    assert paths_check(data)["status"] == "skip"
    report = evaluate(probe(("01", "02")), ignored, TWO, gates=ANY)
    assert "nccl_paths" not in {c["id"] for c in report["checks"]}  # nothing to hold it to


@pytest.mark.parametrize("paths", [[["0000:01:00.0", "0000:02:00.0", "CLOSE"]], [["0000:01:00.0", "PIX"]],
                                   [["0000:01:00.0", "0000:02:00.0", 4]], {"a": "PIX"},
                                   [["0000:01:00.0", "0000:02:00.0 ", "PIX"]], [["bogus", "0000:02:00.0", "PIX"]],
                                   [["0000:01:00.0", "0000:02:00.0", "PIX"]] * 32641])
def test_a_guest_whose_paths_are_no_ncclpath_rows_is_refused(tmp_path, fakecuda_libdir, paths):
    """The guest's paths are hostile input: rows of two bus ids and one of NCCL's path type names,
    at most one per pair of NCCL's 256 XML nodes."""
    topo_file(tmp_path / "etc" / "gpuvfio" / "nccl-topo.xml", LINKS)
    data = run(fakecuda_libdir, "--root", str(tmp_path), env={"FAKECUDA_NDEV": "2"})
    data["nccl"]["topology"]["paths"] = paths
    with pytest.raises(VerifyError, match="nccl.topology is malformed"):
        parse_verifier("GPUVFIO-VERIFIER " + json.dumps(data))


def test_nccl_runs_as_a_job_without_nccl_settings_would_and_says_what_wins(tmp_path, fakecuda_libdir):
    """NCCL's own files decide which topology file it loads: without /etc/nccl.conf naming it,
    gpuvfio's file is not loaded (a warning that says so); a user's ~/.nccl.conf, which NCCL reads
    first, wins and is reported; the verifier's own NCCL_* variables (NCCL_CONF_FILE among them)
    are taken out and reported."""
    home = tmp_path / "home" / "user"  # $HOME as the guest names it, under the stand-in root
    home.mkdir(parents=True)
    attached(tmp_path, conf=None)
    env = {"FAKECUDA_NDEV": "2", "HOME": "/home/user", "NCCL_CONF_FILE": "/elsewhere.conf", "NCCL_DEBUG": "INFO"}
    data = run(fakecuda_libdir, "--root", str(tmp_path), env=env)
    topology = data["nccl"]["topology"]
    assert topology["file"] is None and topology["gpuvfio_file"] == "/etc/gpuvfio/nccl-topo.xml"
    assert [(a["source"], a["key"]) for a in topology["above"]] == [("environment", "NCCL_CONF_FILE"),
                                                                     ("environment", "NCCL_DEBUG")]
    _report, checks = judged(data, TWO, ("01", "02"))
    warned = checks["nccl_topology"]
    assert warned["status"] == "warn" and "nothing NCCL reads names it" in warned["reason"]
    assert "NCCL_CONF_FILE='/elsewhere.conf' (environment)" in warned["reason"]
    (tmp_path / "etc" / "nccl.conf").write_bytes(b"NCCL_TOPO_FILE=/etc/gpuvfio/nccl-topo.xml\n")
    (home / ".nccl.conf").write_bytes(b"# mine\nNCCL_TOPO_FILE=/opt/other.xml\nNCCL_ALGO=Ring\n")
    topo_file(tmp_path / "opt" / "other.xml", {"0000:01:00.0": ("8.0 GT/s PCIe", "4")})
    data = run(fakecuda_libdir, "--root", str(tmp_path), env=env)
    topology = data["nccl"]["topology"]
    assert (topology["file"], topology["source"]) == ("/opt/other.xml", "~/.nccl.conf")
    assert {"source": "~/.nccl.conf", "key": "NCCL_ALGO", "value": "Ring"} in topology["above"]
    warned = judged(data, TWO, ("01", "02"))[1]["nccl_topology"]
    assert warned["status"] == "warn" and "NCCL loads '/opt/other.xml' (named in ~/.nccl.conf)" in warned["reason"]


def test_in_a_guest_the_verifier_sets_no_nccl_topo_file_of_its_own(monkeypatch):
    """At the guest's own root NCCL reads /etc/nccl.conf itself: the all-reduce's environment
    holds no NCCL_* variable but the dump's two, whatever the verifier was started with."""
    import types

    program = the_program(monkeypatch)
    monkeypatch.setenv("NCCL_TOPO_FILE", "/etc/the-session.xml")
    monkeypatch.setenv("NCCL_P2P_LEVEL", "SYS")
    view = program.TopologyView(types.SimpleNamespace(root="/", nccl_topo_file=""))
    try:
        assert sorted(k for k in os.environ if k.startswith("NCCL_")) == ["NCCL_TOPO_DUMP_FILE",
                                                                         "NCCL_TOPO_DUMP_FILE_RANK"]
        assert {"source": "environment", "key": "NCCL_P2P_LEVEL", "value": "SYS"} in view.above
    finally:
        view.close()
        for key in ("NCCL_TOPO_DUMP_FILE", "NCCL_TOPO_DUMP_FILE_RANK"):
            os.environ.pop(key, None)


THREE = [Expected(f"0000:{bus}:00.0", "10de", "2330", "030200", 5, 16, "x") for bus in ("1b", "2b", "3b")]


def test_identical_gpus_may_sit_anywhere_their_paths_allow(tmp_path, fakecuda_libdir):
    """The host cannot know which of three identical GPUs the guest shows first: a guest whose
    PIX pair is its second and third GPU, where the host's is its first two, is the host's
    machine to NCCL and passes; one with no PIX pair fails, the pairs named as matched."""
    attached(tmp_path, links={f"0000:0{n}:00.0": ("16.0 GT/s PCIe", "16") for n in (1, 2, 3)})
    data = run(fakecuda_libdir, "--root", str(tmp_path), env={"FAKECUDA_NDEV": "3"})
    want = {("0000:1b:00.0", "0000:2b:00.0"): "PIX", ("0000:1b:00.0", "0000:3b:00.0"): "PHB",
            ("0000:2b:00.0", "0000:3b:00.0"): "PHB"}

    def paths_check(rows):
        data["nccl"]["topology"]["paths"] = rows
        report = evaluate(probe(("01", "02", "03")), data, THREE, gates=ANY, nccl_paths=want)
        return {c["id"]: c for c in report["checks"]}["nccl_paths"]

    moved = [["0000:01:00.0", "0000:02:00.0", "PHB"], ["0000:01:00.0", "0000:03:00.0", "PHB"],
             ["0000:02:00.0", "0000:03:00.0", "PIX"]]
    assert paths_check(moved)["status"] == "pass"
    flat = [[a, b, "PHB"] for a, b, _kind in moved]
    failed = paths_check(flat)
    assert failed["status"] == "fail" and "0000:1b:00.0 <-> 0000:2b:00.0: host PIX, guest PHB" in failed["reason"]
    assert failed["observed"] == "2 the same"


def nccl_tests_all_reduce_get_bw(count, typesize, sec, nranks, nccl_algo):
    """nccl-tests src/all_reduce.cu AllReduceGetBw (commit 03a204a1), line for line."""
    base_bw = (count * typesize) / 1.0E9 / sec
    if nccl_algo is not None and (nccl_algo == "NVLS" or nccl_algo == "NVLSTREE"):  # strcmp
        factor = (nranks - 1) / (nranks + 1)
    else:
        factor = (2 * (nranks - 1)) / nranks
    return base_bw, base_bw * factor


@pytest.mark.parametrize("algo", [None, "Ring", "Tree", "NVLS", "NVLSTREE", "nvls", "NVLS,Ring", "^NVLS", "CollNet"])
def test_the_bus_bandwidth_factor_is_nccl_tests_for_each_algorithm(monkeypatch, algo):
    program = the_program(monkeypatch)
    for nranks in range(1, 9):
        algbw, busbw = nccl_tests_all_reduce_get_bw(1 << 24, 4, 0.001, nranks, algo)
        assert algbw * program.busbw_factor(nranks, algo) == pytest.approx(busbw, rel=1e-12)


def test_nccl_algo_is_read_where_nccl_tests_reads_it(monkeypatch):
    """After NCCL's init, what its files set is in the C environment, not in os.environ."""
    import ctypes

    program = the_program(monkeypatch)
    libc = ctypes.CDLL(None)
    assert program.nccl_algo() is None or "NCCL_ALGO" in os.environ
    libc.setenv(b"NCCL_ALGO", b"NVLS", 0)
    try:
        assert program.nccl_algo() == "NVLS" and "NCCL_ALGO" not in os.environ
    finally:
        libc.unsetenv(b"NCCL_ALGO")


def topology_checks(topology, want=None, found=("01", "02"), expected=TWO):
    """The checks judge makes of a verifier answer whose NCCL topology view is ``topology``."""
    verifier = {"version": 1, "errors": {}, "nvml": None, "cuda": None, "bandwidth": {}, "p2p": None,
                "nccl": {"results": [], "topology": topology}}
    from gpuvfio.guest.nccl_checks import check_nccl, check_nccl_paths

    checks = []
    check_nccl(checks, verifier, len(expected))
    gpus = [(exp, {"address": f"0000:{bus}:00.0"} if bus else None) for exp, bus in zip(expected, found)]
    if want is not None:
        check_nccl_paths(checks, verifier, gpus, want)
    return {c.check_id: c.to_json() for c in checks}


def test_the_topology_check_says_each_case_in_full():
    many = [{"source": "environment", "key": f"NCCL_K{n}", "value": "v"} for n in range(11)]
    skipped = topology_checks({"file": None, "gpuvfio_file": None, "nccl": None, "above": many[:1]})["nccl_topology"]
    assert skipped["status"] == "skip" and skipped["reason"] == (
        "no NCCL topology file in the guest (gpuvfio attach writes one for two or more GPUs); NCCL settings "
        "ranked above /etc/nccl.conf: NCCL_K0='v' (environment)")
    other = topology_checks({"file": "/opt/x.xml", "source": "~/.nccl.conf",
                             "gpuvfio_file": "/etc/gpuvfio/nccl-topo.xml", "above": many})["nccl_topology"]
    assert (other["expected"], other["observed"]) == ("'/etc/gpuvfio/nccl-topo.xml'", "'/opt/x.xml'")
    assert other["reason"].startswith("gpuvfio's '/etc/gpuvfio/nccl-topo.xml' is in the guest, but NCCL loads "
                                      "'/opt/x.xml' (named in ~/.nccl.conf): a job gets another PCIe tree")
    assert other["reason"].endswith("NCCL_K9='v' (environment) and 1 more") and "NCCL_K10" not in other["reason"]
    ten = topology_checks({"file": None, "gpuvfio_file": None, "above": many[:10]})["nccl_topology"]
    assert ten["reason"].endswith("NCCL_K9='v' (environment)")
    odd = topology_checks({"file": None, "gpuvfio_file": None,
                           "above": [{"source": "x y", "key": "A B", "value": "v"}]})["nccl_topology"]
    assert odd["reason"].endswith("'A B'='v' ('x y')")
    # What the guest names is bounded where shown: 60 characters of a key, 120 of a path.
    key = "A " + "b" * 57  # its repr is 61 characters: one too many
    cut = topology_checks({"file": None, "gpuvfio_file": None,
                           "above": [{"source": "environment", "key": key, "value": "v"}]})["nccl_topology"]
    assert f"'A {'b' * 52}...'='v'" in cut["reason"]
    path = "/" + "p" * 118  # its repr is 121 characters
    long = topology_checks({"file": path, "source": "/etc/nccl.conf", "gpuvfio_file": path + "x"})["nccl_topology"]
    assert long["observed"] == repr(path)[:115] + "...'" and long["expected"] == repr(path + "x")[:115] + "...'"
    links = {"0000:01:00.0": {"link_speed": "16.0 GT/s PCIe", "link_width": "8"}}
    no_dump = topology_checks({"file": "/etc/gpuvfio/nccl-topo.xml", "gpuvfio_file": "/etc/gpuvfio/nccl-topo.xml",
                               "planned": links, "nccl": None, "error": "boom", "above": many[:1]})["nccl_topology"]
    assert no_dump["reason"] == "boom; NCCL settings ranked above /etc/nccl.conf: NCCL_K0='v' (environment)"
    same = topology_checks({"file": "/etc/gpuvfio/nccl-topo.xml", "gpuvfio_file": "/etc/gpuvfio/nccl-topo.xml",
                            "planned": links, "nccl": links, "above": many[:1]})["nccl_topology"]
    assert same["status"] == "pass" and same["reason"] == ("NCCL settings ranked above /etc/nccl.conf: "
                                                           "NCCL_K0='v' (environment)")
    assert topology_checks({"file": "/etc/gpuvfio/nccl-topo.xml", "gpuvfio_file": "/etc/gpuvfio/nccl-topo.xml",
                            "planned": links, "nccl": links})["nccl_topology"]["reason"] is None


def test_the_paths_check_says_each_case_in_full():
    want = {("0000:1b:00.0", "0000:2b:00.0"): "PIX"}
    from gpuvfio.guest.nccl_checks import check_nccl_paths

    checks = []
    check_nccl_paths(checks, {"nccl": None}, [], want)
    assert [c.to_json() for c in checks] == [{"id": "nccl_paths", "status": "skip", "expected": None,
                                              "observed": None, "device": None,
                                              "reason": "NCCL did not run in the guest (see nccl_allreduce)"}]
    closed = topology_checks({"file": None, "gpuvfio_file": None, "paths": None, "error": "no dump"}, want)
    assert closed["nccl_paths"] == {"id": "nccl_paths", "status": "fail", "expected": "1 pair(s) as on the host",
                                    "observed": None, "reason": "no paths from NCCL's topology dump: no dump",
                                    "device": None}
    missing = topology_checks({"file": None, "gpuvfio_file": None, "paths": [["0000:01:00.0", "0000:02:00.0", "PIX"]]},
                              want, found=("01", None))["nccl_paths"]
    assert (missing["status"], missing["expected"], missing["observed"]) == ("fail", "1 pair(s) as on the host",
                                                                             "0 the same")
    assert missing["reason"].endswith("0000:1b:00.0 <-> 0000:2b:00.0: host PIX, guest not in NCCL view")


def test_the_pairing_search_is_bounded(monkeypatch):
    """Eight identical GPUs whose guest has no pairing: the search gives up at PAIRING_STEPS
    (a bound on a hostile or odd guest), failing closed."""
    from gpuvfio.guest import nccl_checks

    eight = [Expected(f"0000:{n:02x}:00.0", "10de", "2330", "030200", 5, 16, "x") for n in range(0x10, 0x18)]
    hosts = [(e.address, ("10de", "2330"), f"0000:{n + 1:02x}:00.0") for n, e in enumerate(eight)]
    want = {(a[0], b[0]): "PIX" if (i // 2 == j // 2) else "PHB"
            for i, a in enumerate(hosts) for j, b in enumerate(hosts) if i < j}
    seen = {(a[2], b[2]): "PIX" if (i // 4 == j // 4) else "PHB"
            for i, a in enumerate(hosts) for j, b in enumerate(hosts) if i < j}
    calls = []
    real = nccl_checks._pair

    def counted(a, b):
        calls.append(1)
        return real(a, b)
    monkeypatch.setattr(nccl_checks, "_pair", counted)
    assert nccl_checks._pairing(hosts, want, seen) is None
    unbounded = len(calls)
    monkeypatch.setattr(nccl_checks, "PAIRING_STEPS", 20)
    calls.clear()
    assert nccl_checks._pairing(hosts, want, seen) is None and len(calls) < unbounded
