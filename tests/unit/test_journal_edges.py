"""The journal's edges, called in process on real state directories under tmp_path: what doctor's
journal check says (its name, verdict, summary and fix, word for word), which journals a load
refuses and how it names the fault, what a save writes, what a step records, where the state
directory and the trusted SSH host keys live, and the run lock: what its file says of the holder,
when it waits, takes over or lets go (flock(2), kill(2) with signal 0)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys

import pytest

from gpuvfio.bind.journal import CorruptJournal, Journal, LockTimeout, RunLock, _shown, journal_check
from gpuvfio.guest.ssh import SshTarget
from gpuvfio.host.checks import FAIL, OK, WARN
from gpuvfio.host.root import HostRoot
from gpuvfio.errors import GpuvfioError

GPU, AUDIO, OTHER = "0000:01:00.0", "0000:01:00.1", "0000:02:00.0"
NOBODY = 65534


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


@contextlib.contextmanager
def without_capabilities():
    """This thread without its effective capabilities (kept permitted, raised again after): root then
    meets file modes and kill(2)'s permission check as any user does. Any process may lower its
    own effective set (capset(2)), so this needs no privilege."""
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
    assert libc.capget(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())
    saved = [d.effective for d in data]
    for d in data:
        d.effective = 0
    assert libc.capset(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())
    try:
        yield
    finally:
        for d, effective in zip(data, saved):
            d.effective = effective
        assert libc.capset(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A host root whose state directory is the default, <root>/var/lib/gpuvfio."""
    monkeypatch.delenv("GPUVFIO_STATE_DIR", raising=False)
    (tmp_path / "root").mkdir()
    return HostRoot(str(tmp_path / "root"))


def state_of(host) -> str:
    return os.path.join(host.root, "var/lib/gpuvfio")


def write_journal(host, record) -> str:
    os.makedirs(state_of(host), exist_ok=True)
    path = os.path.join(state_of(host), "journal.json")
    with open(path, "w") as handle:
        handle.write(record if isinstance(record, str) else json.dumps(record))
    return path


def held(*addresses) -> dict:
    return {a: {"original_driver": "nvidia", "original_override": None, "group": 1} for a in addresses}


def refusal(host, record) -> str:
    """What a load says of a journal it refuses (the message doctor shows and restore stops on)."""
    write_journal(host, record)
    with pytest.raises(CorruptJournal) as refused:
        Journal.load(state_of(host))
    return str(refused.value)


# -- doctor's journal check --------------------------------------------------------------------------
def test_a_journal_gpuvfio_cannot_trust_fails_doctor_naming_the_file_to_inspect(host):
    """A corrupt journal fails the "journal" check, says what is wrong and names the file to mend."""
    path = write_journal(host, {"version": 1, "devices": {"nope": {}}})
    got = journal_check(host)
    assert (got.check_id, got.status) == ("journal", FAIL)
    assert got.summary == (f"journal {path} is corrupt (device 'nope' is not a PCI address); it is kept as is: "
                           "inspect it, then move it away")
    assert got.fix == (f"inspect {path}; gpuvfio restore cannot use it until it is mended or moved away "
                       "(then restore the devices by hand)")


def test_a_journal_root_cannot_read_fails_doctor_with_the_permission_fix(host):
    """A journal doctor cannot open (run without root's override) fails with "run as root", not a traceback."""
    path = write_journal(host, {"version": 1, "devices": {}})
    os.chmod(path, 0)
    with without_capabilities():
        got = journal_check(host)
    assert (got.check_id, got.status) == ("journal", FAIL)
    assert got.summary == f"cannot read journal {path}: cannot open {path}: permission denied (run as root?)"
    assert got.fix == "run gpuvfio doctor as root (gpuvfio's state is root's)"


def test_broken_devices_are_listed_with_their_reasons_and_one_reset_for_all(host):
    """Each broken device is named with its reason, and the fix is one reset naming every one of them."""
    write_journal(host, {"version": 1, "devices": held(GPU),
                         "broken": {OTHER: {"reason": "no answer after FLR", "since": 2.0},
                                    GPU: {"reason": "config space reads 0xffff", "since": 1.0}}})
    got = journal_check(host)
    assert (got.check_id, got.status) == ("journal", FAIL)
    assert got.summary == (f"marked broken (binds refuse them): {GPU}: config space reads 0xffff; "
                           f"{OTHER}: no answer after FLR")
    assert got.fix == (f"gpuvfio reset {GPU} {OTHER} (the kernel's reset; --forget once a device answers again "
                       "without one)")


def test_a_broken_mark_without_a_reason_says_none(host):
    """A mark that records no reason still names the device (its reason shown as None), not a crash."""
    write_journal(host, {"version": 1, "devices": {}, "broken": {GPU: {"since": 1.0}}})
    assert journal_check(host).summary == f"marked broken (binds refuse them): {GPU}: None"


@pytest.mark.parametrize("length, shown", [(199, 199), (200, 200), (201, 200), (5000, 200)])
def test_a_reason_longer_than_200_characters_is_cut_with_an_ellipsis(host, length, shown):
    """A reason fits on a line: up to 200 characters shown whole, a longer one cut at 200 with "..."."""
    reason = "".join(chr(ord("a") + i % 26) for i in range(length))
    write_journal(host, {"version": 1, "devices": {}, "broken": {GPU: {"reason": reason, "since": 1.0}}})
    expected = reason if shown == length else reason[:200] + "..."
    assert journal_check(host).summary == f"marked broken (binds refuse them): {GPU}: {expected}"


def test_a_reason_that_is_not_text_is_shown_as_its_repr():
    """A reason that is not text (None, when a mark records none) is shown as Python writes it, cut like any other."""
    assert _shown(None) == "None" and _shown(["EIO"]) == "['EIO']" and _shown(list(range(100))).endswith("...")
    assert _shown("x" * 10, limit=4) == "xxxx..."


def test_an_unfinished_operation_warns_and_a_finished_one_counts_the_functions_held(host):
    """An operation that did not finish warns with its pid; once finished, doctor says what gpuvfio holds."""
    operation = {"kind": "fabric", "pid": 4242, "steps": [{"state": "running"}]}
    write_journal(host, {"version": 1, "devices": held(GPU, AUDIO), "operation": operation})
    got = journal_check(host)
    assert (got.check_id, got.status) == ("journal", WARN)
    assert got.summary == "a fabric operation (pid 4242) did not finish, or is running now"
    assert got.fix == "gpuvfio status; gpuvfio restore puts back what it did"
    write_journal(host, {"version": 1, "devices": held(GPU, AUDIO), "operation": {**operation, "finished": 3.0}})
    got = journal_check(host)
    assert (got.check_id, got.status, got.fix) == ("journal", OK, None)
    assert got.summary == "gpuvfio holds 2 function(s); no broken device, no unfinished operation"


# -- what a load refuses -----------------------------------------------------------------------------
def test_a_field_this_gpuvfio_does_not_know_is_refused(host):
    """A journal with a field gpuvfio never writes (hand-edited, or another tool's) is not acted on."""
    message = refusal(host, {"version": 1, "devices": {}, "extra": {}, "another": 1})
    assert "is corrupt (unknown field(s) another, extra);" in message


@pytest.mark.parametrize("key", ["devices", "mdevs", "vgpus", "schedulers", "broken", "partitions"])
def test_a_table_that_is_not_an_object_is_refused_by_name(host, key):
    """Each table of the journal must be a JSON object: a list there is named, not a crash."""
    record = {"version": 1, "devices": {}, key: [GPU]}
    assert f"is corrupt ({key} is not an object);" in refusal(host, record)


@pytest.mark.parametrize("field, value, problem", [
    ("group", -1, "group is -1"),
    ("group", True, "group is True"),
    ("group", 1.5, "group is 1.5"),
    ("original_driver", "../../nvidia", "original_driver is '../../nvidia'"),
    ("original_override", "vfio-pci\nnvidia", "original_override is 'vfio-pci\\nnvidia'"),
])
def test_a_device_record_restore_could_not_trust_is_refused_naming_the_device(host, field, value, problem):
    """A bogus original driver or IOMMU group would have restore write it back: the device and field are named."""
    record = {"version": 1, "devices": {GPU: {"original_driver": "nvidia", "original_override": None, "group": 1,
                                              field: value}}}
    assert f"is corrupt (device {GPU}.{problem});" in refusal(host, record)


def test_a_device_address_that_is_not_canonical_is_refused(host):
    """Device keys are sysfs names (0000:01:00.0): a short or upper-case form restore would not find is refused."""
    for address in ("01:00.0", "0000:0A:00.0"):
        record = {"version": 1, "devices": {address: {"original_driver": "nvidia"}}}
        assert f"is corrupt (device {address!r} is not a PCI address);" in refusal(host, record)


def test_a_device_without_a_group_or_driver_is_loaded(host):
    """A device gpuvfio found unbound and outside any group records None: that journal is valid."""
    write_journal(host, {"version": 1, "devices": {GPU: {"original_driver": None, "original_override": None,
                                                         "group": None}}})
    assert Journal.load(state_of(host)).devices == {GPU: {"original_driver": None, "original_override": None,
                                                          "group": None}}


@pytest.mark.parametrize("services", [["sshd"], ["nvidia-persistenced", "docker"]])
def test_a_stopped_service_gpuvfio_never_stops_is_refused(host, services):
    """restore starts every service the journal says it stopped: only NVIDIA's own units may be there."""
    record = {"version": 1, "devices": {}, "services_stopped": services}
    assert f"is corrupt (services_stopped is {services!r});" in refusal(host, record)
    write_journal(host, {"version": 1, "devices": {}, "services_stopped": ["nvidia-persistenced", "nvidia-dcgm"]})
    assert Journal.load(state_of(host)).data["services_stopped"] == ["nvidia-persistenced", "nvidia-dcgm"]


# -- steps, known hosts ------------------------------------------------------------------------------
def test_a_step_keeps_the_detail_it_was_given_and_only_that(host):
    """A failed step's detail (the kernel's error) is on disk for restore and status; a step given none has none."""
    journal = Journal(state_of(host))
    journal.data["operation"] = {"kind": "bind", "pid": 1, "steps": [{"state": "pending"}, {"state": "pending"}]}
    journal.save()
    journal.set_step(0, "failed", "unbind: EBUSY")
    journal.set_step(1, "done")
    steps = Journal.load(state_of(host)).data["operation"]["steps"]
    assert steps == [{"state": "failed", "detail": "unbind: EBUSY"}, {"state": "done"}]
    journal.set_step(0, "rolled_back")  # no new detail: the earlier one stays
    assert Journal.load(state_of(host)).data["operation"]["steps"][0] == {"state": "rolled_back",
                                                                          "detail": "unbind: EBUSY"}


def test_trusted_ssh_host_keys_live_in_the_state_directory(host, tmp_path, monkeypatch):
    """Host keys trusted on first use are kept in <state>/known_hosts, wherever the state directory is."""
    from gpuvfio.ops.context import Context

    assert Context(host=host).ssh(SshTarget("h")).record_to == os.path.join(state_of(host), "known_hosts")
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    assert Context(host=HostRoot(host.root)).ssh(SshTarget("h")).record_to == str(tmp_path / "state" / "known_hosts")


# -- the run lock and a holder still alive -----------------------------------------------------------
def _lock_naming(host, pid: int) -> None:
    os.makedirs(state_of(host), exist_ok=True)
    with open(os.path.join(state_of(host), "lock"), "w") as handle:
        handle.write(f"{pid} 2026-12-01T10:00:00+0000 gpuvfio attach lab-vm 01:00\n")


def _ended_by_sighup() -> subprocess.Popen:
    """A process SIGHUP ends, whatever this one inherited (under nohup SIGHUP is ignored, and an
    ignored signal stays ignored across exec: signal(7))."""
    code = "import signal, time; signal.signal(signal.SIGHUP, signal.SIG_DFL); print(flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    child.stdout.readline()  # its handler is set
    return child


def test_a_state_directory_or_lock_the_kernel_refuses_is_one_line_naming_it(tmp_path):
    """mkdir(2) or open(2) refused (EACCES: a user's run, a root without CAP_DAC_OVERRIDE) is one
    line naming the place and the kernel's words, not a traceback."""
    parent = tmp_path / "read-only"
    parent.mkdir(mode=0o500)
    state = tmp_path / "state"
    state.mkdir(mode=0o500)
    with without_capabilities():
        with pytest.raises(GpuvfioError) as made:
            RunLock(str(parent / "gpuvfio"), 0).__enter__()
        with pytest.raises(GpuvfioError) as opened:
            RunLock(str(state), 0).__enter__()
    assert str(made.value) == f"cannot open {parent}/gpuvfio: permission denied (run as root?)"
    assert str(opened.value) == f"cannot open {state}/lock: permission denied (run as root?)"


def test_a_lock_naming_a_live_process_is_not_reported_taken_over_and_the_process_is_left_alone(host):
    """A holder still running is not "gone": no take-over message, and probing it (kill(2) with signal 0) sends
    it nothing (SIGHUP would end it)."""
    child = _ended_by_sighup()
    try:
        _lock_naming(host, child.pid)
        said = []
        with RunLock(state_of(host), 1, progress=said.append) as lock:
            assert lock.taken_over is None
        assert said == []
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.3)
    finally:
        child.kill()
        child.wait()


def test_a_lock_naming_another_users_live_process_is_not_reported_taken_over(host):
    """kill(2) answers EPERM for a live process of another user the caller may not signal: it is not gone."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a process of another user")
    child = subprocess.Popen(["sleep", "30"], user=NOBODY, group=NOBODY)
    try:
        _lock_naming(host, child.pid)
        said = []
        with without_capabilities():
            with RunLock(state_of(host), 1, progress=said.append) as lock:
                assert lock.taken_over is None
        assert said == []
    finally:
        child.kill()
        child.wait()


# -- every table a journal holds ---------------------------------------------------------------------
UUID, UUID2 = "4b20d080-1b54-4048-85b3-a6a62d165c01", "0f9c6c3e-5d7a-4c1e-9b7a-3c5e2f1a0b9d"
VF = "0000:01:00.4"


def full_journal() -> dict:
    """A journal with every table filled, every allowed state and every optional value used."""
    return {
        "version": 1,
        "devices": {GPU: {"original_driver": "nvidia", "original_override": None, "group": 0},
                    AUDIO: {"original_driver": None, "original_override": "snd_hda_intel", "group": None}},
        "services_stopped": ["nvidia-persistenced", "nvidia-fabricmanager", "nvidia-dcgm"],
        "operation": {"kind": "bind", "pid": 7, "steps": [{"state": "done"}, {"action": "unbind"}], "finished": 2.0},
        "mdevs": {UUID: {"parent": GPU, "type": "nvidia-558", "state": "creating", "persisted": None},
                  UUID2: {"parent": GPU, "type": "nvidia-559", "state": "created", "persisted": "/etc/mdevctl.d/x"}},
        "vgpus": {VF: {"parent": GPU, "type": 558, "previous": 0}},
        "schedulers": {GPU: {"policy": "best-effort", "arr_mode": "default", "arr": False, "timeslice": 0,
                             "avg_factor": 1},
                       OTHER: {"policy": "equal-share", "arr": True},
                       "0000:03:00.0": {"policy": "fixed-share"}},
        "broken": {OTHER: {"reason": "no answer after FLR", "since": 1}, "0000:03:00.0": {"since": 2.5}},
        "partitions": {"0": {"state": "activating", "since": 1.5, "modules": [0, 1], "devices": [GPU]},
                       "63": {"state": "active", "since": 2, "modules": [], "devices": []},
                       "7": {"state": "deactivating"}},
    }


def test_a_journal_with_every_table_and_state_loads_as_written(host):
    """Every state gpuvfio itself writes (mdevs being made, partitions being activated...) must load back."""
    write_journal(host, full_journal())
    assert Journal.load(state_of(host)).data == full_journal()


def test_a_journal_with_only_its_devices_loads_with_empty_tables(host):
    """A journal from a gpuvfio that wrote fewer tables loads with the missing ones empty, not absent."""
    write_journal(host, {"version": 1, "devices": held(GPU)})
    assert Journal.load(state_of(host)).data == {
        "version": 1, "devices": held(GPU), "services_stopped": [], "operation": None, "mdevs": {}, "vgpus": {},
        "schedulers": {}, "broken": {}, "partitions": {}}
    assert Journal.load(state_of(host)).unfinished_operation() is None


def _set(record: dict, path: tuple, value) -> dict:
    where = record
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    return record


@pytest.mark.parametrize("path, value, problem", [
    (("devices", GPU), "nvidia", f"device {GPU} is not an object"),
    (("devices", GPU, "owner"), "me", f"device {GPU} has an unknown field 'owner'"),
    (("services_stopped",), "nvidia-persistenced", "services_stopped is 'nvidia-persistenced'"),
    (("mdevs", UUID.upper()), {}, f"mdev {UUID.upper()!r} is not a UUID"),
    (("mdevs", "not-a-uuid"), {}, "mdev 'not-a-uuid' is not a UUID"),
    (("mdevs", UUID, "type"), "../nvidia-558", f"mdev {UUID}.type is '../nvidia-558'"),
    (("mdevs", UUID, "type"), 558, f"mdev {UUID}.type is 558"),
    (("mdevs", UUID, "state"), "removing", f"mdev {UUID}.state is 'removing'"),
    (("mdevs", UUID, "persisted"), 5, f"mdev {UUID}.persisted is 5"),
    (("mdevs", UUID, "parent"), "01:00.0", f"mdev {UUID}.parent is '01:00.0'"),
    (("mdevs", UUID, "parent"), None, f"mdev {UUID}.parent is None"),
    (("vgpus", "0000:01:00"), {}, "vGPU '0000:01:00' is not a PCI address"),
    (("vgpus", VF, "type"), -1, f"vGPU {VF}.type is -1"),
    (("vgpus", VF, "previous"), "0", f"vGPU {VF}.previous is '0'"),
    (("vgpus", VF, "parent"), 1, f"vGPU {VF}.parent is 1"),
    (("schedulers", "gpu0"), {}, "scheduler 'gpu0' is not a PCI address"),
    (("schedulers", GPU, "policy"), "round-robin", f"scheduler {GPU}.policy is 'round-robin'"),
    (("schedulers", GPU, "arr_mode"), 1, f"scheduler {GPU}.arr_mode is 1"),
    (("schedulers", GPU, "arr"), 1, f"scheduler {GPU}.arr is 1"),
    (("schedulers", GPU, "timeslice"), -1, f"scheduler {GPU}.timeslice is -1"),
    (("schedulers", GPU, "avg_factor"), 1.5, f"scheduler {GPU}.avg_factor is 1.5"),
    (("broken", "01:00.0"), {}, "broken '01:00.0' is not a PCI address"),
    (("broken", OTHER, "reason"), 5, f"broken {OTHER}.reason is 5"),
    (("broken", OTHER, "since"), True, f"broken {OTHER}.since is True"),
    (("broken", OTHER, "since"), "1", f"broken {OTHER}.since is '1'"),
    (("partitions", "64"), {}, "partition '64' is not a partition id"),
    (("partitions", "007"), {}, "partition '007' is not a partition id"),
    (("partitions", "-1"), {}, "partition '-1' is not a partition id"),
    (("partitions", "0", "state"), "inactive", "partition 0.state is 'inactive'"),
    (("partitions", "0", "since"), False, "partition 0.since is False"),
    (("partitions", "0", "since"), None, "partition 0.since is None"),
    (("partitions", "0", "modules"), [-1], "partition 0.modules is [-1]"),
    (("partitions", "0", "modules"), 0, "partition 0.modules is 0"),
    (("partitions", "0", "devices"), ["01:00.0"], "partition 0.devices is ['01:00.0']"),
    (("partitions", "0", "devices"), GPU, f"partition 0.devices is {GPU!r}"),
    (("operation",), [], "operation is malformed"),
    (("operation", "steps"), {}, "operation is malformed"),
    (("operation", "steps"), [1], "operation is malformed"),
    (("operation", "steps"), [{"state": "done"}, {"state": 1}], "operation is malformed"),
])
def test_a_journal_field_restore_could_not_trust_is_refused_by_name(host, path, value, problem):
    """Restore acts on every table: one value out of place refuses the journal, naming the table, key and field."""
    message = refusal(host, _set(full_journal(), path, value))
    assert f"is corrupt ({problem});" in message, message


def test_an_operation_without_steps_or_states_is_accepted(host):
    """An operation recorded before its steps, or a step not yet given a state, is what a crash can leave."""
    for operation in ({"kind": "bind", "pid": 1}, {"kind": "bind", "steps": [{}]}):
        write_journal(host, _set(full_journal(), ("operation",), operation))
        assert Journal.load(state_of(host)).unfinished_operation() == operation


# -- loads and saves ---------------------------------------------------------------------------------
def test_a_journal_that_is_not_a_versioned_object_is_refused_and_kept(host):
    """Not JSON, not an object, no version, or a newer gpuvfio's: refused with the file left as it was."""
    path = os.path.join(state_of(host), "journal.json")
    cases = [("[1]", f"journal {path} is corrupt (no version); it is kept as is"),
             ('{"version": "1", "devices": {}}', f"journal {path} is corrupt (no version); it is kept as is"),
             ('{"devices": {}}', f"journal {path} is corrupt (no version); it is kept as is"),
             ('{"version": 2, "devices": {}}',
              f"journal {path} is from a newer gpuvfio (version 2); use that version to restore"),
             ('{"version": 1}', f"journal {path} is corrupt (devices missing); it is kept as is: inspect it, "
                                "then move it away")]
    for text, message in cases:
        assert refusal(host, text) == message
        with open(path) as handle:
            assert handle.read() == text
    assert refusal(host, "{not json").startswith(f"journal {path} is corrupt (")
    assert refusal(host, "{not json").endswith("); it is kept as is: inspect it, then move it away")


def test_a_journal_that_is_a_link_is_not_followed_nor_trusted(host, tmp_path):
    """A link planted as journal.json (to a file an attacker wrote) is refused, naming it, never read."""
    (tmp_path / "planted.json").write_text(json.dumps({"version": 1, "devices": held(GPU)}))
    os.makedirs(state_of(host))
    path = os.path.join(state_of(host), "journal.json")
    os.symlink(tmp_path / "planted.json", path)
    with pytest.raises(CorruptJournal) as refused:
        Journal.load(state_of(host))
    assert str(refused.value) == (f"journal {path} cannot be trusted ({path} is a link, not a regular file); "
                                  "it is kept as is: inspect it, then move it away")


def test_a_journal_past_a_megabyte_loads_and_one_past_16_mib_is_refused(host):
    """Thousands of functions and steps fit (more than a text file's 1 MiB); /dev/zero's worth does not."""
    record = json.dumps({"version": 1, "devices": held(GPU)})
    path = write_journal(host, record + " " * (2 << 20))
    assert Journal.load(state_of(host)).devices == held(GPU)
    write_journal(host, record + " " * (16 << 20))
    with pytest.raises(CorruptJournal) as refused:
        Journal.load(state_of(host))
    assert str(refused.value) == (f"journal {path} cannot be trusted ({path} is larger than {16 << 20} bytes); "
                                  "it is kept as is: inspect it, then move it away")


def test_a_saved_journal_is_private_sorted_json_in_a_private_directory(host):
    """The journal names the host's devices and services: root's alone (0600 in a 0700 directory), and stable."""
    journal = Journal(state_of(host))
    assert journal.path == os.path.join(state_of(host), "journal.json")
    assert journal.data == {"version": 1, "devices": {}, "services_stopped": [], "operation": None, "mdevs": {},
                            "vgpus": {}, "schedulers": {}, "broken": {}, "partitions": {}}
    journal.devices.update(held(GPU))
    journal.save()
    with open(journal.path) as handle:
        assert handle.read() == json.dumps(journal.data, indent=2, sort_keys=True) + "\n"
    assert os.stat(journal.path).st_mode & 0o777 == 0o600
    assert os.stat(state_of(host)).st_mode & 0o777 == 0o700
    assert Journal.load(state_of(host)).data == journal.data


def test_a_journal_that_cannot_be_written_is_one_error_naming_it(host, tmp_path):
    """A directory where the journal goes, or a file where the state directory goes: one line, no traceback."""
    from gpuvfio.errors import GpuvfioError, InputError

    os.makedirs(os.path.join(state_of(host), "journal.json"))
    path = os.path.join(state_of(host), "journal.json")
    with pytest.raises(GpuvfioError) as refused:
        Journal(state_of(host)).save()
    assert str(refused.value) == f"cannot write the journal {path}: cannot write {path}: it is a directory"
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError) as refused:
        Journal(str(tmp_path / "file")).save()
    assert str(refused.value) == (f"the state directory {tmp_path / 'file'} cannot be used: {tmp_path / 'file'} "
                                  "is not a directory")


# -- where the state directory is --------------------------------------------------------------------
def test_the_state_directory_is_under_the_root_unless_named(host, tmp_path, monkeypatch):
    """GPUVFIO_STATE_DIR moves the state (a trailing slash or a relative path is the same directory)."""
    from gpuvfio.host.state import state_dir, state_tree
    from gpuvfio.files import Tree

    assert state_dir(host).path() == state_of(host)
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state") + "/")
    assert state_dir(HostRoot(host.root)).path() == str(tmp_path / "state")
    monkeypatch.chdir(tmp_path)
    assert state_tree("state").path() == str(tmp_path / "state") and state_tree("/").path() == "/"
    tree = Tree(str(tmp_path), "elsewhere")
    assert state_tree(tree) is tree


@pytest.mark.parametrize("named", ["", " ", "\t\n", "state\0dir"])
def test_an_empty_state_directory_setting_is_refused_by_name(host, monkeypatch, named):
    """An empty GPUVFIO_STATE_DIR (a shell's typo) must not become the working directory."""
    from gpuvfio.host.state import state_dir
    from gpuvfio.errors import InputError

    expected = "GPUVFIO_STATE_DIR is empty (give a directory, or leave it unset for <root>/var/lib/gpuvfio)"
    with pytest.raises(InputError) as refused:
        Journal(named)
    assert str(refused.value) == expected
    if "\0" not in named:  # the environment cannot hold a NUL
        monkeypatch.setenv("GPUVFIO_STATE_DIR", named)
        with pytest.raises(InputError) as refused:
            state_dir(HostRoot(host.root))
        assert str(refused.value) == expected


def test_the_state_directory_itself_is_never_followed(host, tmp_path):
    """A link planted as the state directory is refused; links above it (the admin's) are followed."""
    from gpuvfio.host.state import make_state_dir, state_tree
    from gpuvfio.errors import InputError

    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "linked")
    with pytest.raises(InputError) as refused:
        make_state_dir(state_tree(str(tmp_path / "linked")))
    assert str(refused.value) == (f"the state directory {tmp_path / 'linked'} cannot be used: "
                                  f"{tmp_path / 'linked'} is a link (not followed)")
    make_state_dir(state_tree(str(tmp_path / "linked" / "state")))
    assert os.stat(tmp_path / "real" / "state").st_mode & 0o777 == 0o700


# -- the run lock: what it says of its holder, when it lets go ---------------------------------------
STAMP = r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}[+-][0-9]{4}"


def _lock_text(host) -> str:
    with open(os.path.join(state_of(host), "lock")) as handle:
        return handle.read()


def _held_elsewhere(path: str) -> bool:
    """Does some open file description hold the flock (another process, or a RunLock here)?"""
    import errno
    import fcntl

    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError as exc:
        assert exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
        return True
    finally:
        os.close(fd)


def test_the_lock_names_its_holder_while_held_and_is_emptied_and_freed_after(host):
    """Another run waiting on the lock is told who holds it: pid, when, the command (printable, one line)."""
    import re

    command = "gpuvfio attach lab-vm\x1b[2J " + "x" * 300
    lock = RunLock(state_of(host), 1, command=command)
    assert (lock.path, lock.fd, lock.taken_over) == (os.path.join(state_of(host), "lock"), None, None)
    with lock:
        words = ("gpuvfio attach lab-vm?[2J " + "x" * 300)[:200]
        assert re.fullmatch(rf"{os.getpid()} {STAMP} {re.escape(words)}\n", _lock_text(host))
        assert _held_elsewhere(lock.path)
        with RunLock(state_of(host), 0.1, command="gpuvfio bind 01:00") as inner:  # re-entered: no wait
            assert inner.fd == lock.fd
        assert _held_elsewhere(lock.path) and _lock_text(host).endswith(words + "\n")
    assert lock.fd is None and _lock_text(host) == "" and not _held_elsewhere(lock.path)
    assert os.stat(lock.path).st_mode & 0o777 == 0o600


def test_the_lock_without_a_command_names_the_program_as_run(host, monkeypatch):
    """A holder that gives no command is named by its program's base name and its arguments as
    given: a path among the arguments keeps its directories."""
    import re
    import sys

    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/gpuvfio", "xml", "/etc/gpuvfio/lab.toml", "--out", "x/\nvm.xml"])
    with RunLock(state_of(host), 1):
        words = "gpuvfio xml /etc/gpuvfio/lab.toml --out x/?vm.xml"
        assert re.fullmatch(rf"{os.getpid()} {STAMP} {re.escape(words)}\n", _lock_text(host))


def test_a_lock_held_by_another_run_times_out_naming_the_holder(host):
    """After the wait, the refusal names the holder (pid, command, since; a stray byte as U+FFFD) and the wait."""
    import fcntl
    import time

    os.makedirs(state_of(host))
    path = os.path.join(state_of(host), "lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"4242 2026-12-01T10:00:00+0000 gpuvfio attach lab-\xff-vm 01:00\n")  # a torn byte
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a RunLock that did not let go fails here, not hangs
        started = time.monotonic()
        with pytest.raises(LockTimeout) as refused:
            with RunLock(state_of(host), 0.25):
                pass
        assert 0.25 <= time.monotonic() - started < 1.0  # it retries often, not once a second
    finally:
        os.close(fd)
    assert str(refused.value) == (f"another gpuvfio run holds {path} (pid 4242, gpuvfio attach lab-\ufffd-vm 01:00, "
                                  "since 2026-12-01T10:00:00+0000); waited 0.25s")
    with RunLock(state_of(host), 0) as lock:  # let go: taken at once, even with no time to wait
        assert lock.fd is not None


def test_a_lock_left_by_a_dead_run_is_taken_over_and_said_once(host):
    """A holder that is gone (killed mid-run) is named with what it was doing, so the admin looks at its journal."""
    _lock_naming(host, 4194303)  # above any pid_max: no such process
    said = []
    path = os.path.join(state_of(host), "lock")
    with RunLock(state_of(host), 1, progress=said.append) as lock:
        assert said == [lock.taken_over]
    assert lock.taken_over == (f"took over the lock {path} left by pid 4194303, gpuvfio attach lab-vm 01:00, since "
                               "2026-12-01T10:00:00+0000, which is gone (gpuvfio status shows what it did)")
    _lock_naming(host, 4194303)
    with RunLock(state_of(host), 1) as quiet:  # no one to tell: still taken over
        assert quiet.taken_over is not None


def test_a_lock_naming_this_process_or_no_pid_is_not_a_take_over(host):
    """Our own pid (a lock file left by this very process) or a line without a pid is nobody to report."""
    for line in (f"{os.getpid()} 2026-12-01T10:00:00+0000 gpuvfio", "", "gpuvfio attach", "123456789 x y"):
        os.makedirs(state_of(host), exist_ok=True)
        with open(os.path.join(state_of(host), "lock"), "w") as handle:
            handle.write(line)
        said = []
        with RunLock(state_of(host), 1, progress=said.append) as lock:
            assert lock.taken_over is None and said == []


def test_what_a_lock_file_says_of_its_holder():
    """The holder's line is read defensively: a pid of digits (at most 8), printable words, its start time."""
    from gpuvfio.bind.journal import _holder

    assert _holder("12 2026-12-01T10:00:00+0000 gpuvfio attach vm\n") == (
        12, "pid 12, gpuvfio attach vm, since 2026-12-01T10:00:00+0000")
    assert _holder("12345678") == (12345678, "pid 12345678")
    assert _holder("123456789 then cmd") == (None, "pid unknown, cmd, since then")
    assert _holder("١٢ since cmd") == (None, "pid unknown, cmd, since since")  # digits, not ASCII ones
    assert _holder("") == (None, "pid unknown")
    assert _holder("7 t " + "\x07" + "y" * 300) == (7, "pid 7, ?" + "y" * 199 + ", since t")


def test_a_lock_in_a_place_that_is_not_a_file_is_refused_by_name(host):
    """A directory where the lock goes is one line naming it; leaving a lock never entered does nothing."""
    from gpuvfio.errors import InputError

    os.makedirs(os.path.join(state_of(host), "lock"))
    path = os.path.join(state_of(host), "lock")
    with pytest.raises(InputError) as refused:
        RunLock(state_of(host), 1).__enter__()
    assert str(refused.value) == f"cannot use the lock {path}: {path} is a directory, not a regular file"
    RunLock(state_of(host)).__exit__(None, None, None)
    assert RunLock(state_of(host)).timeout == 30.0


def test_a_lock_file_that_is_not_utf8_is_still_named_and_taken_over(host):
    """A lock file with stray bytes (a torn write) names its holder with replacement marks, never a crash."""
    os.makedirs(state_of(host))
    with open(os.path.join(state_of(host), "lock"), "wb") as handle:
        handle.write(b"4194303 2026-12-01T10:00:00+0000 gpuvfio attach \xff\xfe-vm\n")
    with RunLock(state_of(host), 1) as lock:
        assert "left by pid 4194303, gpuvfio attach \ufffd\ufffd-vm, since 2026-12-01T10:00:00+0000" in lock.taken_over


def test_leaving_a_lock_this_object_never_took_does_not_free_the_holders(host):
    """Only the RunLock that took the lock (or re-entered it) lets it go: another object's exit changes nothing."""
    with RunLock(state_of(host), 1) as lock:
        RunLock(state_of(host), 1).__exit__(None, None, None)
        assert _held_elsewhere(lock.path) and _lock_text(host) != ""
    assert not _held_elsewhere(lock.path)


def test_the_lock_is_freed_on_leaving_even_while_a_forked_child_keeps_its_descriptor(host):
    """flock(2) locks belong to the open file: a child forked mid-run shares it, so leaving must unlock
    explicitly (LOCK_UN), not rely on close(2), or the next run waits for that child."""
    import signal

    with RunLock(state_of(host), 1) as lock:
        child = os.fork()
        if child == 0:  # keeps the inherited lock descriptor open until killed
            signal.pause()
            os._exit(0)
    try:
        assert not _held_elsewhere(lock.path)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_holder_line_is_read_in_its_first_512_bytes(host):
    """A holder's line is read in one bounded read (512 bytes): a character cut there shows as U+FFFD, in the
    refusal of a waiting run and in the take-over message alike."""
    import fcntl

    line = ("4194303 tttt " + "\U0001F600" * 200 + "\n").encode()  # 814 bytes: the 512th ends mid-character
    shown = "pid 4194303, " + "\U0001F600" * 124 + "\ufffd, since tttt"
    os.makedirs(state_of(host))
    path = os.path.join(state_of(host), "lock")
    with open(path, "wb") as handle:
        handle.write(line)
    with RunLock(state_of(host), 1) as lock:
        assert lock.taken_over == f"took over the lock {path} left by {shown}, which is gone (gpuvfio status shows " \
                                  "what it did)"
    fd = os.open(path, os.O_RDWR)
    try:
        os.write(fd, line)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a RunLock that did not let go fails here, not hangs
        with pytest.raises(LockTimeout) as refused:
            RunLock(state_of(host), 0).__enter__()
    finally:
        os.close(fd)
    assert str(refused.value) == f"another gpuvfio run holds {path} ({shown}); waited 0s"
