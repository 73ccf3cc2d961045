"""A host key trusted on first use goes into the state dir through the Context (issue 36 item
1): the state dir is made private (0700) as every other write makes it, and a Context that only
reads refuses to record (its state dir refuses every write, by construction)."""

from __future__ import annotations

import os
import stat

import pytest

from gpuvfio.files import ReadOnly
from gpuvfio.guest.ssh import SshTarget
from gpuvfio.host.root import HostRoot
from gpuvfio.ops.context import Context


@pytest.fixture
def server(tmp_path):
    from tests.lanes import hypervisor as hv

    if hv.skip_reason():
        pytest.skip(hv.skip_reason())
    running = hv.start(str(tmp_path / "server"))
    try:
        yield running
    finally:
        running.stop()


def _target(server) -> SshTarget:
    return SshTarget("127.0.0.1", server.port, key=server.client_key, trust_on_first_use=True, connect_timeout=60)


def test_a_key_trusted_on_first_use_is_recorded_in_a_private_state_dir(server, tmp_path):
    (tmp_path / "host").mkdir()
    with Context(host=HostRoot(str(tmp_path / "host")), writable=True) as ctx:
        with ctx.ssh(_target(server)).connect() as session:
            assert session.run(["true"])[0] == 0
        state = ctx.state.path()
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    recorded = open(os.path.join(state, "known_hosts")).read()
    assert recorded.startswith(f"[127.0.0.1]:{server.port} ") and recorded.count("\n") == 1
    assert stat.S_IMODE(os.stat(os.path.join(state, "known_hosts")).st_mode) == 0o600


def test_a_context_that_only_reads_does_not_record_a_key(server, tmp_path):
    (tmp_path / "host").mkdir()
    with Context(host=HostRoot(str(tmp_path / "host"))) as ctx:
        with pytest.raises(ReadOnly):
            ctx.ssh(_target(server)).connect()
        assert not os.path.exists(ctx.state.path())


def test_a_state_dir_that_is_a_link_is_not_read_for_pinned_keys(server, tmp_path):
    """The state dir's known_hosts is read through the Context's state Tree, as the journal and the
    lock are: a state dir swapped for a link to a planted directory (a key pinned there for an
    impostor) is refused, never trusted."""
    import shutil

    from gpuvfio.errors import GpuvfioError

    (tmp_path / "host/var/lib").mkdir(parents=True)
    planted = tmp_path / "planted"
    planted.mkdir()
    shutil.copy(server.known_hosts, planted / "known_hosts")
    os.symlink(str(planted), tmp_path / "host/var/lib/gpuvfio")
    target = SshTarget("127.0.0.1", server.port, key=server.client_key, connect_timeout=30)
    with Context(host=HostRoot(str(tmp_path / "host")), writable=True) as ctx:
        with pytest.raises(GpuvfioError) as info:
            ctx.ssh(target).connect()
    assert "link" in str(info.value)


def test_naming_the_state_dirs_own_known_hosts_keeps_it_private(server, tmp_path):
    """--known-hosts <state>/known_hosts with trust on first use records as the default does:
    the state dir made 0700, and not at all by a Context that only reads."""
    (tmp_path / "host").mkdir()
    for writable in (False, True):
        with Context(host=HostRoot(str(tmp_path / "host")), writable=writable) as ctx:
            named = SshTarget("127.0.0.1", server.port, key=server.client_key, known_hosts=ctx.state.path("known_hosts"),
                              trust_on_first_use=True, connect_timeout=60)
            if not writable:
                with pytest.raises(ReadOnly):
                    ctx.ssh(named).connect()
                assert not os.path.exists(ctx.state.path())
                continue
            with ctx.ssh(named).connect():
                pass
            assert stat.S_IMODE(os.stat(ctx.state.path()).st_mode) == 0o700
