"""What kvwire's two halves inside vLLM say to each other: the scheduler's per-step
metadata, a worker's handshake answer, and the counters vLLM's stats logger reads. Plain
dataclasses vLLM hands between processes (its own serialisation, not kvwire's wire)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

BlockIds = list[list[int]]


@dataclass
class KVWireHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """One worker's handshake answer, as kvwire encodes it; the scheduler's listener
    serves it to peers at (pp, tp)."""

    payload: bytes


@dataclass
class KVWireMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler side tells every worker in one step."""

    to_send: dict[str, tuple[BlockIds, int]] = field(default_factory=dict)
    """P: requests whose blocks to hold for consumers, with their token counts."""
    to_recv: dict[str, tuple[dict[str, Any], BlockIds, int | None]] = field(default_factory=dict)
    """D: requests to fetch, with P's params, the local blocks to fill (may be empty: a full
    local prefix hit still tells P it may free) and the prompt's length (which places the
    lists when P's blocks are larger than ours and P's params do not carry it)."""
    read_back: set[str] = field(default_factory=set)
    """Requests of ``to_recv`` reading back what a decode engine kept of their conversation
    (``bidirectional_kv_xfer``): their count is the tokens to read, from the first."""
    held_s: dict[str, float] = field(default_factory=dict)
    """Requests of ``to_send`` a decode engine keeps for the next turn's prefill, held this
    many seconds (``decoder_kv_blocks_ttl``) rather than the lease."""
    to_abort: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    """P: requests scheduled for prefill; their producer knows them from here (an abort
    before the prefill ends is then the machine's to forget)."""
    chunks: dict[str, tuple[BlockIds, int, int]] = field(default_factory=dict)
    """P, streaming push: requests this step computes prompt tokens of, with their blocks
    so far, the token the step computes the prompt through and the prompt's length."""
    staged: dict[str, BlockIds] = field(default_factory=dict)
    """P with a host buffer: per request whose prompt this step computes, the blocks the
    step writes (per transfer group), copied to the host once the forward ran."""
    preempted: list[str] = field(default_factory=list)
    """P, streaming push: requests whose blocks vLLM took back since the last step (it
    computes them again from the start)."""


class KVWireStats(KVConnectorStats):  # type: ignore[misc]
    """The runtime's counters for vLLM's stats logger (a snapshot, so aggregation keeps the
    latest)."""

    data: dict[str, Any]

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = dict(other.data) or self.data
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, (int, float))}

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data
