"""Run one agent of a transport in another process and command it over a socketpair.

Both ``kvwire bench transport`` and the conformance suite (``kvwire_conformance``) need the
other side of a transfer in a separate interpreter, so the two sides share no memory,
threads or library state. :class:`~kvwire.peer.agent.PeerAgent` spawns
``python -m kvwire.peer.process`` and talks :mod:`kvwire.peer.protocol` to it;
:mod:`kvwire.peer.memory` is the oracle both sides use to read and write memory by address.

Nothing here imports pytest or Hypothesis, and ``import kvwire`` does not load this package.
"""

from __future__ import annotations

from kvwire.peer.agent import DEFAULT_TIMEOUT_S, PeerAgent, PeerAgentError

__all__ = ["DEFAULT_TIMEOUT_S", "PeerAgent", "PeerAgentError"]
