"""The one walk (gpuvfio.host.walk): HostRoot.resolve_in_sys, a pass's SysDirs.open and
HostRoot.open_sys_attribute resolve a path under sys alike, and each answers the same on a fresh
host and on one that has walked the same tree before: its limits (MAX_LINK_HOPS links,
MAX_COMPONENTS components) count on the path asked, never on what an earlier walk kept."""

from __future__ import annotations

import errno
import os
import shutil
import signal

import pytest

from gpuvfio.errors import GpuvfioError, HostReadError, UnsafePathError
from gpuvfio.host.inventory import device_path, list_addresses, read_functions
from gpuvfio.host.root import HostRoot
from gpuvfio.host.walk import MAX_COMPONENTS, MAX_LINK_HOPS
from tests.conftest import gpu_workstation, open_fds

GPU = "0000:01:00.0"


def _answer(call) -> str:
    """What a call answers: a path, or its error's type and words."""
    try:
        return call()
    except GpuvfioError as exc:
        return f"{type(exc).__name__}: {exc}"


def _walked(host: HostRoot, path: str) -> str:
    """Where resolve_in_sys ends for ``path``, opened there as a directory; or the error of either."""
    def walk():
        real = host.resolve_in_sys(path)
        with host.sys_dirs() as dirs, dirs.open(real) as directory:  # a real path: no link to take
            return directory.path
    return _answer(walk)


def _in_pass(dirs, path: str) -> str:
    """Where a pass's SysDirs.open ends for ``path`` (the directory it opened is the one named
    there), or its error."""
    def walk():
        with dirs.open(path) as directory:
            assert os.path.samestat(os.fstat(directory.fd), os.stat(directory.path, follow_symlinks=False))
            return directory.path
    return _answer(walk)


def _opened(host: HostRoot, path: str) -> str:
    with host.sys_dirs() as dirs:
        return _in_pass(dirs, path)


def _warm(root: str) -> HostRoot:
    """A host that has resolved everything under sys/devices first (every link of a chain, every
    directory on the way, each with its answer kept), in one pass and alone; errors ignored."""
    host = HostRoot(root)
    devices = os.path.join(root, "sys", "devices")
    paths = [devices]
    for top, dirs, names in os.walk(devices):  # links are listed, not followed (followlinks False)
        paths += [os.path.join(top, name) for name in dirs + names]
    with host.sys_dirs() as dirs:
        for path in paths:
            _answer(lambda: host.resolve_in_sys(path))
            _in_pass(dirs, path)
    return host


def _relink(root: str, name: str, target: str) -> None:
    link = os.path.join(root, "sys", "bus", "pci", "devices", name)
    os.unlink(link)
    os.symlink(target, link)


def _real_gpu(root: str) -> str:
    return os.path.realpath(os.path.join(root, "sys", "bus", "pci", "devices", GPU))


def _alias_link(root: str) -> None:
    """devices/GPU -> a link inside sys -> the device: the walk follows both."""
    alias = os.path.join(root, "sys", "devices", "gpu-alias")
    os.symlink(os.path.relpath(_real_gpu(root), os.path.dirname(alias)), alias)
    _relink(root, GPU, "../../../devices/gpu-alias")


def _linked_bridge(root: str) -> None:
    """The device's bridge reached through a link inside sys: the walk follows it."""
    bridge = os.path.dirname(_real_gpu(root))
    alias = os.path.join(root, "sys", "devices", "bridge-alias")
    os.symlink(os.path.relpath(bridge, os.path.dirname(alias)), alias)
    _relink(root, GPU, f"../../../devices/bridge-alias/{GPU}")


def _directory_in_place(root: str) -> None:
    """No link at all: a directory stands in devices/ (the walk takes it as it is)."""
    real = _real_gpu(root)
    link = os.path.join(root, "sys", "bus", "pci", "devices", GPU)
    os.unlink(link)
    shutil.copytree(real, link, symlinks=True)


def _chained_bridge(root: str, links: int) -> None:
    """The device's bridge behind a chain of ``links`` links inside sys (hop0 -> hop1 -> ... ->
    the bridge), the device's own link one more: MAX_LINK_HOPS (40) is 39 here."""
    bridge = os.path.dirname(_real_gpu(root))
    devices = os.path.join(root, "sys", "devices")
    os.symlink(os.path.relpath(bridge, devices), os.path.join(devices, f"hop{links - 1}"))
    for n in range(links - 1):
        os.symlink(f"hop{n + 1}", os.path.join(devices, f"hop{n}"))
    _relink(root, GPU, f"../../../devices/hop0/{GPU}")


def _deep_device(root: str, components: int) -> None:
    """The device's directory ``components`` components below sys (MAX_COMPONENTS is 128)."""
    deep = os.path.join(root, "sys", "devices", *["d"] * (components - 2))
    os.makedirs(deep)
    shutil.copytree(_real_gpu(root), os.path.join(deep, GPU), symlinks=True)
    _relink(root, GPU, "../../../devices/" + "d/" * (components - 2) + GPU)


def _bridge_link(root: str, target: str) -> None:
    devices = os.path.join(root, "sys", "devices")
    os.symlink(target, os.path.join(devices, "bridge-alias"))
    _relink(root, GPU, f"../../../devices/bridge-alias/{GPU}")


def _loop(root: str) -> None:
    devices = os.path.join(root, "sys", "devices")
    os.symlink("loop-b", os.path.join(devices, "loop-a"))
    os.symlink("loop-a", os.path.join(devices, "loop-b"))
    _relink(root, GPU, f"../../../devices/loop-a/{GPU}")


def _fifo_bridge(root: str) -> None:
    """A FIFO where the device's bridge should be: never opened, never waited on."""
    os.mkfifo(os.path.join(root, "sys", "devices", "fifo"))
    _relink(root, GPU, f"../../../devices/fifo/{GPU}")


def _newline_bridge(root: str) -> None:
    """The bridge behind a link whose name holds a newline: a name like any other."""
    bridge = os.path.dirname(_real_gpu(root))
    os.symlink(os.path.relpath(bridge, os.path.join(root, "sys", "devices")),
               os.path.join(root, "sys", "devices", "bri\ndge"))
    _relink(root, GPU, f"../../../devices/bri\ndge/{GPU}")


CASES = {
    "as the kernel makes it": lambda root: None,
    "a link to a link": _alias_link,
    "a linked bridge": _linked_bridge,
    "a directory, not a link": _directory_in_place,
    "an absolute link": lambda root: _relink(root, GPU, _real_gpu(root)),
    "a link out of sys": lambda root: _relink(root, GPU, "../../../../outside"),
    "a link climbing out": lambda root: _relink(root, GPU, "../../../" + "../" * 12 + "outside/x"),
    "a link to nothing": lambda root: _relink(root, GPU, "../../../devices/none"),
    "a link to a file": lambda root: _relink(root, GPU, os.path.relpath(
        os.path.join(_real_gpu(root), "vendor"), os.path.join(root, "sys", "bus", "pci", "devices"))),
    "a link to a FIFO": lambda root: (os.mkfifo(os.path.join(root, "sys", "devices", "fifo")),
                                      _relink(root, GPU, "../../../devices/fifo")),
    "a link through a FIFO": _fifo_bridge,
    "a link through a name with a newline": _newline_bridge,
    "a link to itself": lambda root: _relink(root, GPU, GPU),
    "a link loop": _loop,
    "a link to ..": lambda root: _relink(root, GPU, ".."),
    "a link to sys": lambda root: _relink(root, GPU, "../../.."),
    "a bridge behind 38 links": lambda root: _chained_bridge(root, 38),
    "a bridge behind 39 links": lambda root: _chained_bridge(root, 39),
    "a bridge behind 40 links": lambda root: _chained_bridge(root, 40),
    "a device 128 components deep": lambda root: _deep_device(root, 128),
    "a device 129 components deep": lambda root: _deep_device(root, 129),
    "a bridge linked out of sys": lambda root: _bridge_link(root, "../../outside"),
    "a bridge linked absolutely": lambda root: _bridge_link(root, os.path.dirname(_real_gpu(root))),
}


@pytest.fixture
def no_hang():
    """A FIFO opened for reading would wait for a writer: fail instead of hanging the run."""
    def expired(*_):
        raise TimeoutError("a walk waited (a FIFO opened?)")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_device_opens_where_resolve_in_sys_ends_cold_and_warm(tmp_path, case, no_hang):
    root = str(tmp_path / "host")
    gpu_workstation(root)
    os.makedirs(tmp_path / "outside" / "x")
    CASES[case](root)
    before = open_fds()
    addresses = list_addresses(HostRoot(root))
    expected = {a: _walked(HostRoot(root), device_path(HostRoot(root), a)) for a in addresses}
    for address in addresses:
        for host in (HostRoot(root), _warm(root)):
            path = device_path(host, address)
            assert _walked(host, path) == expected[address], (address, "resolve_in_sys")
            assert _opened(host, path) == expected[address], (address, "SysDirs.open")
    # All in one pass, as an inventory reads them: siblings share the held bridges, and each
    # device is opened twice (a selection's vendor, then the rest), on a fresh host and a warm one.
    for shared in (HostRoot(root), _warm(root)):
        with shared.sys_dirs() as dirs:
            for _round in range(2):
                for address in addresses:
                    assert _in_pass(dirs, device_path(shared, address)) == expected[address], address
    assert open_fds() == before


def _attribute(host: HostRoot, path: str) -> str:
    def open_it():
        os.close(host.open_sys_attribute(path))
        return "opened"
    try:
        return _answer(open_it)
    except FileNotFoundError:
        return "missing"


@pytest.mark.parametrize("links", [MAX_LINK_HOPS - 1, MAX_LINK_HOPS])
def test_a_chain_at_or_over_the_limit_answers_alike_after_its_bridge_was_resolved(tmp_path, links):
    """With the device's own link, 40 links is the limit, 41 one over: refused, whatever was
    resolved before. On main a host that had resolved the chain (sys/devices/hop0, 40 links,
    accepted) kept its answer and started the device's walk there: 1 link, accepted."""
    root = str(tmp_path / "host")
    gpu_workstation(root)
    _chained_bridge(root, links)
    path = device_path(HostRoot(root), GPU)
    chain = os.path.join(root, "sys", "devices", "hop0")
    warm = HostRoot(root)
    assert warm.resolve_in_sys(chain) == os.path.dirname(_real_gpu(root))  # 40 links or fewer
    cold = HostRoot(root)
    for call in (lambda host: _answer(lambda: host.resolve_in_sys(path)), lambda host: _opened(host, path),
                 lambda host: _attribute(host, os.path.join(path, "vendor"))):
        assert call(cold) == call(warm)
    over = links + 1 > MAX_LINK_HOPS
    assert _answer(lambda: warm.resolve_in_sys(path)) == (
        f"UnsafePathError: too many symlinks at {path}" if over else _real_gpu(root))
    assert _attribute(warm, os.path.join(path, "vendor")) == (
        f"UnsafePathError: too many symlinks at {path}" if over else "opened")


def test_a_path_too_deep_behind_a_link_is_refused_after_the_link_was_resolved(tmp_path):
    """sys/a -> a directory 126 components below sys; sys/a/b/c/e is 129 components on the way
    (the target's 126 and three still to walk): refused. On main a host that had resolved sys/a
    alone (126 + 0, accepted) took its answer for the first component and walked on unchecked."""
    root = str(tmp_path / "host")
    gpu_workstation(root)
    sys_dir = os.path.join(root, "sys")
    deep = os.path.join(sys_dir, "devices", *["d"] * (MAX_COMPONENTS - 3))
    os.makedirs(os.path.join(deep, "b", "c", "e"))
    os.symlink(os.path.relpath(deep, sys_dir), os.path.join(sys_dir, "a"))
    warm = HostRoot(root)
    assert warm.resolve_in_sys(os.path.join(sys_dir, "a")) == deep
    refused = f"UnsafePathError: {os.path.join(sys_dir, 'a')}: too many path components"
    for host in (HostRoot(root), warm):
        assert _answer(lambda: host.resolve_in_sys(os.path.join(sys_dir, "a", "b", "c", "e"))) == refused
        assert _opened(host, os.path.join(sys_dir, "a", "b", "c", "e")) == refused
        assert host.resolve_in_sys(os.path.join(sys_dir, "a", "b", "c")) == os.path.join(deep, "b", "c")


def test_a_directory_swapped_for_a_link_between_passes_is_followed_or_refused_afresh(tmp_path):
    """A pass holds the bridge it opened; the next pass walks again: a bridge moved out of sys
    and a link left in its place is refused, by the walk and by the file layer reading through
    a kept answer; a write's path is resolved afresh."""
    root = str(tmp_path / "host")
    gpu_workstation(root)
    host = HostRoot(root)
    path = device_path(host, GPU)
    real = _real_gpu(root)
    assert _opened(host, path) == real and host.read(os.path.join(path, "vendor")) == "0x10de"
    bridge = os.path.dirname(real)
    moved = str(tmp_path / "moved")
    shutil.move(bridge, moved)
    os.symlink(os.path.relpath(moved, os.path.dirname(bridge)), bridge)
    assert _opened(host, real).startswith("UnsafePathError: ") and "links outside" in _opened(host, real)
    assert _attribute(host, os.path.join(path, "vendor")).startswith("UnsafePathError: ")
    with pytest.raises(GpuvfioError, match="is a link"):
        host.read(os.path.join(path, "vendor"))  # the kept answer names the bridge: not followed now
    os.unlink(bridge)
    os.symlink(os.path.relpath(os.path.join(root, "sys", "devices", "pci0000:00"), os.path.dirname(bridge)),
               bridge)  # a link inside sys: followed, to where it leads
    assert _opened(HostRoot(root), path).startswith("HostReadError: missing ")


def test_a_missing_attribute_directory_is_the_kernels_answer_for_a_write(tmp_path):
    root = str(tmp_path / "host")
    gpu_workstation(root)
    host = HostRoot(root)
    with pytest.raises(FileNotFoundError) as raised:
        host.open_sys_attribute(os.path.join(host.sys, "bus", "pci", "devices", "0000:09:00.0", "remove"))
    assert raised.value.errno == errno.ENOENT


def test_a_link_outside_sys_into_it_is_refused_as_resolve_in_sys_refuses_it(tmp_path):
    root = str(tmp_path / "host")
    gpu_workstation(root)
    elsewhere = os.path.join(root, "etc", "gpu")
    os.makedirs(os.path.dirname(elsewhere), exist_ok=True)
    os.symlink(os.path.relpath(_real_gpu(root), os.path.dirname(elsewhere)), elsewhere)
    got = _opened(HostRoot(root), elsewhere)
    assert got == _walked(HostRoot(root), elsewhere) and got.startswith("UnsafePathError")


def test_a_pass_holds_each_directory_once_and_closes_every_fd(tmp_path):
    root = str(tmp_path / "host")
    gpu_workstation(root)
    host = HostRoot(root)
    before = open_fds()
    with host.sys_dirs() as dirs:
        for _round in range(2):
            for address in list_addresses(host):
                with dirs.open(device_path(host, address)):
                    pass
        held = open_fds() - before
    # The root, sys, devices, bus, pci, devices and each bridge with functions under it, once.
    bridges = {os.path.dirname(host.resolve_in_sys(device_path(host, a))) for a in list_addresses(host)}
    assert held <= 6 + len(bridges) and open_fds() == before
    functions = read_functions(host)
    assert open_fds() == before and functions[next(iter(functions))].vendor_id


def test_a_sys_deep_in_the_root_is_walked_without_recursion(tmp_path):
    """A host tree whose sys links to a directory 700 deep: its directories are opened one after
    another from the root, answered with gpuvfio's own errors (RecursionError before)."""
    root = tmp_path / "deep"
    deep = root.joinpath(*["d"] * 700)
    deep.mkdir(parents=True)
    os.symlink(os.path.relpath(deep, root), root / "sys")
    host = HostRoot(str(root))
    with pytest.raises(HostReadError, match="missing"):
        host.resolve_in_sys(os.path.join(host.sys, "x"))
    with host.sys_dirs() as dirs, dirs.open(host.sys) as opened:
        assert opened.path == host.sys


def test_a_sys_that_is_the_root_itself_is_refused(tmp_path):
    """sys -> . would make the whole root sysfs's: a device's driver link to ../../etc would be
    read, and written, as an attribute."""
    root = tmp_path / "self"
    (root / "etc").mkdir(parents=True)
    os.symlink(".", root / "sys")
    with pytest.raises(UnsafePathError, match="is the root .* itself"):
        HostRoot(str(root))


def test_a_name_too_long_on_the_way_is_refused_in_words(tmp_path):
    """openat(2) answers ENAMETOOLONG for a component over NAME_MAX (255 bytes): the walk says so,
    naming where, instead of taking it for a missing directory or a link."""
    root = str(tmp_path / "host")
    gpu_workstation(root)
    host = HostRoot(root)
    too_long = os.path.join(host.sys, "devices", "x" * 300, "vendor")
    with pytest.raises(UnsafePathError, match=r"/devices/x+\.\.\.: name too long"):
        host.resolve_in_sys(too_long)
