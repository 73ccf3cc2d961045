"""Messages that say what really happened (issue 40, item 7): the reason a note gives is the one
that holds for the command line given."""

from __future__ import annotations

import re

import pytest

from tests.make_samples import host_tree


@pytest.fixture(scope="module")
def switch_host(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pcie-switch"))
    host_tree("pcie-switch", root)
    return root


@pytest.mark.parametrize("connect, why, ask", [
    ((), "no libvirt connection", "pass --qemu-version or --connect"),
    (("--connect", "test:///default"), "the libvirt connection is not to QEMU",
     "pass --qemu-version or --connect a qemu:// URI"),
])
def test_an_unknown_qemu_version_says_why(cli, switch_host, connect, why, ask):
    """Two GPUs behind one switch would get a P2P clique; without QEMU's version it is left out,
    and the note says whether libvirt was asked at all (the test driver answers, but not for QEMU)."""
    result = cli("--root", switch_host, "xml", "18:00.0", "19:00.0", "--name", "p2p", *connect)
    note = " ".join(result.err.split())
    assert result.code == 0, result.err
    said = rf"QEMU version unknown \({re.escape(why)}\): P2P cliques left out, [^;]*; {re.escape(ask)}(?: gpuvfio:|$)"
    assert re.search(said, note), note
