"""Messages that say what really happened (issue 40, item 7): the reason a note gives is the one
that holds for the command line given."""

from __future__ import annotations

import re

import pytest

from gpuvfio.sizes import pages_text
from tests.hostbuilder import HostBuilder
from tests.make_samples import host_tree


@pytest.fixture(scope="module")
def switch_host(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pcie-switch"))
    host_tree("pcie-switch", root)
    return root


@pytest.mark.parametrize("connect, why, ask", [
    ((), "no libvirt connection", "pass --qemu-version or --connect"),
    (("--connect", "test:///default"), "the libvirt connection is not to QEMU",
     "pass --qemu-version or --connect a qemu:// URI"),
])
def test_an_unknown_qemu_version_says_why(cli, switch_host, connect, why, ask):
    """Two GPUs behind one switch would get a P2P clique; without QEMU's version it is left out,
    and the note says whether libvirt was asked at all (the test driver answers, but not for QEMU)."""
    result = cli("--root", switch_host, "xml", "18:00.0", "19:00.0", "--name", "p2p", *connect)
    note = " ".join(result.err.split())
    assert result.code == 0, result.err
    said = rf"QEMU version unknown \({re.escape(why)}\): P2P cliques left out, [^;]*; {re.escape(ask)}(?: gpuvfio:|$)"
    assert re.search(said, note), note


@pytest.mark.parametrize("kib, text", [(None, "4K pages"), (0, "4K pages"), (2048, "2M hugepages"),
                                       (1048576, "1G hugepages"), (64, "64K hugepages"), (16 * 1048576, "16G hugepages")])
def test_page_sizes_are_written_as_hugepages_takes_them(kib, text):
    assert pages_text(kib) == text


def test_an_attach_plan_speaks_of_its_pages_and_new_domain_as_to_be_done(cli, switch_host, tmp_path):
    """A dry run showed "1048576 KiB hugepages" where doctor and --hugepages say 1G, and "defined
    new" for a domain nothing had defined yet."""
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"\0" * 64)
    result = cli("--root", switch_host, "attach", "18:00.0", "--name", "p2p", "--dry-run", "--connect",
                 "test:///default", "--kernel", str(kernel), "--user-net-ssh-port", "2222", "--hugepages", "1G")
    plan = " ".join(result.out.split())
    assert "Placement: 1G hugepages" in plan and "KiB" not in plan.split("Placement:")[1].split(",")[0], plan
    assert "no domain p2p yet: the run defines it" in plan and "defined new" not in plan
    assert "Domain: new, none of that name in libvirt" in plan


@pytest.mark.parametrize("sample", ["pcie-switch", "dgx-h100"])
def test_topo_names_each_device_as_list_does(cli, tmp_path, sample):
    """topo said "device [10de:26b9]" for a GPU pci.ids does not name, where list says "3D
    controller [10de:26b9]" (its class), and "bridge" names for NVSwitches."""
    host_tree(sample, str(tmp_path))
    listed = {}
    for line in cli("--root", str(tmp_path), "list", "--all").out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", cells[0]):
            listed[cells[0]] = cells[1]
    shown = re.findall(r"^\s+[A-Z]+\d+:\s+(\S+)\s+(.+) \([^()]*\)$", cli("--root", str(tmp_path), "topo").out, re.M)
    assert shown and all(listed[address] == name for address, name in shown), (shown, listed)
    assert not any(name.startswith("device [") for _address, name in shown)


@pytest.mark.parametrize("args, value, words", [
    (("xml", "0000:01:00.0", "--name", "x", "--vcpus"), "abc", "'abc' is not a whole number"),
    (("xml", "0000:01:00.0", "--name", "x", "--vcpus"), "١٢", "'١٢' is not a whole number"),
    (("xml", "0000:01:00.0", "--name", "x", "--vcpus"), "1e3", "'1e3' is not a whole number"),
    (("qualify", "0000:01:00.0", "--connect", "none", "--cycles"), "two", "'two' is not a whole number"),
    (("verify", "--ssh-host", "127.0.0.1", "--connect", "none", "--ssh-timeout"), "soon", "'soon' is not a number"),
    (("verify", "--ssh-host", "127.0.0.1", "--connect", "none", "--ssh-timeout"), "nan", "'nan' is not a number"),
])
def test_a_number_option_given_words_says_so_in_gpuvfios_words(cli, tmp_path, args, value, words):
    """typer parsed numbers through pydantic: "Input should be a valid integer, unable to parse
    string as an integer", and took nan for a float."""
    host_tree("workstation", str(tmp_path))
    result = cli("--root", str(tmp_path), *args, value)
    assert result.code == 2 and result.out == "", result.err
    (line,) = result.err.splitlines()
    assert words in line and "Input should be" not in line, line


def _nic_only_host(root) -> str:
    b = HostBuilder(str(root))
    b.iommu("intel", 1)
    b.cpuinfo("Intel(R) Xeon(R)", 46)
    b.numa_node(0, b.cpu_topology(1, 2, 1)[0], 8, {})
    rb = b.root_bus(numa=0)
    b.function(rb, "0000:00:00.0", "8086", "a700", "060000")
    b.function(rb, "0000:00:19.0", "8086", "15f3", "020000", driver="igc")
    return str(root)


@pytest.mark.parametrize("args, said", [
    (("list",), "no NVIDIA device on this host (gpuvfio list --all lists every PCI function)"),
    (("status",), "gpuvfio holds no device (its journal records none)"),
    (("persist", "--list"), "no boot-time driver override on this host"),
])
def test_an_empty_listing_says_so(cli, tmp_path, monkeypatch, args, said):
    """A bare header said nothing: an empty status, persist --list, or list on a host without an
    NVIDIA GPU. The header stays (a data line format, as lspci keeps it), the words go to stderr;
    CSV stays data only."""
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    root = _nic_only_host(tmp_path / "host")
    result = cli("--root", root, *args, "--format", "plain")
    assert result.code == 0 and len(result.out.splitlines()) == 1, result.out
    assert result.err.splitlines() == [said], result.err
    csv = cli("--root", root, *args, "--format", "csv")
    assert csv.code == 0 and len(csv.out.splitlines()) == 1 and said not in csv.out + csv.err
