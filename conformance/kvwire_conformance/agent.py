"""The peer agent handle, kept under its old name.

The peer process machinery moved into the core as :mod:`kvwire.peer` (``kvwire bench``
needs it too, and the core must not import this package); these names stay importable
from here for code written against earlier releases.
"""

from __future__ import annotations

from kvwire.peer.agent import DEFAULT_TIMEOUT_S, PeerAgent, PeerAgentError

__all__ = ["DEFAULT_TIMEOUT_S", "PeerAgent", "PeerAgentError"]
