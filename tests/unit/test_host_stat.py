"""HostRoot's stat-like checks (exists, is_dir, is_file, is_link): beneath the root, a final
link never followed, a directory link never out of the root, a FIFO never a file (issue 36
item 5: they replace os.path checks that followed links out of the root)."""

from __future__ import annotations

import os

from gpuvfio.host.root import HostRoot


def test_checks_never_follow_a_link_out_of_the_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "usr/share/OVMF").mkdir(parents=True)
    outside.mkdir()
    (outside / "OVMF_CODE.fd").write_bytes(b"x")
    (root / "usr/share/OVMF/real.fd").write_bytes(b"x")
    os.symlink(str(outside / "OVMF_CODE.fd"), root / "usr/share/OVMF/abs.fd")  # this machine's file
    os.symlink("real.fd", root / "usr/share/OVMF/rel.fd")
    os.symlink(os.path.relpath(outside, root / "usr"), root / "usr/escape")  # a directory out of the root
    os.mkfifo(root / "usr/share/OVMF/fifo.fd")
    host = HostRoot(str(root))
    path = lambda *parts: host.path("usr", *parts)  # noqa: E731
    assert host.is_file(path("share/OVMF/real.fd")) and not host.is_link(path("share/OVMF/real.fd"))
    for link in ("abs.fd", "rel.fd"):
        assert host.exists(path("share/OVMF", link)) and host.is_link(path("share/OVMF", link))
        assert not host.is_file(path("share/OVMF", link)) and not host.is_dir(path("share/OVMF", link))
    assert not host.exists(path("escape", "OVMF_CODE.fd")) and not host.is_file(path("escape", "OVMF_CODE.fd"))
    assert not host.is_dir(path("escape"))
    assert host.exists(path("share/OVMF/fifo.fd")) and not host.is_file(path("share/OVMF/fifo.fd"))
    assert host.is_dir(path("share/OVMF")) and not host.exists(path("share/OVMF/none.fd"))


def test_installed_follows_the_hosts_own_links_inside_the_root_only(tmp_path):
    """OVMF images are often links (Fedora: /usr/share/OVMF -> ../edk2/ovmf): a link the host
    would follow to a file counts, a dangling one or one out of the root does not."""
    from gpuvfio.host.firmware import find_ovmf

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "usr/share/OVMF").mkdir(parents=True)
    (root / "usr/share/edk2/ovmf").mkdir(parents=True)
    outside.mkdir()
    (outside / "OVMF_CODE_4M.fd").write_bytes(b"x")
    for name in ("OVMF_CODE.fd", "OVMF_VARS.fd"):
        (root / "usr/share/edk2/ovmf" / name).write_bytes(b"x")
    os.symlink("/usr/share/nowhere/OVMF_CODE_4M.fd", root / "usr/share/OVMF/OVMF_CODE_4M.fd")  # dangling
    os.symlink("/usr/share/nowhere/OVMF_VARS_4M.fd", root / "usr/share/OVMF/OVMF_VARS_4M.fd")
    os.symlink(str(outside / "OVMF_CODE_4M.fd"), root / "usr/share/OVMF/out.fd")  # this machine's file
    os.symlink("/usr/share/edk2/ovmf/OVMF_CODE.fd", root / "usr/share/OVMF/abs.fd")  # the host's, absolute
    host = HostRoot(str(root))
    assert not host.installed(host.path("usr/share/OVMF/OVMF_CODE_4M.fd"))
    assert not host.installed(host.path("usr/share/OVMF/out.fd"))
    assert host.installed(host.path("usr/share/OVMF/abs.fd"))
    assert host.installed(host.path("usr/share/edk2/ovmf/OVMF_CODE.fd"))
    code, _vars = find_ovmf(host)
    assert not code.endswith("_4M.fd")  # the dangling pair is passed over for the real one
