"""The inventory on generated hosts: the same answers as before it learnt to read only what it
shows, on every sample and generated host, and nothing read whole that is not shown.

The goldens (tests/golden/reports/generated.json) were written by the inventory that read every
function whole: a small SR-IOV server whole, the 2,119-function one (16 ConnectX-7 PFs x 127
VFs, 8 GPUs, 4 NVSwitches: benchmarks/bench_inventory.py's host) as a digest of each report.
"""

import hashlib
import json
import os

import pytest

from gpuvfio.ops.context import Context
from gpuvfio.errors import InputError
from gpuvfio.host.fixture import load_fixture
from gpuvfio.host.inventory import FunctionIndex, read_inventory
from gpuvfio.host.pciids import PciIds
from gpuvfio.host.root import HostRoot
from gpuvfio.ops.inventory import inventory_report, list_report
from gpuvfio.ops.selection import resolve
from tests.hostbuilder import build_sriov_server
from tests.make_samples import REPO, SAMPLES, sample_path
from tests.unit.test_samples import PCI_IDS

GOLDEN = os.path.join(REPO, "tests", "golden", "reports", "generated.json")
REPORTS = {
    "list": ["list", "--json"],
    "list --all": ["list", "--all", "--json"],
    "list -d 10de:": ["list", "-d", "10de:", "--json"],
    "list -d 15b3:101e": ["list", "-d", "15b3:101e", "--json"],
    "list -d ::0302": ["list", "-d", "::0302", "--json"],
    "list slot": ["list", "12:00", "--json"],
    "list addresses": ["list", "0000:12:00.0", "0000:13:00.3", "0000:7e:00.0", "--json"],
    "list --all slot": ["list", "--all", "0000:13:00", "--json"],
    "list unknown": ["list", "0000:ee:00.0", "--json"],
    "doctor": ["doctor", "--json"],
    "topo": ["topo", "--json"],
}
HOSTS = {"small": {"switches_per_socket": 1, "nic_vfs": 6}, "large": {}}


def _built(factory, name: str) -> str:
    root = str(factory.mktemp(f"sriov-{name}"))
    build_sriov_server(root, **HOSTS[name])
    return root


@pytest.fixture(scope="module")
def small_root(tmp_path_factory):
    return _built(tmp_path_factory, "small")


@pytest.fixture(scope="module")
def large_root(tmp_path_factory):
    return _built(tmp_path_factory, "large")


@pytest.fixture
def pci_ids(tmp_path, monkeypatch):
    (tmp_path / "pci.ids").write_text(PCI_IDS)
    monkeypatch.setenv("GPUVFIO_PCI_IDS", str(tmp_path / "pci.ids"))
    monkeypatch.delenv("GPUVFIO_STATE_DIR", raising=False)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_generated_hosts_answer_as_before(small_root, large_root, cli, pci_ids, regenerate):
    """Every report of both hosts, as the inventory that read everything whole printed it: the
    small host's JSON whole, the large one's as (exit, size, sha256) of its output."""
    got = {}
    for name, root in (("small", small_root), ("large", large_root)):
        got[name] = {}
        for key, args in REPORTS.items():
            result = cli("--root", root, *args)
            if name == "small":
                got[name][key] = {"exit": result.code, "json": result.json() if result.out else None}
            else:
                got[name][key] = {"exit": result.code, "bytes": len(result.out), "sha256": _digest(result.out)}
    if regenerate or not os.path.exists(GOLDEN):
        with open(GOLDEN, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(got, indent=1) + "\n")
        if not regenerate:
            pytest.fail(f"golden file {GOLDEN} was missing and has been written; review and commit it")
    with open(GOLDEN, encoding="utf-8") as handle:
        expected = json.load(handle)
    for name in HOSTS:
        for key in REPORTS:
            assert got[name][key] == expected[name][key], f"{name} host: {key} differs from {GOLDEN}"
    large = got["large"]
    assert large["list --all"]["exit"] == 0 and large["list --all"]["bytes"] > 2_000_000
    assert large["list unknown"]["exit"] == 2


def _selections(root: str) -> list[tuple[list[str] | None, list[str] | None, bool]]:
    """Every kind of selection a list takes on this host: none, each slot, each -d filter, an
    exact address, with and without --all."""
    host = HostRoot(root)
    index = FunctionIndex(host)
    slots = sorted({f"{a.bus:02x}:{a.slot:02x}" for a in index.addresses})
    picks = [(None, None), (None, ["10de:"]), (None, ["::0302"]), (None, ["15b3:", "144d:"]),
             ([str(index.addresses[0])], None)] + [([slot], None) for slot in slots[:12]]
    return [(texts, ids, show_all) for texts, ids in picks for show_all in (False, True)]


@pytest.mark.parametrize("name", sorted(SAMPLES) + ["generated"])
def test_the_light_path_is_the_whole_read_filtered(name, small_root, tmp_path):
    """A list of some functions (the ids of all, then the chosen ones whole) equals the report of
    the inventory read whole and filtered: functions, fields and groups with their verdicts."""
    if name == "generated":
        root = small_root
    else:
        with open(sample_path(name), encoding="utf-8") as handle:
            root = load_fixture(handle.read(), str(tmp_path / name))
    names = PciIds.load(HostRoot(root))
    whole = read_inventory(HostRoot(root), names=names)
    for texts, ids, show_all in _selections(root):
        ctx = Context(host=HostRoot(root))
        index = FunctionIndex(ctx.host)
        try:
            only = resolve(ctx, texts, ids, index=index)
        except InputError:  # a slot of bridges only: nothing to list either way
            continue
        light = list_report(ctx, show_all=show_all, only=only, index=index).to_json()
        assert light == inventory_report(whole, show_all=show_all, only=only).to_json(), (texts, ids, show_all)


def test_list_reads_whole_only_what_it_shows(small_root, cli):
    """A FIFO in place of an attribute of a NIC VF (never a read that waits) is an error where
    the VF is shown, and not read at all where it is not: list of the GPUs, a -d of them."""
    root = small_root
    vf = os.path.join(root, "sys", "bus", "pci", "devices", "0000:13:00.1")
    real = os.path.realpath(vf)
    for attr in ("resource", "power_state"):
        saved = open(os.path.join(real, attr), "rb").read()
        os.unlink(os.path.join(real, attr))
        os.mkfifo(os.path.join(real, attr))
        try:
            for args in (["list", "--json"], ["list", "-d", "10de:", "--json"], ["list", "12:00", "--json"]):
                assert cli("--root", root, *args).code == 0, (attr, args)
            for args in (["list", "--all", "--json"], ["list", "0000:13:00.1", "--json"], ["list", "-d", "15b3:101e"]):
                result = cli("--root", root, *args)
                assert result.code == 2 and "FIFO" in result.err, (attr, args, result.err)
        finally:
            os.unlink(os.path.join(real, attr))
            with open(os.path.join(real, attr), "wb") as handle:
                handle.write(saved)
