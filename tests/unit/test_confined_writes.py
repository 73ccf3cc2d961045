"""Writes are confined as reads are (issue 34 item 1): every sysfs write opens its target
through held directory fds beneath the root, each component O_NOFOLLOW, a regular file with
one link, never a path string resolved at plan time; the run lock is a file gpuvfio made.

The attacker owns the tree. A directory swapped for a link to outside between plan and write
is driven from the simulated kernel (the swap happens inside the first write, as a process
racing the run would), not by a hook in the package. Canaries outside the root are checked by
content and link count."""

from __future__ import annotations

import os
import shutil

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError
from tests.unit.test_binding import AUDIO, GPU, Host


def snapshot(top) -> dict[str, tuple[bytes, int]]:
    found = {}
    for directory, _dirs, names in os.walk(top):
        for name in names:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                with open(path, "rb") as handle:
                    found[path] = (handle.read(), os.stat(path).st_nlink)
    return found


class SwapAtTheFirstStep:
    """The simulated kernel, and an attacker who swaps ``sys/devices`` for a link to a copy
    outside the root while the run's first step (loading vfio-pci) runs: after the plan resolved
    every path and the journal was saved, before the first sysfs write."""

    def __init__(self, kernel, root: str, outside: str) -> None:
        self.kernel, self.root, self.outside = kernel, root, outside
        self.swapped = False

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, path, data, fd=None):
        self.kernel(path, data, fd)

    def modprobe(self, name):
        self.kernel.modprobe(name)
        devices = os.path.join(self.root, "sys", "devices")
        os.rename(devices, devices + ".real")
        os.symlink(self.outside, devices)
        self.swapped = True


@pytest.fixture
def h(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    return Host(tmp_path / "host")


def test_a_directory_swapped_for_a_link_between_plan_and_write_is_never_written_through(h, tmp_path):
    outside = str(tmp_path / "outside")
    shutil.copytree(os.path.join(h.root, "sys", "devices"), outside, symlinks=True)
    before = snapshot(outside)
    h.kernel = SwapAtTheFirstStep(h.kernel, h.root, outside)
    with pytest.raises(GpuvfioError):
        h.bind(GPU, uri="none")
    assert h.kernel.swapped, "the swap never happened: the test tested nothing"
    assert snapshot(outside) == before  # not one byte, not one link, outside the root
    assert "vfio-pci" not in "".join(data.decode("utf-8", "replace") for data, _n in before.values())


@pytest.mark.parametrize("target", ["driver_override", "unbind", "drivers_probe"])
def test_a_hard_link_in_place_of_an_attribute_is_not_written(h, tmp_path, target):
    canary = tmp_path / "canary"
    canary.write_text("(null)\n")  # what an override with none set reads
    path = {"driver_override": os.path.join(h.builder.functions[PciAddress.parse(GPU)].path, "driver_override"),
            "unbind": h.builder.sys_path("bus", "pci", "drivers", "nvidia", "unbind"),
            "drivers_probe": h.builder.sys_path("bus", "pci", "drivers_probe")}[target]
    os.unlink(path)
    os.link(canary, path)
    with pytest.raises(GpuvfioError) as info:
        h.bind(GPU, uri="none")
    assert "it has 2 links (a sysfs attribute has one)" in str(info.value)
    assert canary.read_text() == "(null)\n" and os.stat(canary).st_nlink == 2
    assert h.drivers()[GPU] == "nvidia" and h.drivers()[AUDIO] == "snd_hda_intel"


def test_a_hard_linked_lock_is_refused_and_its_file_kept(h, tmp_path, cli):
    canary = tmp_path / "canary"
    canary.write_text("an outside file the lock must not empty\n")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.link(canary, state / "lock")
    with pytest.raises(GpuvfioError, match="not a lock gpuvfio made"):
        h.bind(GPU, uri="none")
    result = cli("--root", h.root, "restore", "--yes")
    assert result.code != 0 and "not a lock gpuvfio made" in result.err
    assert canary.read_text() == "an outside file the lock must not empty\n"
    assert h.drivers()[GPU] == "nvidia"


@pytest.mark.parametrize("kind", ["directory", "device", "socket"])
def test_a_directory_device_or_socket_at_an_attribute_is_refused_in_one_line(h, cli, kind, monkeypatch):
    """The writer looks before it opens (a device is never opened), and says what it found: one
    line, exit 1 or 2, never an IsADirectoryError traceback."""
    import socket
    import stat

    path = h.builder.sys_path("bus", "pci", "drivers", "nvidia", "unbind")
    os.unlink(path)
    if kind == "directory":
        os.mkdir(path)
    elif kind == "device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    else:  # bound by its name from its directory: a socket's path is at most 107 bytes
        monkeypatch.chdir(os.path.dirname(path))
        server = socket.socket(socket.AF_UNIX)
        server.bind(os.path.basename(path))
    with pytest.raises(GpuvfioError, match=f"refusing to write .*unbind: it is a {kind}"):
        h.bind(GPU, uri="none")
    assert h.drivers()[GPU] == "nvidia"
