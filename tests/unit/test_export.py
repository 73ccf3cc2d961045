"""Kubernetes hand-offs (issue 15 item 9): KubeVirt's permittedHostDevices with the resource names
NVIDIA's kubevirt-gpu-device-plugin registers, and DRA device attributes, checked by parsing and
against the shapes KubeVirt's API types and the DRA deviceattribute package define."""

from __future__ import annotations

import os
import re

import pytest

from gpuvfio.ops.export import plugin_resource_name
from tests.make_samples import sample_path

yaml = pytest.importorskip("yaml")  # PyYAML comes with ansible-core in the test venv

PCI_IDS = "10de  NVIDIA Corporation\n\t2330  GH100 [H100 SXM5 80GB]\n\t22a3  GH100 [H100 NVSwitch]\n"


@pytest.mark.parametrize("name, device, resource", [
    # The plugin's own unit tests (device_plugin_test.go, getDeviceName) and pci.ids names.
    ("GK104GL [GRID K520]", "118a", "nvidia.com/GK104GL_GRID_K520"),
    ("gk104.gl [grid/k./520]", "118a", "nvidia.com/GK104_GL_GRID_K__520"),
    ("GH100 [H100 PCIe]", "2331", "nvidia.com/GH100_H100_PCIE"),
    ("GH100 [H100 SXM5 80GB]", "2330", "nvidia.com/GH100_H100_SXM5_80GB"),
    ("AD102 [GeForce RTX 4090]", "2684", "nvidia.com/AD102_GEFORCE_RTX_4090"),
    ("TU104GL [Tesla T4] (rev a1), x+y", "1eb8", "nvidia.com/TU104GL_TESLA_T4_REV_A1_XY"),
    (None, "2335", "nvidia.com/2335"),  # no name in pci.ids: the device id
    ("  ", "2335", "nvidia.com/2335"),
])
def test_resource_names_as_the_plugin_forms_them(name, device, resource):
    assert plugin_resource_name(name, device) == resource


@pytest.fixture
def dgx_ids(tmp_path, monkeypatch):
    path = tmp_path / "pci.ids"
    path.write_text(PCI_IDS)
    monkeypatch.setenv("GPUVFIO_PCI_IDS", str(path))
    return sample_path("dgx-h100")


def test_kubevirt_export_parses_as_the_kubevirt_cr(cli, dgx_ids):
    result = cli("--root", dgx_ids, "export", "kubevirt", "-d", "10de::0302")
    assert result.code == 0, result.err
    doc = yaml.safe_load(result.out)
    assert doc["apiVersion"] == "kubevirt.io/v1" and doc["kind"] == "KubeVirt"
    (entry,) = doc["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"]
    # kubevirt.io/api core/v1 PciHostDevice: these three fields, the selector VENDOR:DEVICE.
    assert set(entry) == {"pciVendorSelector", "resourceName", "externalResourceProvider"}
    assert entry == {"pciVendorSelector": "10DE:2330", "resourceName": "nvidia.com/GH100_H100_SXM5_80GB",
                     "externalResourceProvider": True}
    comments = [line for line in result.out.splitlines() if line.startswith("#")]
    assert any("a subset of identical GPUs" in line for line in comments)
    assert any("not on vfio-pci" in line and "0000:1b:00.0" in line for line in comments)
    # One GPU named: the other seven of its pair are said to follow it.
    one = cli("--root", dgx_ids, "export", "kubevirt", "1b:00.0", "--json").json()
    assert one["devices"] == ["0000:1b:00.0"]
    assert any("7 more on this host" in note for note in one["notes"])


def test_kubevirt_export_of_nothing_and_of_a_foreign_device(cli, dgx_ids):
    none = cli("--root", dgx_ids, "export", "kubevirt")  # no NVIDIA GPU on vfio-pci in the sample
    assert none.code == 0
    assert yaml.safe_load(none.out)["spec"]["configuration"]["permittedHostDevices"] == {"pciHostDevices": []}
    foreign = cli("--root", dgx_ids, "export", "kubevirt", "0000:08:00.0")  # the BMC's VGA
    assert foreign.code == 2 and "not an NVIDIA device" in foreign.err


def test_dra_attributes_have_the_standard_names_and_shapes(cli, dgx_ids):
    data = cli("--root", dgx_ids, "export", "attributes").json()
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
