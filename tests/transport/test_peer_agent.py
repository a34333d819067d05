"""The peer agent process the bench and the conformance suite command: closed politely
when its channel is in step, killed at once when a call was cut short (Ctrl-C mid-call
leaves a command unanswered or a frame half sent, and waiting on that channel could only
time out)."""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

from kvwire.peer import protocol as p
from kvwire.peer.agent import PeerAgent


def _close_within(agent: PeerAgent, seconds: float) -> None:
    closing = threading.Thread(target=agent.close, kwargs={"timeout": 600}, daemon=True)
    closing.start()
    closing.join(seconds)
    assert not closing.is_alive(), "close waited on a channel out of step"


def test_a_call_in_step_closes_politely() -> None:
    agent = PeerAgent("shm")
    assert agent.drain() == []
    _close_within(agent, 60)
    assert agent.process.returncode == 0, "the peer was killed, not closed"


@pytest.mark.parametrize("cut", ["unanswered", "half-sent"])
def test_a_call_cut_short_leaves_close_to_kill_the_peer(
    monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    agent = PeerAgent("shm")
    if cut == "unanswered":
        agent.start(p.Drain(at_least=1, timeout=600))  # nothing will come
    else:

        def half_then_ctrl_c(sock: socket.socket, payload: bytes) -> None:
            sock.sendall(struct.pack("<I", len(payload)) + payload[: len(payload) // 2])
            raise KeyboardInterrupt

        with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
            patch.setattr("kvwire.peer.agent.send_frame", half_then_ctrl_c)
            agent.read(np.zeros((256, 3), dtype=np.int64))  # a frame longer than Close's
    _close_within(agent, 60)
    assert agent.process.returncode is not None
