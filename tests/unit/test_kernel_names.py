"""Names read from links and attributes are the kernel's, or refused where they enter (issue 34
items 2 and 6): a driver's module link whose target carries a newline must never become a line
of modprobe.d (modprobe runs ``install X CMD`` as root at the next boot), and a driver_override
that the journal could not hold is refused before the first write, so gpuvfio never writes a
journal it then refuses to read."""

from __future__ import annotations

import os

import pytest

from gpuvfio.errors import Refused
from gpuvfio.names import is_driver_name, is_module_name
from gpuvfio.ops.binding import status
from tests.unit.test_binding import AUDIO, GPU, Host

INJECTED = "nvidia\ninstall vfio-pci touch PWNED; true #"


@pytest.fixture
def h(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    return Host(tmp_path / "host")


def test_the_rules():
    for name in ("nvidia", "snd_hda_intel", "nvidia-gpu", "i2c_nvidia_gpu", "vfio-pci", "xhci_hcd"):
        assert is_driver_name(name), name
    for name in ("nvidia", "snd_hda_intel", "i2c_nvidia_gpu", "vfio-pci"):
        assert is_module_name(name), name
    for name in ("", "x y", INJECTED, "a/b", "nvidia\n", "-x" * 40, "\x1b[31m", None, 3):
        assert not is_module_name(name), name
    for name in ("", "x y", INJECTED, "a/b", "nvidia\n", "x" * 65, None):
        assert not is_driver_name(name), name


def test_a_module_link_with_a_newline_never_reaches_modprobe_d(cli, h):
    module_link = h.builder.sys_path("bus", "pci", "drivers", "nvidia", "module")
    os.makedirs(h.builder.sys_path("module", INJECTED))
    os.unlink(module_link)
    os.symlink(os.path.join("..", "..", "..", "..", "module", INJECTED), module_link)
    for args in (["--dry-run"], []):
        result = cli("--root", h.root, "persist", GPU, *args)
        assert result.code == 1, result.err
        assert "not a kernel module name" in result.err and "\ninstall" not in result.err
    softdep = os.path.join(h.root, "etc", "modprobe.d", "gpuvfio-vfio.conf")
    assert not os.path.exists(softdep)


def test_a_bad_name_already_in_the_softdep_file_is_not_written_again(cli, h):
    softdep = os.path.join(h.root, "etc", "modprobe.d", "gpuvfio-vfio.conf")
    os.makedirs(os.path.dirname(softdep))
    with open(softdep, "w") as handle:
        handle.write("softdep evil\x1b]0;x\x07 pre: vfio-pci\n")
    result = cli("--root", h.root, "persist", GPU)
    assert result.code == 1 and "not a kernel module name" in result.err
    assert "\x1b" not in result.err
    with open(softdep) as handle:
        assert handle.read() == "softdep evil\x1b]0;x\x07 pre: vfio-pci\n"


def test_an_override_the_journal_could_not_hold_is_refused_before_the_first_write(h):
    from gpuvfio.address import PciAddress

    with open(os.path.join(h.builder.functions[PciAddress.parse(GPU)].path, "driver_override"), "w") as handle:
        handle.write("x y\n")
    with pytest.raises(Refused, match="its driver_override is 'x y', not a kernel driver name"):
        h.bind(GPU, uri="none")
    assert h.drivers()[GPU] == "nvidia" and h.drivers()[AUDIO] == "snd_hda_intel"
    with h.context() as ctx:  # the journal, if any, reads back: status works and holds nothing
        assert status(ctx).devices == []
    with pytest.raises(Refused, match="not a kernel driver name"):
        h.bind(GPU, uri="none", dry_run=True)
