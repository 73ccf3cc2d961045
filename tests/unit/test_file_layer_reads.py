"""The file layer's reads (gpuvfio.files: split, read_at, scan_fd, open_dir_at and the errors they
raise), in-process on real files: links, FIFOs, swapped entries, files one byte over a limit,
procfs files that give no size, names too long, unreadable files. Also the helpers beneath
Tree.write (a new file's mode, a stale temp cleared) and silence_stdout."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import stat
import subprocess
import sys

import pytest

from gpuvfio.errors import HostReadError, UnsafePathError
from gpuvfio.files import (HOST_TEXT_LIMIT, NotRegular, Tree, _write_new, kind_name, open_dir_at, read_at, scan_fd,
                           silence_stdout, split)

LIMIT = 1 << 16


@pytest.fixture
def top(tmp_path):
    """A directory (0755: a child that gave up root still reads it) with an fd held on it."""
    where = tmp_path / "top"
    where.mkdir()
    where.chmod(0o755)
    fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    yield where, fd
    os.close(fd)


# A child whose /proc/<pid>/maps fills a page and a half: mappings of alternating protection (so
# the kernel cannot merge them) are added until its maps is that long; then it waits on stdin.
PAD = """import mmap, sys
keep, prot = [], (mmap.PROT_READ, mmap.PROT_READ | mmap.PROT_WRITE)
while len(open('/proc/self/maps', 'rb').read()) < int(sys.argv[1]):
    keep.append(mmap.mmap(-1, mmap.PAGESIZE, prot=prot[len(keep) % 2]))
print('ready', flush=True)
sys.stdin.read()
"""


@pytest.fixture
def two_reads():
    """A procfs file that gives no size (st_size 0) and answers in exactly two read(2)s (seq_file
    hands out a page at most per read): (fd of its directory, name, its path, the two chunks)."""
    child = subprocess.Popen([sys.executable, "-S", "-I", "-c", PAD, str(os.sysconf("SC_PAGE_SIZE") * 3 // 2)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    dir_fd = -1
    try:
        assert child.stdout.readline() == b"ready\n"
        dir_fd = os.open(f"/proc/{child.pid}", os.O_RDONLY | os.O_DIRECTORY)
        fd = os.open("maps", os.O_RDONLY, dir_fd=dir_fd)
        size = os.fstat(fd).st_size
        chunks = list(iter(lambda: os.read(fd, 1 << 20), b""))
        os.close(fd)
        if len(chunks) != 2 or size:
            pytest.skip(f"this kernel reads the padded maps in {len(chunks)} reads, not 2")
        yield dir_fd, "maps", f"/proc/{child.pid}/maps", chunks
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)
        child.stdin.close()  # the child ends on EOF
        child.stdout.close()
        child.wait(timeout=30)


def read_calls(action) -> int:
    """How many read(2)s ``action`` makes: the process's syscr (/proc/self/io) before and after,
    less the one read that looking at it costs; the fewest of three tries (another thread of the
    runner may read meanwhile, only ever adding)."""
    def syscr() -> int:
        fd = os.open("/proc/self/io", os.O_RDONLY)
        try:
            text = os.read(fd, 4096).decode()
        finally:
            os.close(fd)
        return int(next(line.split()[1] for line in text.splitlines() if line.startswith("syscr:")))

    if not os.path.exists("/proc/self/io"):
        pytest.skip("no /proc/self/io (task I/O accounting) on this kernel")
    counts = []
    for _ in range(3):
        start = syscr()
        action()
        counts.append(syscr() - start - 1)
    return min(counts)


def in_child(action, *, unprivileged: bool = False, fds: bool = False) -> tuple[str, str]:
    """Run ``action`` in a forked child and return what it raised (type name, message), or
    ("returned", repr). ``unprivileged``: the child gives up root first (and stays dumpable, so
    its /proc/self is its own); ``fds``: it may open no more files."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe and never returns
        try:
            os.close(read_end)
            if unprivileged and os.geteuid() == 0:
                os.setgroups([])
                os.setresgid(65534, 65534, 65534)
                os.setresuid(65534, 65534, 65534)
                ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
            if fds:
                lowest = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor number
                os.close(lowest)
                resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            try:
                result = ("returned", repr(action()))
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                result = (type(exc).__name__, str(exc))
            os.write(write_end, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return tuple(json.loads(data))


# -- paths and names ------------------------------------------------------------------------------
def test_paths_with_nul_absolute_or_dotdot_are_refused_naming_them():
    """The file layer must refuse a relative path that could leave its top (absolute, '..') or be
    cut short by the kernel (NUL), naming it; '.' and empty components are dropped."""
    assert split("a/./b//c/") == ["a", "b", "c"]
    assert split(".") == []
    for rel in ("/etc/passwd", "a/../../etc", "dev\0null", "x\0"):
        with pytest.raises(UnsafePathError) as refused:
            split(rel)
        assert repr(rel) in str(refused.value)
    with pytest.raises(UnsafePathError, match="None"):
        split(None)


def test_kind_name_says_what_a_file_is_in_words():
    """A refusal must say what was found (a link, a FIFO, a device): a type outside the table
    still gets words, never None in a message."""
    kinds = {stat.S_IFLNK: "a link", stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO",
             stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket"}
    for kind, words in kinds.items():
        assert kind_name(kind | 0o644) == words
    assert kind_name(0) == "not a regular file"


# -- what read_at opens ---------------------------------------------------------------------------
def test_a_link_fifo_or_dangling_link_is_refused_as_not_regular(top, outside_file):
    """The file layer must never read through a final link (even a dangling one, which is not
    'missing') nor open a FIFO: NotRegular naming the path and what is there, looked at by fstatat
    or by the type a listing gave."""
    where, fd = top
    os.mkfifo(where / "fifo")
    os.symlink(outside_file, where / "link")
    os.symlink(where / "nothing", where / "dangling")
    listing = scan_fd(fd, str(where))
    for name, words in (("fifo", "a FIFO"), ("link", "a link"), ("dangling", "a link")):
        for listed in (None, listing[name]):
            with pytest.raises(NotRegular) as refused:
                read_at(fd, name, LIMIT, str(where / name), listed=listed)
            assert str(where / name) in str(refused.value) and words in str(refused.value)
    assert read_at(fd, "missing", LIMIT, str(where / "missing")) is None


def test_an_entry_swapped_after_the_listing_is_refused(top, outside_file):
    """A listing's type is only the look before the open: a file swapped since for a link must be
    refused as a link (O_NOFOLLOW), and one swapped for a FIFO refused by fstat, never read."""
    where, fd = top
    for name in ("linked", "piped", "gone"):
        (where / name).write_text("listed as a file\n")
    listing = scan_fd(fd, str(where))
    for name in ("linked", "piped", "gone"):
        os.unlink(where / name)
    os.symlink(outside_file, where / "linked")
    os.mkfifo(where / "piped")
    with pytest.raises(UnsafePathError) as refused:
        read_at(fd, "linked", LIMIT, str(where / "linked"), listed=listing["linked"])
    assert f"{where / 'linked'} is a link" in str(refused.value)
    with pytest.raises(NotRegular) as refused:
        read_at(fd, "piped", LIMIT, str(where / "piped"), listed=listing["piped"])
    assert f"{where / 'piped'} changed" in str(refused.value)
    assert read_at(fd, "gone", LIMIT, str(where / "gone"), listed=listing["gone"]) is None


@pytest.fixture
def outside_file(tmp_path):
    path = tmp_path / "outside"
    path.write_text("CANARY-SECRET\n")
    return str(path)


# -- how much read_at reads -----------------------------------------------------------------------
def test_a_file_over_its_limit_is_refused_unless_head_is_asked(top):
    """Every read has a bound: one byte over it is an error naming the path (not a truncation),
    unless the caller asks for the head; an empty file is b'', not 'missing'."""
    where, fd = top
    (where / "five").write_bytes(b"12345")
    (where / "empty").write_bytes(b"")
    path = str(where / "five")
    assert read_at(fd, "five", 5, path) == b"12345"
    for limit in (4, 0):
        with pytest.raises(UnsafePathError, match=f"{path} is larger than {limit} bytes"):
            read_at(fd, "five", limit, path)
    assert read_at(fd, "five", 4, path, head=True) == b"1234"
    assert read_at(fd, "empty", LIMIT, str(where / "empty")) == b""
    assert read_at(fd, "empty", 0, str(where / "empty")) == b""


def test_a_file_that_gives_no_size_is_read_whole_and_bounded_across_reads(two_reads):
    """A procfs file says size 0 and answers a page per read: the file layer must read it all,
    byte for byte, and still count every read against the limit (one byte over after the first
    read is refused; a head is cut at the limit)."""
    dir_fd, name, path, chunks = two_reads
    whole = b"".join(chunks)
    assert read_at(dir_fd, name, LIMIT, path) == whole
    assert read_at(dir_fd, name, len(whole), path) == whole
    for limit in (len(chunks[0]), len(whole) - 1):
        with pytest.raises(UnsafePathError, match="larger than"):
            read_at(dir_fd, name, limit, path)
    cut = len(chunks[0]) + 10
    assert read_at(dir_fd, name, cut, path, head=True) == whole[:cut]


def test_a_file_is_read_in_as_few_read_calls_as_it_allows(top, two_reads):
    """A file that gives its size (a sysfs attribute, pci.ids) is read in one read(2), whatever
    its size: reaching its size is the end. One that gives none (procfs) is read in large
    requests, a read per page it answers, never a byte at a time, and never more than 1 MiB
    asked at once (os.read allocates what it asks)."""
    where, fd = top
    (where / "attribute").write_bytes(b"0x10de\n")
    (where / "ids").write_bytes(b"#" * ((1 << 20) + 5))
    assert read_calls(lambda: read_at(fd, "attribute", LIMIT, str(where / "attribute"))) == 1
    assert read_calls(lambda: read_at(fd, "ids", HOST_TEXT_LIMIT, str(where / "ids"))) == 1
    assert read_at(fd, "ids", HOST_TEXT_LIMIT, str(where / "ids")) == b"#" * ((1 << 20) + 5)
    dir_fd, name, path, chunks = two_reads
    assert read_calls(lambda: read_at(dir_fd, name, LIMIT, path)) == len(chunks) + 1  # and the empty read
    # pagemap gives no size and answers every byte asked (8 a page of the address space).
    proc = os.open("/proc/self", os.O_RDONLY | os.O_DIRECTORY)
    try:
        def over_two_mib():
            with pytest.raises(UnsafePathError, match="larger than"):
                read_at(proc, "pagemap", (2 << 20) - 1, "/proc/self/pagemap")

        assert read_calls(over_two_mib) == 2
    finally:
        os.close(proc)


def test_an_attribute_that_answers_eio_has_no_value():
    """sysfs answers EIO/EINVAL/ENODEV for an attribute a device does not implement: no value
    (None), not an error. /proc/self/mem answers EIO at address 0 the same way."""
    fd = os.open("/proc/self", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert read_at(fd, "mem", LIMIT, "/proc/self/mem") is None
    finally:
        os.close(fd)


# -- what a refusal names -------------------------------------------------------------------------
def test_a_name_too_long_is_refused_naming_its_path_cut_short(top):
    """A name over NAME_MAX, as the file or as a directory on the way, must be one refusal that
    names the path cut to 120 characters (a message stays one readable line), not an OSError."""
    where, fd = top
    long_name = "n" * 300
    path = str(where / long_name)
    with pytest.raises(UnsafePathError) as refused:
        read_at(fd, long_name, LIMIT, path)
    assert str(refused.value).startswith(path[:120] + "...") and "too long" in str(refused.value)
    tree = Tree(str(where))
    with pytest.raises(UnsafePathError) as refused:
        tree.read(f"{long_name}/file")
    assert str(refused.value).startswith(tree.path(long_name)[:120] + "...") and "too long" in str(refused.value)


def test_a_directory_on_the_way_that_is_a_link_or_a_file_is_named_for_what_it_is(top, tmp_path):
    """A component that is a link is refused as a link (never followed), one that is a file as not
    a directory: O_DIRECTORY|O_NOFOLLOW answers ENOTDIR for both, so the layer must look (without
    following) and name the path it refused."""
    where, fd = top
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", where / "linked")
    os.symlink(where / "nothing", where / "dangling")
    (where / "file").write_text("x")
    tree = Tree(str(where))
    for rel, words in (("linked/x", "is a link"), ("dangling/x", "is a link"), ("file/x", "is not a directory")):
        with pytest.raises(UnsafePathError) as refused:
            tree.read(rel)
        assert f"{tree.path(rel.split('/')[0])} {words}" in str(refused.value)
    with pytest.raises(UnsafePathError, match=f"{where / 'linked'} is a link"):
        open_dir_at(fd, "linked", str(where / "linked"))
    # Beneath a descriptor that is no directory at all, the look fails too: still a refusal.
    file_fd = os.open(where / "file", os.O_RDONLY)
    try:
        with pytest.raises(UnsafePathError, match=f"{where / 'file'}/sub is not a directory"):
            open_dir_at(file_fd, "sub", str(where / "file" / "sub"))
        listed = scan_fd(fd, str(where))["file"]
        with pytest.raises(UnsafePathError, match=f"{where / 'file'}/file is not a directory"):
            read_at(file_fd, "file", LIMIT, str(where / "file" / "file"), listed=listed)
    finally:
        os.close(file_fd)


def test_unreadable_files_are_one_line_naming_the_path_and_the_reason(top):
    """A file that cannot be opened or read (permission, no descriptors left, a procfs file that
    refuses the read) must be a HostReadError naming the path and the reason in words, never a
    link or directory refusal, nor Python's '[Errno N]' form."""
    where, fd = top
    # A read and a refused open in this process as well (the failures below happen in children):
    # what a test calls in its own process is what mutation testing (make mutate) runs it against.
    (where / "plain").write_text("x")
    assert read_at(fd, "plain", LIMIT, str(where / "plain")) == b"x"
    with pytest.raises(UnsafePathError):
        read_at(fd, "n" * 300, LIMIT, str(where / ("n" * 300)))
    (where / "secret").write_text("x")
    (where / "secret").chmod(0)
    path = str(where / "secret")
    kind, message = in_child(lambda: read_at(fd, "secret", LIMIT, path), unprivileged=True)
    assert (kind, message) == ("HostReadError", f"cannot open {path}: permission denied (run as root?)")
    kind, message = in_child(lambda: read_at(fd, "plain", LIMIT, str(where / "plain")), fds=True)
    assert kind == "HostReadError" and message == f"cannot open {where / 'plain'}: {os.strerror(errno.EMFILE)}"
    if not os.path.exists("/proc/self/stack"):
        pytest.skip("no /proc/self/stack on this kernel")

    def read_own_stack():  # opened as its owner, read without CAP_SYS_ADMIN: EACCES on the read
        proc = os.open("/proc/self", os.O_RDONLY | os.O_DIRECTORY)
        return read_at(proc, "stack", LIMIT, "/proc/self/stack")

    kind, message = in_child(read_own_stack, unprivileged=True)
    assert (kind, message) == ("HostReadError", f"cannot read /proc/self/stack: {os.strerror(errno.EACCES)}")


def test_a_write_only_file_is_a_permission_error_naming_it():
    """Even root cannot read a 0200 sysctl (drop_caches): the layer must say permission denied for
    that path, not call it a link or a directory."""
    fd = os.open("/proc/sys/vm", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(HostReadError) as refused:
            read_at(fd, "drop_caches", LIMIT, "/proc/sys/vm/drop_caches")
    finally:
        os.close(fd)
    assert not isinstance(refused.value, UnsafePathError)
    assert "/proc/sys/vm/drop_caches: permission denied" in str(refused.value)


def test_a_listing_that_fails_names_the_directory_and_the_reason(top):
    """scan_fd on something that cannot be listed must be a HostReadError naming it and why."""
    where, _fd = top
    (where / "file").write_text("x")
    file_fd = os.open(where / "file", os.O_RDONLY)
    try:
        with pytest.raises(HostReadError) as refused:
            scan_fd(file_fd, str(where / "file"))
    finally:
        os.close(file_fd)
    assert str(refused.value) == f"cannot list {where / 'file'}: {os.strerror(errno.ENOTDIR)}"


# -- beneath Tree.write; stdout -------------------------------------------------------------------
def test_a_new_file_gets_its_mode_and_a_stale_temp_is_cleared_first(top, outside_file):
    """The file layer must make a file with the mode asked (the state directory's 0600 files name
    a host's devices), clear a stale or planted temp beside it (a link included, never written
    through), and never make a new file over an existing name or through a link."""
    where, fd = top
    old = os.umask(0o022)
    try:
        Tree(str(where)).write("state.json", "{}", mode=0o600)
        assert stat.S_IMODE(os.stat(where / "state.json").st_mode) == 0o600
        (where / f".plain.tmp-{os.getpid()}").write_text("stale")
        os.symlink(outside_file, where / f".linked.tmp-{os.getpid()}")
        for name in ("plain", "linked"):
            Tree(str(where)).write(name, "new")
            assert (where / name).read_text() == "new" and not os.path.islink(where / name)
        assert sorted(os.listdir(where)) == ["linked", "plain", "state.json"]
        for name in ("plain", "made-link"):
            if name == "made-link":
                os.symlink(outside_file, where / name)
            with pytest.raises(FileExistsError):
                _write_new(fd, name, b"overwritten", 0o644, False)
        assert (where / "plain").read_text() == "new"
        with open(outside_file) as canary:
            assert canary.read() == "CANARY-SECRET\n"
    finally:
        os.umask(old)


def test_silence_stdout_points_stdout_at_dev_null(tmp_path, monkeypatch):
    """When stdout's reader is gone, the file layer must point stdout's descriptor at /dev/null
    (what is still buffered is dropped at exit, not raised again), with no descriptor left open."""
    out = open(tmp_path / "stdout", "w")  # noqa: SIM115 - closed below, after the check
    monkeypatch.setattr(sys, "stdout", out)
    before = sorted(os.listdir("/proc/self/fd"))
    silence_stdout()
    after = sorted(os.listdir("/proc/self/fd"))
    os.write(out.fileno(), b"dropped\n")
    assert os.path.samestat(os.fstat(out.fileno()), os.stat(os.devnull))
    out.close()
    assert (tmp_path / "stdout").read_text() == "" and after == before
