"""The bundled sample hosts: golden files, lspci agreement, and what each is meant to show."""

import json
import os

import pytest

from gpuvfio.host.fixture import load_fixture
from tests.conftest import golden_text
from tests.lspci import compare, lspci_available, lspci_records
from tests.make_samples import REPO, SAMPLES, check, sample_path


@pytest.fixture(scope="module")
def sample_roots(tmp_path_factory):
    roots = {}
    for name in SAMPLES:
        with open(sample_path(name), encoding="utf-8") as handle:
            roots[name] = load_fixture(handle.read(), str(tmp_path_factory.mktemp(name)))
    return roots


def test_committed_samples_are_what_the_generator_makes():
    assert check(list(SAMPLES)) == []


@pytest.mark.skipif(not lspci_available(), reason="pciutils not installed")
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_inventory_agrees_with_lspci(name, sample_roots, cli):
    data = cli("--root", sample_roots[name], "list", "--all", "--json").json()
    compare(data["devices"], lspci_records(os.path.join(sample_roots[name], "sys", "bus", "pci")))


def _nvidia(cli, root):
    return cli("--root", root, "list", "--json").json()


def _doctor(cli, root):
    result = cli("--root", root, "doctor", "--json")
    return result.code, {c["id"]: c for c in result.json()["checks"]}


def test_dgx(sample_roots, cli):
    data = _nvidia(cli, sample_roots["dgx-h100"])
    gpus = [d for d in data["devices"] if d["device_id"] == "2330"]
    switches = [d for d in data["devices"] if d["class_id"] == "068000"]
    assert len(gpus) == 8 and len(switches) == 4
    assert all(g["largest_bar"] == 128 << 30 and g["link"]["current_gen"] == 5 for g in gpus)
    assert {g["numa_node"] for g in gpus} == {0, 1}
    assert all(g["viable"] for g in data["groups"])
    assert len({s["iommu_group"] for s in switches}) == 1  # NVSwitches share a group, still viable
    code, checks = _doctor(cli, sample_roots["dgx-h100"])
    assert code == 0
    assert checks["nvidia_holders"]["status"] == "warn"
    assert "nv-fabricmanage (pid" in checks["nvidia_holders"]["summary"]
    assert "nvidia-nvswitch" in checks["nvidia_holders"]["summary"]
    assert checks["boot_vga"]["status"] == "ok"
    near = checks["hugepages_near_gpus"]  # 1G pages on both sockets, four GPUs on each
    assert near["status"] == "ok" and near["summary"] == (
        "node0 (0000:1b:00.0, 0000:43:00.0, 0000:52:00.0, 0000:61:00.0): 256/256 x 1G free; "
        "node1 (0000:9d:00.0, 0000:c3:00.0, 0000:d1:00.0, 0000:df:00.0): 256/256 x 1G free")


def test_workstation(sample_roots, cli):
    data = _nvidia(cli, sample_roots["workstation"])
    groups = {g["id"]: g for g in data["groups"]}
    by_id = {d["device_id"]: d for d in data["devices"]}
    assert groups[by_id["2684"]["iommu_group"]]["viable"]
    shared = groups[by_id["2504"]["iommu_group"]]
    assert not shared["viable"]
    assert any("[8086:15f3] Ethernet controller (igc)" in p for p in shared["problems"])
    code, checks = _doctor(cli, sample_roots["workstation"])
    assert checks["boot_vga"]["status"] == "warn" and checks["gpu_groups"]["status"] == "warn"
    # numa_node -1 on the one-node desktop: the GPUs are on node 0, which has no hugepages.
    near = checks["hugepages_near_gpus"]
    assert near["status"] == "warn" and near["summary"].startswith("node0 (0000:01:00.0, 0000:04:00.0): none reserved")
    assert "node0/hugepages/hugepages-1048576kB/nr_hugepages" in near["fix"]


def test_epyc(sample_roots, cli):
    data = _nvidia(cli, sample_roots["epyc-mixed"])
    drivers = {d["driver"] for d in data["devices"]}
    assert "vfio-pci" in drivers
    assert any(d["sriov"] and d["sriov"]["num_vfs"] for d in data["devices"])
    assert any(d["vgpu"] and d["vgpu"]["current_type"] for d in data["devices"])
    assert any(d["mdev_types"] for d in data["devices"])
    assert all(g["viable"] for g in data["groups"])
    code, checks = _doctor(cli, sample_roots["epyc-mixed"])
    assert code == 0 and "amd" in checks["iommu"]["summary"]
    near = checks["hugepages_near_gpus"]  # 16 GiB of node 1's 2M pages back the A100 guest
    assert near["status"] == "ok" and near["summary"] == (
        "node0 (0000:41:00.0): 32768/32768 x 2M free; node1 (0000:81:00.0, 0000:82:00.0): 24576/32768 x 2M free")


def test_iommu_off(sample_roots, cli):
    data = _nvidia(cli, sample_roots["iommu-off"])
    assert data["groups"] is None and all(d["iommu_group"] is None for d in data["devices"])
    code, checks = _doctor(cli, sample_roots["iommu-off"])
    assert code == 1 and checks["iommu"]["status"] == "fail"
    near = checks["hugepages_near_gpus"]
    assert near["status"] == "warn" and "hugepages=0:N,1:N" in near["fix"]


def test_fixture_file_as_root(cli):
    result = cli("--root", sample_path("workstation"), "list")
    assert result.code == 0 and result.out.splitlines()[1].startswith("0000:01:00.0")  # plain, into a pipe
    table = cli("--root", sample_path("workstation"), "list", "--format", "table")
    assert table.code == 0 and "NVIDIA devices on workstation.host" in table.out


REPORT_GOLDEN = os.path.join(REPO, "tests", "golden", "reports")
REPORTS = {"list": ["list", "--json"], "list --all": ["list", "--all", "--json"], "doctor": ["doctor", "--json"],
           "topo": ["topo", "--json"]}
# A few pci.ids entries (its format: https://pci-ids.ucw.cz), so the names in the goldens do not
# depend on the pci.ids of the machine the tests run on.
PCI_IDS = """\
10de  NVIDIA Corporation
\t2330  GH100 [H100 SXM5 80GB]
\t2684  AD102 [GeForce RTX 4090]
\t20b5  GA100 [A100 PCIe 80GB]
1000  Broadcom / LSI
\tc030  PEX890xx PCIe Gen 5 Switch
15b3  Mellanox Technologies
\t1021  MT2910 Family [ConnectX-7]
8086  Intel Corporation
\t15f3  Ethernet Controller I225-V
C 02  Network controller
\t00  Ethernet controller
C 03  Display controller
\t00  VGA compatible controller
\t02  3D controller
C 06  Bridge
\t04  PCI bridge
"""


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_reports_are_their_goldens(name, cli, regenerate, tmp_path, monkeypatch):
    """list, list --all, doctor and topo --json of each sample, byte for byte as JSON (key order
    too): the typed reports serialise to exactly what the commands printed before them."""
    (tmp_path / "pci.ids").write_text(PCI_IDS)
    monkeypatch.setenv("GPUVFIO_PCI_IDS", str(tmp_path / "pci.ids"))
    monkeypatch.delenv("GPUVFIO_STATE_DIR", raising=False)
    got = {}
    for key, args in REPORTS.items():
        result = cli("--root", sample_path(name), *args)
        got[key] = {"exit": result.code, "json": result.json()}
    text = json.dumps(got, indent=1) + "\n"
    path = os.path.join(REPORT_GOLDEN, f"{name}.json")
    expected = golden_text(path, text, regenerate)
    for key in REPORTS:  # the first report that differs, named
        assert json.dumps(got[key], indent=1) == json.dumps(json.loads(expected)[key], indent=1), (
            f"{name}: {key} differs from {path} (pytest --regenerate to accept)")
    assert text == expected
