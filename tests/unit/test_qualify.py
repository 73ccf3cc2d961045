"""gpuvfio qualify on the unit lane (issue 38 item 5): each reset method the kernel lists is
selected alone (reset_method), written to reset N times and checked; the original list goes
back; the verdicts per model and method are what health, doctor and bind's plan read. The
simulated kernel plays reset_method_store and the device's resets (tests/simkernel.py)."""

from __future__ import annotations

import json
import os

import pytest

from gpuvfio.bind.journal import Journal
from gpuvfio.cli import main
from gpuvfio.errors import InputError, Refused
from gpuvfio.host.reset_verdicts import (FILE_NAME, Outcome, ResetVerdicts, Run, VerdictsUnreadable, parse,
                                         read_verdicts)
from gpuvfio.host.root import HostRoot
from gpuvfio.host.state import state_dir
from gpuvfio.ops.health import health_report
from gpuvfio.ops.qualify import plan_qualify, qualify
from gpuvfio.settings import Settings
from tests.contexts import sim_context
from tests.unit.test_binding import AUDIO, GPU, NIC, PORT, A, Host

MODEL = "10de:2684"


@pytest.fixture
def h(tmp_path):
    host = Host(tmp_path / "host")
    for address in (GPU, PORT):  # a Gen4 x16 link, as the kernel shows it
        for name, value in (("current_link_speed", "16.0 GT/s PCIe"), ("max_link_speed", "16.0 GT/s PCIe"),
                            ("current_link_width", "16"), ("max_link_width", "16")):
            with open(dev(host, address, name), "w") as handle:
                handle.write(value + "\n")
    host.bind(GPU)  # the GPU and its audio function, on vfio-pci and in the journal
    return host


def dev(h, address, name):
    return os.path.join(h.root, "sys", "bus", "pci", "devices", address, name)


def read(path):
    with open(path) as handle:
        return handle.read()


def qualified(h, *addresses, cycles=2, **kw):
    with h.context(**kw) as ctx:
        return qualify(ctx, [A(a) for a in addresses or (GPU,)], cycles=cycles, uri="none")


def verdicts(h) -> ResetVerdicts:
    return read_verdicts(h.host)


def reset_writes(h):
    return [(os.path.basename(path), value) for path, value in h.kernel.writes() if "/reset" in path]


def test_each_method_alone_n_times_then_the_list_goes_back(h):
    result = qualified(h)
    assert result.ok and [(m.method, m.outcome, m.cycles) for m in result.methods] == [
        ("flr", Outcome.PASSED, 2), ("bus", Outcome.PASSED, 2)]
    assert reset_writes(h) == [("reset_method", "flr\n"), ("reset", "1\n"), ("reset", "1\n"),
                               ("reset_method", "bus\n"), ("reset", "1\n"), ("reset", "1\n"),
                               ("reset_method", "flr bus\n")]
    assert read(dev(h, GPU, "reset_method")) == "flr bus\n"
    record = verdicts(h).record(MODEL, "flr")
    assert (record.outcome, record.passed, record.failed, record.last.device, record.last.cycles) == (
        Outcome.PASSED, 1, 0, GPU, 2)
    assert os.path.exists(os.path.join(h.root, "var", "lib", "gpuvfio", FILE_NAME))
    qualified(h, cycles=1)  # a second run adds to the counts
    assert verdicts(h).record(MODEL, "bus").passed == 2
    health = {d.address: d for d in health_report(sim_context(h.root, h.kernel), only=[A(GPU)], uri="none").devices}
    (finding,) = [f for f in health[A(GPU)].findings if f.check == "reset"]
    assert finding.status.value == "ok" and finding.message == f"its reset (flr) qualified for {MODEL} in 2 run(s), " \
                                                                "1 cycle(s) the last"


def test_a_method_that_narrows_the_link_fails_for_the_model_and_warns_the_plans(h):
    h.kernel.inject("reset", GPU, driver="bus", effect="narrow")
    result = qualified(h)
    assert not result.ok
    assert [(m.method, m.outcome, m.cycles, m.failure) for m in result.methods] == [
        ("flr", Outcome.PASSED, 2, None),
        ("bus", Outcome.FAILED, 0, "its link trained to x1 after the reset, x16 before")]
    assert read(dev(h, GPU, "reset_method")) == "flr bus\n"  # put back
    bus = verdicts(h).record(MODEL, "bus")
    assert (bus.outcome, bus.failed, bus.last_failure.failure) == (Outcome.FAILED, 1, result.methods[1].failure)
    # The kernel tries flr first, which qualified: health is content; with bus first it is not.
    assert reset_finding(h) == ("ok", "its reset (flr) qualified")
    with open(dev(h, GPU, "reset_method"), "w") as handle:
        handle.write("bus flr\n")
    status, message = reset_finding(h)
    assert status == "degraded" and message.startswith(f"the kernel resets it by bus, which failed qualification for "
                                                       f"{MODEL} in 1 of 1 run(s) (last on {GPU} of ")
    h.restore()
    plan = h.bind(GPU, dry_run=True)
    assert any(c.check_id == "health" and c.status.value == "warn" and "failed qualification" in c.message
               for c in plan.checks)


def reset_finding(h) -> tuple[str, str]:
    device = health_report(sim_context(h.root, h.kernel), only=[A(GPU)], uri="none").devices[0]
    (finding,) = [f for f in device.findings if f.check == "reset"]
    return finding.status.value, finding.message[:len("its reset (flr) qualified")] if finding.status.value == "ok" \
        else finding.message


def test_bar_registers_left_wrong_fail_and_stay_wrong(h):
    """The kernel saves config space before each reset: BARs a device left wrong stay wrong,
    so bus fails after flr too."""
    h.kernel.inject("reset", GPU, driver="flr", effect="bars")
    result = qualified(h)
    assert [(m.method, m.outcome) for m in result.methods] == [("flr", Outcome.FAILED), ("bus", Outcome.FAILED)]
    assert result.methods[0].failure.startswith("its BAR registers read differently after the reset")


def test_what_a_reset_may_leave_that_is_not_its_failure(h):
    """Not the model's reset failing: a lower link speed (GPUs lower it while idle, as health
    says), a link that was narrow before (the host's slot, reported by health), a function
    without a link of its own (Link Capabilities 0, an SR-IOV VF)."""
    h.kernel.inject("reset", GPU, driver="flr", effect="slow", times=2)
    assert qualified(h).ok
    with open(dev(h, GPU, "current_link_width"), "w") as handle:
        handle.write("8\n")
    h.kernel.inject("reset", GPU, driver="bus", effect="narrow")  # x1 after x8: that is a failure
    result = qualified(h)
    assert [(m.method, m.outcome) for m in result.methods] == [("flr", Outcome.PASSED), ("bus", Outcome.FAILED)]
    assert result.methods[1].failure == "its link trained to x1 after the reset, x8 before"


def test_a_function_without_a_link_of_its_own_is_not_held_to_one(h):
    for name, value in (("current_link_width", "0"), ("max_link_width", "0"), ("current_link_speed", "Unknown"),
                        ("max_link_speed", "Unknown")):  # as the kernel shows Link Capabilities of 0
        with open(dev(h, AUDIO, name), "w") as handle:
            handle.write(value + "\n")
    assert qualified(h, AUDIO).ok


def test_a_device_that_does_not_come_back_is_marked_and_the_rest_not_tried(h):
    h.kernel.inject("reset", GPU, driver="flr", effect="dead")
    result = qualified(h)
    assert [(m.method, m.outcome) for m in result.methods] == [("flr", Outcome.FAILED), ("bus", None)]
    assert "0xffff" in result.methods[0].failure
    assert result.to_json()["methods"][1]["outcome"] == "not tried"
    assert "qualify: config space reads 0xffff" in Journal.load(state_dir(h.host)).data["broken"][GPU]["reason"]
    assert verdicts(h).record(MODEL, "bus") is None and verdicts(h).record(MODEL, "flr").failed == 1
    assert read(dev(h, GPU, "reset_method")) == "flr bus\n"
    with pytest.raises(Refused, match="came back broken"):
        qualified(h)  # health refuses a broken device; gpuvfio reset is its way back


def test_a_reset_the_kernel_refuses_fails_the_method(h):
    h.kernel.inject("reset", GPU, driver="bus", errno_=5)
    result = qualified(h)
    assert result.methods[1].outcome is Outcome.FAILED and "the kernel refused to reset" in result.methods[1].failure


def test_refusals_change_nothing(h):
    with pytest.raises(Refused, match="not held: " + NIC):
        qualified(h, NIC)
    with pytest.raises(InputError, match="is a PCI bridge"):
        qualified(h, "0000:00:01.0")
    with open(dev(h, AUDIO, "reset_method"), "w") as handle:
        handle.write("\n")
    with pytest.raises(Refused, match="lists no reset method"):
        qualified(h, AUDIO)
    state = os.path.join(h.root, "var", "lib", "gpuvfio")
    with open(os.path.join(state, FILE_NAME), "w") as handle:
        handle.write('{"format": "gpuvfio-reset-verdicts", "version": 1, "models": {"10DE:2684": {}}}')
    with pytest.raises(Refused, match="the reset verdicts cannot be read"):
        qualified(h)
    assert reset_writes(h) == []


def test_the_dry_run_is_the_plan_and_exits_as_the_run(h, capsys):
    root = str(h.root)
    assert main(["--root", root, "qualify", "--dry-run", "--json", "--cycles", "2", "--connect", "none", GPU]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["methods"] == {GPU: ["flr", "bus"]} and plan["original"] == {GPU: "flr bus"}
    assert [(s["kind"], s.get("value")) for s in plan["steps"]][:4] == [
        ("select reset method", "flr\n"), ("reset", "1\n"), ("reset", "1\n"), ("select reset method", "bus\n")]
    assert plan["steps"][-1]["kind"] == "write file" and len(plan["steps"]) == 8
    assert reset_writes(h) == []
    assert main(["--root", root, "qualify", "--dry-run", "--connect", "none", NIC]) == 1
    assert main(["--root", root, "qualify", "--cycles", "0", GPU]) == 2
    assert main(["--root", root, "qualify", "--cycles", "101", GPU]) == 2
    capsys.readouterr()
    # The run itself, on the tree's plain files (no simulated kernel): every reset comes back.
    assert main(["--root", root, "qualify", "--cycles", "1", "--connect", "none", GPU]) == 0
    out = capsys.readouterr().err
    assert f"{GPU} flr: passed after 1 reset(s)" in out and f"{GPU} bus: passed after 1 reset(s)" in out


def test_a_fleet_shares_one_file(h, tmp_path):
    shared = tmp_path / "fleet" / "verdicts.json"
    shared.parent.mkdir()
    host = HostRoot(h.root, settings=Settings(reset_verdicts=str(shared)))
    with sim_context(host, h.kernel) as ctx:
        qualify(ctx, [A(GPU)], cycles=1, uri="none")
    assert parse(shared.read_bytes()).record(MODEL, "flr").passed == 1
    assert not os.path.exists(os.path.join(h.root, "var", "lib", "gpuvfio", FILE_NAME))
    assert read_verdicts(host).record(MODEL, "bus").passed == 1
    link = tmp_path / "fleet" / "link.json"
    link.symlink_to(shared)  # never read through a link
    assert "link" in read_verdicts(HostRoot(h.root, settings=Settings(reset_verdicts=str(link)))).error


def run(outcome="passed", **over):
    out = {"outcome": outcome, "device": GPU, "host": "gpu-07", "at": "2026-12-06T10:00:00Z", "cycles": 3,
           "failure": None if outcome == "passed" else "its link is down after the reset (width 0)"}
    return {**out, **over}


def record(**over):
    return {"verdict": "passed", "passed": 1, "failed": 0, "last": run(), "last_failure": None, **over}


def document(models) -> bytes:
    return json.dumps({"format": "gpuvfio-reset-verdicts", "version": 1, "models": models}).encode()


@pytest.mark.parametrize("data, words", [
    (b"{", "not JSON"),
    (b'{"format": "x", "version": 1, "models": {}}', "not a gpuvfio-reset-verdicts file"),
    (document({"10de:2684": {"warm": record()}}), "a reset method the kernel does not have"),
    (document({"10de:26840": {}}), "not a lower-case vendor:device"),
    (document({MODEL: {"flr": record(verdict="failed")}}), "does not follow from its counts"),
    (document({MODEL: {"flr": record(passed=-1)}}), "a count is not a whole number"),
    (document({MODEL: {"flr": record(passed=True)}}), "a count is not a whole number"),
    (document({MODEL: {"flr": record(last=run(host="a\nb"))}}), "malformed"),
    (document({MODEL: {"flr": record(last=run(failure="x"))}}), "malformed"),  # a pass with a failure
    (document({MODEL: {"flr": record(last=run(device="../../x"))}}), "malformed"),
    (document({MODEL: {"flr": record(extra=1)}}), "not a record gpuvfio writes"),
    (b'{"format": "gpuvfio-reset-verdicts", "version": 1, "models": {}, "models": {}}', "appears twice"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
])
def test_a_verdicts_file_from_elsewhere_is_read_as_hostile(data, words):
    with pytest.raises(VerdictsUnreadable, match=words):
        parse(data)


def test_a_file_gpuvfio_wrote_reads_back_and_a_failure_stays():
    verdicts = ResetVerdicts()
    verdicts.add(MODEL, "bus", Run(Outcome.FAILED, GPU, "gpu-07", "2026-12-06T10:00:00Z", 1, "its link is down"))
    verdicts.add(MODEL, "bus", Run(Outcome.PASSED, GPU, "", "2026-12-06T11:00:00Z", 3))
    again = parse(verdicts.render().encode())
    bus = again.record(MODEL, "bus")
    assert again.to_json() == verdicts.to_json() and bus.outcome is Outcome.FAILED and (bus.passed, bus.failed) == (1, 1)
    assert parse(document({MODEL: {"flr": record(failed=1, verdict="failed", last_failure=run("failed"))}})) \
        .record(MODEL, "flr").outcome is Outcome.FAILED


def test_an_unreadable_file_makes_health_say_so(h):
    state = os.path.join(h.root, "var", "lib", "gpuvfio")
    os.mkfifo(os.path.join(state, FILE_NAME))  # never opened: not a regular file
    status, message = reset_finding(h)
    assert status == "unknown" and message.startswith("the reset verdicts cannot be read")
    device = health_report(sim_context(h.root, h.kernel), only=[A(GPU)], uri="none").devices[0]
    assert device.status.value == "degraded"


def test_a_device_gone_from_sysfs_is_dead_and_marked(h):
    """Not only 0xffff: a device whose config space can no longer be read is dead too."""
    h.kernel.inject("reset", GPU, driver="flr", effect="gone")
    result = qualified(h, cycles=1)
    assert result.methods[0].dead and "cannot be read" in result.methods[0].failure
    assert [m.outcome for m in result.methods] == [Outcome.FAILED, None]
    assert "qualify: its config space cannot be read" in Journal.load(state_dir(h.host)).data["broken"][GPU]["reason"]


def test_a_reset_that_does_not_return_is_no_verdict_and_the_device_is_left_alone(h):
    h.kernel.inject("reset", GPU, driver="flr", hang=True)
    result = qualified(h, write_timeout=0.5)
    assert [(m.method, m.outcome) for m in result.methods] == [("flr", None), ("bus", None)]
    assert not result.ok and any("did not return" in p for p in result.problems)
    assert verdicts(h).models == {}  # a hang is no verdict on the model's reset
    assert "did not return" in Journal.load(state_dir(h.host)).data["broken"][GPU]["reason"]


def test_hosts_sharing_the_file_wait_for_each_other(h, tmp_path):
    import fcntl

    from gpuvfio.files import Tree

    shared = tmp_path / "fleet" / "verdicts.json"
    shared.parent.mkdir()
    host = HostRoot(h.root, settings=Settings(reset_verdicts=str(shared)))
    fd = Tree(str(shared.parent)).open_lock("lock")  # the directory's run lock
    fcntl.flock(fd, fcntl.LOCK_EX)  # another host is adding its runs
    try:
        with sim_context(host, h.kernel, lock_timeout=0.3) as ctx:
            result = qualify(ctx, [A(GPU)], cycles=1, uri="none")
    finally:
        os.close(fd)
    assert not result.ok and any("another gpuvfio run holds" in p for p in result.problems) and not shared.exists()
    with sim_context(host, h.kernel) as ctx:
        assert qualify(ctx, [A(GPU)], cycles=1, uri="none").ok
    assert parse(shared.read_bytes()).record(MODEL, "flr").passed == 1


def test_a_file_no_host_could_read_is_never_written():
    verdicts = ResetVerdicts()
    verdicts.add(MODEL, "flr", Run(Outcome.PASSED, GPU, "", "2026-12-06T10:00:00Z", 1))
    verdicts.models[MODEL]["flr"].passed = 2 ** 64 - 1
    verdicts.add(MODEL, "flr", Run(Outcome.PASSED, GPU, "", "2026-12-06T10:00:00Z", 1))
    assert parse(verdicts.render().encode()).record(MODEL, "flr").passed == 2 ** 64 - 1  # stops at the top
    for n in range(4097):
        verdicts.add(f"10de:{n:04x}", "flr", Run(Outcome.PASSED, GPU, "", "2026-12-06T10:00:00Z", 1))
    with pytest.raises(VerdictsUnreadable):
        verdicts.render()


@pytest.mark.parametrize("value, fails", [("", False), ("relative/v.json", True)])
def test_the_fleet_variable_is_an_absolute_path_or_unset(h, value, fails):
    from gpuvfio.settings import Settings as S

    settings = S.from_environment({"GPUVFIO_RESET_VERDICTS": value})
    host = HostRoot(h.root, settings=settings)
    if fails:
        with pytest.raises(InputError, match="GPUVFIO_RESET_VERDICTS must be an absolute path"):
            read_verdicts(host)
    else:
        assert settings.reset_verdicts is None and read_verdicts(host).error is None
