"""The Context's clock drives every wait, interval and stamp of a run (issue 36 item 1): a fake
clock (a sleep that advances time and returns at once) makes a long wait pass at once, and what
the journal and the lock file record is the fake clock's time."""

from __future__ import annotations

import socket
import time

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.bind.journal import LockTimeout
from gpuvfio.clock import Clock
from gpuvfio.guest.ssh import SshError, SshTarget
from gpuvfio.ops.binding import BindPolicy, bind
from tests.contexts import lock_held_elsewhere, sim_context
from tests.unit.test_binding import GPU, Host

EPOCH = 1_000_000_000.0  # 2001-09-09T01:46:40Z


class FakeClock:
    """Time that moves only when something sleeps on it."""

    def __init__(self) -> None:
        self.now, self.slept = EPOCH, 0.0

    def clock(self) -> Clock:
        return Clock(monotonic=lambda: self.now, sleep=self.sleep, time=lambda: self.now)

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds


@pytest.fixture
def h(tmp_path):
    return Host(tmp_path / "host")


def test_the_lock_waits_on_the_contexts_clock(h):
    fake = FakeClock()
    began = time.monotonic()
    with sim_context(h.root, h.kernel, lock_timeout=600, clock=fake.clock()) as ctx:
        with lock_held_elsewhere(ctx.state.path(), "gpuvfio bind 01:00.0"):
            with pytest.raises(LockTimeout) as info:
                with ctx.lock():
                    pass
    assert "waited 600s" in str(info.value) and 600 <= fake.slept < 601
    assert time.monotonic() - began < 20  # ten minutes passed on the fake clock only


def test_the_journal_and_the_lock_file_record_the_contexts_time(h):
    fake = FakeClock()
    with sim_context(h.root, h.kernel, clock=fake.clock()) as ctx:
        with ctx.lock():
            holder = ctx.state.read("lock", 512).decode()
        bind(ctx, [PciAddress.parse(GPU)], BindPolicy(), uri="none")
        operation = ctx.journal().data["operation"]
    assert operation["started"] == operation["finished"] == EPOCH
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(EPOCH))
    assert holder.split(" ")[1] == stamp


def test_an_ssh_connection_waits_on_the_contexts_clock(h, tmp_path):
    listener = socket.socket()  # a port that refuses: bound, never listening
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    fake = FakeClock()
    began = time.monotonic()
    try:
        with sim_context(h.root, h.kernel, clock=fake.clock()) as ctx:
            session = ctx.ssh(SshTarget("127.0.0.1", port, connect_timeout=300.0, key=None,
                                        known_hosts=str(tmp_path / "kh"), trust_on_first_use=True))
            with pytest.raises(SshError) as info:
                session.connect()
    finally:
        listener.close()
    assert "did not answer SSH within 300s" in str(info.value)
    assert 299 <= fake.slept <= 300 and time.monotonic() - began < 20
