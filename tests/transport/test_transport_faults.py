"""The fault-injecting wrapper does what it promises, around real shm agents."""

from __future__ import annotations

import time

import numpy as np
import pytest
from kvwire_shm import ShmTransport

from kvwire.errors import ConfigError, TransferFailedError, TransportError
from kvwire.testing.faulty_transport import FaultyTransport
from kvwire.transport import (
    DelegatingTables,
    DelegatingTransport,
    XferState,
    create,
    region_of_array,
    wait_for,
)


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    sender, receiver = ShmTransport("faults-sender"), ShmTransport("faults-receiver")
    yield sender, receiver
    sender.close()
    receiver.close()


def _deliver(sender: ShmTransport, receiver: FaultyTransport, messages: list[bytes]) -> list[bytes]:
    peer = sender.add_peer(receiver.local_metadata())
    for message in messages:
        sender.notify(peer, message)
    sender.notify(peer, b"end")
    got: list[bytes] = []
    deadline = time.monotonic() + 30
    total = len(messages) + 1

    def done() -> bool:
        if b"end" in got:  # notifications are ordered: everything before it is in
            return True
        # "end" itself may be dropped: then count, which duplicates would spoil.
        dropped = receiver.injected["drop_notifications"]
        return receiver.p["duplicate_notifications"] == 0 and len(got) + dropped >= total

    while not done():
        assert time.monotonic() < deadline, f"only {len(got)} of {total} notifications came"
        receiver.wait(0.5)
        got += [m for _, m in receiver.drain_notifications()]
    return got


def _messages(n: int) -> list[bytes]:
    return [f"m{i}".encode() for i in range(n)]


def test_no_faults_is_transparent(pair) -> None:  # type: ignore[no-untyped-def]
    sender, receiver = pair
    got = _deliver(sender, FaultyTransport(receiver), _messages(20))
    assert got == [*_messages(20), b"end"]


def test_dropped_notifications_vanish(pair) -> None:  # type: ignore[no-untyped-def]
    sender, receiver = pair
    faulty = FaultyTransport(receiver, drop_notifications=0.5, seed=3)
    got = _deliver(sender, faulty, _messages(200))
    assert 0 < faulty.injected["drop_notifications"] == 201 - len(got)
    assert set(got) <= {*_messages(200), b"end"}


def test_duplicated_notifications_come_twice(pair) -> None:  # type: ignore[no-untyped-def]
    sender, receiver = pair
    got = _deliver(sender, FaultyTransport(receiver, duplicate_notifications=1.0), _messages(5))
    assert sorted(got) == sorted([*_messages(5), b"end"] * 2)


def test_delayed_notifications_come_later(pair) -> None:  # type: ignore[no-untyped-def]
    sender, receiver = pair
    faulty = FaultyTransport(receiver, delay_notifications=1.0, delay_s=0.3)
    peer = sender.add_peer(receiver.local_metadata())
    sender.notify(peer, b"late")
    t0 = time.monotonic()
    got: list[bytes] = []
    while not got and time.monotonic() - t0 < 30:
        faulty.wait(1.0)
        got = [m for _, m in faulty.drain_notifications()]
    assert got == [b"late"]
    assert time.monotonic() - t0 >= 0.3


def test_reordered_notifications_are_a_permutation(pair) -> None:  # type: ignore[no-untyped-def]
    sender, receiver = pair
    faulty = FaultyTransport(receiver, reorder_notifications=True, seed=1)
    peer = sender.add_peer(receiver.local_metadata())
    for message in _messages(50):
        sender.notify(peer, message)
    got: list[bytes] = []
    deadline = time.monotonic() + 30
    while len(got) < 50 and time.monotonic() < deadline:
        receiver.wait(0.5)
        got += [m for _, m in faulty.drain_notifications()]
    assert sorted(got) == sorted(_messages(50))


def test_posts_polls_releases_and_done_can_fail(pair) -> None:  # type: ignore[no-untyped-def]
    sender, receiver = pair
    src, dst = np.arange(4096, dtype=np.uint8) % 251, np.zeros(4096, dtype=np.uint8)
    receiver.register([region_of_array(src)])
    sender.register([region_of_array(dst)])
    peer = sender.add_peer(receiver.local_metadata())
    local = np.array([[dst.ctypes.data, 4096, 0]], dtype=np.int64)
    remote = np.array([[src.ctypes.data, 4096, 0]], dtype=np.int64)
    with pytest.raises(TransferFailedError):
        FaultyTransport(sender, fail_posts=1.0).read(peer, local, remote)
    flipper = FaultyTransport(sender, done_to_failed=1.0)
    handle = flipper.read(peer, local, remote)
    assert wait_for(flipper, handle, 30) is XferState.FAILED
    assert flipper.poll(handle) is XferState.FAILED, "a flipped transfer came back"
    assert sender.poll(handle) is XferState.DONE  # the bytes did move underneath
    assert flipper.failure_reason(handle) == "injected fault: DONE turned FAILED"
    assert FaultyTransport(sender).failure_reason(handle) == sender.failure_reason(handle)
    with pytest.raises(TransportError):
        FaultyTransport(sender, fail_polls=1.0).poll(handle)
    with pytest.raises(TransportError):
        FaultyTransport(sender, fail_releases=1.0).release(handle)
    flipper.release(handle)  # the failed release left the handle intact


def test_a_handle_the_inner_agent_does_not_know_has_no_reason(pair) -> None:  # type: ignore[no-untyped-def]
    """A wrapper may hand out handles of its own: asked why one failed, the forwarding
    base says nothing rather than raise (the driver asks while ending a transfer)."""
    sender, _ = pair
    with pytest.raises(TransportError):
        sender.failure_reason(object())
    assert DelegatingTransport(sender).failure_reason(object()) is None


def test_tables_are_forwarded_only_over_an_agent_that_prepares_them(pair) -> None:  # type: ignore[no-untyped-def]
    """Checked once, when the wrapper is made, not on every post."""
    sender, _ = pair
    with pytest.raises(TypeError, match="prepares no descriptor tables"):
        DelegatingTables(sender)


def test_factory_form_and_bad_probabilities() -> None:
    agent = create(
        "kvwire.testing.faulty_transport:faulty",
        "faults-factory",
        inner="shm",
        drop_notifications=0.1,
    )
    try:
        assert isinstance(agent, FaultyTransport)
    finally:
        agent.close()
    with pytest.raises(ConfigError):
        create("kvwire.testing.faulty_transport:faulty", "faults-bad", inner="shm", fail_posts=2.0)
    with pytest.raises(ConfigError):
        create("kvwire.testing.faulty_transport:faulty", "faults-bad", inner="shm", explode=True)
