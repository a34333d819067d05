"""One transport agent behind a Producer and a Consumer of the same rank.

An engine that is a prefill engine for some requests and a decode engine for others (vLLM's
``kv_role: "kv_both"``), or whose decode side keeps a conversation's blocks for the next
turn's prefill to read back (``bidirectional_kv_xfer``), has one agent per rank, as a stock
vLLM engine does: peers know it by the one handshake it serves, read from and write to the
one registration, and notify the one agent name. A :class:`SharedAgent` lets the two
runtime sides, each a driver with its own machine, share that agent:

- the memory is registered once, and deregistered when the last side lets it go;
- a peer one side holds is not added again for the other (adding it again would drop the
  descriptor tables the posting side prepared for it), and is removed when neither holds
  it; a side adding again a peer it holds (a new handshake), or any side adding one a side
  let go of (after a failure), reaches the transport as without sharing;
- each notification goes to the side whose machine understands it: a push registration or
  a heartbeat to the producer; a completion to the producer in pull mode (a consumer read
  our blocks) and to the consumer in push mode (a producer wrote into ours);
- the agent is closed once, by the owner of the :class:`SharedAgent`.

Each side's background thread still waits on the agent itself. A notification one side's
drain routes to the other is seen on the other's next turn, which comes within its
``poll_interval_s`` at the latest (at once when it has transfers in flight).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvwire.errors import ConfigError, KVWireError
from kvwire.transport import (
    DelegatingTables,
    DelegatingTransport,
    PreparesTables,
    Region,
    Transport,
)
from kvwire.wire.notifications import decode_notification
from kvwire.wire.schemas import Completion

Side = Literal["producer", "consumer"]


class SharedAgent:
    """``transport`` (owned: closed by :meth:`close`) shared by a producer and a consumer
    of one rank running in ``mode`` (``"pull"`` or ``"push"``)."""

    def __init__(self, transport: Transport, mode: str) -> None:
        if mode not in ("pull", "push"):
            raise ConfigError(f"transfer mode must be pull or push, got {mode!r}")
        self.transport = transport
        self._completions: Side = "producer" if mode == "pull" else "consumer"
        self._lock = threading.Lock()
        self._inbox: dict[Side, list[tuple[str, bytes]]] = {"producer": [], "consumer": []}
        self._registration: object | None = None
        self._registered: tuple[Region, ...] = ()
        self._holders = 0
        self._peers: dict[str, _Peer] = {}
        """Per peer name, its metadata and the sides that hold it."""

    def view(self, side: Side) -> Transport:
        """The transport ``side``'s runtime is given (``Producer(config, view)``)."""
        if side not in ("producer", "consumer"):
            raise ConfigError(f"a shared agent's side is producer or consumer, got {side!r}")
        if isinstance(self.transport, PreparesTables):
            return _TablesView(self, side)
        return _View(self, side)

    def close(self) -> None:
        self.transport.close()

    # -- what the views share ------------------------------------------------------

    def register(self, regions: Sequence[Region]) -> object:
        spans = tuple(regions)
        with self._lock:
            if self._registration is None:
                self._registration = self.transport.register(spans)
                self._registered = spans
            elif spans != self._registered:
                raise ConfigError(
                    "the producer and the consumer of a shared agent register different "
                    "memory: both sides of a rank move the same KV cache"
                )
            self._holders += 1
            return self._registration

    def deregister(self, handle: object) -> None:
        with self._lock:
            if handle is not self._registration or self._holders == 0:
                raise ConfigError("deregister of a registration this shared agent did not make")
            self._holders -= 1
            if self._holders == 0:
                self._registration, self._registered = None, ()
                self.transport.deregister(handle)

    def add_peer(self, side: Side, blob: bytes) -> str:
        with self._lock:
            held = next((p for p in self._peers.values() if p.blob == blob), None)
            if held is not None and not held.dirty and side not in held.sides:
                held.sides.add(side)
                return held.name
            name = self.transport.add_peer(blob)
            peer = self._peers.setdefault(name, _Peer(name, blob))
            peer.blob, peer.dirty = blob, False
            peer.sides.add(side)
            return name

    def remove_peer(self, side: Side, name: str) -> None:
        with self._lock:
            peer = self._peers.get(name)
            if peer is not None:
                peer.sides.discard(side)
                if peer.sides:
                    # The other side keeps it; whoever adds it next reaches the transport
                    # (a side drops a peer after a failure, to connect afresh).
                    peer.dirty = True
                    return
                del self._peers[name]
            self.transport.remove_peer(name)

    def drain(self, side: Side) -> list[tuple[str, bytes]]:
        with self._lock:
            for sender, data in self.transport.drain_notifications():
                self._inbox[self._side_of(data)].append((sender, data))
            out, self._inbox[side] = self._inbox[side], []
            return out

    def has_mail(self, side: Side) -> bool:
        with self._lock:
            return bool(self._inbox[side])

    def _side_of(self, data: bytes) -> Side:
        """Which side's machine takes a notification, by its kind: what neither understands
        goes to the producer, whose machine counts it malformed."""
        try:
            message = decode_notification(data)
        except KVWireError:
            return "producer"
        return self._completions if isinstance(message, Completion) else "producer"


@dataclass
class _Peer:
    name: str
    blob: bytes
    sides: set[Side] = field(default_factory=set)
    dirty: bool = False
    """A side let go of it while the other held it: the next add reaches the transport."""


class _View(DelegatingTransport):
    """One side's transport: the shared agent's, with registration, peers and
    notifications shared (see the module docstring); closing it closes nothing."""

    def __init__(self, agent: SharedAgent, side: Side) -> None:
        super().__init__(agent.transport)
        self._agent = agent
        self._side = side

    def register(self, regions: Sequence[Region]) -> object:
        return self._agent.register(regions)

    def deregister(self, handle: object) -> None:
        self._agent.deregister(handle)

    def add_peer(self, blob: bytes) -> str:
        return self._agent.add_peer(self._side, blob)

    def remove_peer(self, peer: str) -> None:
        self._agent.remove_peer(self._side, peer)

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        return self._agent.drain(self._side)

    def wait(self, timeout: float) -> None:
        if not self._agent.has_mail(self._side):
            self.inner.wait(timeout)

    def close(self) -> None:
        """The agent outlives either side: :meth:`SharedAgent.close` closes it."""


class _TablesView(_View, DelegatingTables):
    """A view of an agent that prepares descriptor tables (``PreparesTables``). Only the
    side that posts prepares any (pull: the consumer; push: the producer)."""
