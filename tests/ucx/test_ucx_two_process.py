"""The ucx adapter between two processes: the target only sleeps, the initiator moves data.

The target (``ucx_peer.py``) blocks reading its stdin and never calls into kvwire while a
transfer runs, so a transfer that completes shows the progress thread answers for it (over
TCP a get needs the target's worker to respond). Every byte is checked.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvwire_ucx import UcxTransport

from kvwire.errors import TransportError
from kvwire.transport import XferState, region_of_array, wait_for

PEER = Path(__file__).with_name("ucx_peer.py")
SIZE = 4 << 20
SEED = 11
BLOCK = 64 * 1024
TIMEOUT = 60.0

pytestmark = pytest.mark.slow


def pattern(size: int, seed: int) -> np.ndarray:
    return ((np.arange(size, dtype=np.int64) * 31 + seed) % 251).astype(np.uint8)


class Peer:
    """The target process and its line protocol."""

    def __init__(self, name: str, options: dict[str, Any], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), name, str(SIZE), str(SEED), json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        hello = self.read()
        self.meta = base64.b64decode(hello["meta"])
        self.addr = int(hello["addr"])

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"peer exited with {self.proc.poll()}"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(AssertionError, BrokenPipeError):
                self.call(cmd="exit")
        self.proc.kill()
        self.proc.wait(timeout=TIMEOUT)


def connect(options: dict[str, Any], env: dict[str, str]) -> tuple[UcxTransport, Peer, np.ndarray]:
    peer = Peer("target", options, env)
    agent = UcxTransport("initiator", **options)
    local = np.zeros(SIZE, dtype=np.uint8)
    agent.register([region_of_array(local)])
    assert agent.add_peer(peer.meta) == "target"
    assert peer.call(cmd="add_peer", meta=base64.b64encode(agent.local_metadata()).decode()) == {
        "peer": "initiator"
    }
    return agent, peer, local


@pytest.fixture(
    params=[
        pytest.param(({}, {}), id="auto-shm"),
        pytest.param(({"config": {"TLS": "tcp"}}, {"UCX_TLS": "tcp"}), id="tcp"),
    ]
)
def link(request: pytest.FixtureRequest) -> Iterator[tuple[UcxTransport, Peer, np.ndarray]]:
    options, env = request.param
    agent, peer, local = connect(options, env)
    yield agent, peer, local
    agent.close()
    peer.stop()


def descs(base: int, blocks: list[int]) -> np.ndarray:
    return np.array([[base + b * BLOCK, BLOCK, 0] for b in blocks], dtype=np.int64)


def test_read_scattered_blocks_from_an_idle_target(link) -> None:  # type: ignore[no-untyped-def]
    agent, peer, local = link
    blocks = np.random.default_rng(3).permutation(SIZE // BLOCK).tolist()
    handle = agent.read("target", descs(local.ctypes.data, list(range(len(blocks)))),
                        descs(peer.addr, blocks), notify=b"read-done")  # fmt: skip
    assert wait_for(agent, handle, TIMEOUT) is XferState.DONE
    expected = pattern(SIZE, SEED).reshape(-1, BLOCK)[blocks]
    assert np.array_equal(local.reshape(-1, BLOCK), expected)
    assert peer.call(cmd="notifs", count=1) == {"notifs": [["initiator", "read-done"]]}


def test_write_then_notification_sees_all_bytes(link) -> None:  # type: ignore[no-untyped-def]
    agent, peer, local = link
    local[:] = np.random.default_rng(4).integers(0, 256, SIZE, dtype=np.uint8)
    blocks = list(range(0, SIZE // BLOCK, 2))
    handle = agent.write("target", descs(local.ctypes.data, blocks), descs(peer.addr, blocks),
                         notify=b"written")  # fmt: skip
    # The target checks its memory only after the notification reached it.
    assert peer.call(cmd="notifs", count=1) == {"notifs": [["initiator", "written"]]}
    assert wait_for(agent, handle, TIMEOUT) is XferState.DONE
    for b in blocks[:4] + blocks[-4:]:
        want = hashlib.sha256(local[b * BLOCK : (b + 1) * BLOCK].tobytes()).hexdigest()
        assert peer.call(cmd="digest", offset=b * BLOCK, length=BLOCK) == {"digest": want}


def test_notifications_both_ways(link) -> None:  # type: ignore[no-untyped-def]
    agent, peer, _ = link
    agent.notify("target", b"ping")
    assert peer.call(cmd="notifs", count=1) == {"notifs": [["initiator", "ping"]]}
    assert peer.call(cmd="notify", peer="initiator", message="pong") == {"ok": True}
    deadline = time.monotonic() + TIMEOUT
    got: list[tuple[str, bytes]] = []
    while not got and time.monotonic() < deadline:
        agent.wait(0.05)
        got = agent.drain_notifications()
    assert got == [("target", b"pong")]


@pytest.mark.parametrize("mode", ["auto", "peer"])
def test_killed_target_fails_transfers(mode: str) -> None:
    agent, peer, local = connect({"error_handling": mode}, {})
    try:
        one = descs(local.ctypes.data, [0])
        assert wait_for(agent, agent.read("target", one, descs(peer.addr, [0])), TIMEOUT) is (
            XferState.DONE
        )
        peer.proc.kill()
        peer.proc.wait(timeout=TIMEOUT)
        states = []
        for _ in range(3):
            handle = agent.read("target", one, descs(peer.addr, [1]), notify=b"x")
            states.append(wait_for(agent, handle, TIMEOUT))
        assert states[-1] is XferState.FAILED
        with pytest.raises(TransportError):
            agent.notify("target", b"anyone?")
    finally:
        agent.close()
        peer.stop()
