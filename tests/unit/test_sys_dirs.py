"""A pass's directories (gpuvfio.host.root.SysDirs): a device reached through its link in
sys/bus/pci/devices is opened in fewer steps than the general walk (HostRoot.resolve_in_sys)
takes, and must end where that walk ends, or fail as it fails, whatever the link is."""

from __future__ import annotations

import os
import shutil

import pytest

from gpuvfio.errors import GpuvfioError
from gpuvfio.host.inventory import device_path, list_addresses, read_functions
from gpuvfio.host.root import HostRoot
from tests.conftest import gpu_workstation, open_fds

GPU = "0000:01:00.0"


def _walked(root: str, path: str) -> str:
    """Where the general walk ends for ``path`` on a fresh host (no cache), opened there as a
    directory; or the error of either."""
    try:
        host = HostRoot(root)
        real = host.resolve_in_sys(path)
        with host.sys_dirs() as dirs, dirs.open(real) as directory:  # a real path: no link to take
            return directory.path
    except GpuvfioError as exc:
        return f"{type(exc).__name__}: {exc}"


def _opened(host: HostRoot, path: str) -> str:
    try:
        with host.sys_dirs() as dirs, dirs.open(path) as directory:
            assert os.path.samestat(os.fstat(directory.fd), os.stat(directory.path, follow_symlinks=False))
            return directory.path
    except GpuvfioError as exc:
        return f"{type(exc).__name__}: {exc}"


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
    real = _real_gpu(root)
    bridge = os.path.dirname(real)
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
    """The device's bridge behind a chain of ``links`` links inside sys: 40 is the walk's limit
    (MAX_LINK_HOPS), with the device's own link one more."""
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


CASES = {
    "as the kernel makes it": lambda root: None,
    "a link to a link": _alias_link,
    "a linked bridge": _linked_bridge,
    "a directory, not a link": _directory_in_place,
    "an absolute link": lambda root: _relink(root, GPU, _real_gpu(root)),
    "a link out of sys": lambda root: _relink(root, GPU, "../../../../outside"),
    "a link to nothing": lambda root: _relink(root, GPU, "../../../devices/none"),
    "a link to a file": lambda root: _relink(root, GPU, os.path.relpath(
        os.path.join(_real_gpu(root), "vendor"), os.path.join(root, "sys", "bus", "pci", "devices"))),
    "a link to itself": lambda root: _relink(root, GPU, GPU),
    "a link to ..": lambda root: _relink(root, GPU, ".."),
    "a link to sys": lambda root: _relink(root, GPU, "../../.."),
    "a bridge behind 39 links": lambda root: _chained_bridge(root, 39),
    "a bridge behind 40 links": lambda root: _chained_bridge(root, 40),
    "a device 128 components deep": lambda root: _deep_device(root, 128),
    "a device 129 components deep": lambda root: _deep_device(root, 129),
    "a bridge linked out of sys": lambda root: _bridge_link(root, "../../outside"),
    "a bridge linked absolutely": lambda root: _bridge_link(root, os.path.dirname(_real_gpu(root))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_device_opens_where_the_general_walk_ends_or_fails_as_it_fails(tmp_path, case):
    root = str(tmp_path / "host")
    gpu_workstation(root)
    os.makedirs(tmp_path / "outside" / "x")
    CASES[case](root)
    before = open_fds()
    host = HostRoot(root)
    addresses = list_addresses(host)
    expected = {a: _walked(root, device_path(host, a)) for a in addresses}
    # Each device on its own: a fresh host and pass.
    for address in addresses:
        fresh = HostRoot(root)
        assert _opened(fresh, device_path(fresh, address)) == expected[address], address
    # All in one pass, as an inventory reads them: siblings share the held bridges, and each
    # device is opened twice (a selection's vendor, then the rest).
    shared = HostRoot(root)
    with shared.sys_dirs() as dirs:
        for _round in range(2):
            for address in addresses:
                try:
                    with dirs.open(device_path(shared, address)) as directory:
                        got = directory.path
                except GpuvfioError as exc:
                    got = f"{type(exc).__name__}: {exc}"
                assert got == expected[address], address
    assert open_fds() == before


def test_a_link_outside_sys_into_it_is_refused_as_the_general_walk_refuses_it(tmp_path):
    root = str(tmp_path / "host")
    gpu_workstation(root)
    elsewhere = os.path.join(root, "etc", "gpu")
    os.makedirs(os.path.dirname(elsewhere), exist_ok=True)
    os.symlink(os.path.relpath(_real_gpu(root), os.path.dirname(elsewhere)), elsewhere)
    got = _opened(HostRoot(root), elsewhere)
    assert got == _walked(root, elsewhere) and got.startswith("UnsafePathError")


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
