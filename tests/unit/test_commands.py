"""One way to start a process (issue 23 item 6): gpuvfio.commands runs every local command, and
the Context's runner is what ssh -G, the Fabric Manager client and modprobe/systemctl go
through -- a Context built around a recording runner sees their argument lists, and no process
starts."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from gpuvfio.bind.fabric_manager import FabricManagerClient, FabricManagerError, FabricManagerTimeout
from gpuvfio.commands import (Command, CommandFailed, CommandNotStarted, CommandOutputLimit, CommandTimeout,
                              Finished, Runner)
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.guest.ssh_config import resolve
from gpuvfio.host.root import HostRoot
from gpuvfio.ops import fabric
from gpuvfio.ops.context import Context, host_context, live_actions

PY = sys.executable
PARTITIONS = {"numPartitions": 1, "maxNumPartitions": 64, "partitionInfo": [
    {"partitionId": 3, "isActive": 0, "numGpus": 1,
     "gpuInfo": [{"physicalId": 1, "uuid": "GPU-1", "pciBusId": "00000000:1B:00.0"}]}]}


class Recorder:
    """A runner's ``start`` that records each command and answers from a table (argv -> answer);
    it never starts a process."""

    def __init__(self, answers: dict[tuple[str, ...], Finished] | None = None,
                 default: Finished = Finished(0, b"", b"")) -> None:
        self.commands: list[Command] = []
        self.answers = answers or {}
        self.default = default

    def __call__(self, command: Command) -> Finished:
        self.commands.append(command)
        answer = self.answers.get(command.argv, self.default)
        if isinstance(answer, Exception):
            raise answer
        return answer

    @property
    def argvs(self) -> list[list[str]]:
        return [list(c.argv) for c in self.commands]


@pytest.fixture
def tree(workstation, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    return HostRoot(workstation.root)


# -- the runner on this machine ----------------------------------------------------------------
def test_output_of_a_command_and_its_environment():
    run = Runner()
    assert run([PY, "-c", "print('hello')"], 20) == "hello\n"
    env = dict(os.environ, GPUVFIO_TEST_VALUE="passed in")
    assert run([PY, "-c", "import os; print(os.environ['GPUVFIO_TEST_VALUE'])"], 20, env=env) == "passed in\n"
    done = run.finish([PY, "-c", "import sys; sys.stdout.write('out'); sys.stderr.write('err'); sys.exit(3)"], 20)
    assert done == Finished(3, b"out", b"err")


def test_stdin_is_empty_not_the_terminal():
    assert Runner()([PY, "-c", "import sys; print(repr(sys.stdin.read()))"], 20) == "''\n"


def test_a_failure_is_one_line_with_the_last_thing_said():
    with pytest.raises(CommandFailed) as info:
        Runner()([PY, "-c", "import sys; print('first', file=sys.stderr); print('last\\x1b[2J', file=sys.stderr); "
                  "sys.exit(4)"], 20)
    assert str(info.value) == f"{PY} -c import sys; print('first', file=sys.stderr); print('last\\x1b[2J', " \
                              "file=sys.stderr); sys.exit(4) failed: last?[2J"
    assert info.value.status == 4 and "\n" not in str(info.value)
    with pytest.raises(CommandFailed, match=r"failed: exit 5$"):
        Runner()([PY, "-c", "raise SystemExit(5)"], 20)


def test_a_missing_program_is_named():
    with pytest.raises(CommandNotStarted, match=r"^cannot run /nonexistent/fmpm: No such file or directory$"):
        Runner()(["/nonexistent/fmpm", "-l"], 20)


def test_a_timeout_kills_what_the_command_started_too():
    """The background sleep keeps the pipes open: without the process group killed, the read
    would last its 60 seconds."""
    started = time.monotonic()
    with pytest.raises(CommandTimeout) as info:
        Runner().finish(["sh", "-c", "sleep 60 & sleep 60"], 0.5, label="sleepers")
    assert time.monotonic() - started < 10
    assert str(info.value) == "sleepers: no answer within 0.5s" and info.value.reason == "no answer within 0.5s"


def test_output_past_the_limit_is_cut_off():
    with pytest.raises(CommandOutputLimit, match=r"more than 1000 bytes of output"):
        Runner().finish([PY, "-c", "import sys\nwhile True: sys.stdout.write('x' * 4096)"], 20, limit=1000)


def test_a_command_is_an_argument_list():
    for bad in ((), (b"ls",), ("ls", 1)):
        with pytest.raises(GpuvfioError, match="non-empty list of strings"):
            Command(bad, 5)
    assert Command(("modprobe", "--", "vfio-pci", "x"), 5).label == "modprobe -- vfio-pci"


# -- the Context's runner is the one way ---------------------------------------------------------
def test_a_context_runs_its_commands_through_its_runner(tree):
    recorder = Recorder(default=Finished(0, b"done\n", b""))
    ctx = Context(host=tree, run=Runner(recorder), writable=True)
    assert ctx.run(["sh", "/probe.sh"], 5) == "done\n"
    actions = live_actions(ctx.run, timeout=7)
    actions.modprobe("vfio-pci")
    actions.stop_service("nvidia-persistenced.service")
    assert recorder.argvs == [["sh", "/probe.sh"], ["modprobe", "--", "vfio-pci"],
                              ["systemctl", "stop", "--", "nvidia-persistenced.service"]]
    assert [c.timeout for c in recorder.commands] == [5, 7, 7]
    assert isinstance(host_context(tree).run, Runner)


def test_the_ssh_config_is_resolved_through_the_runner(tmp_path, tree):
    config = tmp_path / "ssh_config"
    config.write_text("Host lab\n  HostName 192.0.2.9\n  User admin\n  Port 2200\n")
    defaults = Finished(0, b"hostname lab\nuser me\nport 22\n", b"")
    answers = {("ssh", "-G", "-F", str(config), "--", "lab"): Finished(0, b"hostname 192.0.2.9\nuser admin\n"
                                                                          b"port 2200\n", b""),
               ("ssh", "-G", "-F", os.devnull, "--", "lab"): defaults}
    recorder = Recorder(answers)
    ctx = Context(host=tree, run=Runner(recorder), writable=True)
    found = resolve("lab", str(config), ssh="ssh", run=ctx.run)
    assert recorder.argvs == [["ssh", "-G", "-F", str(config), "--", "lab"],
                              ["ssh", "-G", "-F", os.devnull, "--", "lab"]]
    assert (found.hostname, found.user, found.port, found.source) == ("192.0.2.9", "admin", 2200, "ssh -G")
    assert all(c.timeout == 10.0 for c in recorder.commands)


def test_ssh_g_failures_are_bad_input_in_one_line(tmp_path, tree):
    config = tmp_path / "ssh_config"
    config.write_text("Host lab\n  Bogus yes\n")
    said = Recorder(default=Finished(255, b"", b"line 1\n/x: line 2: Bad configuration option: bogus\n"))
    with pytest.raises(InputError) as info:
        resolve("lab", str(config), ssh="ssh", run=Runner(said))
    assert info.value.exit_code == 2 and str(info.value) == "ssh -G lab: /x: line 2: Bad configuration option: bogus"
    slow = Recorder(answers={("ssh", "-G", "-F", str(config), "--", "lab"): CommandTimeout("ssh -G lab", "no answer "
                                                                                           "within 10s")})
    with pytest.raises(InputError) as info:
        resolve("lab", str(config), ssh="ssh", run=Runner(slow))
    assert info.value.exit_code == 2 and str(info.value) == "ssh -G lab: no answer within 10s"


def test_the_fabric_manager_client_runs_through_the_contexts_runner(tree):
    recorder = Recorder({("fmpm", "-l"): Finished(0, json.dumps(PARTITIONS).encode(), b"")})
    ctx = Context(host=tree, run=Runner(recorder), fabric_manager=FabricManagerClient, writable=True)
    partitions = ctx.fabric_manager().list_partitions()
    assert [(p.partition_id, p.active) for p in partitions] == [(3, False)]
    fabric.client(ctx).activate(3)
    assert recorder.argvs == [["fmpm", "-l"], ["fmpm", "-a", "3"]]
    assert all(c.timeout == 60.0 and c.limit == 1 << 20 for c in recorder.commands)


def test_a_client_made_elsewhere_still_runs_through_the_contexts_runner(tree):
    """Whoever builds the client (here with its own command and instance), the Context hands it
    out with the Context's runner: no process starts."""
    recorder = Recorder(default=Finished(249, b"Failed to activate partition. fmReturn: -7\n", b""))
    ctx = Context(host=tree, run=Runner(recorder),
                  fabric_manager=lambda: FabricManagerClient(["/opt/fm/fmpm"], hostname="10.0.0.2", timeout=9), writable=True)
    with pytest.raises(FabricManagerError) as info:
        ctx.fabric_manager().activate(1)
    assert info.value.status == -7 and "FM_ST_IN_USE" in str(info.value)
    assert recorder.argvs == [["/opt/fm/fmpm", "--hostname", "10.0.0.2", "-a", "1"]]
    assert recorder.commands[0].timeout == 9.0


def test_the_fabric_manager_client_names_the_runners_errors_its_way(tree):
    recorder = Recorder(answers={("fmpm", "-l"): CommandTimeout("fmpm -l (list the partitions)",
                                                                "no answer within 60s")})
    ctx = Context(host=tree, run=Runner(recorder), fabric_manager=FabricManagerClient, writable=True)
    with pytest.raises(FabricManagerTimeout) as info:
        ctx.fabric_manager().list_partitions()
    assert str(info.value) == "fmpm -l (list the partitions): no answer within 60s" and info.value.status is None


def test_a_read_only_context_has_no_fabric_manager(tree):
    ctx = Context(host=tree, run=Runner(Recorder()), fabric_manager=FabricManagerClient)
    assert ctx.fabric_manager is None
