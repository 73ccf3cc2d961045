"""Fleet lane: the Ansible modules and playbooks in playbooks/, and the Vagrant dev box.

* ansible-playbook --syntax-check and ansible-lint (production profile) for every playbook;
* the modules' unit tests, in-process with Ansible's module-testing conventions
  (``ansible.module_utils.testing.patch_module_args``, exit_json/fail_json captured), on
  the bundled sample hosts and on a small built host whose sysfs writes a simulated kernel
  answers (tests/simkernel.py);
* real ansible-playbook runs against 8 simulated hosts at once (the four sample fixtures,
  twice each, loaded into temp dirs; ansible_connection=local, one gpuvfio_root and
  GPUVFIO state dir per host): inventory.yml twice, attach.yml in check mode, host-prep.yml
  in check mode, then applied, then applied again with changed=0 everywhere;
* ``vagrant validate`` for vagrant/Vagrantfile.

Needs ansible-core and ansible-lint in the venv and vagrant + vagrant-libvirt (Debian
packages). Without them the tests skip, except under ``make test``
(GPUVFIO_REQUIRE_LANES=1), where a missing tool fails them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAYBOOKS = os.path.join(REPO, "playbooks")
PLAYBOOK_FILES = ["host-prep.yml", "inventory.yml", "attach.yml", "verify.yml", "testbed.yml"]
VENV_BIN = os.path.dirname(sys.executable)
SAMPLES = os.path.join(REPO, "gpuvfio", "samples")

sys.path.insert(0, REPO)

from tests.hostbuilder import BAR32, BAR64_PREF, GiB, HostBuilder, KiB, MiB  # noqa: E402


def _need(tool_ok: bool, what: str) -> None:
    if tool_ok:
        return
    message = f"{what} is not installed (Makefile: see the fleet lane's packages)"
    if os.environ.get("GPUVFIO_REQUIRE_LANES") == "1":
        pytest.fail(message + "; required under make test")
    pytest.skip(message)


def _which(name: str) -> str | None:
    return shutil.which(name, path=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))


# ansible-core has no JSON callback (it lives in ansible.posix): this one writes what the
# tests read -- per play, per task, each host's result (loops with their items) -- and the recap.
JSON_CALLBACK = '''
from __future__ import annotations
import json, sys
from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: fleet_json
type: stdout
short_description: JSON of plays, tasks, results and the recap (gpuvfio tests)
description: JSON of plays, tasks, results and the recap.
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "fleet_json"

    def __init__(self):
        super().__init__()
        self.plays = []

    def v2_playbook_on_play_start(self, play):
        self.plays.append({"play": {"name": play.get_name()}, "tasks": []})

    def _task(self, task):
        self.plays[-1]["tasks"].append({"task": {"name": task.get_name()}, "hosts": {}})

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._task(task)

    def v2_playbook_on_handler_task_start(self, task):
        self._task(task)

    def _record(self, result, **extra):
        data = json.loads(self._dump_results(dict(result._result, **extra), indent=None))
        if "diff" in result._result:  # _dump_results leaves it out
            data["diff"] = json.loads(json.dumps(result._result["diff"], default=str))
        self.plays[-1]["tasks"][-1]["hosts"][result._host.get_name()] = data

    def v2_runner_on_ok(self, result):
        self._record(result)

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._record(result, failed=True)

    def v2_runner_on_skipped(self, result):
        self._record(result, skipped=True)

    def v2_runner_on_unreachable(self, result):
        self._record(result, unreachable=True)

    def v2_playbook_on_stats(self, stats):
        recap = {host: stats.summarize(host) for host in sorted(stats.processed)}
        sys.stdout.write(json.dumps({"plays": self.plays, "stats": recap}) + "\\n")
'''


@pytest.fixture(scope="module")
def ansible_env(tmp_path_factory):
    _need(importlib.util.find_spec("ansible") is not None and _which("ansible-playbook") is not None,
          "ansible-core")
    home = tmp_path_factory.mktemp("ansible-home")
    (home / "callbacks").mkdir()
    (home / "callbacks" / "fleet_json.py").write_text(JSON_CALLBACK)
    return {**os.environ,
            "ANSIBLE_CALLBACK_PLUGINS": str(home / "callbacks"),
            "PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", ""),
            "ANSIBLE_CONFIG": os.path.join(PLAYBOOKS, "ansible.cfg"),
            "ANSIBLE_HOME": str(home),
            "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
            "ANSIBLE_REMOTE_TEMP": str(home / "remote-tmp"),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            "ANSIBLE_DEPRECATION_WARNINGS": "0",
            "ANSIBLE_PYTHON_INTERPRETER": sys.executable}


def _parse(out: str, err: str, returncode: int, args) -> dict:
    try:
        return json.loads(out)
    except ValueError:
        raise AssertionError(f"ansible-playbook {' '.join(args)} printed no JSON (rc {returncode}):\n"
                             f"{out[-3000:]}\n{err[-3000:]}") from None


def _playbook(env, *args, timeout=300):
    """ansible-playbook with the JSON callback: (returncode, parsed output, stderr)."""
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-playbook"), *args], cwd=PLAYBOOKS, capture_output=True,
                          text=True, timeout=timeout, env={**env, "ANSIBLE_STDOUT_CALLBACK": "fleet_json"})
    return proc.returncode, _parse(proc.stdout, proc.stderr, proc.returncode, args), proc.stderr


def _recap(data) -> dict:
    return {host: {k: stats[k] for k in ("ok", "changed", "failures", "unreachable", "skipped")}
            for host, stats in data["stats"].items()}


def _task_results(data, name_part: str) -> dict:
    """host -> result of the first task whose name contains name_part (all plays)."""
    for play in data["plays"]:
        for task in play["tasks"]:
            if name_part in task["task"]["name"]:
                return task["hosts"]
    raise AssertionError(f"no task named like {name_part!r}")


def _failures(data) -> str:
    out = []
    for play in data["plays"]:
        for task in play["tasks"]:
            for host, result in task["hosts"].items():
                if result.get("failed") or result.get("unreachable"):
                    out.append(f"{host}: {task['task']['name']}: {result.get('msg')}")
    return "\n".join(out)


# -- syntax and lint ---------------------------------------------------------------------------

def test_playbooks_pass_syntax_check(ansible_env):
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-playbook"), "-i", "inventory/hosts.yml", "--syntax-check",
                           *PLAYBOOK_FILES], cwd=PLAYBOOKS, capture_output=True, text=True, env=ansible_env,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in PLAYBOOK_FILES:
        assert f"playbook: {name}" in proc.stdout
    assert "WARNING" not in proc.stderr.upper(), proc.stderr


def test_ansible_lint_production_profile_is_clean(ansible_env):
    lint = _which("ansible-lint")
    _need(lint is not None, "ansible-lint")
    proc = subprocess.run([lint, "--offline", "--profile", "production", "--nocolor"], cwd=PLAYBOOKS,
                          capture_output=True, text=True, env=ansible_env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Profile 'production' was required, and it passed" in out, out


# -- module unit tests (in-process) ---------------------------------------------------------------

class ModuleExit(Exception):
    def __init__(self, failed: bool, result: dict) -> None:
        super().__init__(result.get("msg", ""))
        self.failed, self.result = failed, result


@pytest.fixture(scope="module")
def modules():
    """The modules in playbooks/library, imported as Ansible would run them."""
    _need(importlib.util.find_spec("ansible") is not None, "ansible-core")
    import ansible.module_utils

    utils = os.path.join(PLAYBOOKS, "module_utils")
    if utils not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(utils)
    loaded = {}
    for name in ("gpuvfio_facts", "gpuvfio_device", "gpuvfio_domain", "gpuvfio_verify", "gpuvfio_host_info"):
        path = os.path.join(PLAYBOOKS, "library", f"{name}.py")
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
                os.environ.pop("GPUVFIO_STATE_DIR", None)  # the module sets it for its process
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

        return sim_context(host.root, self.kernel, connect=lambda uri: self.libvirt)

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
        failed, result = run_module("gpuvfio_facts", {"root": root}, check=check)
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
    failed, result = run_module("gpuvfio_facts", {"root": os.path.join(SAMPLES, "dgx-h100.host"),
                                                  "gather": ["devices"]})
    assert not failed, result
    facts = result["ansible_facts"]["gpuvfio"]
    summary = facts["summary"]
    assert summary["gpu_count"] == 8 and list(summary["gpu_models"].values()) == [8]
    assert "H100" in next(iter(summary["gpu_models"]))
    assert len(summary["viable_groups"]) == 8 and summary["non_viable_groups"] == []
    assert {g["numa_node"] for g in summary["gpus"]} == {0, 1}
    assert "doctor" not in facts and "status" not in facts


def test_facts_module_fails_with_gpuvfio_message(run_module, tmp_path):
    failed, result = run_module("gpuvfio_facts", {"root": str(tmp_path / "nowhere")})
    assert failed and result["exit_code"] == 2
    assert "nowhere" in result["msg"]


def test_host_info_module_reads_a_sample_root(run_module, built_host, tmp_path):
    from gpuvfio.host.fixture import load_fixture

    root = tmp_path / "epyc"
    with open(os.path.join(SAMPLES, "epyc-mixed.host"), encoding="utf-8") as handle:
        load_fixture(handle.read(), str(root))
    failed, result = run_module("gpuvfio_host_info", {"root": str(root), "paths": ["/etc/os-release", "/nope"],
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
    failed, result = run_module("gpuvfio_device", args, check=True, diff=True, context=built_host.context)
    assert not failed, result
    assert result["changed"] is True
    assert result["plan"]["result"] == "dry_run" and result["plan"]["steps"]
    assert result["devices"] == [GPU, AUDIO]
    assert "0000:01:00.0: nvidia" in result["diff"]["before"] and "0000:01:00.0: vfio-pci" in result["diff"]["after"]
    assert _driver(root, GPU) == "nvidia" and not os.path.exists(os.path.join(state, "journal.json"))

    failed, result = run_module("gpuvfio_device", args, context=built_host.context)
    assert not failed, result
    assert result["changed"] is True and result["plan"]["result"] == "applied"
    assert _driver(root, GPU) == _driver(root, AUDIO) == "vfio-pci"
    assert result["drivers"]["after"] == {GPU: "vfio-pci", AUDIO: "vfio-pci"}
    assert "diff" not in result  # only with --diff

    failed, result = run_module("gpuvfio_device", args, check=True, context=built_host.context)
    assert not failed and result["changed"] is False, result
    failed, result = run_module("gpuvfio_device", args, context=built_host.context)
    assert not failed and result["changed"] is False, result

    back = dict(args, state="host")
    failed, result = run_module("gpuvfio_device", back, check=True, diff=True, context=built_host.context)
    assert not failed and result["changed"] is True and _driver(root, GPU) == "vfio-pci"
    assert "0000:01:00.1: snd_hda_intel" in result["diff"]["after"]
    # the GPU's address gives back its whole group
    failed, result = run_module("gpuvfio_device", back, context=built_host.context)
    assert not failed and result["changed"] is True, result
    assert _driver(root, GPU) == "nvidia" and _driver(root, AUDIO) == "snd_hda_intel"
    failed, result = run_module("gpuvfio_device", back, context=built_host.context)
    assert not failed and result["changed"] is False, result


def test_device_module_persists_with_a_diff_and_is_idempotent(run_module, built_host):
    root, state, _kernel = built_host
    args = {"root": root, "state_dir": state, "devices": [GPU], "state": "persisted"}
    failed, result = run_module("gpuvfio_device", args, check=True, diff=True, context=built_host.context)
    assert not failed and result["changed"] is True, result
    assert 'KERNEL=="0000:01:00.0"' in result["diff"]["prepared"]
    assert not os.path.exists(os.path.join(root, "etc", "udev", "rules.d", "61-gpuvfio-vfio-pci.rules"))
    failed, result = run_module("gpuvfio_device", args, context=built_host.context)
    assert not failed and result["changed"] is True
    assert os.path.exists(os.path.join(root, "etc", "udev", "rules.d", "61-gpuvfio-vfio-pci.rules"))
    failed, result = run_module("gpuvfio_device", args, context=built_host.context)
    assert not failed and result["changed"] is False
    failed, result = run_module("gpuvfio_device", dict(args, state="unpersisted"), context=built_host.context)
    assert not failed and result["changed"] is True
    assert not os.path.exists(os.path.join(root, "etc", "udev", "rules.d", "61-gpuvfio-vfio-pci.rules"))


def test_device_module_fails_with_the_refusal_in_check_mode_too(run_module, tmp_path):
    from gpuvfio.host.fixture import load_fixture

    root = tmp_path / "ws"
    with open(os.path.join(SAMPLES, "workstation.host"), encoding="utf-8") as handle:
        load_fixture(handle.read(), str(root))
    failed, result = run_module("gpuvfio_device", {"root": str(root), "devices": ["0000:04:00.0"]}, check=True)
    assert failed and result["exit_code"] == 1 and result["error"] == "Refused"
    assert result["msg"].startswith("refused: ") and "igc" in result["msg"]
    assert {c["id"] for c in result["report"]["refused"]} >= {"group_viable"}
    failed, result = run_module("gpuvfio_device", {"root": str(root), "devices": ["0000:04:00.0"],
                                                   "state_dir": str(tmp_path / "s")})
    assert failed and not os.path.exists(tmp_path / "s" / "journal.json")
    failed, result = run_module("gpuvfio_device", {"root": str(root), "devices": ["04:00.0.9"]})
    assert failed and result["exit_code"] == 2
    failed, result = run_module("gpuvfio_device", {"root": os.path.join(SAMPLES, "workstation.host"),
                                                   "devices": ["0000:04:00.0"]})
    assert failed and "fixture file" in result["msg"]


def test_device_module_takes_selectors_as_the_command_does(run_module, built_host):
    """A slot, a node-device name and lspci -d ids select as on the command line; the expansion is
    in the result; bad selectors are bad input (exit status 2) before anything is read."""
    root, state, _kernel = built_host
    base = {"root": root, "state_dir": state, "state": "vfio"}
    for devices in (["01:00"], ["pci_0000_01_00_0"]):
        failed, result = run_module("gpuvfio_device", dict(base, devices=devices), check=True,
                                    context=built_host.context)
        assert not failed and result["devices"] == [GPU, AUDIO], result
    failed, result = run_module("gpuvfio_device", dict(base, devices=["01:00"]), check=True,
                                context=built_host.context)
    assert result["selected"] == [f"selected 01:00 -> {GPU}, {AUDIO}"]
    # -d ids: the NVIDIA display function only (class 03xx), not the NIC
    failed, result = run_module("gpuvfio_device", dict(base, device_ids=["10de::03xx"]), context=built_host.context)
    assert not failed and result["changed"] is True, result
    assert result["selected"] == [f"selected -d 10de::03xx -> {GPU}"]
    assert _driver(root, GPU) == _driver(root, AUDIO) == "vfio-pci" and _driver(root, NIC) == "igc"
    for bad in ({"devices": ["01:00.9"]}, {"device_ids": ["10de:zz"]}, {"devices": ["pci_0000_01_00"]}):
        failed, result = run_module("gpuvfio_device", dict(base, **bad), context=built_host.context)
        assert failed and result["exit_code"] == 2, (bad, result)
    failed, result = run_module("gpuvfio_device", dict(base, devices=[1080]), context=built_host.context)  # 18:00 unquoted
    assert failed and result["exit_code"] == 2 and "quote device addresses" in result["msg"], result
    failed, result = run_module("gpuvfio_device", dict(base, device_ids=["1af4:"]), context=built_host.context)
    assert failed and result["exit_code"] == 2 and "no PCI function" in result["msg"]
    failed, result = run_module("gpuvfio_device", {"root": root, "state": "vfio"}, context=built_host.context)
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
        failed, result = run_module("gpuvfio_device", args, check=check)
        assert failed and result["exit_code"] == 1 and "matches 8 devices" in result["msg"], result
        assert "add all_matched: true to act on all of them" in result["msg"]
        assert result["selected"][0].startswith("selected -d 10de:2330 -> 0000:1b:00.0, 0000:43:00.0")
    assert not os.path.exists(tmp_path / "s" / "journal.json")
    failed, result = run_module("gpuvfio_device", dict(args, all_matched=True, stop_services=True), check=True)
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

    failed, result = run_module("gpuvfio_domain", args, check=True, context=built_host.context)
    assert not failed, result
    assert "<rom file='/var/lib/gpuvfio/clean.rom'/>" in result["xml"], result["xml"]
    assert sources(result["xml"]) == [("0x01", "0x00", "0x0"), ("0x01", "0x00", "0x1")]  # the slot follows
    failed, result = run_module("gpuvfio_domain", dict(args, rom_file=None, rom_bar="off", devices=[],
                                                       device_ids=["10de::0300"]), check=True,
                                context=built_host.context)
    assert not failed, result
    assert "<rom bar='off'/>" in result["xml"], result["xml"]
    assert sources(result["xml"]) == [("0x01", "0x00", "0x0"), ("0x01", "0x00", "0x1")]
    for bad in ({"rom_file": "/var/lib/gpuvfio/missing.rom"}, {"rom_file": "relative.rom"},
                {"firmware": "efi", "loader": "/usr/share/OVMF/OVMF_CODE.fd"}, {"devices": ["1:2:3"]},
                {"state": "running", "min_gbps": float("nan")}, {"state": "running", "link_efficiency": 1.5}):
        failed, result = run_module("gpuvfio_domain", dict(args, **bad), check=True, context=built_host.context)
        assert failed and result["exit_code"] == 2, (bad, result)


def test_domain_module_defines_updates_and_removes_idempotently(run_module, built_host):
    from gpuvfio.virt.lifecycle import lookup

    root, state, _kernel = built_host
    shared, ctx = built_host.libvirt, built_host.context
    # firmware=bios: libvirt's test driver drops <qemu:commandline>, where gpuvfio puts OVMF's MMIO window,
    # so an EFI domain never compares equal there (the qemu driver keeps it).
    args = {"root": root, "state_dir": state, "name": "train-0", "devices": [GPU], "uri": "test:///default",
            "vcpus": 2, "memory": "2G", "hugepages": "none", "firmware": "bios"}
    failed, result = run_module("gpuvfio_domain", args, check=True, diff=True, context=ctx)
    assert not failed, result
    assert result["changed"] is True and result["define"]["result"] == "would_define"
    assert result["diff"]["before"] == "" and "<name>train-0</name>" in result["diff"]["after"]
    failed, result = run_module("gpuvfio_domain", args, context=ctx)
    assert not failed and result["define"]["result"] == "defined" and result["changed"] is True, result
    failed, result = run_module("gpuvfio_domain", args, context=ctx)
    assert not failed and result["define"]["result"] == "unchanged" and result["changed"] is False, result

    bigger = dict(args, vcpus=4)
    failed, result = run_module("gpuvfio_domain", bigger, check=True, diff=True, context=ctx)
    assert not failed and result["changed"] is True and result["define"]["result"] == "differs"
    failed, result = run_module("gpuvfio_domain", dict(bigger, update=False), context=ctx)
    assert not failed and result["changed"] is False and result["define"]["changes"]
    failed, result = run_module("gpuvfio_domain", bigger, context=ctx)
    assert not failed and result["define"]["result"] == "updated" and result["changed"] is True
    failed, result = run_module("gpuvfio_domain", bigger, context=ctx)
    assert not failed and result["changed"] is False

    failed, result = run_module("gpuvfio_domain", {**args, "state": "absent"}, check=True, context=ctx)
    assert not failed and result["changed"] is True and result["plan"]["undefine"] is True
    assert lookup(shared, "train-0") is not None
    failed, result = run_module("gpuvfio_domain", {**args, "state": "absent"}, context=ctx)
    assert not failed and result["changed"] is True and result["detach"]["undefined"] is True
    failed, result = run_module("gpuvfio_domain", {**args, "state": "absent"}, context=ctx)
    assert not failed and result["changed"] is False

    # A domain gpuvfio did not make is not touched (a refusal: the host's state, exit status 1).
    failed, result = run_module("gpuvfio_domain", {**args, "name": "test"}, context=ctx)
    assert failed and "not created by gpuvfio" in result["msg"] and result["exit_code"] == 1


def test_domain_module_defined_then_running_attaches_to_that_definition(run_module, built_host, guest_server):
    """The role's state=defined, then state=running: attach onto the existing definition, keeping
    its UUID (on main defineXML without the UUID failed, and the rollback would have undefined a
    domain the attach had not created). The guest is this machine behind dropbear."""
    from gpuvfio.virt.lifecycle import lookup

    root, state, kernel = built_host
    ctx = built_host.context
    server, private_key = guest_server
    args = {"root": root, "state_dir": state, "name": "train-1", "devices": [GPU], "uri": "test:///default",
            "vcpus": 2, "memory": "2G", "hugepages": "none", "firmware": "bios"}
    failed, result = run_module("gpuvfio_domain", args, context=ctx)
    assert not failed and result["define"]["result"] == "defined", result
    uuid = lookup(built_host.libvirt, "train-1").UUIDString()
    target = {"ssh_host": "127.0.0.1", "ssh_port": server.port, "known_hosts": server.known_hosts,
              "boot_timeout": 20}
    # A failing attach onto it (SSH refuses: no key given) undoes only what it did: the
    # domain stays defined as it was, the devices go back.
    failed, result = run_module("gpuvfio_domain", dict(args, state="running", **target), context=ctx)
    assert failed and "authentication" in result["msg"], result
    assert result["attach"]["define"]["result"] == "unchanged"
    assert result["attach"]["rolled_back"] == ["destroy", "restore devices"], result["attach"]
    assert lookup(built_host.libvirt, "train-1").UUIDString() == uuid
    assert kernel.driver_of(GPU) == "nvidia"
    # verify=false: the "guest" probes the built host's own tree, where the GPU now sits on vfio-pci
    running = dict(args, state="running", ssh_private_key=private_key, verify=False, **target)
    failed, result = run_module("gpuvfio_domain", running, context=ctx)
    assert not failed, result["msg"]
    attach = result["attach"]
    assert attach["define"]["result"] == "unchanged" and attach["ok"] is True
    assert lookup(built_host.libvirt, "train-1").UUIDString() == uuid
    assert kernel.driver_of(GPU) == "vfio-pci" and kernel.driver_of(AUDIO) == "vfio-pci"
    failed, result = run_module("gpuvfio_domain", {**args, "state": "absent"}, context=ctx)
    assert not failed and result["detach"]["restored"]["restored"] == {GPU: "nvidia", AUDIO: "snd_hda_intel"}


def test_discovered_guest_address_keeps_the_ssh_options(run_module, built_host, guest_server):
    """The guest's address comes from the forward gpuvfio recorded in the domain; the user's key,
    user and pinned host keys still apply (on main a discovered address meant root, no key)."""
    from gpuvfio.virt.lifecycle import lookup

    root, state, _kernel = built_host
    server, private_key = guest_server
    args = {"root": root, "state_dir": state, "name": "train-2", "devices": [GPU], "uri": "test:///default",
            "vcpus": 2, "memory": "2G", "hugepages": "none", "firmware": "bios", "state": "running",
            "user_net_ssh_port": server.port, "known_hosts": server.known_hosts, "boot_timeout": 20,
            "ssh_private_key": private_key, "verify": False}
    failed, result = run_module("gpuvfio_domain", args, context=built_host.context)
    assert not failed, result
    attach = result["attach"]
    # One GPU: no NCCL topology file to write (that needs two or more).
    assert [s["step"] for s in attach["steps"]] == ["bind", "define", "start", "find address", "wait for ssh"]
    assert attach["nccl_topology"] is None
    assert attach["start_to_ssh_s"] is not None and attach["start_to_ssh_s"] >= 0
    assert attach["ssh"]["port"] == server.port and attach["ok"] is True
    failed, result = run_module("gpuvfio_domain", {**args, "state": "absent"}, context=built_host.context)
    assert not failed and lookup(built_host.libvirt, "train-2") is None


def test_domain_module_plans_an_attach_in_check_mode(run_module, built_host):
    root, state, _kernel = built_host
    failed, result = run_module("gpuvfio_domain", {"root": root, "state_dir": state, "name": "g", "devices": [GPU],
                                                   "uri": "test:///default", "state": "running", "vcpus": 2,
                                                   "memory": "2G", "hugepages": "none"}, check=True)
    assert not failed, result
    assert result["changed"] is True
    plan = result["plan"]  # attach's own plan (gpuvfio.ops.attach_plan), as attach --dry-run prints it
    assert plan["operation"] == "attach" and plan["result"] == "planned" and not plan["refused"]
    assert [s["step"] for s in plan["steps"]] == ["bind", "define", "start", "find address", "wait for ssh",
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
        failed, result = run_module("gpuvfio_verify", {
            "root": root, "state_dir": state, "ssh_host": "127.0.0.1", "ssh_port": bare.port,
            "known_hosts": bare.known_hosts, "expect_devices": [GPU], "ssh_private_key": key, "bandwidth": False})
        assert failed and result["report"]["ok"] is False  # an NVIDIA GPU and no CUDA: not a pass
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
        failed, result = run_module("gpuvfio_verify", args, check=True)
        assert not failed and result["changed"] is False, result
        assert result["report"]["ok"] is True
        checks = {c["id"]: c for c in result["report"]["checks"]}
        assert checks["pci_present"]["status"] == "pass" and checks["pci_present"]["observed"].startswith(GPU)
        assert checks["driver"]["status"] == "pass"
        assert private_key.splitlines()[1] not in json.dumps(result)
        os.unlink(os.path.join(root, "sys", "bus", "pci", "devices", GPU, "driver"))
        failed, result = run_module("gpuvfio_verify", args)
        assert failed and result["msg"].startswith("verification failed: driver")
        assert result["report"]["ok"] is False
    finally:
        server.stop()
    failed, result = run_module("gpuvfio_verify", {"root": root})
    assert failed and "domain" in result["msg"] and "ssh_host" in result["msg"]
    failed, result = run_module("gpuvfio_verify", {"root": root, "ssh_host": "127.0.0.1", "expect_devices": ["01:00.9"]})
    assert failed and result["exit_code"] == 2 and "01:00.9" in result["msg"]
    failed, result = run_module("gpuvfio_verify", {"root": root, "ssh_host": "127.0.0.1", "min_gbps": -1.0})
    assert failed and result["exit_code"] == 2 and "bandwidth" in result["msg"]


def test_secrets_stay_out_of_the_output(ansible_env, tmp_path):
    """ssh_private_key is no_log: ansible -vvv shows neither it nor its lines."""
    from gpuvfio.host.fixture import load_fixture

    root = tmp_path / "dgx"
    with open(os.path.join(SAMPLES, "dgx-h100.host"), encoding="utf-8") as handle:
        load_fixture(handle.read(), str(root))
    secret = "SeCrEt-KeY-MaTeRiAl-42"
    args = json.dumps({"root": str(root), "state_dir": str(tmp_path / "state"), "name": "g", "state": "running",
                       "devices": ["0000:1b:00.0"], "uri": "test:///default", "memory": "4G",
                       "stop_services": True, "ssh_private_key": f"-----BEGIN KEY-----\n{secret}\n-----END KEY-----"})
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible"), "localhost", "-c", "local", "-i", "localhost,",
                           "-m", "gpuvfio_domain", "-a", args, "--check", "-vvv",
                           "-e", f"ansible_python_interpreter={sys.executable}"],
                          cwd=PLAYBOOKS, capture_output=True, text=True, env=ansible_env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CHANGED" in proc.stdout
    assert secret not in proc.stdout + proc.stderr
    assert "VALUE_SPECIFIED_IN_NO_LOG_PARAMETER" in proc.stdout


# -- the playbooks against 8 simulated hosts -----------------------------------------------------

class _HostPrepRuns(threading.Thread):
    """host-prep.yml against its own 8 simulated hosts: in check mode (with --diff), applied,
    applied again. The runs take most of this file's time and leave one of the two cores
    idle (Ansible's controller loop is one process), so they start with the fleet and run
    beside the other playbook tests; the host-prep test waits for them."""

    RUNS = (("--check", "--diff"), (), ())

    def __init__(self, env: dict, fleet_hosts: dict, inventory: str) -> None:
        super().__init__(name="host-prep-runs", daemon=True)
        self.env, self.hosts, self.inventory = env, fleet_hosts, inventory
        self.results: list[tuple[int, dict, str]] = []
        self.check_left_roots_alone: dict[str, bool] = {}
        self.error: BaseException | None = None
        self.proc: subprocess.Popen | None = None
        self.stopped = False

    def run(self) -> None:
        try:
            before = {name: _tree_snapshot(info["root"]) for name, info in self.hosts.items()}
            for args in self.RUNS:
                if self.stopped:
                    return
                self.proc = subprocess.Popen(
                    [os.path.join(VENV_BIN, "ansible-playbook"), "-i", self.inventory, "host-prep.yml", *args],
                    cwd=PLAYBOOKS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    env={**self.env, "ANSIBLE_STDOUT_CALLBACK": "fleet_json"})
                out, err = self.proc.communicate(timeout=600)
                self.results.append((self.proc.returncode, _parse(out, err, self.proc.returncode, args), err))
                if not self.check_left_roots_alone:
                    self.check_left_roots_alone = {name: _tree_snapshot(info["root"]) == before[name]
                                                   for name, info in self.hosts.items()}
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def wait(self) -> list[tuple[int, dict, str]]:
        self.join(900)
        if self.error is not None:
            raise self.error
        assert len(self.results) == len(self.RUNS), "host-prep runs did not finish"
        return self.results

    def stop(self) -> None:
        self.stopped = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self.join(30)


@pytest.fixture(scope="module")
def fleet(ansible_env, tmp_path_factory):
    spec = importlib.util.spec_from_file_location("_fleet_simfleet", os.path.join(PLAYBOOKS, "simfleet.py"))
    simfleet = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(simfleet)
    make_fleet = simfleet.make_fleet

    out = tmp_path_factory.mktemp("fleet")
    hosts = make_fleet(str(out), 8, sys.executable)
    prep_dir = tmp_path_factory.mktemp("prep-fleet")
    prep_hosts = make_fleet(str(prep_dir), 8, sys.executable)
    prep = _HostPrepRuns(ansible_env, prep_hosts, os.path.join(str(prep_dir), "hosts.yml"))
    prep.start()
    yield {"dir": str(out), "inventory": os.path.join(str(out), "hosts.yml"), "hosts": hosts,
           "reports": os.path.join(str(out), "reports"), "env": ansible_env, "prep": prep,
           "prep_hosts": prep_hosts}
    prep.stop()


def _tree_snapshot(root: str) -> dict:
    snap = {}
    for directory, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            snap[path] = (st.st_size, st.st_mtime_ns)
    return snap


def test_inventory_playbook_collects_the_fleet_and_changes_nothing_the_second_time(fleet):
    report_dir = fleet["reports"]
    first = None
    for run in (1, 2):
        rc, data, err = _playbook(fleet["env"], "-i", fleet["inventory"], "inventory.yml",
                                  "-e", f"gpuvfio_report_dir={report_dir}")
        assert rc == 0, _failures(data) or err[-2000:]
        recap = _recap(data)
        assert set(recap) == set(fleet["hosts"]) | {"localhost"}
        for host in fleet["hosts"]:
            assert recap[host]["failures"] == 0 and recap[host]["changed"] == 0, recap
        if run == 1:
            assert recap["localhost"]["changed"] > 0  # the report was written
            first = open(os.path.join(report_dir, "inventory.json"), encoding="utf-8").read()
        else:
            assert recap["localhost"]["changed"] == 0, recap  # same facts, same report
    report = json.loads(first)
    assert sorted(report) == sorted(fleet["hosts"])
    for host, info in fleet["hosts"].items():
        summary = report[host]["summary"]
        if info["sample"] == "dgx-h100":
            assert summary["gpu_count"] == 8 and len(summary["viable_groups"]) == 8
            assert list(summary["gpu_models"].values()) == [8] and "H100" in next(iter(summary["gpu_models"]))
            assert summary["non_viable_groups"] == []
        elif info["sample"] == "workstation":
            (bad,) = summary["non_viable_groups"]
            assert any("igc" in p and "0000:03:00.0" in p for p in bad["problems"])
            assert summary["viable_groups"] == [1]
        elif info["sample"] == "iommu-off":
            assert summary["iommu_groups_present"] is False and "iommu" in summary["doctor_failed"]
        elif info["sample"] == "epyc-mixed":
            assert "vfio-pci" in summary["drivers"] and summary["gpu_count"] == 3
        assert report[host]["root"] == info["root"]
    markdown = open(os.path.join(report_dir, "inventory.md"), encoding="utf-8").read()
    assert "igc" in markdown and "8x GH100" in markdown and "IOMMU off" in markdown


def test_attach_playbook_in_check_mode_plans_and_changes_nothing(fleet):
    before = {name: _tree_snapshot(info["root"]) for name, info in fleet["hosts"].items()}
    rc, data, err = _playbook(fleet["env"], "-i", fleet["inventory"], "attach.yml", "--check", "--diff")
    assert rc == 0, _failures(data) or err[-2000:]
    recap = _recap(data)
    binds = _task_results(data, "Bind each guest")
    defines = _task_results(data, "Define each guest")
    starts = _task_results(data, "Start each guest")
    for host, info in fleet["hosts"].items():
        assert recap[host]["failures"] == 0
        if info["sample"] == "dgx-h100":
            assert recap[host]["changed"] == 3, recap[host]  # bind, define, start would change
            items = binds[host]["results"]
            assert [r["devices"] for r in items] == [["0000:1b:00.0"], ["0000:9d:00.0"]]
            assert all(r["changed"] and r["diff"]["after"].endswith(": vfio-pci\n") for r in items)
            assert {r["define"]["result"] for r in defines[host]["results"]} == {"would_define"}
            assert all(r["plan"]["result"] == "planned" and r["plan"]["bind"]["moving"]
                       for r in starts[host]["results"])
        elif info["sample"] == "epyc-mixed":  # the A100 is on vfio-pci already: only the domain would change
            (item,) = binds[host]["results"]
            assert item["changed"] is False and item["plan"]["result"] == "nothing_to_do"
            assert recap[host]["changed"] == 2
        else:
            assert recap[host]["changed"] == 0 and recap[host]["ok"] == 0  # no guests there
        assert _tree_snapshot(info["root"]) == before[host], f"check mode wrote into {host}'s root"
        assert not os.path.exists(os.path.join(info["state_dir"], "journal.json"))


def _file(info, *parts):
    path = os.path.join(info["root"], *parts)
    return open(path, encoding="utf-8").read() if os.path.exists(path) else None


# -- the Vagrant dev box ---------------------------------------------------------------------------

def test_vagrantfile_validates(tmp_path):
    vagrant = shutil.which("vagrant")
    _need(vagrant is not None, "vagrant (with vagrant-libvirt)")
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "VAGRANT_HOME": str(home / ".vagrant.d"),
           "VAGRANT_CHECKPOINT_DISABLE": "1", "VAGRANT_DEFAULT_PROVIDER": "libvirt",
           # vagrant keeps its machine state in <cwd>/.vagrant: keep it out of the work tree
           "VAGRANT_DOTFILE_PATH": str(tmp_path / "dotfile")}
    vagrant_dir = os.path.join(REPO, "vagrant")
    plugins = subprocess.run([vagrant, "plugin", "list"], cwd=vagrant_dir, capture_output=True, text=True,
                             env=env, timeout=120)
    _need("vagrant-libvirt" in plugins.stdout, "the vagrant-libvirt plugin")
    proc = subprocess.run([vagrant, "validate"], cwd=vagrant_dir, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "validated successfully" in proc.stdout
    assert not os.path.exists(os.path.join(vagrant_dir, ".vagrant"))
    # The box is shaped like the kernel lane's GPU host.
    text = open(os.path.join(vagrant_dir, "Vagrantfile"), encoding="utf-8").read()
    for device in ("intel-iommu,intremap=on", "e1000e,id=gpu_fn0,bus=rp_gpu,addr=0x0.0,multifunction=on",
                   "ich9-intel-hda,id=gpu_fn1,bus=rp_gpu,addr=0x0.1", "pxb-pcie,id=pxb_numa1",
                   "numa_node=1"):
        assert device in text


@pytest.mark.parametrize("name", ["gpuvfio_facts", "gpuvfio_device", "gpuvfio_domain", "gpuvfio_verify",
                                  "gpuvfio_host_info"])
def test_module_documentation_matches_its_argument_spec(modules, monkeypatch, name):
    """What ansible-test's validate-modules checks first: every option documented with the
    spec's type, default, choices and required, and nothing documented that is not there."""
    import yaml
    from ansible.module_utils import basic

    class Captured(Exception):
        pass

    def capture(self, argument_spec, **kwargs):
        raise Captured(argument_spec)

    monkeypatch.setattr(basic.AnsibleModule, "__init__", capture)
    with pytest.raises(Captured) as caught:
        modules[name].main()
    spec = caught.value.args[0]
    doc = yaml.safe_load(modules[name].DOCUMENTATION)
    yaml.safe_load(modules[name].EXAMPLES)
    yaml.safe_load(modules[name].RETURN)
    assert doc["module"] == name
    assert set(doc["options"]) == set(spec)
    for option, rules in spec.items():
        documented = doc["options"][option]
        assert documented.get("type", "str") == rules.get("type", "str"), option
        assert documented.get("default") == rules.get("default"), option
        assert documented.get("choices") == rules.get("choices"), option
        assert bool(documented.get("required")) == bool(rules.get("required")), option
        assert documented.get("elements") == rules.get("elements"), option


def test_verify_playbook_reports_every_guest_and_fails_naming_the_failing_ones(fleet):
    """No guest runs in the simulated fleet (libvirt's test driver): every guest fails, is
    reported per host on the controller, and the controller play fails naming them."""
    dgx = sorted(name for name, info in fleet["hosts"].items() if info["sample"] == "dgx-h100")[0]
    reports = os.path.join(fleet["dir"], "verify-reports")
    rc, data, err = _playbook(fleet["env"], "-i", fleet["inventory"], "verify.yml", "--limit", f"{dgx},localhost",
                              "-e", f"gpuvfio_report_dir={reports}")
    assert rc != 0
    recap = _recap(data)
    assert recap[dgx]["failures"] == 0 and recap["localhost"]["failures"] == 1
    (result,) = _task_results(data, "Fail for the guests").values()
    assert result["msg"] == (f"guests failing verification: {dgx}/train-0: no domain named train-0; "
                             f"{dgx}/train-1: no domain named train-1")
    report = json.load(open(os.path.join(reports, "verify", f"{dgx}.json"), encoding="utf-8"))
    assert report["messages"] == {"train-0": "no domain named train-0", "train-1": "no domain named train-1"}


def test_testbed_playbook_plans_runs_fetches_and_resumes(fleet, tmp_path):
    """A bare-metal-only testbed (it needs no guest): check mode shows gpuvfio's plan, a run
    measures and fetches the reports, a second run finds everything done (changed=0)."""
    dgx = sorted(name for name, info in fleet["hosts"].items() if info["sample"] == "dgx-h100")[0]
    extra = tmp_path / "testbed.json"
    extra.write_text(json.dumps({
        "gpuvfio_report_dir": str(tmp_path / "reports"),
        "gpuvfio_testbed": {"guest": {"kernel": "/var/lib/gpuvfio/vmlinux", "vcpus": 2, "memory": "2G",
                                      "virt_type": "qemu"},
                            "ssh": {"user": "root", "trust_on_first_use": True, "port": 2222},
                            "repetitions": 1, "gpus": ["1b:00"],  # a slot, expanded on the host
                            "variants": [{"name": "baremetal", "kind": "baremetal"}]}}))
    spec = os.path.join(fleet["hosts"][dgx]["root"], "var", "lib", "gpuvfio", "testbed", "spec.toml")
    rc, data, err = _playbook(fleet["env"], "-i", fleet["inventory"], "testbed.yml", "--limit", dgx,
                              "-e", f"@{extra}", "--check")
    assert rc == 0, _failures(data) or err[-2000:]
    plan = _task_results(data, "Print the plan")[dgx]["gpuvfio_testbed_plan.stdout_lines"]
    assert plan[:2] == ["selected 1b:00 -> 0000:1b:00.0", "== baremetal (baremetal)"]
    assert not os.path.exists(spec)
    for run in (1, 2):
        rc, data, err = _playbook(fleet["env"], "-i", fleet["inventory"], "testbed.yml", "--limit", dgx,
                                  "-e", f"@{extra}")
        assert rc == 0, _failures(data) or err[-2000:]
        changed = _recap(data)[dgx]["changed"]
        assert changed > 0 if run == 1 else changed == 0, _recap(data)
    fetched = tmp_path / "reports" / "testbed" / dgx
    assert sorted(os.listdir(fetched)) == ["identity.json", "report.html", "report.md", "results.json"]
    assert "baremetal" in (fetched / "report.md").read_text()
    assert 'gpus = ["1b:00"]' in open(spec, encoding="utf-8").read()
    identity = json.loads((fetched / "identity.json").read_text())
    assert identity["gpus"] == ["0000:1b:00.0"] and identity["accelerator_count"] == 1


def test_host_prep_check_mode_then_apply_then_nothing_left_to_change(fleet):
    prep = fleet["prep"]
    (rc, data, err), (rc2, data2, err2), (rc3, data3, err3) = prep.wait()
    hosts = fleet["prep_hosts"]
    assert rc == 0, _failures(data) or err[-2000:]
    predicted = _recap(data)
    for host in hosts:
        assert predicted[host]["failures"] == 0 and predicted[host]["changed"] > 0, predicted
        assert prep.check_left_roots_alone[host], f"check mode wrote into {host}'s root"
    assert "GRUB_CMDLINE_LINUX_DEFAULT" in json.dumps(_task_results(data, "Kernel command line through GRUB"))

    assert rc2 == 0, _failures(data2) or err2[-2000:]
    applied = _recap(data2)
    for host in hosts:
        assert applied[host]["failures"] == 0
        assert applied[host]["changed"] == predicted[host]["changed"], (host, predicted[host], applied[host])
    told = _task_results(data2, "Say what is left to do")

    assert rc3 == 0, _failures(data3) or err3[-2000:]
    again = _recap(data3)
    assert all(again[host]["changed"] == 0 and again[host]["failures"] == 0 for host in hosts), again

    for host, info in hosts.items():
        sample = info["sample"]
        grub = _file(info, "etc", "default", "grub.d", "99-gpuvfio.cfg")
        dracut = _file(info, "etc", "dracut.conf.d", "gpuvfio-vfio.conf")
        assert "vfio_pci" in _file(info, "etc", "modules-load.d", "gpuvfio-early.conf")
        assert "blacklist nouveau" in _file(info, "etc", "modprobe.d", "gpuvfio-blacklist-nouveau.conf")
        message = told[host]["msg"][0]
        if sample == "epyc-mixed":  # RHEL: dracut, grubby (not run on a simulated root); uneven 2M pages
            assert grub is None and "vfio_pci" in dracut
            unit = _file(info, "etc", "systemd", "system", "gpuvfio-hugepages.service")
            assert "echo 40960 > /sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages" in unit
            assert os.path.islink(os.path.join(info["root"], "etc/systemd/system/sysinit.target.wants/"
                                               "gpuvfio-hugepages.service"))
            assert message.startswith("reboot needed") and "hugepages=65536" in message
        else:
            assert dracut is None and "vfio_pci" in _file(info, "etc", "initramfs-tools", "modules")
            assert "GRUB_CMDLINE_LINUX_DEFAULT=" in grub and "intel_iommu=on iommu=pt" in grub
        if sample == "dgx-h100":  # 256 x 1G per node on 5.15: hugepages=512, as it runs already
            assert "default_hugepagesz=1G hugepagesz=1G hugepages=512" in grub
            assert message == "no reboot needed"
        if sample == "iommu-off":
            assert message.startswith("reboot needed") and "intel_iommu=off" in message
        if sample == "workstation":
            assert "iommu=pt" in message and "hugepages" not in grub


def test_role_installs_a_wheel_built_from_this_checkout_never_a_bare_name(ansible_env, tmp_path):
    """host-prep's install step: a wheel built from the checkout on the controller, copied to the host
    and installed into gpuvfio's venv; a bare package name (which a public index could serve
    anything under) is refused. On main the role pip-installed the name "gpuvfio"."""
    play = tmp_path / "install.yml"
    play.write_text(f"""---
- name: Install gpuvfio the way host-prep does
  hosts: localhost
  connection: local
  gather_facts: false
  vars:
    gpuvfio_os_family: debian
    gpuvfio_system_packages: {{debian: []}}
    gpuvfio_venv: {tmp_path}/venv
    gpuvfio_package_cache: {tmp_path}/cache
    gpuvfio_wheel_dir: {tmp_path}/dist
    gpuvfio_bin_link: {tmp_path}/gpuvfio
    gpuvfio_virtualenv_command: {sys.executable} -m venv
  tasks:
    - name: The role's install tasks
      ansible.builtin.include_role:
        name: gpuvfio
        tasks_from: install
""")
    env = {k: v for k, v in ansible_env.items() if k != "PYTHONPATH"}  # only what the venv gets
    env["ANSIBLE_ROLES_PATH"] = os.path.join(PLAYBOOKS, "roles")
    rc, data, err = _playbook(env, "-i", "localhost,", str(play), "-e", "gpuvfio_package=gpuvfio")
    assert rc != 0 and "is a name" in _failures(data), _failures(data) or err[-2000:]
    assert not (tmp_path / "venv").exists()
    rc, data, err = _playbook(env, "-i", "localhost,", str(play), timeout=1200)
    assert rc == 0, _failures(data) or err[-2000:]
    (wheel,) = os.listdir(tmp_path / "cache")
    assert wheel.startswith("gpuvfio-") and wheel.endswith(".whl")
    version = subprocess.run([str(tmp_path / "gpuvfio"), "--version"], capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, cwd=str(tmp_path))
    assert version.returncode == 0 and version.stdout.startswith("gpuvfio "), version.stderr
    rc, data, err = _playbook(env, "-i", "localhost,", str(play), timeout=1200)  # the same wheel again
    assert rc == 0 and _recap(data)["localhost"]["changed"] == 0, _recap(data)
    location = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c",
                               "import gpuvfio; print(gpuvfio.__file__)"],
                              capture_output=True, text=True, cwd=str(tmp_path), check=True,
                              env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).stdout
    assert str(tmp_path / "venv") in location


def test_failed_attach_gives_back_only_what_it_bound(run_module, built_host, guest_server):
    """The role binds the GPU first (gpuvfio_device), then attaches: a failing attach must not
    give back a GPU it did not bind (on main its rollback released whatever gpuvfio held)."""
    root, state, kernel = built_host
    ctx = built_host.context
    server, _private_key = guest_server
    failed, result = run_module("gpuvfio_device", {"root": root, "state_dir": state, "devices": [GPU]}, context=ctx)
    assert not failed and kernel.driver_of(GPU) == "vfio-pci", result
    args = {"root": root, "state_dir": state, "name": "train-3", "devices": [GPU], "uri": "test:///default",
            "vcpus": 2, "memory": "2G", "hugepages": "none", "firmware": "bios", "state": "running",
            "ssh_host": "127.0.0.1", "ssh_port": server.port, "known_hosts": server.known_hosts,
            "boot_timeout": 10}
    failed, result = run_module("gpuvfio_domain", args, context=ctx)  # no key: SSH refuses
    assert failed and result["attach"]["rolled_back"] == ["destroy", "undefine"], result["attach"]
    assert kernel.driver_of(GPU) == "vfio-pci" and kernel.driver_of(AUDIO) == "vfio-pci"


def test_attach_refuses_a_gpu_another_domain_uses(run_module, built_host):
    """A GPU already on vfio-pci is "nothing to bind", but another domain using it still refuses an
    attach (on main the check was skipped and the rollback then unbound it under that guest)."""
    from gpuvfio.virt.lifecycle import lookup

    root, state, kernel = built_host
    ctx = built_host.context
    base = {"root": root, "state_dir": state, "devices": [GPU], "uri": "test:///default", "vcpus": 2,
            "memory": "2G", "hugepages": "none", "firmware": "bios"}
    failed, result = run_module("gpuvfio_domain", dict(base, name="owner"), context=ctx)
    assert not failed, result
    failed, result = run_module("gpuvfio_device", {"root": root, "state_dir": state, "devices": [GPU]}, context=ctx)
    assert not failed and kernel.driver_of(GPU) == "vfio-pci", result
    failed, result = run_module("gpuvfio_domain", dict(base, name="intruder", state="running", ssh_host="127.0.0.1",
                                                       ssh_port=1, boot_timeout=1), context=ctx)
    assert failed and result["exit_code"] == 1 and "libvirt domain(s) owner" in result["msg"], result
    assert lookup(built_host.libvirt, "intruder") is None and kernel.driver_of(GPU) == "vfio-pci"
