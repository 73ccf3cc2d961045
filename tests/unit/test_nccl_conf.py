"""/etc/nccl.conf carries gpuvfio's NCCL_TOPO_FILE (issue 24 item 1), tested against the consumer.

The reference reader below is NCCL's own, ported line by line from NCCL v2.30.7-1 (commit
73cf1122): src/misc/param.cc ``setEnvFile`` and ``initEnvFunc``, src/os/linux.cc ``ncclOsSetEnv``
(``setenv(name, value, 0)``). It is written apart from gpuvfio.guest.nccl_conf on purpose: the
merge is held to what NCCL would read, not to its own idea of the file.
"""

from __future__ import annotations

import io
import os
import stat
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuvfio.guest.nccl_conf import CONF_FILE, KEY, ConfChange, merge, records, value_of
from gpuvfio.ops.guests import WRITE_CONF, merge_nccl_conf

OURS = "/etc/gpuvfio/nccl-topo.xml"


def nccl_set_env_file(data: bytes, env: dict[bytes, bytes]) -> None:
    """NCCL v2.30.7-1 src/misc/param.cc setEnvFile, on the bytes of one file."""
    file = io.BytesIO(data)
    while True:
        line = file.readline(4095)  # fgets(line, sizeof(line) /* 4096 */, file)
        if not line:  # fgets returns NULL at the end of the file
            return
        line = line.split(b"\0", 1)[0]  # size_t len = strlen(line);
        if line.endswith(b"\n"):  # if (len > 0 && line[len - 1] == '\n') line[--len] = '\0';
            line = line[:-1]
        if line.endswith(b"\r"):  # if (len > 0 && line[len - 1] == '\r') line[--len] = '\0';
            line = line[:-1]
        if line[:1] == b"#":  # if (line[0] == '#') continue;
            continue
        s = line.find(b"=")  # while (line[s] != '\0' && line[s] != '=') s++;
        if s < 0:  # if (line[s] == '\0') continue;
            continue
        name, value = line[:min(1023, s)], line[s + 1:][:1023]  # strncpy(..., std::min(1023, s)); 1023
        if name and name not in env:  # ncclOsSetEnv: setenv(name, value, 0); "" is EINVAL
            env[name] = value


def nccl_env(environ: dict[bytes, bytes], etc: bytes | None, conf_file: bytes | None = None,
             home: bytes | None = None) -> dict[bytes, bytes]:
    """NCCL v2.30.7-1 initEnvFunc: $NCCL_CONF_FILE if set and non-empty, else $HOME/.nccl.conf,
    then /etc/nccl.conf, each applied without overwriting what is already set."""
    env = dict(environ)
    user = conf_file if environ.get(b"NCCL_CONF_FILE") else home
    for data in (user, etc):
        if data is not None:  # fopen failing: return
            nccl_set_env_file(data, env)
    return env


def reads(data: bytes | None) -> dict[bytes, bytes]:
    return nccl_env({}, data)


ADMIN = (b"# site defaults\n"
         b"NCCL_DEBUG=WARN\r\n"
         b"export NCCL_TOPO_FILE=/opt/not-read\n"  # NCCL does not understand export: another key
         b" NCCL_TOPO_FILE=/opt/leading-space\n"  # a leading space: another key
         b"NCCL_SOCKET_IFNAME==eth0\n"  # the value is "=eth0"
         b"no equals sign here\n"
         b"\n"
         b"NCCL_IB_HCA=mlx5")  # no newline at the end


def test_no_file_is_created_with_our_line():
    merged = merge(None, OURS)
    assert merged.change is ConfChange.CREATED and merged.previous is None and merged.changed
    assert reads(merged.text) == {KEY.encode(): OURS.encode()}
    assert merged.text.endswith(b"\nNCCL_TOPO_FILE=/etc/gpuvfio/nccl-topo.xml\n")


def test_an_admins_file_is_kept_byte_for_byte_and_our_line_added():
    merged = merge(ADMIN, OURS)
    assert merged.change is ConfChange.ADDED and merged.previous is None
    assert merged.text.startswith(ADMIN + b"\n")  # a newline ends the admin's last line, nothing else moves
    before, after = reads(ADMIN), reads(merged.text)
    assert after.pop(KEY.encode()) == OURS.encode() and after == before
    assert before[b"export NCCL_TOPO_FILE"] == b"/opt/not-read" and before[b" NCCL_TOPO_FILE"] == b"/opt/leading-space"
    assert before[b"NCCL_SOCKET_IFNAME"] == b"=eth0" and before[b"NCCL_DEBUG"] == b"WARN"


def test_an_admins_topology_file_is_kept_and_said():
    """The README's promise: an admin's file is merged, never clobbered. NCCL keeps reading the
    admin's NCCL_TOPO_FILE, and the merge says which one that is."""
    admin = b"NCCL_DEBUG=INFO\nNCCL_TOPO_FILE=/opt/topo.xml\nNCCL_ALGO=Ring\n"
    merged = merge(admin, OURS)
    assert merged.change is ConfChange.KEPT and merged.previous == "/opt/topo.xml" and not merged.changed
    assert merged.text == admin and reads(merged.text)[KEY.encode()] == b"/opt/topo.xml"


def test_an_admins_topology_file_is_replaced_when_asked_and_said():
    admin = b"NCCL_DEBUG=INFO\nNCCL_TOPO_FILE=\"/opt/topo.xml\"\r\nNCCL_ALGO=Ring\n"
    merged = merge(admin, OURS, replace=True)
    # NCCL keeps quotes: the admin's value was the string with them.
    assert merged.change is ConfChange.REPLACED and merged.previous == '"/opt/topo.xml"'
    assert merged.text == b"NCCL_DEBUG=INFO\nNCCL_TOPO_FILE=/etc/gpuvfio/nccl-topo.xml\r\nNCCL_ALGO=Ring\n"
    assert reads(merged.text) == {b"NCCL_DEBUG": b"INFO", KEY.encode(): OURS.encode(), b"NCCL_ALGO": b"Ring"}


def test_the_first_record_is_the_one_nccl_takes_and_the_one_replaced():
    """setenv(..., 0) never overwrites: a second NCCL_TOPO_FILE line was never read; it stays."""
    admin = b"NCCL_TOPO_FILE=/first\nNCCL_TOPO_FILE=/second\n"
    assert reads(admin)[KEY.encode()] == b"/first" and value_of(admin) == b"/first"
    merged = merge(admin, OURS, replace=True)
    assert merged.previous == "/first" and merged.text == b"NCCL_TOPO_FILE=" + OURS.encode() + b"\nNCCL_TOPO_FILE=/second\n"
    assert reads(merged.text)[KEY.encode()] == OURS.encode()


def test_our_value_already_there_changes_nothing():
    admin = ADMIN + b"\nNCCL_TOPO_FILE=" + OURS.encode() + b"\n"
    merged = merge(admin, OURS)
    assert merged.change is ConfChange.UNCHANGED and merged.text == admin and not merged.changed
    assert merge(merge(None, OURS).text, OURS).change is ConfChange.UNCHANGED  # a second attach: idempotent


def test_a_commented_or_empty_key_is_not_ours():
    for admin in (b"#NCCL_TOPO_FILE=/x\n", b"=NCCL_TOPO_FILE\n", b"NCCL_TOPO_FILEX=/x\n"):
        merged = merge(admin, OURS)
        assert merged.change is ConfChange.ADDED and merged.text.startswith(admin), admin
        assert reads(merged.text)[KEY.encode()] == OURS.encode()


def test_a_line_longer_than_nccls_buffer_is_read_as_nccl_reads_it():
    """fgets reads 4095 bytes at a time: the tail of a longer line is a record of its own. A tail
    that reads as NCCL_TOPO_FILE=... is what NCCL takes; ours must come before it."""
    long_line = b"NCCL_X=" + b"a" * (4095 - 7) + b"NCCL_TOPO_FILE=/opt/from-the-tail\n"
    assert reads(long_line)[KEY.encode()] == b"/opt/from-the-tail"
    assert [r.offset for r in records(long_line)] == [0, 4095]
    assert merge(long_line, OURS).change is ConfChange.KEPT
    merged = merge(long_line, OURS, replace=True)
    assert merged.change is ConfChange.REPLACED and merged.previous == "/opt/from-the-tail"
    assert merged.text.endswith(long_line)  # the admin's line is kept whole
    assert reads(merged.text)[KEY.encode()] == OURS.encode()
    # A long NCCL_TOPO_FILE line itself is replaced whole, its tail with it.
    own = b"NCCL_TOPO_FILE=/" + b"b" * 5000 + b"\nNCCL_Y=1\n"
    merged = merge(own, OURS, replace=True)
    assert merged.text == b"NCCL_TOPO_FILE=" + OURS.encode() + b"\nNCCL_Y=1\n"


def test_a_nul_ends_a_record_as_strlen_does():
    admin = b"NCCL_TOPO_FILE=/x\0junk\nNCCL_Y=1\n"
    assert reads(admin)[KEY.encode()] == b"/x" and value_of(admin) == b"/x"
    merged = merge(admin, OURS, replace=True)
    assert merged.previous == "/x" and merged.text == b"NCCL_TOPO_FILE=" + OURS.encode() + b"\nNCCL_Y=1\n"


@pytest.mark.parametrize("path", ["relative/topo.xml", "/a\nNCCL_DEBUG=INFO", "/a\rb", "/a\0b", "/" + "x" * 1023])
def test_a_path_nccl_could_not_read_back_is_refused(path):
    with pytest.raises(ValueError, match="not a path NCCL can read"):
        merge(None, path)


def test_the_environment_and_the_users_file_win_over_etc():
    """Precedence by NCCL v2.30.7-1 initEnvFunc: what /etc/nccl.conf carries is the default a job
    can still override (its environment, $NCCL_CONF_FILE, or ~/.nccl.conf without it)."""
    etc = merge(None, OURS).text
    assert nccl_env({}, etc)[KEY.encode()] == OURS.encode()
    assert nccl_env({KEY.encode(): b"/job"}, etc)[KEY.encode()] == b"/job"
    assert nccl_env({}, etc, home=b"NCCL_TOPO_FILE=/home\n")[KEY.encode()] == b"/home"
    set_conf = {b"NCCL_CONF_FILE": b"/c"}
    assert nccl_env(set_conf, etc, conf_file=b"NCCL_TOPO_FILE=/c\n", home=b"NCCL_TOPO_FILE=/home\n")[KEY.encode()] == b"/c"
    assert CONF_FILE == "/etc/nccl.conf"


LINES = st.lists(st.one_of(
    st.sampled_from([b"NCCL_TOPO_FILE=/old", b"NCCL_TOPO_FILE=", b"#NCCL_TOPO_FILE=/c", b"NCCL_DEBUG=INFO",
                     b"export NCCL_TOPO_FILE=/e", b"NCCL_TOPO_FILE=/a=b", b"", b"=", b"NCCL_TOPO_FILE"]),
    st.binary(max_size=40), st.builds(lambda n: b"K=" + b"v" * n, st.integers(4000, 4200))), max_size=12)


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(LINES, st.sampled_from([b"\n", b"\r\n"]), st.booleans())
def test_nccl_reads_our_value_and_every_other_pair_as_before(lines, newline, last_newline):
    admin = newline.join(lines) + (newline if last_newline and lines else b"")
    kept = merge(admin, OURS)
    if value_of(admin) not in (None, OURS.encode()):  # the admin's own file: NCCL reads all as before
        assert kept.change is ConfChange.KEPT and kept.text == admin
    merged = merge(admin, OURS, replace=True)
    before, after = reads(admin), reads(merged.text)
    assert after.pop(KEY.encode()) == OURS.encode()
    before.pop(KEY.encode(), None)
    assert after == before
    if merged.change is ConfChange.ADDED:
        assert merged.text.startswith(admin)
    old = value_of(admin)
    assert merged.previous == (None if old in (None, OURS.encode()) else old.decode("utf-8", "replace"))


# -- the guest's side: the scripts merge_nccl_conf runs, run here by sh under a stand-in root -------

class LocalGuest:
    """A guest whose shell is this machine's sh, its / under ``root`` (GPUVFIO_PROBE_ROOT, as the
    stand-in guests of the tests keep their /etc)."""

    def __init__(self, root, shell: list[str]) -> None:
        self.root, self.shell = str(root), shell
        self.calls: list[list[str]] = []

    def run_bytes(self, argv, timeout=120.0, stdin=None):
        self.calls.append(argv)
        assert argv[0] == "sh"
        proc = subprocess.run(self.shell + argv[1:], input=stdin or b"", capture_output=True, timeout=timeout,
                              env={**os.environ, "GPUVFIO_PROBE_ROOT": self.root})
        return proc.returncode, proc.stdout, proc.stderr


def conf_of(root) -> bytes:
    with open(os.path.join(root, "etc", "nccl.conf"), "rb") as handle:
        return handle.read()


SHELLS = [s for s in (["/usr/bin/busybox", "sh"], ["/usr/bin/dash"], ["/bin/bash", "--posix"])
          if os.path.exists(s[0])]


@pytest.fixture(params=SHELLS, ids=[os.path.basename(s[0]) for s in SHELLS])
def guest(tmp_path, request):
    """A guest with a busybox, dash or bash sh: what small and large guest images have."""
    (tmp_path / "etc").mkdir()
    return LocalGuest(tmp_path, request.param)


def test_the_guest_gets_a_new_file_nccl_reads(guest, tmp_path):
    done = merge_nccl_conf(guest, OURS, 30)
    assert done.change is ConfChange.CREATED and done.error is None
    assert reads(conf_of(tmp_path)) == {KEY.encode(): OURS.encode()}
    assert stat.S_IMODE(os.stat(tmp_path / "etc" / "nccl.conf").st_mode) == 0o644
    assert os.listdir(tmp_path / "etc") == ["nccl.conf"]  # no temporary file left


def test_the_admins_file_keeps_its_bytes_and_mode(guest, tmp_path):
    path = tmp_path / "etc" / "nccl.conf"
    path.write_bytes(ADMIN + b"\nNCCL_TOPO_FILE=/opt/old.xml\r\n# end\n")
    os.chmod(path, 0o600)
    inode = os.stat(path).st_ino
    calls = len(guest.calls)
    kept = merge_nccl_conf(guest, OURS, 30)  # not asked to replace: only read
    assert kept.change is ConfChange.KEPT and kept.previous == "/opt/old.xml" and len(guest.calls) == calls + 1
    assert os.stat(path).st_ino == inode
    done = merge_nccl_conf(guest, OURS, 30, replace=True)
    assert done.change is ConfChange.REPLACED and done.previous == "/opt/old.xml"
    assert conf_of(tmp_path) == ADMIN + b"\nNCCL_TOPO_FILE=" + OURS.encode() + b"\r\n# end\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.stat(path).st_ino != inode  # renamed over it, not rewritten in place
    assert sorted(os.listdir(tmp_path / "etc")) == ["nccl.conf"]
    # A second attach finds its own line: nothing written at all.
    calls = len(guest.calls)
    assert merge_nccl_conf(guest, OURS, 30).change is ConfChange.UNCHANGED and len(guest.calls) == calls + 1


def test_a_symbolic_link_is_refused_and_left_as_it_is(guest, tmp_path):
    target = tmp_path / "shared.conf"
    target.write_bytes(b"NCCL_DEBUG=INFO\n")
    os.symlink(str(target), tmp_path / "etc" / "nccl.conf")
    done = merge_nccl_conf(guest, OURS, 30)
    assert done.change is None and "symbolic link" in done.error and str(target) in done.error
    assert target.read_bytes() == b"NCCL_DEBUG=INFO\n" and os.path.islink(tmp_path / "etc" / "nccl.conf")
    # The write itself refuses a link that appeared after the read.
    status, _out, err = guest.run_bytes(["sh", "-c", WRITE_CONF, "sh", CONF_FILE, "/etc/.t"], stdin=b"X=1\n")
    assert status == 3 and b"symbolic link" in err and target.read_bytes() == b"NCCL_DEBUG=INFO\n"


def test_something_else_than_a_file_is_refused(guest, tmp_path):
    (tmp_path / "etc" / "nccl.conf").mkdir()
    done = merge_nccl_conf(guest, OURS, 30)
    assert done.change is None and "not a regular file" in done.error


def test_attach_says_when_the_admins_file_is_what_nccl_reads():
    """A kept admin line is no failure, but jobs do not find gpuvfio's file by themselves: the
    answer says to export it and how to replace the line, the admin's value bounded."""
    from gpuvfio.ops.guests import NcclConf, NcclTopology

    kept = NcclTopology(path=OURS, xml="", conf=NcclConf(change=ConfChange.KEPT, previous="/opt/" + "x" * 500))
    assert not kept.named and kept.use.startswith(f"export NCCL_TOPO_FILE={OURS} (")
    assert "--replace-nccl-topo-file" in kept.use and len(kept.use) < 400
    added = NcclTopology(path=OURS, xml="", conf=NcclConf(change=ConfChange.ADDED))
    assert added.named and "no export needed" in added.use
