"""The modules of the Ansible collection gpuvfio.gpuvfio (playbooks/collections/), in-process,
as Ansible's module-testing conventions run them (``ansible.module_utils.testing.
patch_module_args``, exit_json/fail_json captured): on the bundled sample hosts and on a small
built host whose sysfs writes a simulated kernel answers (tests/simkernel.py), and each
module's DOCUMENTATION held to its argument_spec and attributes. The playbooks, the role and the Vagrant box as users run them, with
the real ansible-playbook, ansible-lint and vagrant: tests/package/test_playbooks.py; the
collection built, installed, documented and sanity-tested: tests/package/test_collection.py.

Needs ansible-core in the venv. Without it the tests skip, except under ``make test``
(GPUVFIO_REQUIRE_LANES=1), where a missing tool fails them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = os.path.join(REPO, "gpuvfio", "samples")
MODULE_NAMES = ("facts", "device", "domain", "verify", "host_info")  # gpuvfio.gpuvfio.<name>

sys.path.insert(0, REPO)

from tests.conftest import ANSIBLE_COLLECTIONS, ANSIBLE_MODULES_DIR, need_tool  # noqa: E402

from tests.hostbuilder import BAR32, BAR64_PREF, GiB, HostBuilder, KiB, MiB  # noqa: E402


# -- module unit tests (in-process) ---------------------------------------------------------------

class ModuleExit(Exception):
    def __init__(self, failed: bool, result: dict) -> None:
        super().__init__(result.get("msg", ""))
        self.failed, self.result = failed, result


@pytest.fixture(scope="module")
def modules():
    """The collection's modules (by their short names), imported as Ansible would run them: the
    collection's module_utils as ansible_collections.gpuvfio.gpuvfio.plugins.module_utils."""
    need_tool(importlib.util.find_spec("ansible") is not None, "ansible-core")
    if ANSIBLE_COLLECTIONS not in sys.path:
        sys.path.insert(0, ANSIBLE_COLLECTIONS)
    loaded = {}
    for name in MODULE_NAMES:
        path = os.path.join(ANSIBLE_MODULES_DIR, f"{name}.py")
        spec = importlib.util.spec_from_file_location(f"_fleet_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        loaded[name] = module
    return loaded


@pytest.fixture
def run_module(modules, monkeypatch):
    """run_module(name, args, check=False, diff=False) -> (failed, result)."""
    from ansible.module_utils import basic

    try:
        from ansible.module_utils.testing import patch_module_args
    except ImportError:  # ansible-core < 2.19
        from ansible.module_utils.common.text.converters import to_bytes

        @contextlib.contextmanager
        def patch_module_args(args):
            saved = basic._ANSIBLE_ARGS
            basic._ANSIBLE_ARGS = to_bytes(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
            try:
                yield
            finally:
                basic._ANSIBLE_ARGS = saved

    def exit_json(self, **kwargs):
        kwargs.setdefault("changed", False)
        raise ModuleExit(False, kwargs)

    def fail_json(self, msg, **kwargs):
        raise ModuleExit(True, dict(kwargs, msg=msg, failed=True))

    monkeypatch.setattr(basic.AnsibleModule, "exit_json", exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", fail_json)
    monkeypatch.delenv("GPUVFIO_STATE_DIR", raising=False)

    def run(name, args, check=False, diff=False, context=None):
        """``context``: the gpuvfio Context factory the module's main takes (the simulated kernel,
        a shared libvirt test connection); the live one when None."""
        full = dict(args, _ansible_check_mode=check, _ansible_diff=diff)
        with patch_module_args(full):
            try:
                modules[name].main(*([context] if context is not None else []))
            except ModuleExit as done:
                return done.failed, done.result
        raise AssertionError(f"{name} returned without exit_json/fail_json")

    return run


GPU, AUDIO, NIC = "0000:01:00.0", "0000:01:00.1", "0000:03:00.0"


class BuiltHost:
    """A small host (GPU + audio behind a root port, a NIC elsewhere) whose sysfs writes a
    simulated kernel answers, and the Context factory that hands it to the modules."""

    def __init__(self, root: str, state: str, kernel) -> None:
        self.root, self.state, self.kernel = root, state, kernel
        from tests.contexts import SharedConnection

        self.libvirt = SharedConnection()

    def context(self, host):
        from tests.contexts import sim_context

        return sim_context(host, self.kernel, connect=lambda uri: self.libvirt)

    def __iter__(self):  # root, state, kernel = built_host
        return iter((self.root, self.state, self.kernel))


@pytest.fixture
def built_host(tmp_path):
    from tests.simkernel import SimKernel

    b = HostBuilder(str(tmp_path / "host"))
    b.iommu("intel", 1)
    cpus = b.cpu_topology(1, 4, 2)
    b.numa_node(0, cpus[0], 32)
    b.cpuinfo("Intel(R) Xeon(R)", 46)
    b.firmware()
    b.os_release("Debian GNU/Linux 12 (bookworm)", "debian")
    rb = b.root_bus(numa=0)
    group = b.new_group()
    port = b.bridge(rb, "0000:00:01.0", "8086", "a70d", secondary_bus=1, group=group)
    b.function(port, GPU, "10de", "2684", "030000", driver="nvidia", group=group, multifunction=True,
               bars=[(0, 16 * MiB, BAR32), (1, 32 * GiB, BAR64_PREF)], boot_vga=False)
    b.function(port, AUDIO, "10de", "22ba", "040300", driver="snd_hda_intel", group=group,
               bars=[(0, 16 * KiB, BAR32)])
    nic_port = b.bridge(rb, "0000:00:1c.0", "8086", "7a38", secondary_bus=3)
    b.function(nic_port, NIC, "8086", "15f3", "020000", driver="igc")
    b.modules(["nvidia", "snd_hda_intel", "igc"], available=["vfio-pci", "vfio_pci"])
    return BuiltHost(b.root, str(tmp_path / "state"), SimKernel(b.root))


@pytest.fixture
def guest_server(built_host, tmp_path):
    """This machine behind dropbear (tests/lanes/hypervisor.py) playing a guest whose probe reads the
    built host's tree (GPUVFIO_PROBE_ROOT): (server, its client private key)."""
    from tests.lanes import hypervisor as hv

    if hv.skip_reason():
        pytest.skip(hv.skip_reason())
    server = hv.start(str(tmp_path / "guest"), env={"GPUVFIO_PROBE_ROOT": built_host.root})
    try:
        with open(server.client_key) as handle:
            yield server, handle.read()
    finally:
        server.stop()


def _driver(root, address):
    link = os.path.join(root, "sys", "bus", "pci", "devices", address, "driver")
    return os.path.basename(os.readlink(link)) if os.path.islink(link) else None


def test_facts_module_reports_the_workstation_non_viable_group(run_module):
    root = os.path.join(SAMPLES, "workstation.host")
    for check in (False, True):
        failed, result = run_module("facts", {"root": root}, check=check)
        assert not failed, result
        assert result["changed"] is False
        summary = result["ansible_facts"]["gpuvfio"]["summary"]
        assert summary["gpu_count"] == 2
        assert summary["viable_groups"] == [1]
        (bad,) = summary["non_viable_groups"]
        assert bad["id"] == 6 and "0000:03:00.0" in bad["devices"]
        assert any("igc" in problem for problem in bad["problems"])
        assert result["ansible_facts"]["gpuvfio"]["doctor"]["checks"]


def test_facts_module_reports_eight_h100s_on_the_dgx(run_module):
    failed, result = run_module("facts", {"root": os.path.join(SAMPLES, "dgx-h100.host"),
                                                  "gather": ["devices"]})
    assert not failed, result
    facts = result["ansible_facts"]["gpuvfio"]
    summary = facts["summary"]
    assert summary["gpu_count"] == 8 and list(summary["gpu_models"].values()) == [8]
    assert "H100" in next(iter(summary["gpu_models"]))
    assert len(summary["viable_groups"]) == 8 and summary["non_viable_groups"] == []
    assert {g["numa_node"] for g in summary["gpus"]} == {0, 1}
    assert "doctor" not in facts and "status" not in facts


def test_facts_module_gives_the_reset_verdicts_a_fleet_shares(run_module, tmp_path):
    """Each GPU's verdict is the one of the method the kernel resets it by first (flr on the
    DGX's H100s); the state directory's verdicts come whole, and a damaged file says why."""
    from gpuvfio.host.reset_verdicts import Outcome, ResetVerdicts, Run

    verdicts = ResetVerdicts()
    verdicts.add("10de:2330", "flr", Run(Outcome.FAILED, "0000:1b:00.0", "dgx-01", "2026-12-06T10:00:00Z", 1,
                                         "its link trained to x8 after the reset, x16 before"))
    verdicts.add("10de:2330", "bus", Run(Outcome.PASSED, "0000:1b:00.0", "dgx-01", "2026-12-06T10:00:00Z", 3))
    state = tmp_path / "state"
    state.mkdir()
    (state / "reset-verdicts.json").write_text(verdicts.render())
    args = {"root": os.path.join(SAMPLES, "dgx-h100.host"), "gather": ["devices"], "state_dir": str(state)}
    failed, result = run_module("facts", args)
    assert not failed, result
    facts = result["ansible_facts"]["gpuvfio"]
    assert {g["reset"] for g in facts["summary"]["gpus"]} == {"failed"}
    assert facts["reset_verdicts"]["10de:2330"]["bus"]["verdict"] == "passed" and facts["reset_verdicts_error"] is None
    (state / "reset-verdicts.json").write_text("{")
    failed, result = run_module("facts", args)
    facts = result["ansible_facts"]["gpuvfio"]
    assert not failed and facts["reset_verdicts"] == {} and "not JSON" in facts["reset_verdicts_error"]
    assert {g["reset"] for g in facts["summary"]["gpus"]} == {None}


def test_facts_module_fails_with_gpuvfio_message(run_module, tmp_path):
    failed, result = run_module("facts", {"root": str(tmp_path / "nowhere")})
    assert failed and result["exit_code"] == 2
    assert "nowhere" in result["msg"]


def test_host_info_module_reads_a_sample_root(run_module, built_host, tmp_path):
    from gpuvfio.host.fixture import load_fixture

    root = tmp_path / "epyc"
    with open(os.path.join(SAMPLES, "epyc-mixed.host"), encoding="utf-8") as handle:
        load_fixture(handle.read(), str(root))
    failed, result = run_module("host_info", {"root": str(root), "paths": ["/etc/os-release", "/nope"],
                                                      "machine_paths": [sys.executable]})
    assert not failed, result
    assert result["os_family"] == "redhat" and "rhel" in result["os_ids"]
    assert result["cpu_vendor"] == "AuthenticAMD"
    assert result["kernel_release"].startswith("5.14.0")
    assert "amd_iommu=on" in result["cmdline"] and result["numa_nodes"] == [0, 1]
    assert result["nvidia_driver"] is True
    assert result["exists"] == {"/etc/os-release": True, "/nope": False, sys.executable: True}


def test_device_module_binds_with_plan_in_check_mode_then_for_real_then_not_again(run_module, built_host):
    root, state, kernel = built_host
    args = {"root": root, "state_dir": state, "devices": [GPU], "state": "vfio"}
    failed, result = run_module("device", args, check=True, diff=True, context=built_host.context)
    assert not failed, result
    assert result["changed"] is True
    assert result["plan"]["result"] == "dry_run" and result["plan"]["steps"]
    assert result["devices"] == [GPU, AUDIO]
    assert "0000:01:00.0: nvidia" in result["diff"]["before"] and "0000:01:00.0: vfio-pci" in result["diff"]["after"]
    assert _driver(root, GPU) == "nvidia" and not os.path.exists(os.path.join(state, "journal.json"))

    failed, result = run_module("device", args, context=built_host.context)
    assert not failed, result
    assert result["changed"] is True and result["plan"]["result"] == "applied"
    assert _driver(root, GPU) == _driver(root, AUDIO) == "vfio-pci"
    # state_dir is this task's setting: the journal is there, and the process's environment (in
    # which other tasks may run) is left as it was.
    assert os.path.isfile(os.path.join(state, "journal.json")) and "GPUVFIO_STATE_DIR" not in os.environ
    assert result["drivers"]["after"] == {GPU: "vfio-pci", AUDIO: "vfio-pci"}
    assert "diff" not in result  # only with --diff

    failed, result = run_module("device", args, check=True, context=built_host.context)
    assert not failed and result["changed"] is False, result
    failed, result = run_module("device", args, context=built_host.context)
    assert not failed and result["changed"] is False, result

    back = dict(args, state="host")
    failed, result = run_module("device", back, check=True, diff=True, context=built_host.context)
    assert not failed and result["changed"] is True and _driver(root, GPU) == "vfio-pci"
    assert "0000:01:00.1: snd_hda_intel" in result["diff"]["after"]
    # the GPU's address gives back its whole group
    failed, result = run_module("device", back, context=built_host.context)
    assert not failed and result["changed"] is True, result
    assert _driver(root, GPU) == "nvidia" and _driver(root, AUDIO) == "snd_hda_intel"
    failed, result = run_module("device", back, context=built_host.context)
    assert not failed and result["changed"] is False, result


def test_a_bad_timeout_is_named_as_the_module_and_the_command_spell_it(run_module, built_host, cli):
    """The write and lock limits' bounds are the table's, and the message names the option as the
    task (write_timeout) or the command (--write-timeout) does; it said --timeout to both."""
    root, state, _kernel = built_host
    args = {"root": root, "state_dir": state, "devices": [GPU], "state": "vfio"}
    for bad, words in (({"write_timeout": 0}, "write_timeout must be above 0 and at most 3600, not 0.0"),
                       ({"lock_timeout": 1e9}, "lock_timeout must be above 0 and at most 86400, not 1000000000.0")):
        # the live Context's own check (host_context), before anything reads the host
        failed, result = run_module("device", dict(args, **bad), check=True)
        assert failed and result["exit_code"] == 2 and result["msg"] == words, result
    refused = cli("--root", root, "bind", GPU, "--write-timeout", "0")
    assert refused.code == 2 and "--write-timeout must be above 0 and at most 3600, not 0.0" in refused.err, \
        refused.err


def test_a_bad_stop_timeout_fails_even_where_there_is_nothing_to_stop(run_module, built_host):
    """stop_timeout was checked only when the domain existed: -1 on a missing one passed."""
    root, state, _kernel = built_host
    args = {"root": root, "state_dir": state, "name": "no-such-domain", "state": "absent",
            "connect": "test:///default", "stop_timeout": -1}
    failed, result = run_module("domain", args, check=True)
    assert failed and result["exit_code"] == 2, result
    assert result["msg"] == "stop_timeout must be from 0 to 86400, not -1.0", result["msg"]


def test_device_module_persists_with_a_diff_and_is_idempotent(run_module, built_host):
    root, state, _kernel = built_host
    args = {"root": root, "state_dir": state, "devices": [GPU], "state": "persisted"}
    failed, result = run_module("device", args, check=True, diff=True, context=built_host.context)
    assert not failed and result["changed"] is True, result
    assert 'KERNEL=="0000:01:00.0"' in result["diff"]["prepared"]
    assert not os.path.exists(os.path.join(root, "etc", "udev", "rules.d", "61-gpuvfio-vfio-pci.rules"))
    failed, result = run_module("device", args, context=built_host.context)
    assert not failed and result["changed"] is True
    assert os.path.exists(os.path.join(root, "etc", "udev", "rules.d", "61-gpuvfio-vfio-pci.rules"))
    failed, result = run_module("device", args, context=built_host.context)
    assert not failed and result["changed"] is False
    failed, result = run_module("device", dict(args, state="unpersisted"), context=built_host.context)
    assert not failed and result["changed"] is True
    assert not os.path.exists(os.path.join(root, "etc", "udev", "rules.d", "61-gpuvfio-vfio-pci.rules"))


def test_device_module_fails_with_the_refusal_in_check_mode_too(run_module, tmp_path):
    from gpuvfio.host.fixture import load_fixture

    root = tmp_path / "ws"
    with open(os.path.join(SAMPLES, "workstation.host"), encoding="utf-8") as handle:
        load_fixture(handle.read(), str(root))
    failed, result = run_module("device", {"root": str(root), "devices": ["0000:04:00.0"]}, check=True)
    assert failed and result["exit_code"] == 1 and result["error"] == "Refused"
    assert result["msg"].startswith("refused: ") and "igc" in result["msg"]
    assert {c["id"] for c in result["report"]["refused"]} >= {"group_viable"}
    failed, result = run_module("device", {"root": str(root), "devices": ["0000:04:00.0"],
                                                   "state_dir": str(tmp_path / "s")})
    assert failed and not os.path.exists(tmp_path / "s" / "journal.json")
    failed, result = run_module("device", {"root": str(root), "devices": ["04:00.0.9"]})
    assert failed and result["exit_code"] == 2
    failed, result = run_module("device", {"root": os.path.join(SAMPLES, "workstation.host"),
                                                   "devices": ["0000:04:00.0"]})
    assert failed and "fixture file" in result["msg"]


def test_device_module_takes_selectors_as_the_command_does(run_module, built_host):
    """A slot, a node-device name and lspci -d ids select as on the command line; the expansion is
    in the result; bad selectors are bad input (exit status 2) before anything is read."""
    root, state, _kernel = built_host
    base = {"root": root, "state_dir": state, "state": "vfio"}
    for devices in (["01:00"], ["pci_0000_01_00_0"]):
        failed, result = run_module("device", dict(base, devices=devices), check=True,
                                    context=built_host.context)
        assert not failed and result["devices"] == [GPU, AUDIO], result
    failed, result = run_module("device", dict(base, devices=["01:00"]), check=True,
                                context=built_host.context)
    assert result["selected"] == [f"selected 01:00 -> {GPU}, {AUDIO}"]
    # -d ids: the NVIDIA display function only (class 03xx), not the NIC
    failed, result = run_module("device", dict(base, device_ids=["10de::03xx"]), context=built_host.context)
    assert not failed and result["changed"] is True, result
    assert result["selected"] == [f"selected -d 10de::03xx -> {GPU}"]
    assert _driver(root, GPU) == _driver(root, AUDIO) == "vfio-pci" and _driver(root, NIC) == "igc"
    for bad in ({"devices": ["01:00.9"]}, {"device_ids": ["10de:zz"]}, {"devices": ["pci_0000_01_00"]}):
        failed, result = run_module("device", dict(base, **bad), context=built_host.context)
        assert failed and result["exit_code"] == 2, (bad, result)
    failed, result = run_module("device", dict(base, devices=[1080]), context=built_host.context)  # 18:00 unquoted
    assert failed and result["exit_code"] == 2 and "quote device addresses" in result["msg"], result
    failed, result = run_module("device", dict(base, device_ids=["1af4:"]), context=built_host.context)
    assert failed and result["exit_code"] == 2 and "no PCI function" in result["msg"]
    failed, result = run_module("device", {"root": root, "state": "vfio"}, context=built_host.context)
    assert failed and "devices" in result["msg"] and "device_ids" in result["msg"]


def test_device_module_wants_all_matched_beyond_one_device(run_module, tmp_path):
    """-d 10de:2330 on an HGX host is eight GPUs: refused without all_matched (nothing written,
    in check mode as in a real run), planned with it."""
    from gpuvfio.host.fixture import load_fixture

    root = tmp_path / "dgx"
    with open(os.path.join(SAMPLES, "dgx-h100.host"), encoding="utf-8") as handle:
        load_fixture(handle.read(), str(root))
    args = {"root": str(root), "state_dir": str(tmp_path / "s"), "device_ids": ["10de:2330"], "libvirt_uri": "none"}
    for check in (True, False):
        failed, result = run_module("device", args, check=check)
        assert failed and result["exit_code"] == 1 and "matches 8 physical devices" in result["msg"], result
        assert "add all_matched: true to act on all of them" in result["msg"]
        assert result["selected"][0].startswith("selected -d 10de:2330 -> 0000:1b:00.0, 0000:43:00.0")
    assert not os.path.exists(tmp_path / "s" / "journal.json")
    failed, result = run_module("device", dict(args, all_matched=True, stop_services=True), check=True)
    assert not failed, result
    assert {"0000:1b:00.0", "0000:df:00.0", "0000:03:00.0"} <= set(result["devices"])  # NVSwitches come along


def test_domain_module_takes_selectors_and_the_rom_and_loader_options(run_module, built_host):
    root, state, _kernel = built_host
    rom = os.path.join(root, "var", "lib", "gpuvfio", "clean.rom")
    os.makedirs(os.path.dirname(rom))
    with open(rom, "wb") as handle:
        handle.write(b"\x55\xaa" + bytes(510))
    args = {"root": root, "state_dir": state, "name": "rom-0", "devices": ["pci_0000_01_00_0"],
            "uri": "test:///default", "vcpus": 2, "memory": "2G", "hugepages": "none", "firmware": "bios",
            "rom_file": "/var/lib/gpuvfio/clean.rom"}
    def sources(xml):  # the host functions the guest gets
        from lxml import etree

        return [(a.get("bus"), a.get("slot"), a.get("function"))
                for a in etree.fromstring(xml.encode()).iterfind("devices/hostdev/source/address")]

    failed, result = run_module("domain", args, check=True, context=built_host.context)
    assert not failed, result
    assert "<rom file='/var/lib/gpuvfio/clean.rom'/>" in result["xml"], result["xml"]
    assert sources(result["xml"]) == [("0x01", "0x00", "0x0"), ("0x01", "0x00", "0x1")]  # the slot follows
    failed, result = run_module("domain", dict(args, rom_file=None, rom_bar="off", devices=[],
                                                       device_ids=["10de::0300"]), check=True,
                                context=built_host.context)
    assert not failed, result
    assert "<rom bar='off'/>" in result["xml"], result["xml"]
    assert sources(result["xml"]) == [("0x01", "0x00", "0x0"), ("0x01", "0x00", "0x1")]
    for bad in ({"rom_file": "/var/lib/gpuvfio/missing.rom"}, {"rom_file": "relative.rom"},
                {"firmware": "efi", "loader": "/usr/share/OVMF/OVMF_CODE.fd"}, {"devices": ["1:2:3"]},
                {"state": "running", "min_gbps": float("nan")}, {"state": "running", "link_efficiency": 1.5}):
        failed, result = run_module("domain", dict(args, **bad), check=True, context=built_host.context)
        assert failed and result["exit_code"] == 2, (bad, result)


def test_a_bad_domain_option_is_named_as_the_module_spells_it(run_module, built_host):
    """Issue 36 item 3: the domain request's messages named options as the command spells them
    (--rom-bar, --loader/--nvram-template), which no Ansible user typed."""
    root, state, _kernel = built_host
    args = {"root": root, "state_dir": state, "name": "named", "devices": [GPU], "connect": "test:///default",
            "firmware": "bios", "hugepages": "none"}
    for bad, words in (({"rom_bar": "off", "rom_file": "/var/lib/gpuvfio/clean.rom"},
                        "rom_bar off hides the ROM that rom_file gives: one of them"),
                       ({"loader": "/usr/share/OVMF/OVMF_CODE.fd", "nvram_template": "/usr/share/OVMF/VARS.fd"},
                        "loader and nvram_template are UEFI firmware: they need firmware efi"),
                       ({"vcpus": 0}, "vcpus must be from 1 to 4096, not 0"),
                       ({"rom_file": "/var/lib/gpuvfio/none.rom"},
                        "rom_file '/var/lib/gpuvfio/none.rom': no such file on this host"),
                       ({"firmware": "efi", "loader": "/usr/share/OVMF/none.fd",
                         "nvram_template": "/usr/share/OVMF/VARS.fd"},
                        "loader '/usr/share/OVMF/none.fd': no such file on this host")):
        failed, result = run_module("domain", dict(args, **bad), check=True, context=built_host.context)
        assert failed and result["exit_code"] == 2, (bad, result)
        assert result["msg"] == words and "--" not in result["msg"], result["msg"]


def test_domain_module_defines_updates_and_removes_idempotently(run_module, built_host):
    from gpuvfio.virt.lifecycle import lookup

    root, state, _kernel = built_host
    shared, ctx = built_host.libvirt, built_host.context
    # firmware=bios: libvirt's test driver drops <qemu:commandline>, where gpuvfio puts OVMF's MMIO window,
    # so an EFI domain never compares equal there (the qemu driver keeps it).
    args = {"root": root, "state_dir": state, "name": "train-0", "devices": [GPU], "uri": "test:///default",
            "vcpus": 2, "memory": "2G", "hugepages": "none", "firmware": "bios"}
    failed, result = run_module("domain", args, check=True, diff=True, context=ctx)
    assert not failed, result
    assert result["changed"] is True and result["define"]["result"] == "would_define"
    assert result["diff"]["before"] == "" and "<name>train-0</name>" in result["diff"]["after"]
    failed, result = run_module("domain", args, context=ctx)
    assert not failed and result["define"]["result"] == "defined" and result["changed"] is True, result
    failed, result = run_module("domain", args, context=ctx)
    assert not failed and result["define"]["result"] == "unchanged" and result["changed"] is False, result

    bigger = dict(args, vcpus=4)
    failed, result = run_module("domain", bigger, check=True, diff=True, context=ctx)
    assert not failed and result["changed"] is True and result["define"]["result"] == "would_update"
    failed, result = run_module("domain", dict(bigger, update=False), context=ctx)
    assert not failed and result["changed"] is False and result["define"]["changes"]
    failed, result = run_module("domain", bigger, context=ctx)
    assert not failed and result["define"]["result"] == "updated" and result["changed"] is True
    failed, result = run_module("domain", bigger, context=ctx)
    assert not failed and result["changed"] is False

    failed, result = run_module("domain", {**args, "state": "absent"}, check=True, context=ctx)
    assert not failed and result["changed"] is True and result["plan"]["operation"] == "detach"
    planned = [s["kind"] for s in result["plan"]["steps"]]
    assert "undefine" in planned
    assert lookup(shared, "train-0") is not None
    failed, result = run_module("domain", {**args, "state": "absent"}, context=ctx)
    assert not failed and result["changed"] is True and result["detach"]["undefined"] is True
    assert [s["kind"] for s in result["detach"]["steps"]] == planned  # check mode's plan is what ran
    failed, result = run_module("domain", {**args, "state": "absent"}, context=ctx)
    assert not failed and result["changed"] is False

    # A domain gpuvfio did not make is not touched (a refusal: the host's state, exit status 1).
    failed, result = run_module("domain", {**args, "name": "test"}, context=ctx)
    assert failed and "not created by gpuvfio" in result["msg"] and result["exit_code"] == 1


def test_domain_module_defined_then_running_attaches_to_that_definition(run_module, built_host, guest_server):
    """The role's state=defined, then state=running: attach onto the existing definition, keeping
    its UUID (on main defineXML without the UUID failed, and the rollback would have undefined a
    domain the attach had not created). The guest is this machine behind dropbear."""
    from gpuvfio.virt.lifecycle import lookup

    root, state, kernel = built_host
    ctx = built_host.context
    server, private_key = guest_server
    args = {"root": root, "state_dir": state, "name": "train-1", "devices": [GPU], "uri": "test:///default", "kernel": boot_file(root),
            "vcpus": 2, "memory": "2G", "hugepages": "none", "firmware": "bios"}
    failed, result = run_module("domain", args, context=ctx)
    assert not failed and result["define"]["result"] == "defined", result
    uuid = lookup(built_host.libvirt, "train-1").UUIDString()
    target = {"ssh_host": "127.0.0.1", "ssh_port": server.port, "known_hosts": server.known_hosts,
              "boot_timeout": 20}
    # A failing attach onto it (SSH refuses: no key given) undoes only what it did: the
    # domain stays defined as it was, the devices go back.
    failed, result = run_module("domain", dict(args, state="running", **target), context=ctx)
    assert failed and "authentication" in result["msg"], result
    assert result["attach"]["define"]["result"] == "unchanged"
    assert result["attach"]["rolled_back"] == ["destroy", "restore devices"], result["attach"]
    assert lookup(built_host.libvirt, "train-1").UUIDString() == uuid
    assert kernel.driver_of(GPU) == "nvidia"
    # verify=false: the "guest" probes the built host's own tree, where the GPU now sits on vfio-pci
    running = dict(args, state="running", ssh_private_key=private_key, verify=False, **target)
    failed, result = run_module("domain", running, context=ctx)
    assert not failed, result["msg"]
    attach = result["attach"]
    assert attach["define"]["result"] == "unchanged" and attach["ok"] is True
    assert lookup(built_host.libvirt, "train-1").UUIDString() == uuid
    assert kernel.driver_of(GPU) == "vfio-pci" and kernel.driver_of(AUDIO) == "vfio-pci"
    failed, result = run_module("domain", {**args, "state": "absent"}, context=ctx)
    assert not failed and result["detach"]["restored"]["restored"] == {GPU: "nvidia", AUDIO: "snd_hda_intel"}


def test_discovered_guest_address_keeps_the_ssh_options(run_module, built_host, guest_server):
    """The guest's address comes from the forward gpuvfio recorded in the domain; the user's key,
    user and pinned host keys still apply (on main a discovered address meant root, no key)."""
    from gpuvfio.virt.lifecycle import lookup

    root, state, _kernel = built_host
    server, private_key = guest_server
    args = {"root": root, "state_dir": state, "name": "train-2", "devices": [GPU], "uri": "test:///default", "kernel": boot_file(root),
            "vcpus": 2, "memory": "2G", "hugepages": "none", "firmware": "bios", "state": "running",
            "user_net_ssh_port": server.port, "known_hosts": server.known_hosts, "boot_timeout": 20,
            "ssh_private_key": private_key, "verify": False}
    failed, result = run_module("domain", args, context=built_host.context)
    assert not failed, result
    attach = result["attach"]
    # One GPU: no NCCL topology file to write (that needs two or more).
    assert [s["step"] for s in attach["steps"]] == ["bind", "define", "start", "find address", "wait for ssh"]
    assert attach["nccl_topology"] is None
    assert attach["start_to_ssh_s"] is not None and attach["start_to_ssh_s"] >= 0
    assert attach["ssh"]["port"] == server.port and attach["ok"] is True
    failed, result = run_module("domain", {**args, "state": "absent"}, context=built_host.context)
    assert not failed and lookup(built_host.libvirt, "train-2") is None


def boot_file(root: str) -> str:
    """A kernel on this machine, for attach's plan to find (issue 33 item 2: a guest that can boot)."""
    path = os.path.join(str(root), "boot-vmlinuz")
    with open(path, "wb") as handle:
        handle.write(bytes(512))
    return path


def test_domain_module_plans_an_attach_in_check_mode(run_module, built_host):
    root, state, _kernel = built_host
    failed, result = run_module("domain", {"root": root, "state_dir": state, "name": "g", "devices": [GPU],
                                           "uri": "test:///default", "state": "running", "vcpus": 2,
                                           "memory": "2G", "hugepages": "none", "kernel": boot_file(root),
                                           "network": "default"}, check=True)
    assert not failed, result
    assert result["changed"] is True
    plan = result["plan"]  # attach's own plan (gpuvfio.ops.attach_plan), as attach --dry-run prints it
    assert plan["operation"] == "attach" and plan["result"] == "planned" and not plan["refused"]
    assert [s["kind"] for s in plan["steps"]] == ["bind", "define", "start", "find address", "wait for ssh",
                                                  "verify"]
    assert plan["steps"][1]["detail"] == "define g on test:///default" and plan["changes"] == []
    assert plan["bind"]["devices"] == [GPU, AUDIO] and plan["bind"]["moving"] == [GPU, AUDIO]
    assert _driver(root, GPU) == "nvidia"


def test_verify_module_reports_and_fails_on_a_failed_check(run_module, built_host, tmp_path, fakecuda_libdir):
    """Real SSH: this machine behind dropbear (tests/lanes/hypervisor.py) plays the guest, its
    probe pointed at the built host's tree (GPUVFIO_PROBE_ROOT) and the stand-in CUDA/NVML on its
    library path, so the GPU is "in the guest"; then the GPU's driver goes away there and the
    module fails on that check. Without CUDA in the guest it fails closed."""
    from tests.lanes import hypervisor as hv

    if hv.skip_reason():
        pytest.skip(hv.skip_reason())
    root, state, _kernel = built_host
    bare = hv.start(str(tmp_path / "bare"), env={"GPUVFIO_PROBE_ROOT": root})
    try:
        with open(bare.client_key) as handle:
            key = handle.read()
        failed, result = run_module("verify", {  # its key trusted on first use, recorded in state_dir
            "root": root, "state_dir": state, "ssh_host": "127.0.0.1", "ssh_port": bare.port,
            "trust_on_first_use": True, "expect_devices": [GPU], "ssh_private_key": key, "bandwidth": False})
        assert failed and result["report"]["ok"] is False  # an NVIDIA GPU and no CUDA: not a pass
        assert open(os.path.join(state, "known_hosts")).read().startswith(f"[127.0.0.1]:{bare.port} ")
        assert {c["id"]: c["status"] for c in result["report"]["checks"]}["cuda"] == "fail"
    finally:
        bare.stop()
    server = hv.start(str(tmp_path / "guest"), env={"GPUVFIO_PROBE_ROOT": root, "LD_LIBRARY_PATH": fakecuda_libdir})
    try:
        with open(server.client_key) as handle:
            private_key = handle.read()
        args = {"root": root, "state_dir": state, "ssh_host": "127.0.0.1", "ssh_port": server.port,
                "known_hosts": server.known_hosts, "expect_devices": ["pci_0000_01_00_0"],
                "ssh_private_key": private_key, "bandwidth": False}
        failed, result = run_module("verify", args, check=True)
        assert not failed and result["changed"] is False, result
        assert result["report"]["ok"] is True
        checks = {c["id"]: c for c in result["report"]["checks"]}
        assert checks["pci_present"]["status"] == "pass" and checks["pci_present"]["observed"].startswith(GPU)
        assert checks["driver"]["status"] == "pass"
        assert private_key.splitlines()[1] not in json.dumps(result)
        os.unlink(os.path.join(root, "sys", "bus", "pci", "devices", GPU, "driver"))
        failed, result = run_module("verify", args)
        assert failed and result["msg"].startswith("verification failed: driver")
        assert result["report"]["ok"] is False
    finally:
        server.stop()
    failed, result = run_module("verify", {"root": root})
    assert failed and "domain" in result["msg"] and "ssh_host" in result["msg"]
    failed, result = run_module("verify", {"root": root, "ssh_host": "127.0.0.1", "expect_devices": ["01:00.9"]})
    assert failed and result["exit_code"] == 2 and "01:00.9" in result["msg"]
    failed, result = run_module("verify", {"root": root, "ssh_host": "127.0.0.1", "min_gbps": -1.0})
    assert failed and result["exit_code"] == 2 and result["msg"].startswith("min_gbps must be")


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_module_documentation_matches_its_argument_spec(modules, monkeypatch, name):
    """What ansible-test's validate-modules checks first: every option documented with the
    spec's type, default, choices and required, and nothing documented that is not there."""
    import yaml
    from ansible.module_utils import basic

    class Captured(Exception):
        pass

    def capture(self, argument_spec, **kwargs):
        raise Captured(argument_spec, kwargs)

    monkeypatch.setattr(basic.AnsibleModule, "__init__", capture)
    with pytest.raises(Captured) as caught:
        modules[name].main()
    spec, kwargs = caught.value.args
    doc = yaml.safe_load(modules[name].DOCUMENTATION)
    yaml.safe_load(modules[name].EXAMPLES)
    yaml.safe_load(modules[name].RETURN)
    assert doc["module"] == name
    # The attributes ansible-core 2.19 documents (action_common_attributes): check mode as the
    # module declares it, diff mode, the platform.
    attributes = doc["attributes"]
    assert "ansible.builtin.action_common_attributes" in doc["extends_documentation_fragment"]
    assert attributes["check_mode"]["support"] == ("full" if kwargs.get("supports_check_mode") else "none")
    assert attributes["diff_mode"]["support"] in ("full", "partial", "none")
    assert attributes["platform"]["platforms"] == "posix"
    assert set(doc["options"]) == set(spec)
    for option, rules in spec.items():
        documented = doc["options"][option]
        assert documented.get("type", "str") == rules.get("type", "str"), option
        assert documented.get("default") == rules.get("default"), option
        assert documented.get("choices") == rules.get("choices"), option
        assert bool(documented.get("required")) == bool(rules.get("required")), option
        assert documented.get("elements") == rules.get("elements"), option


def test_failed_attach_gives_back_only_what_it_bound(run_module, built_host, guest_server):
    """The role binds the GPU first (gpuvfio.gpuvfio.device), then attaches: a failing attach must not
    give back a GPU it did not bind (on main its rollback released whatever gpuvfio held)."""
    root, state, kernel = built_host
    ctx = built_host.context
    server, _private_key = guest_server
    failed, result = run_module("device", {"root": root, "state_dir": state, "devices": [GPU]}, context=ctx)
    assert not failed and kernel.driver_of(GPU) == "vfio-pci", result
    args = {"root": root, "state_dir": state, "name": "train-3", "devices": [GPU], "uri": "test:///default", "kernel": boot_file(root),
            "vcpus": 2, "memory": "2G", "hugepages": "none", "firmware": "bios", "state": "running",
            "ssh_host": "127.0.0.1", "ssh_port": server.port, "known_hosts": server.known_hosts,
            "boot_timeout": 10}
    failed, result = run_module("domain", args, context=ctx)  # no key: SSH refuses
    assert failed and result["attach"]["rolled_back"] == ["destroy", "undefine"], result["attach"]
    # No key to offer is said at once, not waited on until boot_timeout runs out.
    assert "no key to offer" in result["msg"] and result["attach"]["steps"][-1]["seconds"] < 5, result["attach"]
    assert kernel.driver_of(GPU) == "vfio-pci" and kernel.driver_of(AUDIO) == "vfio-pci"


def test_attach_refuses_a_gpu_another_domain_uses(run_module, built_host):
    """A GPU already on vfio-pci is "nothing to bind", but another domain using it still refuses an
    attach (on main the check was skipped and the rollback then unbound it under that guest)."""
    from gpuvfio.virt.lifecycle import lookup

    root, state, kernel = built_host
    ctx = built_host.context
    base = {"root": root, "state_dir": state, "devices": [GPU], "uri": "test:///default", "vcpus": 2,
            "memory": "2G", "hugepages": "none", "firmware": "bios"}
    failed, result = run_module("domain", dict(base, name="owner"), context=ctx)
    assert not failed, result
    failed, result = run_module("device", {"root": root, "state_dir": state, "devices": [GPU]}, context=ctx)
    assert not failed and kernel.driver_of(GPU) == "vfio-pci", result
    failed, result = run_module("domain", dict(base, name="intruder", state="running", ssh_host="127.0.0.1",
                                                       ssh_port=1, boot_timeout=1), context=ctx)
    assert failed and result["exit_code"] == 1 and "libvirt domain(s) owner" in result["msg"], result
    assert lookup(built_host.libvirt, "intruder") is None and kernel.driver_of(GPU) == "vfio-pci"
