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
