"""Kubernetes hand-offs (issue 15 item 9, issue 24 item 2): KubeVirt's permittedHostDevices with the
resource names NVIDIA's kubevirt-gpu-device-plugin registers (its algorithm over its own bundled
pci.ids, never the host's), mediated devices for vGPUs, NVSwitches under hostDevices, a JSON patch
that adds and a CR fragment that says it replaces, an empty export refused; and DRA device
attributes, checked by parsing and against the shapes KubeVirt's API types and the DRA
deviceattribute package define."""

from __future__ import annotations

import copy
import itertools
import os
import re

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.host.root import HostRoot
from gpuvfio.ops import kubevirt_names
from gpuvfio.ops.context import Context
from gpuvfio.ops.export import DraAttributes, attributes, plugin_resource_name
from gpuvfio.ops.kubevirt_names import (PluginNames, bundled, derive, device_name, nvidia_device_lines, table_path,
                                        table_text, valid_resource_name, vgpu_key)
from tests.hostbuilder import BAR64_PREF, GiB, HostBuilder
from tests.make_plugin_names import EXCERPT
from tests.make_samples import sample_path

yaml = pytest.importorskip("yaml")  # PyYAML comes with ansible-core in the test venv

# The pci.ids of the plugin's own getDeviceName tests (device_plugin_test.go, v1.6.0), verbatim:
# another vendor's 2331 first, one-space separators, lower case, dots and slashes.
PLUGIN_TEST_IDS = (b"\n8086  Intel Corporation\n\t2331  DH89xxCC Chap Counter\n10de NVIDIA Corporation\n"
                   b"\t118a  GK104GL [GRID K520]\n\t118b  GK104GL [GRID K2 GeForce USM]\n\t118d  gk104gl [grid k520]\n"
                   b"\t118e gk104.gl [grid/k./520]\n\t2331 GH100 [H100 PCIe]\n")
# Debian 12's pci.ids (2023.04.10) for the same ids: no space before "[", no 22a3 line.
DEBIAN12_IDS = "10de  NVIDIA Corporation\n\t2330  GH100[H100 SXM5 80GB]\n\t233a  GH100 [H800 PCIe]\n10df  Emulex\n"


def with_plugin_excerpt() -> bytes:
    with open(EXCERPT, "rb") as handle:
        return handle.read()


def reference_get_device_name(pci_ids: bytes | list[str], device_id: str) -> str:
    """getDeviceName of v1.6.0 written out again, line by line, as the test's own reference
    (``pci_ids`` the file, or its lines)."""
    lines = pci_ids.decode("utf-8").split("\n") if isinstance(pci_ids, bytes) else pci_ids
    i = next((n for n, line in enumerate(lines) if line.startswith("10de")), None)
    if i is None:
        return ""
    prefix = "\t" + device_id
    # The first line, comments skipped, that is the next vendor's (no tab) or starts with the prefix.
    line = next((line for line in itertools.islice(lines, i + 1, None)
                 if not line.startswith("#") and (not line.startswith("\t") or line.startswith(prefix))), "")
    if not line.startswith(prefix):
        return ""
    name = line.removesuffix("\r")[len(prefix):].strip(" \t\n\r\f\v").upper().replace("/", "_").replace(".", "_")
    return re.sub(r"[^a-zA-Z0-9_.]+", "", re.sub(r"[ \t\n\r\f]+", "_", name))


# --- the names: the plugin's algorithm over its table ----------------------------------------------

def test_the_shipped_table_is_the_plugins_pci_ids_through_its_algorithm():
    data = with_plugin_excerpt()
    assert b"#\tVersion: 2025.07.11\n" in data  # utils/pci.ids of the plugin's v1.6.0
    names = bundled()
    assert (names.version, names.date) == ("2025.07.11", "2025-07-11 03:15:02")
    assert "v1.6.0" in names.source
    ids = re.findall(rb"^\t([0-9a-f]{4})  ", data.split(b"\n10de  NVIDIA Corporation\n")[1].split(b"\n10df ")[0],
                     re.M)
    assert len(ids) == len(set(ids)) == 1931  # every NVIDIA device line of the 2025.07.11 file
    assert list(names.table) == [i.decode() for i in ids]
    for device in names.table:
        assert names.name(device) == device_name(data, device), device
        assert names.resource(device) == f"nvidia.com/{device_name(data, device) or device}"
    # The scan itself against the test's own literal reference: every fifth id (the reference is a
    # linear scan per id, seconds for all of them) and the ones the research names.
    lines = data.decode("utf-8").split("\n")
    for device in list(names.table)[::5] + ["2330", "22a3", "2335", "2342", "2901", "05be", "24fa", "25f9"]:
        assert device_name(data, device) == reference_get_device_name(lines, device), device
    # The committed table is what the generator writes from the excerpt (tests/make_plugin_names.py).
    with open(table_path(), encoding="utf-8") as handle:
        assert handle.read() == table_text(data)


@pytest.mark.parametrize("device, resource", [
    ("2330", "nvidia.com/GH100_H100_SXM5_80GB"),
    ("22a3", "nvidia.com/GH100_H100_NVSWITCH"),
    ("2335", "nvidia.com/GH100_H200_SXM_141GB"),
    ("2342", "nvidia.com/GH100_GH200_120GB___480GB"),  # "120GB / 480GB": three underscores
    ("2901", "nvidia.com/GB100_B200"),
    ("1eb8", "nvidia.com/TU104GL_TESLA_T4"),  # not TU104GL_Tesla_T4, as the repository's example says
    ("ffff", "nvidia.com/ffff"),  # no line: the id
])
def test_known_names_of_the_research(device, resource):
    assert bundled().resource(device) == resource


def test_three_names_of_the_table_are_not_resource_names():
    names = bundled()
    invalid = sorted(d for d in names.table if not valid_resource_name(names.resource(d)))
    assert invalid == ["05be", "24fa", "25f9"]  # 81 characters; two ending in "_"
    assert len(names.resource("05be").partition("/")[2]) == 81
    assert names.resource("24fa").endswith("EMBEDDED_GPU_")
    assert valid_resource_name("nvidia.com/GRID_T4-1Q") and not valid_resource_name("nvidia.com/")


@pytest.mark.parametrize("device, name", [
    # The plugin's own getDeviceName tests (device_plugin_test.go).
    ("118a", "GK104GL_GRID_K520"), ("118d", "GK104GL_GRID_K520"), ("118e", "GK104_GL_GRID_K__520"),
    ("2331", "GH100_H100_PCIE"),  # Intel's 2331 comes first, in another vendor's block
    ("abcd", ""), ("118c", ""),
])
def test_the_plugins_own_cases(device, name):
    assert device_name(PLUGIN_TEST_IDS, device) == name == reference_get_device_name(PLUGIN_TEST_IDS, device)


@pytest.mark.parametrize("rest, name", [
    ("  A\vB", "AB"),  # RE2's \s has no \v: no "_", and \v is then dropped
    ("  A \x1c", "A_"),  # TrimSpace keeps \x1c (Python's strip would not); then it is dropped
    ("  Stra\u00dfe [x]", "STRAE_X"),  # ToUpper maps one rune to one: "ß" stays and is dropped
    ("  \u0131x", "IX"),  # dotless i upper-cases to ASCII I
    ("  a\u00a0b ", "AB"),  # NBSP is no RE2 space, not trimmed inside: dropped
    ("  [H100 NVSwitch] (rev a1), x+y", "H100_NVSWITCH_REV_A1_XY"),
])
def test_go_string_semantics(rest, name):
    assert derive(rest) == name


def test_the_scanner_rules():
    assert device_name(b"10de  NVIDIA\r\n\t2330  GH100 [H100]\r\n", "2330") == "GH100_H100"  # CR dropped
    assert device_name(b"10de  NVIDIA\n# 2330\n\t\t10de 2330  Sub\n\t2330  X\n", "2330") == "X"
    assert device_name(b"10de  NVIDIA\n\t" + b"a" * 70000 + b"\n\t2330  X\n", "2330") == ""  # ErrTooLong
    assert device_name(b"8086  Intel\n\t2330  X\n", "2330") == ""  # no NVIDIA block
    assert device_name(b"10de  NVIDIA\n\t2331  A\n10df  E\n\t2330  B\n", "2330") == ""  # the next vendor ends it


@pytest.mark.parametrize("key", ["", "2", "23", "233", "2330", "1EB8", "GRID_T4-1Q", "nvidia-222"])
def test_the_table_answers_as_the_file_would(key):
    """A vGPU key goes through getDeviceName too: a key that begins an id finds that line."""
    data = with_plugin_excerpt()
    assert bundled().name(key) == device_name(data, key) == reference_get_device_name(data, key)


def test_vgpu_names_as_the_plugin_forms_them():
    # readVgpuIDFromFileFunc: newlines trimmed, whitespace runs to "_", case kept (device_plugin_test.go).
    assert vgpu_key("GRID P100X-1B\n") == "GRID_P100X-1B"
    assert bundled().vgpu_resource("GRID T4-1Q\n") == "nvidia.com/GRID_T4-1Q"
    assert bundled().vgpu_resource("NVIDIA  A100-4C") == "nvidia.com/NVIDIA_A100-4C"


@pytest.mark.parametrize("name, device, resource", [
    ("GK104GL [GRID K520]", "118a", "nvidia.com/GK104GL_GRID_K520"),
    ("gk104.gl [grid/k./520]", "118a", "nvidia.com/GK104_GL_GRID_K__520"),
    ("GH100 [H100 SXM5 80GB]", "2330", "nvidia.com/GH100_H100_SXM5_80GB"),
    ("GH100[H100 SXM5 80GB]", "2330", "nvidia.com/GH100H100_SXM5_80GB"),  # Debian 12's spelling
    (None, "2335", "nvidia.com/2335"),
    ("  ", "2335", "nvidia.com/2335"),
])
def test_resource_name_of_a_pci_ids_name(name, device, resource):
    assert plugin_resource_name(name, device) == resource


# --- the export -----------------------------------------------------------------------------------

H100, H100B, SWITCH, T4, A4500 = "0000:41:00.0", "0000:42:00.0", "0000:43:00.0", "0000:82:00.0", "0000:61:00.0"
MDEV = "0d2f9b9e-7a2f-4c35-9c4e-3f1a2b3c4d5e"


def make_mdev(b: HostBuilder, parent: str, type_id: str, uuid: str) -> None:
    """An mdev as drivers/vfio/mdev/mdev_sysfs.c makes it: under its parent, mdev_type linked to
    its type, /sys/bus/mdev/devices/<uuid> linked to it."""
    parent_dir = os.path.realpath(os.path.join(b.root, "sys", "bus", "pci", "devices", parent))
    mdev = os.path.join(parent_dir, uuid)
    os.makedirs(mdev)
    os.symlink(os.path.join("..", "mdev_supported_types", type_id), os.path.join(mdev, "mdev_type"))
    bus = os.path.join(b.root, "sys", "bus", "mdev", "devices")
    os.makedirs(bus, exist_ok=True)
    os.symlink(os.path.relpath(mdev, bus), os.path.join(bus, uuid))


@pytest.fixture
def hgx(tmp_path, monkeypatch):
    """Two H100 SXM5 and an NVSwitch on vfio-pci, an A4500 embedded (a name the plugin cannot
    register) on vfio-pci, a T4 on the vGPU host driver with one GRID T4-1Q instance; the host's
    pci.ids is Debian 12's."""
    ids = tmp_path / "host-pci.ids"
    ids.write_text(DEBIAN12_IDS)
    monkeypatch.setenv("GPUVFIO_PCI_IDS", str(ids))
    b = HostBuilder(str(tmp_path / "host"))
    b.iommu("intel")
    b.numa_node(0, list(range(8)), 64)
    rb = b.root_bus(numa=0)
    for address in (H100, H100B):
        b.function(rb, address, "10de", "2330", "030200", driver="vfio-pci", bars=[(1, 128 * GiB, BAR64_PREF)])
    b.function(rb, SWITCH, "10de", "22a3", "068000", driver="vfio-pci")
    b.function(rb, A4500, "10de", "24fa", "030000", driver="vfio-pci")
    t4 = b.function(rb, T4, "10de", "1eb8", "030200", driver="nvidia")
    b.mdev_types(t4, [("nvidia-222", "GRID T4-1B", 2, "1 GB"), ("nvidia-223", "GRID T4-1Q", 1, "1 GB")])
    make_mdev(b, T4, "nvidia-223", MDEV)
    return b.root


def apply_json_patch(document: dict, patch: list[dict]) -> dict:
    """RFC 6902 ``add`` as kubectl's JSON patch applies it: the parent must exist; "-" appends."""
    doc = copy.deepcopy(document)
    for op in patch:
        assert op["op"] == "add"
        *parents, last = op["path"].lstrip("/").split("/")
        node = doc
        for part in parents:
            node = node[part]  # a KeyError: the path does not exist, the patch is refused
        assert last == "-" and isinstance(node, list)
        node.append(op["value"])
    return doc


def test_the_patch_adds_gpus_nvswitches_and_vgpus_with_the_plugins_names(cli, hgx):
    result = cli("--root", hgx, "export", "kubevirt")
    assert result.code == 0, result.err
    patch = yaml.safe_load(result.out)
    cluster = {"spec": {"configuration": {"permittedHostDevices": {
        "pciHostDevices": [{"pciVendorSelector": "10DE:1DB6", "resourceName": "nvidia.com/GV100GL_TESLA_V100_PCIE_32GB",
                            "externalResourceProvider": True}],
        "mediatedDevices": []}}}}
    lists = apply_json_patch(cluster, patch)["spec"]["configuration"]["permittedHostDevices"]
    # What the cluster had stays; the new entries follow it. The host's pci.ids (Debian 12: no 22a3,
    # GH100[H100...]) plays no part.
    assert lists["pciHostDevices"] == [
        cluster["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"][0],
        {"pciVendorSelector": "10DE:22A3", "resourceName": "nvidia.com/GH100_H100_NVSWITCH",
         "externalResourceProvider": True},
        {"pciVendorSelector": "10DE:2330", "resourceName": "nvidia.com/GH100_H100_SXM5_80GB",
         "externalResourceProvider": True}]
    assert lists["mediatedDevices"] == [{"mdevNameSelector": "GRID T4-1Q", "resourceName": "nvidia.com/GRID_T4-1Q",
                                         "externalResourceProvider": True}]
    comments = "\n".join(line for line in result.out.splitlines() if line.startswith("#"))
    assert "--type json" in comments and "2025.07.11" in comments
    assert "nvidia.com/GH100_H100_NVSWITCH (NVSwitches, other functions) under spec.domain.devices.hostDevices" \
        in comments and "HostDevices feature gate" in comments
    assert "not exported: 10DE:24FA" in comments and "GA104_RTX_A4500_EMBEDDED_GPU_" in comments
    data = cli("--root", hgx, "export", "kubevirt", "--json").json()
    assert data["featureGates"] == ["HostDevices"]
    assert data["requests"] == {"gpus": ["nvidia.com/GH100_H100_SXM5_80GB", "nvidia.com/GRID_T4-1Q"],
                                "hostDevices": ["nvidia.com/GH100_H100_NVSWITCH"]}
    assert data["names"] == {"source": "NVIDIA/kubevirt-gpu-device-plugin v1.6.0's bundled pci.ids",
                             "version": "2025.07.11", "date": "2025-07-11 03:15:02"}
    assert data["patch"] == patch and data["devices"] == [H100, H100B, SWITCH, A4500]
    assert [x["what"] for x in data["leftOut"]] == ["10DE:24FA"]


def test_the_cr_fragment_says_it_replaces(cli, hgx):
    result = cli("--root", hgx, "export", "kubevirt", "--format", "cr", "--provider", "kubevirt")
    assert result.code == 0, result.err
    doc = yaml.safe_load(result.out)
    assert doc["apiVersion"] == "kubevirt.io/v1" and doc["kind"] == "KubeVirt"
    lists = doc["spec"]["configuration"]["permittedHostDevices"]
    # KubeVirt's own plugin: no externalResourceProvider (omitempty), and a name Kubernetes takes for
    # the A4500 whose plugin name ends in "_".
    assert lists["pciHostDevices"] == [
        {"pciVendorSelector": "10DE:22A3", "resourceName": "nvidia.com/GH100_H100_NVSWITCH"},
        {"pciVendorSelector": "10DE:2330", "resourceName": "nvidia.com/GH100_H100_SXM5_80GB"},
        {"pciVendorSelector": "10DE:24FA", "resourceName": "nvidia.com/GA104_RTX_A4500_EMBEDDED_GPU"}]
    assert lists["mediatedDevices"] == [{"mdevNameSelector": "GRID T4-1Q", "resourceName": "nvidia.com/GRID_T4-1Q"}]
    assert "REPLACES the cluster's whole pciHostDevices, mediatedDevices list(s)" in result.out


def test_another_plugin_image_through_pci_ids(cli, hgx, tmp_path):
    image_ids = tmp_path / "image-pci.ids"
    image_ids.write_text(DEBIAN12_IDS)
    data = cli("--root", hgx, "export", "kubevirt", SWITCH, H100, "--pci-ids", str(image_ids), "--json").json()
    assert [e["resourceName"] for e in data["permittedHostDevices"]["pciHostDevices"]] == [
        "nvidia.com/22a3", "nvidia.com/GH100H100_SXM5_80GB"]
    assert data["names"]["source"] == f"the pci.ids file {image_ids}" and data["names"]["version"] is None
    assert any("has no name for device 22a3" in note for note in data["notes"])
    assert data["devices"] == [H100, SWITCH]
    assert cli("--root", hgx, "export", "kubevirt", "--pci-ids", str(tmp_path / "none")).code == 2
    (tmp_path / "not-ids").write_text("8086  Intel\n")
    bad = cli("--root", hgx, "export", "kubevirt", "--pci-ids", str(tmp_path / "not-ids"))
    assert bad.code == 2 and "not a pci.ids" in bad.err


def test_vgpu_types_asked_for(cli, hgx):
    data = cli("--root", hgx, "export", "kubevirt", T4, "--vgpu-type", "nvidia-222", "--vgpu-type",
               "NVIDIA A10-2Q", "--json").json()
    assert data["permittedHostDevices"] == {"mediatedDevices": [
        {"mdevNameSelector": "GRID T4-1Q", "resourceName": "nvidia.com/GRID_T4-1Q", "externalResourceProvider": True},
        {"mdevNameSelector": "GRID T4-1B", "resourceName": "nvidia.com/GRID_T4-1B", "externalResourceProvider": True},
        {"mdevNameSelector": "NVIDIA A10-2Q", "resourceName": "nvidia.com/NVIDIA_A10-2Q",
         "externalResourceProvider": True}]}
    assert data["leftOut"] == [{"what": T4, "reason": "it hosts vGPU instances: their types are exported instead"}]
    assert any("'NVIDIA A10-2Q': no GPU of this host offers it" in note for note in data["notes"])
    unknown = cli("--root", hgx, "export", "kubevirt", "--vgpu-type", "nvidia-999")
    assert unknown.code == 2 and "no GPU of this host offers mdev type nvidia-999" in unknown.err


def test_an_empty_export_is_refused(cli, hgx):
    none = cli("--root", sample_path("dgx-h100"), "export", "kubevirt")  # no NVIDIA function on vfio-pci
    assert none.code == 1 and none.out == ""
    assert none.err.count("\n") == 1 and "nothing to export: no NVIDIA GPU or NVSwitch is on vfio-pci" in none.err
    # Only a name the plugin cannot register: refused with that reason, not an empty list.
    only_invalid = cli("--root", hgx, "export", "kubevirt", A4500)
    assert only_invalid.code == 1 and "10DE:24FA: the plugin's name nvidia.com/GA104_RTX_A4500_EMBEDDED_GPU_" \
        in only_invalid.err and only_invalid.out == ""
    foreign = cli("--root", sample_path("dgx-h100"), "export", "kubevirt", "0000:08:00.0")  # the BMC's VGA
    assert foreign.code == 2 and "not an NVIDIA device" in foreign.err


def test_named_devices_not_on_vfio_are_said(cli):
    result = cli("--root", sample_path("dgx-h100"), "export", "kubevirt", "-d", "10de::0302")
    assert result.code == 0, result.err
    (op,) = yaml.safe_load(result.out)
    assert op["value"] == {"pciVendorSelector": "10DE:2330", "resourceName": "nvidia.com/GH100_H100_SXM5_80GB",
                           "externalResourceProvider": True}
    comments = [line for line in result.out.splitlines() if line.startswith("#")]
    assert any("a subset of identical GPUs" in line for line in comments)
    assert any("not on vfio-pci" in line and "0000:1b:00.0" in line for line in comments)
    one = cli("--root", sample_path("dgx-h100"), "export", "kubevirt", "1b:00.0", "--json").json()
    assert one["devices"] == ["0000:1b:00.0"]
    assert any("7 more on this host" in note for note in one["notes"])


def test_plugin_names_from_a_file_use_the_same_function(tmp_path):
    path = tmp_path / "pci.ids"
    path.write_bytes(PLUGIN_TEST_IDS)
    names = kubevirt_names.from_pci_ids(str(path))
    assert isinstance(names, PluginNames) and names.resource("118e") == "nvidia.com/GK104_GL_GRID_K__520"
    assert names.resource("2331") == "nvidia.com/GH100_H100_PCIE"
    assert nvidia_device_lines(with_plugin_excerpt())["2330"] == "GH100_H100_SXM5_80GB"


# --- DRA attributes -------------------------------------------------------------------------------

def test_dra_attributes_have_the_standard_names_and_shapes(cli):
    data = cli("--root", sample_path("dgx-h100"), "export", "attributes").json()
    assert len(data["devices"]) == 8
    for device in data["devices"]:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", device["name"]) and len(device["name"]) <= 63
        attrs = device["attributes"]
        for name, value in attrs.items():
            domain, _, ident = name.rpartition("/")
            assert re.fullmatch(r"[a-z0-9.-]+", domain) and re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,31}", ident)
            assert len(value) == 1 and next(iter(value)) in ("string", "int", "bool", "version")
            if "string" in value:
                assert len(value["string"]) <= 64
        # deviceattribute: pciBusID a lower-case extended BDF; pcieRoot pci<domain>:<bus>.
        bus_id = attrs["resource.kubernetes.io/pciBusID"]["string"]
        assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]", bus_id)
        assert re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", attrs["resource.kubernetes.io/pcieRoot"]["string"])
        assert attrs["gpuvfio.invalid/numaNode"]["int"] in (0, 1)
        assert attrs["gpuvfio.invalid/bar1Bytes"]["int"] >= 64 << 30


def test_dra_attributes_are_typed(hgx):
    result = attributes(Context(host=HostRoot(hgx)), [PciAddress.parse(H100)])
    assert isinstance(result, DraAttributes)
    (device,) = result.devices
    values = {a.name: a.value for a in device.attributes}
    assert values["resource.kubernetes.io/pciBusID"] == H100 and values["gpuvfio.invalid/bar1Bytes"] == 128 * GiB
    assert result.to_json()["devices"][0]["attributes"]["gpuvfio.invalid/numaNode"] == {"int": 0}


def test_pcie_root_is_the_first_component_under_sys_devices(cli, tmp_path):
    """As deviceattribute's resolvePCIeRoot derives it: the sysfs link's first component below
    devices/ (on a host with a second root complex, not pci0000:00)."""
    from tests.unit.test_layout import switch_host

    b = switch_host(tmp_path)
    data = cli("--root", b.root, "export", "attributes", "9a:00.0", "18:00.0").json()
    got = {d["attributes"]["resource.kubernetes.io/pciBusID"]["string"]:
           d["attributes"]["resource.kubernetes.io/pcieRoot"]["string"] for d in data["devices"]}
    for bus_id, root in got.items():
        real = os.path.realpath(os.path.join(b.root, "sys", "bus", "pci", "devices", bus_id))
        first = os.path.relpath(real, os.path.join(b.root, "sys", "devices")).split(os.sep)[0]
        assert root == first
    assert got == {"0000:18:00.0": "pci0000:15", "0000:9a:00.0": "pci0000:97"}
    # Two L40S under one switch with ACS: one P2P clique they share
    clique = cli("--root", b.root, "export", "attributes", "18:00.0", "19:00.0").json()
    assert {d["attributes"]["gpuvfio.invalid/p2pClique"]["int"] for d in clique["devices"]} == {0}
