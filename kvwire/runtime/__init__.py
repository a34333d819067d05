"""The runtime: Producer and Consumer objects a serving engine embeds.

Each joins a sans-IO machine (:mod:`kvwire.machine`), one transport and the handshake side
channel, running handshakes, transfers, notifications, heartbeats and leases on background
threads while the engine makes the calls it already makes.
"""

from __future__ import annotations

from kvwire.runtime.consumer import Consumer, Finished, RequestFailure
from kvwire.runtime.driver import regions_of
from kvwire.runtime.metrics import Metrics, RequestMetrics
from kvwire.runtime.producer import FreedRequest, Producer
from kvwire.runtime.shared_agent import SharedAgent

__all__ = [
    "Consumer",
    "Finished",
    "FreedRequest",
    "Metrics",
    "Producer",
    "RequestFailure",
    "RequestMetrics",
    "SharedAgent",
    "regions_of",
]
