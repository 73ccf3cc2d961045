"""Testbeds on a remote hypervisor ([host]): real SSH (dropbear on 127.0.0.1), real gpuvfio there.

The hypervisor lane (tests/lanes/hypervisor.py) makes this machine the "remote" host:
``testbed plan`` records it with ``gpuvfio dump-host`` over SSH and plans here; ``testbed
run`` (daemon lane) runs gpuvfio there against the test libvirtd, streams its progress,
fetches the results; a local Ctrl-C hangs the remote run up, which tears its guest down.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

import pytest

from gpuvfio.host.root import HostRoot
from gpuvfio.ops.context import Context
from tests.lanes import hypervisor as hv
from tests.make_samples import sample_path
from tests.testbed_data import guest_toml

_REASON = hv.skip_reason()
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)

PLAN_SPEC = """
[guest]
disk = "/var/lib/libvirt/images/g.qcow2"
vcpus = 8
memory = "32G"
[guest.ssh]
port = 2222

[run]
gpus = ["0000:1b:00.0"]
stop_services = true  # the DGX sample runs persistenced, fabricmanager and DCGM

[[variant]]
name = "pt-1g"
kind = "passthrough"
hugepages = "1G"

[[variant]]
name = "pt-remote"
kind = "passthrough"
numa = "remote"
"""


def this_machine(tmp_path) -> Context:
    """The Context of the machine a remote run is started from: its runner and clock, a state dir
    of its own for host keys trusted on first use."""
    (tmp_path / "here").mkdir(exist_ok=True)
    return Context(host=HostRoot(str(tmp_path / "here")))


def reps(directory) -> list[str]:
    """A variant's recorded repetitions (beside them, steps.json: its plan and the steps taken)."""
    return sorted(name for name in os.listdir(directory) if name.startswith("rep-"))


def host_section(server, root: str | None = None, pin: bool = True) -> str:
    lines = ["[host]", 'address = "127.0.0.1"', f"port = {server.port}", f'key = "{server.client_key}"',
             f"gpuvfio = {json.dumps([sys.executable, '-m', 'gpuvfio'])}"]
    lines.append(f'known_hosts = "{server.known_hosts}"' if pin else "trust_on_first_use = true")
    if root:
        lines.append(f'root = "{root}"')
    return "\n".join(lines) + "\n"


def test_remote_plan_is_the_plan_made_there(cli, tmp_path, hypervisor):
    sample = sample_path("dgx-h100")
    local = tmp_path / "local.toml"
    local.write_text(PLAN_SPEC)
    remote = tmp_path / "remote.toml"
    remote.write_text(PLAN_SPEC + host_section(hypervisor, root=sample))
    here = cli("--root", sample, "testbed", "plan", str(local), "--json")
    there = cli("testbed", "plan", str(remote), "--json")
    assert here.code == 0 and there.code == 0, there.err
    remote_plan = there.json()
    assert remote_plan.pop("host") == f"root@127.0.0.1:{hypervisor.port}"
    local_plan = here.json()
    for plan in (local_plan, remote_plan):
        plan.pop("spec")
    assert remote_plan == local_plan
    assert remote_plan["variants"][0]["bind"]["devices"] == ["0000:1b:00.0"]
    text = cli("testbed", "plan", str(remote))
    assert text.out.startswith(f"hypervisor root@127.0.0.1:{hypervisor.port} (over SSH)\n")
    # A ROM image the spec names is on the hypervisor, not in its recording: the plan says it did not
    # check it (the run there does), where a plan of this host refuses a file it does not have.
    rom = 'memory = "32G"\nrom_file = "/usr/share/vbios/clean.rom"'
    remote.write_text(PLAN_SPEC.replace('memory = "32G"', rom) + host_section(hypervisor, root=sample))
    there = cli("testbed", "plan", str(remote), "--json")
    assert there.code == 0, there.err
    assert any("--rom-file /usr/share/vbios/clean.rom not checked here" in w
               for w in there.json()["variants"][0]["warnings"])
    local.write_text(PLAN_SPEC.replace('memory = "32G"', rom))
    here = cli("--root", sample, "testbed", "plan", str(local))
    assert here.code == 2 and "rom_file '/usr/share/vbios/clean.rom': no such file on this host" in here.err


def test_unknown_host_key_is_refused_and_trust_on_first_use_records_it(cli, tmp_path, hypervisor, monkeypatch):
    local_state = tmp_path / "local-state"
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(local_state))
    spec = tmp_path / "remote.toml"
    other = tmp_path / "other_known_hosts"
    other.write_text("[127.0.0.1]:1 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDsSEvQbDPLi0A4sMpn3Xr9sqMSgqKMwP5Jl0l5AqEQ5\n")
    spec.write_text(PLAN_SPEC + host_section(hypervisor, root=sample_path("workstation")).replace(
        hypervisor.known_hosts, str(other)))
    refused = cli("testbed", "plan", str(spec))
    assert refused.code == 1 and "unknown host key" in refused.err and refused.err.count("\n") == 1, refused.err
    spec.write_text(PLAN_SPEC + host_section(hypervisor, root=sample_path("dgx-h100"), pin=False))
    trusted = cli("testbed", "plan", str(spec), "--json")
    assert trusted.code == 0, trusted.err
    recorded = (local_state / "known_hosts").read_text()
    assert recorded.startswith(f"[127.0.0.1]:{hypervisor.port} ssh-ed25519 ")
    assert recorded.split()[2] == open(hypervisor.known_hosts).read().split()[2]


def test_remote_failure_is_one_line(cli, tmp_path, hypervisor):
    spec = tmp_path / "remote.toml"
    spec.write_text(PLAN_SPEC + host_section(hypervisor, root="/nonexistent/host.fixture"))
    result = cli("testbed", "plan", str(spec))
    assert result.code == 1 and result.err.count("\n") == 1, result.err
    assert "gpuvfio dump-host on root@127.0.0.1" in result.err and "/nonexistent/host.fixture" in result.err


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def run_spec(tmp_path, image, port, known, server, uri) -> str:
    from tests.testbed_data import tiny_guest_toml

    text = tiny_guest_toml(image, port, known) + f"""
[run]
repetitions = 2
connect = "{uri}"
stop_timeout = 10  # the tiny guest's ACPI shutdown gets 10 s, then it is destroyed

[[variant]]
name = "tiny-4k"
kind = "passthrough"
hugepages = "none"
numa = "none"

[[variant]]
name = "baremetal"
kind = "baremetal"
""" + host_section(server)
    path = tmp_path / "testbed.toml"
    path.write_text(text)
    return str(path)


def test_remote_run_hung_up_tears_down_there_and_resumes(daemon, tmp_path, hypervisor):
    """Ctrl-C here closes the SSH channel: the run there tears its guest down; a rerun resumes."""
    from gpuvfio.errors import GpuvfioError
    from gpuvfio.testbed.remote import run_remote
    from gpuvfio.testbed.report import write_report
    from gpuvfio.testbed.spec import load_spec
    from tests.lanes import guest as gl

    image = gl.build_guest()
    port = gl.free_port()
    known = tmp_path / "guest_known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {image.host_key_line}\n")
    spec = load_spec(run_spec(tmp_path, image, port, known, hypervisor, daemon.uri))
    out = str(tmp_path / "out")
    seen: list[str] = []

    def interrupt_on_second_repetition(line):
        seen.append(line)
        if line == "tiny-4k: repetition 2/2":
            raise KeyboardInterrupt

    conn = daemon.connect()
    try:
        with pytest.raises(GpuvfioError, match="interrupted"):
            run_remote(this_machine(tmp_path), spec, out, progress=interrupt_on_second_repetition)
        assert "tiny-4k: attach" in seen
        assert [d.name() for d in conn.listAllDomains(0) if d.name().startswith("gpuvfio-tb-")] == []
        assert reps(os.path.join(out, "results", "tiny-4k")) == ["rep-0.json"], (seen, os.listdir(os.path.join(out, "results")))
        assert json.load(open(os.path.join(out, "identity.json")))["host_kernel"] == os.uname().release
        scratch = next(line.split("scratch directory ", 1)[1] for line in seen if "scratch directory" in line)
        assert not os.path.exists(scratch)

        def drop_connection_on_attach(line):
            seen.append(line)
            if line == "tiny-4k: attach":  # the server side of our connection dies: a network loss
                for pid in children(hypervisor.process.pid):
                    os.kill(pid, signal.SIGKILL)

        seen.clear()
        with pytest.raises(GpuvfioError, match="connection lost.*hung up and tears itself down") as lost:
            run_remote(this_machine(tmp_path), spec, out, progress=drop_connection_on_attach)
        scratch = next(line.split("scratch directory ", 1)[1] for line in seen if "scratch directory" in line)
        assert scratch in str(lost.value)
        remote_pid = int(open(os.path.join(scratch, "pid")).read())
        deadline = time.monotonic() + 120
        while os.path.exists(f"/proc/{remote_pid}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{remote_pid}"), "the hung-up run did not end"
        assert [d.name() for d in conn.listAllDomains(0) if d.name().startswith("gpuvfio-tb-")] == []
        assert reps(os.path.join(out, "results", "tiny-4k")) == ["rep-0.json"]
        assert json.load(open(os.path.join(out, "remote.json")))["scratch"] == scratch  # kept for the next run
        seen.clear()
        summary = run_remote(this_machine(tmp_path), spec, out, progress=seen.append)
        assert "results/tiny-4k/rep-1.json" in summary["files"] and "results/baremetal/rep-1.json" in summary["files"]
        assert not any(line == "tiny-4k: repetition 1/2" for line in seen)  # rep 0 went up and was kept
        assert f"root@127.0.0.1:{hypervisor.port}: fetching the results of an earlier run from {scratch}" in seen
        assert not os.path.exists(scratch) and not os.path.exists(os.path.join(out, "remote.json"))
        assert [d.name() for d in conn.listAllDomains(0) if d.name().startswith("gpuvfio-tb-")] == []
    finally:
        conn.close()
    assert write_report(out)["baseline"] == "baremetal"
    assert "| tiny-4k |" in open(os.path.join(out, "report.md")).read()


BAREMETAL_ONLY = guest_toml(disk="/var/lib/libvirt/images/unused.qcow2", ssh={"port": 2222}) + """
[run]
repetitions = 2
connect = "test:///default"

[[variant]]
name = "baremetal"
kind = "baremetal"
"""


def test_cli_remote_run_then_report_here(tmp_path, hypervisor):
    """The whole CLI path: testbed run on the hypervisor, results back here, report made here."""
    from tests.conftest import run_gpuvfio

    spec = tmp_path / "remote.toml"
    spec.write_text(BAREMETAL_ONLY + host_section(hypervisor))
    out = tmp_path / "out"
    ran = run_gpuvfio("testbed", "run", str(spec), "--out", str(out))
    assert ran.code == 0, ran.err
    assert "baremetal: repetition 2/2 on this host" in ran.err and f"results in {out}" in ran.err
    assert reps(out / "results" / "baremetal") == ["rep-0.json", "rep-1.json"]
    assert not [p for p in os.listdir("/var/tmp") if p.startswith("gpuvfio-testbed.")
                and os.path.exists(os.path.join("/var/tmp", p, "spec.toml"))
                and open(os.path.join("/var/tmp", p, "spec.toml")).read() == spec.read_text()]
    again = run_gpuvfio("testbed", "run", str(spec), "--out", str(out), "--json")
    assert again.code == 0 and "baremetal: done already (2 repetitions)" in again.err, again.err
    assert again.json() == {"out": str(out), "host": f"root@127.0.0.1:{hypervisor.port}",
                            "results": {"baremetal": {"kind": "baremetal", "repetitions": 2, "wanted": 2}}}
    reported = run_gpuvfio("testbed", "report", str(out), "--json")
    assert reported.code == 0 and reported.json()["baseline"] == "baremetal", reported.err
    # The results go up with the identity they were measured on: the run there refuses a
    # selection that means other GPUs than the results' (here: an identity edited to say so).
    identity = json.loads((out / "identity.json").read_text())
    assert identity["gpus"] == []
    (out / "identity.json").write_text(json.dumps(dict(identity, gpus=["0000:99:00.0"])))
    refused = run_gpuvfio("testbed", "run", str(spec), "--out", str(out))
    assert refused.code == 1 and "were measured on 0000:99:00.0" in refused.err, refused.err
    # Bad input found there (a slot that host does not have) is bad input here too: exit 2.
    spec.write_text(BAREMETAL_ONLY.replace("repetitions = 2", 'repetitions = 2\ngpus = ["abcd:00:1f"]')
                    + host_section(hypervisor))
    bad = run_gpuvfio("testbed", "run", str(spec), "--out", str(tmp_path / "out2"))
    assert bad.code == 2 and "no PCI function on this host matches abcd:00:1f" in bad.err, bad.err


def test_command_killed_by_a_signal_is_not_a_lost_connection(hypervisor):
    from gpuvfio.guest.ssh import ConnectionLost, Session, SshError, SshTarget

    target = SshTarget("127.0.0.1", hypervisor.port, "root", hypervisor.client_key, hypervisor.known_hosts)
    with Session(target) as session:
        with pytest.raises(SshError, match="terminated by a signal") as info:
            session.run(["sh", "-c", 'kill -9 "$$"'])
        assert not isinstance(info.value, ConnectionLost)
        assert session.run(["true"])[0] == 0  # the connection is still there


def test_an_earlier_run_still_going_there_is_not_started_twice(tmp_path, hypervisor):
    import subprocess
    import tempfile

    from gpuvfio.errors import GpuvfioError
    from gpuvfio.testbed.remote import run_remote
    from gpuvfio.testbed.spec import load_spec

    spec_path = tmp_path / "remote.toml"
    spec_path.write_text(BAREMETAL_ONLY + host_section(hypervisor))
    spec = load_spec(str(spec_path))
    scratch = tempfile.mkdtemp(prefix="gpuvfio-testbed.", dir="/var/tmp")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with open(os.path.join(scratch, "pid"), "w") as handle:
            handle.write(f"{sleeper.pid}\n")
        out = tmp_path / "out"
        out.mkdir()
        (out / "remote.json").write_text(json.dumps({"host": f"root@127.0.0.1:{hypervisor.port}",
                                                     "scratch": scratch}))
        with pytest.raises(GpuvfioError, match=f"still going .*pid {sleeper.pid}, in {scratch}"):
            run_remote(this_machine(tmp_path), spec, str(out))
        assert os.path.isdir(scratch) and not os.path.exists(out / "results")
        sleeper.kill()
        sleeper.wait()
        seen: list[str] = []
        run_remote(this_machine(tmp_path), spec, str(out), progress=seen.append)  # now it is picked up
        assert any("fetching the results of an earlier run" in line for line in seen)
        assert not os.path.exists(scratch) and reps(out / "results" / "baremetal") == [
            "rep-0.json", "rep-1.json"]
    finally:
        sleeper.kill()
        shutil.rmtree(scratch, ignore_errors=True)
