"""A whole handshake with one peer engine: fetch every needed rank, decode, check identity.

The client fetches raw payloads; this step applies the two-phase decode of the wire core
(hash first, then the metadata) and the engine-id check, so the runtime and ``kvwire
probe`` share one definition of "this peer is who the request said it is".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvwire.errors import HandshakeError, WireDecodeError
from kvwire.sidechannel.client import HandshakeClient
from kvwire.wire.compat import CompatFactors
from kvwire.wire.handshake import (
    decode_handshake,
    decode_handshake_payload,
    peer_features,
    peer_lease,
)
from kvwire.wire.schemas import AnyAgentMetadata


@dataclass(frozen=True)
class PeerHandshake:
    """Decoded metadata per ``(pp_rank, tp_rank)`` and the clock offset to the peer."""

    metadata: dict[tuple[int, int], AnyAgentMetadata]
    clock_offset: float
    """Peer clock minus ours, from the lowest-RTT sample."""
    best_rtt: float
    attempts: int
    features: frozenset[str] = frozenset()
    """kvwire protocol additions every queried rank announced (empty for a vLLM peer)."""
    lease_s: float | None = None
    """The shortest lease a queried rank announced (None: none did, as vLLM peers)."""


def fetch_agent_metadata(
    client: HandshakeClient,
    host: str,
    port: int,
    ranks: Iterable[tuple[int, int]],
    *,
    local_hash: str | None,
    expected_engine_id: str | None = None,
    version: int = 13,
    local_factors: CompatFactors | None = None,
) -> PeerHandshake:
    """Handshake with the engine at ``host:port`` for the given ranks.

    Raises ``IncompatiblePeerError`` on a hash mismatch (naming the differing factors when
    they can be known), ``HandshakeTimeoutError`` when a rank stays silent, and
    ``HandshakeError`` for a refusal, undecodable metadata or the wrong engine.
    """
    replies = client.fetch_payloads(host, port, ranks)
    decoded, features, lease = decode_peer_payloads(
        {key: reply.payload for key, reply in replies.replies.items()},
        where=f"{host}:{port}",
        local_hash=local_hash,
        expected_engine_id=expected_engine_id,
        version=version,
        local_factors=local_factors,
    )
    return PeerHandshake(
        decoded, replies.clock_offset, replies.best_rtt, replies.attempts, features, lease
    )


def decode_peer_payloads(
    payloads: Mapping[tuple[int, int], bytes],
    *,
    where: str,
    local_hash: str | None,
    expected_engine_id: str | None = None,
    version: int = 13,
    local_factors: CompatFactors | None = None,
) -> tuple[dict[tuple[int, int], AnyAgentMetadata], frozenset[str], float | None]:
    """Every rank's payload through the two-phase decode and the identity check, the
    features all of them announce and the shortest lease any states: one definition for
    payloads fetched over ZMQ and payloads read from a metadata store
    (:mod:`kvwire.sidechannel.store`)."""
    decoded: dict[tuple[int, int], AnyAgentMetadata] = {}
    features: frozenset[str] | None = None
    leases: list[float] = []
    for key, payload in payloads.items():
        try:
            md = decode_handshake(
                payload,
                local_hash=local_hash,
                version=version,
                local_factors=local_factors,
            )
        except WireDecodeError as exc:
            raise HandshakeError(
                f"{where} rank (pp={key[0]}, tp={key[1]}) sent undecodable metadata: {exc}"
            ) from exc
        if expected_engine_id is not None and md.engine_id != expected_engine_id:
            raise HandshakeError(
                f"{where} is engine {md.engine_id!r}, expected {expected_engine_id!r}"
            )
        decoded[key] = md
        # The envelope decoded again (the metadata inside stays opaque bytes): a handshake
        # happens once per engine, and only a kvwire peer's hello names features.
        envelope = decode_handshake_payload(payload)
        announced = peer_features(envelope)
        features = announced if features is None else features & announced
        lease = peer_lease(envelope)
        if lease is not None:
            leases.append(lease)
    return decoded, features or frozenset(), min(leases, default=None)
