"""Tree's renames, removals, attribute and lock opens on real files: a staged temp renamed over its
target (never across directories, never over a directory or FIFO), a link at a target replaced and
never followed, a planted temp cleared, what remove says and refuses, what open_attribute and
open_lock open and refuse (a link, a FIFO, a directory, a hard link), even when the file is swapped
between the look and the open, and what each refusal names (the path and the reason)."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

from gpuvfio.errors import GpuvfioError, UnsafePathError
from gpuvfio.files import NotRegular, Tree
from tests.conftest import open_fds, untouched


@pytest.fixture(autouse=True)
def elsewhere(tmp_path, monkeypatch):
    """The working directory is an empty directory apart from every tree: a name taken relative to
    it instead of to the directory fd held finds nothing there, and writes nothing in the repository."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd



# -- replace_with: the second half of a transaction ----------------------------------------------
def test_a_staged_file_replaces_its_target_at_any_depth(tmp_path):
    """The file layer must rename a staged temp over its target in the target's own directory, at
    the top of the tree as deep beneath it, leaving no temp behind (persist's transactions)."""
    tree = Tree(str(tmp_path / "root"))
    for rel in ("top.conf", "a/mid.conf", "a/b/deep.conf"):
        tree.write(rel, "old\n")
        staged = tree.stage(rel, "new\n")
        fds = open_fds()
        tree.replace_with(staged, rel)
        assert open_fds() == fds
        assert tree.read(rel) == b"new\n", rel
        assert not [name for name in tree.listdir(os.path.dirname(rel)) if name.startswith(".")], rel


@pytest.mark.parametrize("long", ["a" * 240, "é" * 125])  # 240 bytes; 250 bytes in 125 characters
def test_two_long_names_staged_together_keep_their_own_content(tmp_path, long):
    """A transaction staging two files whose names share a long beginning must put each file's
    content in its place: their temps may not be one file (NAME_MAX is 255 bytes, so a temp name
    is cut, and what is cut must still tell the names apart), nor longer than a name may be."""
    tree = Tree(str(tmp_path / "root"))
    first, second = f"etc/{long}1", f"etc/{long}2"
    staged = [tree.stage(first, "first\n"), tree.stage(second, "second\n")]
    assert staged[0] != staged[1]
    tree.replace_with(staged[0], first)
    tree.replace_with(staged[1], second)
    assert (tree.read(first), tree.read(second)) == (b"first\n", b"second\n")
    assert sorted(tree.listdir("etc")) == sorted([f"{long}1", f"{long}2"])


def test_a_temp_names_its_file_whole_or_cut_with_a_digest(tmp_path):
    """A temp left by a crash says whose it is: '.<name>.tmp-<pid>' for a name of up to 200 bytes;
    a longer name is cut to its first 183 bytes and 16 hex digits of its SHA-256, so the temp
    stays within NAME_MAX (255 bytes) whatever the pid."""
    tree = Tree(str(tmp_path / "root"))
    pid = os.getpid()
    fits = "f" * 200
    assert tree.stage(f"etc/{fits}", "x") == f"etc/.{fits}.tmp-{pid}"
    for long in ("g" * 201, "é" * 127):
        digest = hashlib.sha256(long.encode()).hexdigest()[:16]
        cut = os.fsdecode(long.encode()[:183])
        assert tree.stage(f"etc/{long}", "x") == f"etc/.{cut}-{digest}.tmp-{pid}"


def test_a_rename_across_directories_is_refused_naming_both(tmp_path):
    """A temp staged beside one file must never be renamed over a file in another directory: the
    refusal names both paths so the transaction's report says what was refused."""
    tree = Tree(str(tmp_path / "root"))
    tree.write("b/x.conf", "old\n")
    staged = tree.stage("a/x.conf", "new\n")
    with pytest.raises(UnsafePathError) as refused:
        tree.replace_with(staged, "b/x.conf")
    assert staged in str(refused.value) and "b/x.conf" in str(refused.value)
    assert tree.read("b/x.conf") == b"old\n" and tree.read(staged) == b"new\n"


def test_a_rename_whose_directory_is_gone_names_the_target(tmp_path):
    """When the target's directory was removed since the temp was staged, the failure must name the
    target's path, not raise on a missing fd or lose the path."""
    tree = Tree(str(tmp_path / "root"))
    staged = tree.stage("spool/x.conf", "new\n")
    shutil.rmtree(tmp_path / "root" / "spool")
    with pytest.raises(GpuvfioError) as failed:
        tree.replace_with(staged, "spool/x.conf")
    assert tree.path("spool/x.conf") in str(failed.value) and "directory" in str(failed.value)


@pytest.mark.parametrize("planted", ["FIFO", "directory"])
def test_a_fifo_or_directory_at_a_target_is_never_replaced(tmp_path, planted):
    """A rename replaces a file or a link only: a FIFO or directory planted at the target is refused
    (naming the path and what is there) by write and by replace_with, and stays as it was."""
    tree = Tree(str(tmp_path / "root"))
    tree.make_dir("etc")
    target = tmp_path / "root" / "etc" / "x.conf"
    staged = tree.stage("etc/x.conf", "new\n")
    if planted == "FIFO":
        os.mkfifo(target)
    else:
        target.mkdir()
    # replace_with first: write's own temp has the staged temp's name (same name, same pid).
    for attempt in (lambda: tree.replace_with(staged, "etc/x.conf"), lambda: tree.write("etc/x.conf", "new\n")):
        fds = open_fds()
        with pytest.raises(NotRegular) as refused:
            attempt()
        assert open_fds() == fds
        assert tree.path("etc/x.conf") in str(refused.value) and planted in str(refused.value)
        assert stat.S_ISFIFO(os.lstat(target).st_mode) if planted == "FIFO" else target.is_dir()
    assert os.listdir(tmp_path / "root" / "etc") == ["x.conf"]  # write's failed temp is removed


@pytest.mark.parametrize("points_to", ["secret", "", "missing"])
def test_a_link_at_a_target_is_replaced_never_followed(tmp_path, outside, points_to):
    """A link at a target is replaced by the new file itself, whether it points to a file, a
    directory or nothing: what it points to is never looked at, written or refused for."""
    tree = Tree(str(tmp_path / "root"))
    tree.make_dir("etc")
    target = tmp_path / "root" / "etc" / "x.conf"
    os.symlink(str(outside / points_to) if points_to else str(outside), target)
    tree.write("etc/x.conf", "new\n")
    assert not target.is_symlink() and target.read_text() == "new\n"
    os.unlink(target)
    os.symlink(str(outside / points_to) if points_to else str(outside), target)
    tree.replace_with(tree.stage("etc/x.conf", "newer\n"), "etc/x.conf")
    assert not target.is_symlink() and target.read_text() == "newer\n"
    assert untouched(outside)


def test_a_planted_temp_name_is_cleared_not_written_through(tmp_path, outside):
    """Whatever lies at the temp's name (a stale temp of an earlier run with this pid, a link
    planted there) is removed first: the write succeeds and never goes through the link."""
    tree = Tree(str(tmp_path / "root"))
    tree.make_dir("etc")
    temp = tmp_path / "root" / "etc" / f".x.conf.tmp-{os.getpid()}"
    os.symlink(str(outside / "secret"), temp)
    tree.write("etc/x.conf", "new\n")
    temp.write_text("stale\n")
    staged = tree.stage("etc/y.conf", "staged\n")
    temp.write_text("stale\n")
    tree.write("etc/x.conf", "newer\n")
    tree.replace_with(staged, "etc/y.conf")
    assert tree.read("etc/x.conf") == b"newer\n" and tree.read("etc/y.conf") == b"staged\n"
    assert sorted(os.listdir(tmp_path / "root" / "etc")) == ["x.conf", "y.conf"]
    assert untouched(outside)


# -- remove --------------------------------------------------------------------------------------
def test_remove_says_whether_there_was_something(tmp_path, outside):
    """remove answers True when it removed a file or a link (the link itself, never its target) and
    False when there was nothing, its directory missing included (an undo that finds nothing)."""
    tree = Tree(str(tmp_path / "root"))
    tree.write("etc/x.conf", "x\n")
    os.symlink(str(outside / "secret"), tmp_path / "root" / "etc" / "link")
    fds = open_fds()
    assert tree.remove("etc/x.conf") is True and tree.remove("etc/link") is True
    assert tree.remove("etc/x.conf") is False and tree.remove("gone/x.conf") is False
    assert open_fds() == fds
    assert os.listdir(tmp_path / "root" / "etc") == [] and untouched(outside)


def test_remove_refuses_a_directory_naming_it(tmp_path):
    """A directory at a file's place is refused as unsafe (naming it), never removed."""
    tree = Tree(str(tmp_path / "root"))
    tree.make_dir("etc/x.conf")
    with pytest.raises(UnsafePathError) as refused:
        tree.remove("etc/x.conf")
    assert tree.path("etc/x.conf") in str(refused.value) and "directory" in str(refused.value)
    assert tree.is_dir("etc/x.conf")


def test_remove_reports_any_other_failure_with_the_path_and_reason(tmp_path):
    """A removal that fails for another reason (here a name too long) is an error naming the path
    and the system's reason, not a refusal claiming a directory is there."""
    tree = Tree(str(tmp_path / "root"))
    tree.make_dir("etc")
    rel = "etc/" + "n" * 300
    with pytest.raises(GpuvfioError) as failed:
        tree.remove(rel)
    assert not isinstance(failed.value, UnsafePathError)
    assert tree.path(rel) in str(failed.value) and os.strerror(errno.ENAMETOOLONG) in str(failed.value)
    assert "[Errno" not in str(failed.value)  # the reason in words, not Python's repr naming the file again


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant another owner's file")
def test_a_file_that_may_not_be_removed_is_not_called_a_directory():
    """Linux answers EPERM to unlinking a file in a sticky directory owned by another (or an
    immutable file), and EISDIR for a directory (unlink(2)): the refusal names the system's reason,
    never "a directory" that is not there."""
    import tempfile
    top = tempfile.mkdtemp(dir="/dev/shm")  # every ancestor searchable by nobody
    try:
        os.chmod(top, 0o1777)
        with open(os.path.join(top, "x.conf"), "w") as handle:
            handle.write("x\n")
        nobody = 65534
        os.seteuid(nobody)
        try:
            with pytest.raises(GpuvfioError) as failed:
                Tree(top).remove("x.conf")
        finally:
            os.seteuid(0)
        assert not isinstance(failed.value, UnsafePathError) and "directory" not in str(failed.value)
        assert os.path.join(top, "x.conf") in str(failed.value) and os.strerror(errno.EPERM) in str(failed.value)
        assert os.path.isfile(os.path.join(top, "x.conf"))
    finally:
        shutil.rmtree(top)


# -- open_attribute: a sysfs attribute opened for one write ---------------------------------------
def test_an_attribute_is_opened_for_writing_in_place(tmp_path):
    """An attribute's fd writes into the file itself (never made, never truncated: sysfs files are
    written at offset 0 with what echo would write)."""
    tree = Tree(str(tmp_path / "root"))
    tree.write("dev/attr", "abcdef\n")
    fd = tree.open_attribute("dev/attr")
    try:
        assert os.write(fd, b"X") == 1
    finally:
        os.close(fd)
    assert tree.read("dev/attr") == b"Xbcdef\n"
    with pytest.raises(FileNotFoundError):
        tree.open_attribute("dev/missing")
    assert tree.listdir("dev") == ["attr"]


def test_an_attribute_whose_directory_is_gone_is_the_kernels_enoent_naming_it(tmp_path):
    """A device gone since the plan is FileNotFoundError with the kernel's errno, reason and path,
    as an open of the missing path would have answered."""
    tree = Tree(str(tmp_path / "root"))
    tree.make_dir("sys")
    with pytest.raises(FileNotFoundError) as gone:
        tree.open_attribute("sys/0000:01:00.0/remove")
    assert (gone.value.errno, gone.value.strerror, gone.value.filename) == (
        errno.ENOENT, os.strerror(errno.ENOENT), tree.path("sys/0000:01:00.0/remove"))


@pytest.mark.parametrize("points_to", ["secret", "", "missing"])
def test_a_link_at_an_attribute_is_refused_as_a_link(tmp_path, outside, points_to):
    """A link at an attribute is refused as a link, naming it, whatever it points to (a file, a
    directory, nothing): never followed, and a dangling one is no 'device gone'."""
    tree = Tree(str(tmp_path / "root"))
    tree.make_dir("dev")
    os.symlink(str(outside / points_to) if points_to else str(outside), tmp_path / "root" / "dev" / "attr")
    fds = open_fds()
    with pytest.raises(UnsafePathError) as refused:
        tree.open_attribute("dev/attr")
    assert open_fds() == fds
    assert tree.path("dev/attr") in str(refused.value) and "link" in str(refused.value)
    assert untouched(outside)


def test_an_attribute_that_cannot_be_opened_is_refused_naming_it(tmp_path):
    """A regular file that the open refuses (here a running program: ETXTBSY) is refused, naming
    the path and the system's reason, with no fd left open."""
    tree = Tree(str(tmp_path / "root"))
    tree.make_dir("dev")
    program = tmp_path / "root" / "dev" / "busy"
    shutil.copy(shutil.which("sleep"), program)
    running = subprocess.Popen([str(program), "30"])
    try:
        try:
            os.close(os.open(program, os.O_WRONLY))
            pytest.skip("this kernel lets a running program be opened for writing")
        except OSError as exc:
            assert exc.errno == errno.ETXTBSY
        fds = open_fds()
        with pytest.raises(NotRegular) as refused:
            tree.open_attribute("dev/busy")
        assert open_fds() == fds
        assert tree.path("dev/busy") in str(refused.value) and os.strerror(errno.ETXTBSY) in str(refused.value)
        assert "[Errno" not in str(refused.value)  # the reason in words, not Python's repr of the error
    finally:
        running.kill()
        running.wait()


# -- open_lock -----------------------------------------------------------------------------------
def test_a_lock_and_the_directories_made_for_it_are_private(tmp_path):
    """The lock (it names the holder) is made 0600 in directories made 0700, whatever the umask
    lets through, and its fd reads and writes."""
    tree = Tree(str(tmp_path / "root"))
    fd = tree.open_lock("var/lib/gpuvfio/lock")
    try:
        assert os.write(fd, b"pid 1\n") == 6 and os.pread(fd, 6, 0) == b"pid 1\n"
    finally:
        os.close(fd)
    for rel, rw in (("var", 0o700), ("var/lib", 0o700), ("var/lib/gpuvfio", 0o700), ("var/lib/gpuvfio/lock", 0o600)):
        mode = stat.S_IMODE(os.lstat(tmp_path / "root" / rel).st_mode)
        assert mode & 0o077 == 0 and mode & 0o700 == rw, (rel, oct(mode))
    fd = tree.open_lock("var/lib/gpuvfio/lock")  # an existing lock is opened as it is
    os.close(fd)
    assert (tmp_path / "root" / "var/lib/gpuvfio/lock").read_bytes() == b"pid 1\n"


@pytest.mark.parametrize("planted, named", [("directory", "directory"), ("FIFO", "FIFO"),
                                            ("link to a directory", "link"), ("dangling link", "link")])
def test_a_lock_that_is_no_regular_file_is_refused_naming_what_it_is(tmp_path, outside, planted, named):
    """A directory, FIFO or link at the lock's place is refused, naming the path and what is there
    (a link is named a link, never what it points to), and nothing is made through a link."""
    tree = Tree(str(tmp_path / "root"))
    tree.make_dir("state")
    lock = tmp_path / "root" / "state" / "lock"
    if planted == "directory":
        lock.mkdir()
    elif planted == "FIFO":
        os.mkfifo(lock)
    else:
        os.symlink(str(outside) if planted == "link to a directory" else str(outside / "made"), lock)
    fds = open_fds()
    with pytest.raises(NotRegular) as refused:
        tree.open_lock("state/lock")
    assert open_fds() == fds
    assert tree.path("state/lock") in str(refused.value) and named in str(refused.value)
    assert untouched(outside)


def test_a_hard_linked_lock_is_refused_with_its_link_count(tmp_path):
    """A lock with a second link would empty another file when written: refused, naming the path
    and its link count, and the other file keeps its content."""
    tree = Tree(str(tmp_path / "root"))
    tree.write("state/other", "keep\n")
    os.link(tmp_path / "root" / "state" / "other", tmp_path / "root" / "state" / "lock")
    fds = open_fds()
    with pytest.raises(NotRegular) as refused:
        tree.open_lock("state/lock")
    assert open_fds() == fds
    assert tree.path("state/lock") in str(refused.value) and "2 links" in str(refused.value)
    assert tree.read("state/other") == b"keep\n"


def test_a_lock_name_too_long_is_refused_naming_its_path(tmp_path):
    """A lock path the system refuses (a name too long) is a one-line refusal naming the path."""
    tree = Tree(str(tmp_path / "root"))
    assert len(tree.path()) < 100
    with pytest.raises(UnsafePathError) as refused:
        tree.open_lock("state/" + "n" * 300)
    assert tree.path("state") in str(refused.value) and "too long" in str(refused.value)


# -- a file swapped between the look and the open -------------------------------------------------
class _Swapper:
    """Swaps dev/target, a regular file, for a link to the canary or a new FIFO (one link, like the
    file it replaces; with or without a reader) from a timer's signal handler: at a random point of
    the opener's work, between its look and its open among them. Only the loop puts a regular file
    back, so an open that waits on a FIFO keeps waiting (its retries after each signal find it)."""

    def __init__(self, tree: Tree, canary) -> None:
        self.canary, self.swapped, self.turn, self.reader = str(canary), False, 0, None
        self.dir_fd = os.open(tree.path("dev"), os.O_RDONLY | os.O_DIRECTORY)

    def swap(self, _signum, _frame) -> None:
        if self.swapped:
            return
        self.swapped, self.turn = True, self.turn + 1
        kind = ("link", "FIFO", "FIFO with a reader")[self.turn % 3]
        if kind == "link":
            os.symlink(self.canary, "swap-in", dir_fd=self.dir_fd)
        else:
            os.mkfifo("swap-in", dir_fd=self.dir_fd)
            if kind == "FIFO with a reader":  # an open for writing then succeeds instead of failing
                self.reader = os.open("swap-in", os.O_RDONLY | os.O_NONBLOCK, dir_fd=self.dir_fd)
        os.rename("swap-in", "target", src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)

    def restore(self) -> None:
        if self.swapped:
            os.close(os.open("fresh", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=self.dir_fd))
            os.rename("fresh", "target", src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            if self.reader is not None:
                os.close(self.reader)
                self.reader = None
            self.swapped = False


def _opens_while_swapped(tree: Tree, opener, canary, check_refusal, calls: int = 3000) -> str:
    """What ``opener("dev/target")`` met in a forked copy of this process, called ``calls`` times
    (about a second; at most 10) while _Swapper swaps the target: 'done ...', a fault it found, or
    'blocked' (an open waited, on a FIFO, until the child was killed)."""
    # Once in this process as well, before the target is swapped: what a test calls in its own
    # process is what mutation testing (make mutate) runs it against.
    os.close(opener("dev/target"))
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports through the pipe and never returns into pytest
        outcome, opened, refused = "", 0, 0
        try:
            canary_id = (os.stat(canary).st_dev, os.stat(canary).st_ino)
            swapper = _Swapper(tree, canary)
            signal.signal(signal.SIGALRM, swapper.swap)
            signal.setitimer(signal.ITIMER_REAL, 0.0001, 0.00005)
            deadline = time.monotonic() + 10
            while opened + refused < calls and time.monotonic() < deadline and not outcome:
                swapper.restore()
                try:
                    fd = opener("dev/target")
                except UnsafePathError as exc:
                    refused += 1
                    if tree.path("dev/target") not in str(exc) or not check_refusal(str(exc)):
                        outcome = f"refusal {exc}"
                    continue
                found = os.fstat(fd)
                os.close(fd)
                opened += 1
                if not stat.S_ISREG(found.st_mode) or (found.st_dev, found.st_ino) == canary_id:
                    outcome = f"opened a file that is no regular file of the tree: {found}"
        except BaseException as exc:  # noqa: BLE001 - the parent shows what went wrong
            outcome = f"unexpected {exc!r}"
        signal.setitimer(signal.ITIMER_REAL, 0)
        os.write(writer, (outcome or f"done: {opened} opened, {refused} refused").encode())
        os._exit(0)
    os.close(writer)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    with os.fdopen(reader, "rb") as pipe:
        return pipe.read().decode() or "blocked"


@pytest.fixture
def swapped_tree(tmp_path):
    """A tree whose dev/target, a regular file, is swapped under its user by _Swapper."""
    tree = Tree(str(tmp_path / "root"))
    tree.write("dev/target", "")
    return tree


def test_an_attribute_swapped_before_its_open_is_never_waited_on_nor_followed(swapped_tree, outside):
    """An attribute swapped for a FIFO or a link between its look and its open must be refused
    (naming it), never waited on (O_NONBLOCK) nor written through (O_NOFOLLOW); what opens is a
    regular file of the tree."""
    outcome = _opens_while_swapped(swapped_tree, swapped_tree.open_attribute, outside / "secret", lambda _msg: True)
    assert outcome.startswith("done"), outcome
    assert untouched(outside)


def test_a_lock_swapped_before_its_open_is_refused_never_followed(swapped_tree, outside):
    """A lock swapped for a FIFO or a link between its look and its open must be refused, saying
    why (a link, not a regular file; never 'one link', which every lock has), and never opened
    through the link."""
    outcome = _opens_while_swapped(swapped_tree, swapped_tree.open_lock, outside / "secret",
                                   lambda msg: "it has 1 links" not in msg)
    assert outcome.startswith("done"), outcome
    assert untouched(outside)
