"""The file layer's walks and reads (gpuvfio.files.Tree, ReadOnlyTree), called in process on real
trees under tmp_path: what a read answers, what it refuses and the path its refusal names, what a
read never makes, the modes of the directories a write makes, and descriptors never leaked."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import subprocess
import sys
import threading

import pytest

from gpuvfio.errors import GpuvfioError, HostReadError, InputError, UnsafePathError
from gpuvfio.files import NotRegular, ReadOnly, Tree
from gpuvfio.read_only_tree import ReadOnlyTree
from tests.conftest import open_fds


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@contextlib.contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


@contextlib.contextmanager
def without_capabilities():
    """This thread without its effective capabilities (kept permitted, so raised again after):
    root then meets file modes and kernel checks as any user does. A no-op for a user."""
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        pytest.skip("capget is not available")
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
def top(tmp_path):
    """top/a/file ("héllo"), top/a/linked -> a directory outside, top/empty/."""
    top = tmp_path / "top"
    (top / "a").mkdir(parents=True)
    (top / "a" / "file").write_text("héllo")
    (top / "empty").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("secret")
    os.symlink(str(tmp_path / "outside"), top / "a" / "linked")
    return top


# -- paths and sub-trees ----------------------------------------------------------------------------
def test_a_tree_names_its_top_then_base_then_the_path(tmp_path):
    """Every message names the path built here: a part left out names another file."""
    assert Tree(str(tmp_path)).path() == str(tmp_path)
    assert Tree(str(tmp_path), "a/b").path() == f"{tmp_path}/a/b"
    assert Tree(str(tmp_path), "a/b").path("c/d") == f"{tmp_path}/a/b/c/d"


@pytest.mark.parametrize("bad", ["", "/tmp/x\0y"])
def test_an_empty_or_nul_top_is_bad_input(bad):
    """An empty top would be the working directory (the live host for ``--root ''``)."""
    with pytest.raises(InputError, match="empty"):
        Tree(bad)


@pytest.mark.parametrize("kind", [Tree, ReadOnlyTree])
def test_a_sub_tree_walks_beneath_the_same_top_and_keeps_its_kind(top, kind):
    """A sub-tree of a read-only tree must refuse writes too, and name the paths beneath its parent."""
    (top / "a" / "b" / "c").mkdir(parents=True)
    (top / "a" / "b" / "c" / "deep").write_text("deep")
    sub = kind(str(top), "a").sub("b/c")
    assert type(sub) is kind and sub.top == str(top)
    assert sub.path("deep") == f"{top}/a/b/c/deep" and sub.read("deep") == b"deep"
    if kind is ReadOnlyTree:
        with pytest.raises(ReadOnly):
            sub.write("new", "x")
        assert not (top / "a" / "b" / "c" / "new").exists()


# -- the top -------------------------------------------------------------------------------------
def test_a_top_that_is_not_a_directory_is_refused_by_name(tmp_path):
    """A file (or a dangling link) given as the top is refused, never read as an empty tree."""
    (tmp_path / "file").write_text("x")
    os.symlink(str(tmp_path / "nowhere"), tmp_path / "dangling")
    for top in (tmp_path / "file", tmp_path / "dangling"):
        tree = Tree(str(top))
        calls = [tree.listdir, lambda: tree.read("x"), tree.make_dir] if top.name == "file" else [tree.make_dir]
        for call in calls:
            with pytest.raises(UnsafePathError, match=f"{top} is not a directory"):
                call()
    assert Tree(str(tmp_path / "file")).is_dir() is False


def test_a_top_that_cannot_be_opened_or_made_is_refused_naming_it(tmp_path):
    """A looping top or one beneath a dangling link is named with the reason, not a traceback."""
    loop = tmp_path / "loop"
    os.symlink("loop", loop)
    for call in (Tree(str(loop)).listdir, Tree(str(loop)).make_dir):
        with pytest.raises(UnsafePathError, match="link") as refused:
            call()
        assert str(loop) in str(refused.value)
    os.symlink(str(tmp_path / "gone"), tmp_path / "dangling")
    beneath = tmp_path / "dangling" / "state"
    with pytest.raises(GpuvfioError) as refused:
        Tree(str(beneath)).make_dir()
    assert str(beneath) in str(refused.value)
    assert str(refused.value).endswith(os.strerror(errno.ENOENT))  # the reason, once, without errno noise


def test_reads_never_make_a_directory(tmp_path, top):
    """Reads of what is missing answer nothing and make nothing: a dry run changes no tree."""
    for tree in (Tree(str(tmp_path / "new" / "state")), Tree(str(top)), ReadOnlyTree(str(top))):
        assert tree.listdir("x/y") == [] and tree.is_dir("x/y") is False
        assert tree.read("x/y/f") is None and tree.text("x/y/f") is None
        assert tree.lstat("x/y/f") is None and tree.readlink("x/y/f") is None
        assert tree.exists("x/y/f") is False
    assert not (tmp_path / "new").exists()
    assert sorted(os.listdir(top)) == ["a", "empty"]


# -- making directories ------------------------------------------------------------------------------
def test_directories_are_made_with_the_mode_asked_never_wider(tmp_path):
    """With umask 0 a mode left to the default would be 0777: a world-writable state directory."""
    top = tmp_path / "new" / "top"
    with umask(0):
        tree = Tree(str(top))
        tree.make_dir()
        assert os.listdir(top) == [] and mode_of(top) == 0o755
        tree.make_dir("a/b")
        tree.make_dir("private", 0o700)
        tree.write("d/e/file", "x", dir_mode=0o750)
        os.close(tree.open_dir(["opened"], create=True))
    assert [mode_of(top / rel) for rel in ("a", "a/b", "private", "d", "d/e", "opened")] == [
        0o755, 0o755, 0o700, 0o750, 0o750, 0o755]


def test_a_directory_that_cannot_be_made_or_opened_is_a_host_error_naming_it(top):
    """Where the file system refuses a mkdir or the open of what was just made, the path is named."""
    (top / "locked").mkdir(mode=0o555)
    tree = Tree(str(top))
    try:
        with without_capabilities():
            with pytest.raises(HostReadError) as refused:
                tree.make_dir("locked/new")
            assert f"{top}/locked/new" in str(refused.value)
            with pytest.raises(HostReadError) as refused:
                tree.make_dir("unreadable", 0)
            assert f"{top}/unreadable" in str(refused.value)
    finally:
        os.chmod(top / "locked", 0o755)
        if (top / "unreadable").exists():
            os.chmod(top / "unreadable", 0o755)


# -- another process at the same time ----------------------------------------------------------------
def race(rounds: int, mine, rival) -> None:
    """``mine(i)`` here and ``rival(i)`` in another thread, released together each round: the
    narrow windows between a walk's syscalls are met a few times in a few thousand rounds."""
    barrier = threading.Barrier(2)

    def rival_rounds():
        with contextlib.suppress(threading.BrokenBarrierError):
            for i in range(rounds):
                barrier.wait()
                rival(i)

    thread = threading.Thread(target=rival_rounds)
    thread.start()
    try:
        for i in range(rounds):
            barrier.wait()
            mine(i)
    finally:
        barrier.abort()
        thread.join()


def test_a_top_made_by_another_process_at_the_same_time_is_used(tmp_path):
    """Two commands making the same new state directory at once: the slower one uses it."""
    def rival(i):
        for _ in range(i % 64):  # a later start each round: the mkdir sweeps across the walk's window
            pass
        with contextlib.suppress(FileExistsError):
            os.mkdir(tmp_path / f"top{i}")

    race(2000, lambda i: Tree(str(tmp_path / f"top{i}")).make_dir(), rival)


def test_a_directory_removed_while_it_is_made_is_refused_naming_it(tmp_path):
    """Another process removing what a write just made: an error naming the directory."""
    refused = []

    def mine(i):
        try:
            Tree(str(tmp_path)).make_dir(f"d{i}")
        except HostReadError as exc:
            refused.append((i, str(exc)))

    def rival(i):
        for _ in range(100_000):
            with contextlib.suppress(FileNotFoundError):
                return os.rmdir(tmp_path / f"d{i}")

    race(500, mine, rival)
    assert all(f"{tmp_path}/d{i}" in message for i, message in refused), refused[:3]


# -- links and refusals ------------------------------------------------------------------------------
def test_a_link_on_the_way_is_refused_naming_the_full_path(top, tmp_path):
    """A link inside the tree is never followed; its refusal names where it is, not a bare name."""
    tree = Tree(str(top))
    for call in (lambda: tree.listdir("a/linked"), lambda: tree.read("a/linked/secret"),
                 lambda: tree.make_dir("a/linked/new")):
        with pytest.raises(UnsafePathError, match=f"{top}/a/linked is a link"):
            call()
    with pytest.raises(UnsafePathError, match=f"{top}/a/file is not a directory"):
        tree.listdir("a/file/x")
    assert tree.is_dir("a/linked") is False and tree.is_dir("a/file") is False
    assert tree.exists("a/linked/secret") is False and tree.exists("a/linked") is True
    assert stat.S_ISLNK(tree.lstat("a/linked").st_mode)
    assert tree.readlink("a/linked") == str(tmp_path / "outside")
    assert os.listdir(tmp_path / "outside") == ["secret"]


def test_reads_answer_what_is_there(top):
    """Listings are sorted and complete; a file's text is its UTF-8; a file is not a link."""
    tree = Tree(str(top))
    assert tree.is_dir() is True and tree.is_dir("a") is True
    assert tree.listdir() == ["a", "empty"] and tree.listdir("a") == ["file", "linked"]
    assert tree.text("a/file") == "héllo" and tree.read("a/file") == "héllo".encode()
    assert tree.readlink("a/file") is None and tree.readlink("a") is None
    with pytest.raises(UnsafePathError, match="larger than 3 bytes"):
        tree.text("a/file", 3)


def test_a_refused_read_names_the_file(top):
    """Not UTF-8, a FIFO, a name too long, no name at all: each refusal names the path."""
    tree = Tree(str(top))
    (top / "a" / "latin1").write_bytes("é".encode("latin-1"))
    with pytest.raises(InputError, match=f"{top}/a/latin1 is not UTF-8"):
        tree.text("a/latin1")
    os.mkfifo(top / "a" / "fifo")
    with pytest.raises(NotRegular, match=f"{top}/a/fifo is a FIFO"):
        tree.read("a/fifo")
    long = "x" * 300
    with pytest.raises(UnsafePathError, match="name too long") as refused:
        tree.lstat(f"a/{long}")
    assert str(refused.value).startswith(f"{top}/a/xxx")
    with pytest.raises(UnsafePathError, match=f"empty file name under {top}"):
        tree.read("")


# -- descriptors -------------------------------------------------------------------------------------
def test_directory_walks_leak_no_descriptor(top):
    """gpuvfio walks thousands of sysfs paths in one run: each walk closes what it opened."""
    tree = Tree(str(top))
    before = open_fds()
    for _ in range(3):
        assert tree.is_dir("a") and not tree.is_dir("missing") and not tree.is_dir("a/linked")
        tree.make_dir("a/made")  # there already after the first round
        assert tree.listdir("a") == ["file", "linked", "made"]
        with pytest.raises(UnsafePathError):
            tree.listdir("a/linked/x")
    assert open_fds() == before


def test_descriptor_zero_is_closed_like_any_other(top):
    """Started with stdin closed, the top's fd is 0: a walk that stops there still closes it."""
    tree = Tree(str(top))
    saved = os.dup(0)
    os.close(0)
    try:
        assert tree.listdir("missing") == []
        with pytest.raises(OSError):
            os.fstat(0)
        with pytest.raises(UnsafePathError):
            Tree(str(top), "a").listdir("linked")
        with pytest.raises(OSError):
            os.fstat(0)
    finally:
        os.dup2(saved, 0)
        os.close(saved)


def test_a_listing_the_kernel_refuses_is_a_host_error_naming_it():
    """procfs lets root open another process's map_files, then refuses its listing without
    CAP_SYS_PTRACE: the error names the directory and the reason."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a process with more capabilities than this thread")
    child = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # started: its /proc entries are those of the new program
        where = f"/proc/{child.pid}/map_files"
        with without_capabilities():
            fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.listdir(fd)
                pytest.skip("this kernel lists map_files without CAP_SYS_PTRACE")
            except PermissionError:
                pass
            finally:
                os.close(fd)
            with pytest.raises(HostReadError) as refused:
                Tree(f"/proc/{child.pid}").listdir("map_files")
        assert str(refused.value) == f"cannot list {where}: {os.strerror(errno.EACCES)}"
    finally:
        child.kill()
        child.wait()


# -- a read-only tree --------------------------------------------------------------------------------
def test_a_read_only_tree_reads_and_refuses_every_write_naming_it(top):
    """A dry run's state dir: every write is refused naming what and where, every read still works."""
    tree = ReadOnlyTree(str(top))
    assert tree.read("a/file") == "héllo".encode() and tree.listdir() == ["a", "empty"] and tree.is_dir("a")
    writes = [("writing", lambda: tree.write("a/new", "x")), ("writing", lambda: tree.make_dir("made")),
              ("writing", lambda: tree.open_attribute("a/file")), ("writing", lambda: tree.open_lock("lock")),
              ("removing", lambda: tree.remove("a/file")), ("renaming", lambda: tree.replace_with(".f.tmp", "f"))]
    for what, call in writes:
        with pytest.raises(ReadOnly) as refused:
            call()
        assert str(refused.value).startswith(f"{what} under {top} refused")
    assert sorted(os.listdir(top)) == ["a", "empty"] and sorted(os.listdir(top / "a")) == ["file", "linked"]
    assert (top / "a" / "file").read_text() == "héllo"
