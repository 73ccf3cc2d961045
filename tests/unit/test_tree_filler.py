"""TreeFiller (the bulk writer a recording is loaded with) on real files: it makes a missing root,
files 0644 and directories 0755, replaces a regular file and a link, and refuses the rest: a bad
path component anywhere, a link or file on the way, a FIFO or directory where a file goes. What it
refuses or fails on is one error naming the path and the system's reason; nothing is read,
written or removed beside the root (nor in the working directory), and no descriptor is left."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal
import stat
import threading

import pytest

from gpuvfio.errors import GpuvfioError, HostReadError, UnsafePathError
from gpuvfio.files import NotRegular, Tree
from gpuvfio.tree_filler import TreeFiller
from tests.conftest import open_fds, untouched

NOBODY = 65534


def mode_of(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)



def listing(top) -> list[str]:
    """Every path beneath ``top`` with its kind, links not followed."""
    found = []
    for directory, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(directory, name)
            found.append(f"{os.path.relpath(path, top)}:{stat.S_IFMT(os.lstat(path).st_mode):o}")
    return sorted(found)


def reason(code: int) -> str:
    """The system's words for an errno, as a message ends with them (not an 'Errno' dump)."""
    return ": " + os.strerror(code)


@pytest.fixture
def root(tmp_path):
    top = tmp_path / "root"
    top.mkdir()
    return top


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """A working directory holding names the root holds too (a directory 'up', a temp's name): a
    write that lost its directory fd would land here. Its listing must not change."""
    here = tmp_path / "cwd"
    (here / "up").mkdir(parents=True)
    (here / f".x.tmp-{os.getpid()}").write_text("cwd")
    monkeypatch.chdir(here)
    before = listing(here)
    yield here
    assert listing(here) == before


@pytest.fixture
def umask0():
    """Modes are exactly the ones asked for: nothing masked off."""
    old = os.umask(0)
    yield
    os.umask(old)


@contextlib.contextmanager
def as_nobody(*owned):
    """Without root's override of permissions (so EACCES happens), for the duration; ``owned``
    become nobody's first. A process that is not root is that already."""
    if os.geteuid() != 0:
        yield
        return
    for path in owned:
        os.chown(path, NOBODY, NOBODY)
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def test_a_missing_root_is_made_and_written_into(tmp_path, cwd):
    """A recording is loaded into a directory that need not exist yet: made, then filled, never
    the working directory instead."""
    top = tmp_path / "new" / "root"
    with TreeFiller(Tree(str(top))) as filler:
        filler.write(["x"], b"1")
        filler.write(["sys", "y"], b"2")
    assert (top / "x").read_bytes() == b"1" and (top / "sys" / "y").read_bytes() == b"2"


def test_files_are_0644_and_directories_0755_new_or_replaced(root, umask0):
    """The file layer must make a tree's directories 0755 and files 0644 (a replaced file too),
    whatever the caller's umask, as sysfs shows them."""
    with TreeFiller(Tree(str(root))) as filler:
        filler.make_dir(["a", "b"])
        filler.write(["a", "f"], b"one")
        filler.write(["c", "d", "g"], b"new")
        filler.write(["c", "d", "g"], b"replaced")
    assert [mode_of(root / p) for p in ("a", "a/b", "c", "c/d")] == [0o755] * 4
    assert [mode_of(root / p) for p in ("a/f", "c/d/g")] == [0o644, 0o644]
    assert (root / "c/d/g").read_bytes() == b"replaced"
    assert sorted(os.listdir(root / "c/d")) == ["g"]


BAD = ["", ".", "..", "a/b", "a\0b"]
BAD_PATHS = ([[bad, "b", "c"] for bad in BAD] + [["a", bad, "c"] for bad in BAD] + [["a", "b", bad] for bad in BAD]
             + [["..", "outside", "pwned"], ["../outside", "pwned"], ["a", "b", "../../../outside/pwned"]])


@pytest.mark.parametrize("parts", BAD_PATHS, ids=repr)
def test_a_bad_component_anywhere_is_refused_and_named(root, outside, cwd, parts):
    """The file layer must refuse '', '.', '..', '/' and NUL in any component (a '..' or a '/'
    would leave the root), naming the component, and write nothing anywhere."""
    bad = next(p for p in parts if p in BAD or "/" in p)
    with TreeFiller(Tree(str(root))) as filler, pytest.raises(UnsafePathError) as err:
        filler.write(parts, b"pwned")
    assert repr(bad) in str(err.value) and "component" in str(err.value)
    assert untouched(outside) and "pwned" not in str(listing(root))


def test_an_empty_path_is_refused_naming_the_root(root):
    """A record with no name at all is refused, naming the tree it was for."""
    with TreeFiller(Tree(str(root))) as filler, pytest.raises(UnsafePathError, match=str(root)):
        filler.write([], b"x")


@pytest.mark.parametrize("on_the_way", [["up"], ["sys", "up"]])
@pytest.mark.parametrize("kind", ["link", "file"])
def test_a_link_or_file_on_the_way_is_refused_and_named(root, outside, cwd, on_the_way, kind):
    """The file layer must never walk through a link (nor a file) on a path, at the top or below,
    and must say which path it is and what is there."""
    where = root.joinpath(*on_the_way)
    where.parent.mkdir(parents=True, exist_ok=True)
    if kind == "link":
        where.symlink_to(outside)
    else:
        where.write_text("a file")
    with TreeFiller(Tree(str(root))) as filler, pytest.raises(UnsafePathError) as err:
        filler.write([*on_the_way, "pwned"], b"pwned")
    assert str(where) in str(err.value)
    assert ("is a link" if kind == "link" else "not a directory") in str(err.value)
    assert untouched(outside)


def test_moving_to_another_path_closes_the_directories_left(root):
    """Only the directories of the current path stay open: a recording of thousands of
    directories must not hold thousands of descriptors, nor leak any once done."""
    before = open_fds()
    with TreeFiller(Tree(str(root))) as filler:
        filler.write(["a", "b", "c", "x"], b"1")
        assert open_fds() == before + 4  # the root, a, a/b, a/b/c
        filler.write(["a", "d", "x"], b"2")
        assert open_fds() == before + 3  # the root, a, a/d
        filler.write(["e", "x"], b"3")
        assert open_fds() == before + 2
    assert open_fds() == before


def test_lstat_looks_at_links_without_following(root, cwd):
    """What is at a path, as the filler will find it: a link is a link (a dangling one too), never
    what it names, and a missing name is None."""
    (root / "sys" / "dir").mkdir(parents=True)
    (root / "sys" / "f").write_text("f")
    (root / "sys" / "link").symlink_to("dir")
    (root / "sys" / "dangling").symlink_to("nowhere")
    with TreeFiller(Tree(str(root))) as filler:
        assert stat.S_ISLNK(filler.lstat(["sys", "link"]).st_mode)
        assert stat.S_ISLNK(filler.lstat(["sys", "dangling"]).st_mode)
        assert filler.lstat(["sys", "f"]).st_ino == os.lstat(root / "sys" / "f").st_ino
        assert filler.lstat(["sys", "missing"]) is None


def test_a_name_too_long_is_one_error_naming_the_path(root):
    """The file layer must turn a name the system refuses into one error that names the path and
    gives the system's reason, whichever way it is written or looked at."""
    name = "n" * 300
    where = str(root / "sys" / name)
    with TreeFiller(Tree(str(root))) as filler:
        for call, error in ((lambda: filler.lstat(["sys", name]), HostReadError),
                            (lambda: filler.write(["sys", name], b"x"), GpuvfioError),
                            (lambda: filler.symlink(["sys", name], "target"), GpuvfioError)):
            with pytest.raises(error) as err:
                call()
            assert where in str(err.value) and str(err.value).endswith(reason(errno.ENAMETOOLONG))


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past ``limit`` bytes fail with EFBIG (as on a full disk) instead of a signal."""
    old_limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limits)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_bytes_that_cannot_be_written_are_one_error_naming_the_path(root):
    """A record whose bytes do not fit (no space, a file-size limit) must fail naming its path
    and the reason, a new file or a file written again alike, with no descriptor left open."""
    with TreeFiller(Tree(str(root))) as filler:
        filler.write(["sys", "again"], b"old")
        before = open_fds()
        for parts in (["sys", "new"], ["sys", "again"]):
            with file_size_limit(1024), pytest.raises(GpuvfioError) as err:
                filler.write(parts, b"0" * 4096)
            assert str(root.joinpath(*parts)) in str(err.value) and str(err.value).endswith(reason(errno.EFBIG))
        assert open_fds() == before
    assert (root / "sys" / "again").read_bytes() == b"old"
    # neither the new file nor the temp beside the file written again is left holding part of a record
    assert sorted(os.listdir(root / "sys")) == ["again"]


def test_a_stale_temp_beside_a_file_does_not_block_writing_it_again(root, cwd):
    """A temp left by an interrupted load is cleared in the file's directory (never in the working
    directory), and the file is written again."""
    temp = root / "sys" / f".x.tmp-{os.getpid()}"
    temp.parent.mkdir()
    temp.write_text("stale")
    with TreeFiller(Tree(str(root))) as filler:
        filler.write(["sys", "x"], b"first")
        filler.write(["sys", "x"], b"second")
    assert (root / "sys" / "x").read_bytes() == b"second" and os.listdir(root / "sys") == ["x"]


def test_a_directory_at_the_temp_name_fails_in_one_error_and_keeps_the_file(root, cwd):
    """When the temp cannot be made (a directory holds its name), writing a file again must fail
    naming the path and the reason, keep the file and clear nothing elsewhere."""
    (root / "sys").mkdir()
    (root / "sys" / "x").write_text("old")
    (root / "sys" / f".x.tmp-{os.getpid()}").mkdir()
    with TreeFiller(Tree(str(root))) as filler, pytest.raises(GpuvfioError) as err:
        filler.write(["sys", "x"], b"new")
    assert str(root / "sys" / "x") in str(err.value) and str(err.value).endswith(reason(errno.EISDIR))
    assert (root / "sys" / "x").read_text() == "old"


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_directory_is_never_replaced_and_is_named(root, kind):
    """A file or a link is never put where a FIFO or a directory is: refused, naming the path and
    what is there, and left as it was."""
    where = root / "sys" / "a" / "x"
    where.parent.mkdir(parents=True)
    os.mkfifo(where) if kind == "fifo" else where.mkdir()
    words = "a FIFO" if kind == "fifo" else "a directory"
    with TreeFiller(Tree(str(root))) as filler:
        for call in (lambda: filler.write(["sys", "a", "x"], b"x"), lambda: filler.symlink(["sys", "a", "x"], "t")):
            with pytest.raises(NotRegular) as err:
                call()
            assert str(where) in str(err.value) and words in str(err.value)
    assert stat.S_IFMT(os.lstat(where).st_mode) == (stat.S_IFIFO if kind == "fifo" else stat.S_IFDIR)


def test_a_link_replaces_a_file_or_link_never_what_a_link_names(root, cwd):
    """A link record at a path holding a file or a link replaces that name only: a link to a
    directory (or to nothing) is not followed, and the directory keeps its content."""
    (root / "sys" / "dir").mkdir(parents=True)
    (root / "sys" / "dir" / "keep").write_text("k")
    (root / "sys" / "f").write_text("f")
    (root / "sys" / "l").symlink_to("dir")
    (root / "sys" / "dangling").symlink_to("nowhere")
    with TreeFiller(Tree(str(root))) as filler:
        for name in ("f", "l", "dangling", "new"):
            filler.symlink(["sys", name], f"../{name}-target")
    assert [os.readlink(root / "sys" / n) for n in ("f", "l", "dangling", "new")] == [
        "../f-target", "../l-target", "../dangling-target", "../new-target"]
    assert os.listdir(root / "sys" / "dir") == ["keep"]


def test_a_link_that_cannot_replace_a_file_is_one_error(root):
    """Without permission to remove the file a link record replaces, the error names the path and
    the system's reason."""
    (root / "sys").mkdir()
    (root / "sys" / "f").write_text("f")
    with TreeFiller(Tree(str(root))) as filler:
        filler.make_dir(["sys"])
        os.chmod(root / "sys", 0o555)
        with as_nobody(root / "sys", root / "sys" / "f"), pytest.raises(GpuvfioError) as err:
            filler.symlink(["sys", "f"], "target")
    assert str(root / "sys" / "f") in str(err.value) and str(err.value).endswith(reason(errno.EACCES))
    assert (root / "sys" / "f").read_text() == "f"


def test_a_directory_made_but_not_openable_is_one_error(root, cwd):
    """A directory the filler made and cannot open (here: made with no permission under umask
    0777) is one error naming it and why, not a traceback nor a false 'removed'; it is looked at
    where it was made, not in the working directory."""
    with TreeFiller(Tree(str(root))) as filler:
        old = os.umask(0o777)
        try:
            with as_nobody(root, cwd), pytest.raises(HostReadError) as err:
                filler.make_dir(["d"])
        finally:
            os.umask(old)
    assert str(root / "d") in str(err.value) and "permission denied" in str(err.value)


def test_a_directory_removed_while_held_is_one_error(root):
    """A held directory removed under the filler (a concurrent cleanup) makes nothing more in it:
    one error naming the path and the system's reason."""
    with TreeFiller(Tree(str(root))) as filler:
        filler.make_dir(["a"])
        os.rmdir(root / "a")
        with pytest.raises(GpuvfioError) as err:
            filler.make_dir(["a", "b"])
    assert str(root / "a" / "b") in str(err.value) and str(err.value).endswith(reason(errno.ENOENT))
    assert os.listdir(root) == []


def _flip(where, target, stop) -> None:
    """Turn ``where`` into a link, then into nothing, again and again (and remove an empty
    directory made there meanwhile)."""
    while not stop.is_set():
        try:
            os.symlink(target, where)
        except FileExistsError:
            with contextlib.suppress(OSError):
                os.rmdir(where)
        with contextlib.suppress(OSError):
            os.unlink(where)


def test_a_name_that_changes_while_it_is_made_is_never_written_through(root, outside, cwd):
    """A directory whose name is turned into a link and back while the filler opens or makes it
    (a concurrent writer): the filler must hold that directory or fail in one error naming it,
    and never write through the link nor beside the root (a lost directory fd is the working one)."""
    where = root / "d"
    stop = threading.Event()
    # a thread: each of the filler's syscalls lets it run, so the name changes between two of them
    flipper = threading.Thread(target=_flip, args=(str(where), str(outside), stop), daemon=True)
    flipper.start()
    try:
        for _ in range(2000):
            with TreeFiller(Tree(str(root))) as filler:
                try:
                    filler.make_dir(["d"])
                    filler.write(["d", "x"], b"1")
                except GpuvfioError as exc:  # a link there, or the directory gone
                    assert str(where) in str(exc)
            with contextlib.suppress(OSError):
                os.unlink(where / "x")
    finally:
        stop.set()
        flipper.join()
    assert untouched(outside)
