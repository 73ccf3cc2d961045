"""The playbooks, the role and the Vagrant dev box as users run them (the package lane); the
playbooks are those of the collection gpuvfio.gpuvfio (playbooks/collections/), run through the
one-line wrappers in playbooks/ (the collection built, installed and sanity-tested:
tests/package/test_collection.py):

* ansible-playbook --syntax-check and ansible-lint (production profile) for every playbook;
* real ansible-playbook runs against 8 simulated hosts at once (the four sample fixtures,
  twice each, loaded into temp dirs; ansible_connection=local, one gpuvfio_root and
  GPUVFIO state dir per host): inventory.yml twice, attach.yml in check mode, host-prep.yml
  in check mode, then applied, then applied again with changed=0 everywhere; verify.yml and
  testbed.yml;
* the role installing a wheel built from this checkout; secrets kept out of the output;
* ``vagrant validate`` for vagrant/Vagrantfile.

The modules themselves, in-process: tests/unit/test_fleet.py. Needs ansible-core and
ansible-lint in the venv and vagrant + vagrant-libvirt (Debian packages). Without them the
tests skip, except under ``make test`` (GPUVFIO_REQUIRE_LANES=1), where a missing tool fails
them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import stat
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

from tests.conftest import need_tool, venv_which  # noqa: E402



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
    need_tool(importlib.util.find_spec("ansible") is not None and venv_which("ansible-playbook") is not None,
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
    # Ansible's own warnings about the playbooks ([WARNING]: and [DEPRECATION WARNING]:), not a
    # Python library's warning on import: cryptography 51 warns of DSA when ansible-core 2.19
    # imports its ssh-agent module, whatever the playbooks say.
    assert re.findall(r"^\[(?:DEPRECATION )?WARNING\].*", proc.stderr, re.M | re.I) == [], proc.stderr


def test_ansible_lint_production_profile_is_clean(ansible_env):
    lint = venv_which("ansible-lint")
    need_tool(lint is not None, "ansible-lint")
    proc = subprocess.run([lint, "--offline", "--profile", "production", "--nocolor"], cwd=PLAYBOOKS,
                          capture_output=True, text=True, env=ansible_env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Profile 'production' was required, and it passed" in out, out


def test_secrets_stay_out_of_the_output(ansible_env, tmp_path):
    """ssh_private_key is no_log: ansible -vvv shows neither it nor its lines."""
    from gpuvfio.host.fixture import load_fixture

    root = tmp_path / "dgx"
    with open(os.path.join(SAMPLES, "dgx-h100.host"), encoding="utf-8") as handle:
        load_fixture(handle.read(), str(root))
    secret = "SeCrEt-KeY-MaTeRiAl-42"
    disk = tmp_path / "g.qcow2"  # a guest that can boot and be reached (its plan checks both)
    disk.write_bytes(b"QFI\xfb")
    args = json.dumps({"root": str(root), "state_dir": str(tmp_path / "state"), "name": "g", "state": "running",
                       "devices": ["0000:1b:00.0"], "uri": "test:///default", "memory": "4G",
                       "disk": str(disk), "network": "default",
                       "stop_services": True, "ssh_private_key": f"-----BEGIN KEY-----\n{secret}\n-----END KEY-----"})
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible"), "localhost", "-c", "local", "-i", "localhost,",
                           "-m", "gpuvfio.gpuvfio.domain", "-a", args, "--check", "-vvv",
                           "-e", f"ansible_python_interpreter={sys.executable}"],
                          cwd=PLAYBOOKS, capture_output=True, text=True, env=ansible_env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CHANGED" in proc.stdout
    assert secret not in proc.stdout + proc.stderr
    assert "VALUE_SPECIFIED_IN_NO_LOG_PARAMETER" in proc.stdout


# -- the role's argument validation (meta/argument_specs.yml) ------------------------------------

# The entry points each playbook runs the role with, play by play.
ENTRY_POINTS = {"host-prep.yml": ["host_prep"], "inventory.yml": ["facts", "report_inventory"],
                "attach.yml": ["attach"], "verify.yml": ["verify", "report_verify"], "testbed.yml": ["testbed"]}
VALIDATING = "Validating arguments against arg spec '{}'"


def test_the_example_inventory_passes_the_roles_argument_validation(ansible_env):
    """Every playbook with the example inventory (inventory/: its guests, groups and hosts), only
    the tasks tagged always, which the validation ansible-core puts first in the role is (a tag
    that no task has leaves the rest out; the hosts are not reached): each entry point is
    validated on each of its hosts and passes."""
    for name, entries in ENTRY_POINTS.items():
        rc, data, err = _playbook(ansible_env, "-i", "inventory/hosts.yml", name, "--tags", "validation-only",
                                  "-e", "ansible_connection=local")
        assert rc == 0, _failures(data) or err[-2000:]
        ran = [task["task"]["name"] for play in data["plays"] for task in play["tasks"]]
        assert len(ran) == len(entries) and all(VALIDATING.format(e) in t for t, e in zip(ran, entries)), ran
        for entry in entries:
            results = _task_results(data, VALIDATING.format(entry))
            hosts = {"localhost"} if entry.startswith("report_") else {
                "dgx-01.example.net", "dgx-02.example.net", "epyc-01.example.net", "ws-01.example.net"}
            assert set(results) == hosts, (entry, sorted(results))
            assert all(r.get("msg") == "The arg spec validation passed" for r in results.values()), entry


@pytest.mark.parametrize("setting, named", [
    ("rom_bar: maybe", "value of rom_bar must be one of: on, off, got: maybe found in gpuvfio_guests"),
    ("romm_bar: 'on'", "gpuvfio_guests.romm_bar. Supported parameters include: "),
    ("vcpus: many", "argument 'vcpus' is of type str found in 'gpuvfio_guests'"),
])
def test_a_bad_guest_entry_fails_the_role_before_any_task(ansible_env, tmp_path, setting, named):
    """ansible-core checks gpuvfio_guests against the role's spec before attach's first task: a value
    outside the table's choices, an unknown key (a misspelling the tasks would never read) or a
    value of the wrong type fails there, naming it, and nothing is bound or defined."""
    play = tmp_path / "attach.yml"
    play.write_text(f"""---
- name: Attach a guest with a bad entry
  hosts: localhost
  connection: local
  gather_facts: false
  vars:
    gpuvfio_root: {tmp_path}/root
    gpuvfio_state_dir: {tmp_path}/state
    gpuvfio_python: {sys.executable}
    gpuvfio_libvirt_uri: test:///default
    gpuvfio_guests:
      - name: g
        gpus: ["0000:1b:00.0"]
        {setting}
  tasks:
    - name: The role's attach tasks
      ansible.builtin.import_role:
        name: gpuvfio.gpuvfio.gpuvfio
        tasks_from: attach
""")
    env = dict(ansible_env, ANSIBLE_COLLECTIONS_PATH=os.path.join(PLAYBOOKS, "collections"))
    rc, data, err = _playbook(env, "-i", "localhost,", str(play))
    assert rc != 0
    ran = [task["task"]["name"] for p in data["plays"] for task in p["tasks"]]
    assert len(ran) == 1 and VALIDATING.format("attach") in ran[0], ran
    (result,) = _task_results(data, VALIDATING.format("attach")).values()
    assert result.get("failed") and len(result["argument_errors"]) == 1, result.get("msg")
    assert result["argument_errors"][0].startswith(named), result["argument_errors"]


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
    # One DGX has the textfile collector's directory already, private: host-prep leaves its mode.
    os.makedirs(os.path.join(prep_hosts["dgx-h100-1"]["root"], COLLECTOR), mode=0o750)
    os.chmod(os.path.join(prep_hosts["dgx-h100-1"]["root"], COLLECTOR), 0o750)
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
    validated = _task_results(data, "Validating arguments against arg spec 'attach'")
    assert sorted(validated) == sorted(fleet["hosts"]) and not _failures(data)  # the guests pass the spec
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
        else:  # no guests there: the role's argument validation is all that runs
            assert recap[host]["changed"] == 0 and recap[host]["ok"] == 1
        assert _tree_snapshot(info["root"]) == before[host], f"check mode wrote into {host}'s root"
        assert not os.path.exists(os.path.join(info["state_dir"], "journal.json"))


COLLECTOR = "var/lib/node_exporter/textfile_collector"  # simfleet.py's gpuvfio_health_textfile's directory


def _health_timer_verifies(info) -> None:
    """The health timer host-prep installs (gpuvfio_health_textfile), enabled, read by systemd's
    own parser: systemd-analyze verify in a root holding this machine's units and the two, with
    gpuvfio where gpuvfio_bin_link puts it; a value it ignores (a warning) fails too."""
    units = os.path.join(info["root"], "etc", "systemd", "system")
    service = _file(info, "etc", "systemd", "system", "gpuvfio-health.service")
    assert "ExecStart=/usr/local/bin/gpuvfio health --all --record --textfile " \
           "/var/lib/node_exporter/textfile_collector/gpuvfio.prom\n" in service
    assert os.readlink(os.path.join(units, "timers.target.wants", "gpuvfio-health.timer")) == \
        "/etc/systemd/system/gpuvfio-health.timer"
    collector = os.stat(os.path.join(info["root"], COLLECTOR))
    assert stat.S_IMODE(collector.st_mode) == (0o750 if info["root"].endswith("dgx-h100-1") else 0o755)
    analyze = shutil.which("systemd-analyze")
    if analyze is None or not os.path.isdir("/usr/lib/systemd/system"):
        pytest.fail("systemd-analyze and the system's units are missing: the unit check cannot run")
    verify_root = os.path.join(os.path.dirname(info["root"]), "..", "verify-" + os.path.basename(info["root"]))
    shutil.copytree("/usr/lib/systemd/system", os.path.join(verify_root, "usr/lib/systemd/system"), symlinks=True)
    for name in ("gpuvfio-health.service", "gpuvfio-health.timer"):
        os.makedirs(os.path.join(verify_root, "etc/systemd/system"), exist_ok=True)
        shutil.copy(os.path.join(units, name), os.path.join(verify_root, "etc/systemd/system", name))
    os.makedirs(os.path.join(verify_root, "usr/local/bin"))
    with open(os.path.join(verify_root, "usr/local/bin/gpuvfio"), "w", encoding="utf-8") as handle:
        handle.write("#!/bin/sh\n")
    os.chmod(os.path.join(verify_root, "usr/local/bin/gpuvfio"), 0o755)
    done = subprocess.run([analyze, "verify", f"--root={os.path.abspath(verify_root)}",
                           "/etc/systemd/system/gpuvfio-health.timer", "/etc/systemd/system/gpuvfio-health.service"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr


def _file(info, *parts):
    path = os.path.join(info["root"], *parts)
    return open(path, encoding="utf-8").read() if os.path.exists(path) else None


# -- the Vagrant dev box ---------------------------------------------------------------------------

def test_vagrantfile_validates(tmp_path):
    vagrant = shutil.which("vagrant")
    need_tool(vagrant is not None, "vagrant (with vagrant-libvirt)")
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "VAGRANT_HOME": str(home / ".vagrant.d"),
           "VAGRANT_CHECKPOINT_DISABLE": "1", "VAGRANT_DEFAULT_PROVIDER": "libvirt",
           # vagrant keeps its machine state in <cwd>/.vagrant: keep it out of the work tree
           "VAGRANT_DOTFILE_PATH": str(tmp_path / "dotfile")}
    vagrant_dir = os.path.join(REPO, "vagrant")
    plugins = subprocess.run([vagrant, "plugin", "list"], cwd=vagrant_dir, capture_output=True, text=True,
                             env=env, timeout=120)
    need_tool("vagrant-libvirt" in plugins.stdout, "the vagrant-libvirt plugin")
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
            _health_timer_verifies(info)
        else:  # no gpuvfio_health_textfile: no timer
            assert _file(info, "etc", "systemd", "system", "gpuvfio-health.timer") is None
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
        name: gpuvfio.gpuvfio.gpuvfio
        tasks_from: install
""")
    env = {k: v for k, v in ansible_env.items() if k != "PYTHONPATH"}  # only what the venv gets
    env["ANSIBLE_COLLECTIONS_PATH"] = os.path.join(PLAYBOOKS, "collections")  # the role in the checkout
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
