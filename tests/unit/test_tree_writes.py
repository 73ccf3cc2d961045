"""Tree's writers (write, symlink, stage) on real files: what they make (content, link target,
modes of files and of the parents they make), where a staged temp lies, what they refuse (a
directory or FIFO where a file goes), what they clear first (a stale or planted temp), and what a
failure names (the path and the system's reason), with no temp and no descriptor left behind."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
import struct

import pytest

from gpuvfio.errors import GpuvfioError
from gpuvfio.files import NotRegular, Tree
from tests.conftest import open_fds, untouched


@pytest.fixture
def umask022():
    """Modes are asserted as made under the common umask 022 (it keeps every bit a mode sets
    apart from group and other write), whatever the caller's umask is."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode_of(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)



def test_files_links_and_parents_are_made_with_the_modes_asked(tmp_path, umask022):
    """The file layer must make files 0644 and parents 0755 unless told otherwise, and honour an
    explicit mode or dir_mode (the state directory is 0700: journals name a host's devices)."""
    tree = Tree(str(tmp_path))
    tree.write("a/b/file", b"raw\x00\xff")
    tree.write("c/d/text", "v\u00e9rifi\u00e9\n", mode=0o600, dir_mode=0o700)
    assert (tmp_path / "a/b/file").read_bytes() == b"raw\x00\xff"
    assert (tmp_path / "c/d/text").read_bytes() == "v\u00e9rifi\u00e9\n".encode("utf-8")
    assert [mode_of(tmp_path / p) for p in ("a", "a/b", "a/b/file")] == [0o755, 0o755, 0o644]
    assert [mode_of(tmp_path / p) for p in ("c", "c/d", "c/d/text")] == [0o700, 0o700, 0o600]

    tree.symlink("e/f/link", "../target")
    tree.symlink("g/link", "target", dir_mode=0o700)
    assert os.readlink(tmp_path / "e/f/link") == "../target" and os.readlink(tmp_path / "g/link") == "target"
    assert [mode_of(tmp_path / p) for p in ("e", "e/f", "g")] == [0o755, 0o755, 0o700]

    staged = tree.stage("h/i/file")
    private = tree.stage("j/file", "secret", mode=0o600, dir_mode=0o700)
    assert [mode_of(tmp_path / p) for p in ("h", "h/i", staged)] == [0o755, 0o755, 0o644]
    assert [mode_of(tmp_path / p) for p in ("j", private)] == [0o700, 0o600]


def test_a_link_replaces_a_file_or_link_never_what_it_points_to(tmp_path, outside):
    """The file layer must make systemd's enablement links in place, replacing the name (a file,
    a stale link) and never writing through an old link to its target."""
    top = tmp_path / "top"
    tree = Tree(str(top))
    fds = open_fds()
    tree.symlink("etc/systemd/wants/unit.service", "/lib/systemd/unit.service")
    (top / "etc/file").write_text("old")
    os.symlink(str(outside / "secret"), top / "etc/old-link")
    tree.symlink("etc/file", "new-target")
    tree.symlink("etc/old-link", "other-target")
    assert open_fds() == fds
    assert tree.readlink("etc/systemd/wants/unit.service") == "/lib/systemd/unit.service"
    assert tree.readlink("etc/file") == "new-target" and tree.readlink("etc/old-link") == "other-target"
    assert untouched(outside)
    assert sorted(os.listdir(top / "etc")) == ["file", "old-link", "systemd"]  # no temp left


@pytest.mark.parametrize("rel", ["top-level", "one/deep", "two/levels/deep"])
def test_a_staged_temp_lies_beside_its_target_with_the_content_given(tmp_path, rel):
    """The file layer must stage a transaction's new content in the target's own directory (a
    rename across directories is refused) and return a path that reaches it beneath the top."""
    tree = Tree(str(tmp_path))
    fds = open_fds()
    parent = os.path.dirname(rel)
    for data, expected in ((None, b""), (b"", b""), (b"raw\x00", b"raw\x00"), ("\u00e9\n", "\u00e9\n".encode())):
        staged = tree.stage(rel, data)
        assert os.path.dirname(staged) == parent and os.path.basename(staged) != os.path.basename(rel)
        assert tree.read(staged) == expected, data
        tree.replace_with(staged, rel)
        assert tree.read(rel) == expected and tree.listdir(parent) == [os.path.basename(rel)]
    staged = tree.stage(rel, link="../elsewhere")
    assert os.path.dirname(staged) == parent and tree.readlink(staged) == "../elsewhere"
    tree.replace_with(staged, rel)
    assert tree.readlink(rel) == "../elsewhere" and tree.listdir(parent) == [os.path.basename(rel)]
    assert open_fds() == fds


def test_a_stale_or_planted_temp_is_cleared_not_written_through(tmp_path, outside):
    """The file layer must clear a temp left at its temp name (an earlier run with this pid, or a
    link an attacker planted there) before making its own, and never write through it."""
    top = tmp_path / "top"
    tree = Tree(str(top))
    rel = "etc/conf"
    # Each writer, and whether what it made holds "mine" (a staged temp is then removed).
    writers = {"write": (lambda: tree.write(rel, "mine"), lambda _: tree.read(rel) == b"mine"),
               "symlink": (lambda: tree.symlink(rel, "mine"), lambda _: tree.readlink(rel) == "mine"),
               "stage": (lambda: tree.stage(rel, "mine"),
                         lambda temp: tree.read(temp) == b"mine" and tree.remove(temp)),
               "stage a link": (lambda: tree.stage(rel, link="mine"),
                                lambda temp: tree.readlink(temp) == "mine" and tree.remove(temp))}
    # A temp is left at this process's temp name the way an earlier run would leave it: staged.
    plants = {"a stale temp": lambda: tree.stage(rel, "stale"),
              "a link out": lambda: tree.stage(rel, link=str(outside / "secret"))}
    for how, (writer, made) in writers.items():
        for planted, plant in plants.items():
            plant()
            assert made(writer()), (how, planted)
            assert os.listdir(top / "etc") == ["conf"], (how, planted)
    assert untouched(outside)


@pytest.mark.parametrize("kind", ["directory", "FIFO"])
@pytest.mark.parametrize("how", ["write", "symlink"])
def test_a_directory_or_fifo_at_the_target_is_refused_and_no_temp_is_left(tmp_path, kind, how):
    """The file layer must replace only a file or a link: a directory or FIFO planted at the target
    is refused by name, kept as it was, and the temp made for it is removed."""
    tree = Tree(str(tmp_path))
    (tmp_path / "etc").mkdir()
    target = tmp_path / "etc" / "conf"
    if kind == "directory":
        target.mkdir()
        (target / "inside").write_text("kept")
    else:
        os.mkfifo(target)
    fds = open_fds()
    with pytest.raises(NotRegular) as err:
        tree.write("etc/conf", "x") if how == "write" else tree.symlink("etc/conf", "x")
    assert tree.path("etc/conf") in str(err.value) and kind in str(err.value)
    assert open_fds() == fds and os.listdir(tmp_path / "etc") == ["conf"]
    if kind == "directory":
        assert os.listdir(target) == ["inside"]
    else:
        assert stat.S_ISFIFO(os.lstat(target).st_mode)


def test_a_failed_write_names_its_path_and_the_systems_reason(tmp_path):
    """The file layer must turn an OSError into one message that names the path written and the
    system's reason (not Python's errno repr), leaving no descriptor open."""
    tree = Tree(str(tmp_path))
    rel = "etc/conf"
    # A directory where the temp goes: it cannot be cleared, so the new temp (O_EXCL) is refused.
    temp = tree.stage(rel)
    tree.remove(temp)
    os.mkdir(tmp_path / temp)
    long_name = "etc/" + "n" * 256  # its temp name is cut short to fit; the name itself does not
    attempts = {"write": lambda: tree.write(rel, "x"), "symlink": lambda: tree.symlink(rel, "x"),
                "stage": lambda: tree.stage(rel, "x"), "stage a link": lambda: tree.stage(rel, link="x"),
                "write a long name": lambda: tree.write(long_name, "x"),
                "symlink a long name": lambda: tree.symlink(long_name, "x"),
                "stage a link too long": lambda: tree.stage("etc/other", link="x" * 5000)}
    fds = open_fds()
    for how, attempt in attempts.items():
        with pytest.raises(GpuvfioError) as err:
            attempt()
        named = tree.path(long_name if "long name" in how else "etc/other" if "too long" in how else rel)
        reason = os.strerror(errno.ENAMETOOLONG if "long" in how else errno.EEXIST)
        assert str(err.value) == f"cannot write {named}: {reason}", how
    assert open_fds() == fds
    assert sorted(os.listdir(tmp_path / "etc")) == [os.path.basename(temp)]  # nothing else left


# A seccomp filter that answers EIO to fsync(2) (a disk failing under a write), for this process
# only: fsync's outcome is otherwise seen only after a power loss.
_FSYNC = {"x86_64": (0xC000003E, 74), "aarch64": (0xC00000B7, 82)}


def _fail_fsync() -> None:
    arch, number = _FSYNC[platform.machine()]
    insns = [(0x20, 0, 0, 4), (0x15, 0, 3, arch), (0x20, 0, 0, 0), (0x15, 0, 1, number),
             (0x06, 0, 0, 0x00050000 | errno.EIO), (0x06, 0, 0, 0x7FFF0000)]
    program = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *insn) for insn in insns))
    fprog = struct.pack("HxxxxxxP", len(insns), ctypes.addressof(program))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0):  # NO_NEW_PRIVS, SECCOMP
        raise OSError(ctypes.get_errno(), "seccomp")


def _outcome_when_fsync_fails(call) -> str:
    """What ``call`` does in a forked copy of this process whose fsync fails."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports through the pipe and never returns into pytest
        try:
            _fail_fsync()
            call()
            outcome = "done"
        except GpuvfioError as exc:
            outcome = str(exc)
        except BaseException as exc:  # noqa: BLE001 - the parent shows what went wrong
            outcome = f"unexpected {exc!r}"
        os.write(writer, outcome.encode())
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        outcome = pipe.read().decode()
    os.waitpid(pid, 0)
    return outcome


@pytest.mark.skipif(platform.machine() not in _FSYNC, reason="fsync's syscall number is known for x86_64/aarch64")
def test_a_write_whose_fsync_fails_is_reported_not_claimed_done(tmp_path):
    """The file layer must fsync what it writes or stages by default and report a failed fsync with
    the path: a journal claimed durable but lost at a power cut would undo the wrong binding."""
    tree = Tree(str(tmp_path))
    # Each call once in this process as well (the failures below happen in children): what a
    # test calls in its own process is what mutation testing (make mutate) runs it against.
    tree.write("a/journal", "x")
    tree.replace_with(tree.stage("a/conf", "x"), "a/conf")
    if _outcome_when_fsync_fails(lambda: None).startswith("unexpected"):
        pytest.skip("seccomp filters are not allowed here")
    eio = os.strerror(errno.EIO)
    for name, call in (("a/journal", lambda: tree.write("a/journal", "x")),
                       ("a/conf", lambda: tree.stage("a/conf", "x"))):
        assert _outcome_when_fsync_fails(call) == f"cannot write {tree.path(name)}: {eio}"
    assert _outcome_when_fsync_fails(lambda: tree.write("a/scratch", "x", durable=False)) == "done"
