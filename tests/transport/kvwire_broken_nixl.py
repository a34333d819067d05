"""Deliberately broken NIXL adapters: subclasses of :class:`NixlTransport`, each with one
plausible bug in the adapter's own code (descriptor lists, kept requests, notifications,
peers, error mapping). The conformance suite must fail each in the test named beside it.

Loaded by name (``kvwire_broken_nixl:<variant>``); :data:`VARIANTS` joins the library in
:mod:`variant_library`, and docs/writing-a-transport.md lists them with the rest.
"""

from __future__ import annotations

from typing import Any

from kvwire_broken_shm import adapter_variants
from kvwire_nixl import NixlTransport

from kvwire.transport import Descs


class _RequestDropsLastRow(NixlTransport):
    """Builds NIXL's descriptor lists from every row but the last."""

    def _create_request(self, op: str, peer: str, loc: Descs, rem: Descs, message: bytes) -> Any:
        if loc.shape[0] > 1:
            loc, rem = loc[:-1], rem[:-1]
        return super()._create_request(op, peer, loc, rem, message)


class _DrainKeepsInbox(NixlTransport):
    """Hands out the inbox without emptying it."""

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        self._open_agent()
        with self._lock:
            self._progress_locked()
            return list(self._inbox)


class _AddPeerRawError(NixlTransport):
    """Loads the blob into NIXL before the checks that translate NIXL's errors."""

    def add_peer(self, blob: bytes) -> str:
        self._open_agent().add_remote_agent(bytes(blob))
        return super().add_peer(blob)


class _KeptRequestOutlivesDeregister(NixlTransport):
    """Deregisters memory but keeps the requests prepared over it for re-posting."""

    def _clear_cache(self) -> None:
        return None


class _RemovePeerKeepsKeptRequests(NixlTransport):
    """Forgets a removed peer's name but keeps its prepared requests, which re-post
    without the peer check."""

    def _drop_cached(self, peer: str) -> None:
        self._remote_kind = {k: v for k, v in self._remote_kind.items() if k[0] != peer}


_LIBRARY: list[tuple[str, str, str, str, type[NixlTransport]]] = [
    (
        "nixl_request_drops_last_row",
        "Moving bytes",
        "nixl: builds each request's descriptor lists without the last row",
        "test_read_moves_exact_bytes",
        _RequestDropsLastRow,
    ),
    (
        "nixl_kept_request_outlives_deregister",
        "Registration",
        "nixl: deregister keeps the requests prepared over that memory",
        "test_deregistered_memory_is_refused",
        _KeptRequestOutlivesDeregister,
    ),
    (
        "nixl_remove_peer_keeps_kept_requests",
        "Peers and metadata",
        "nixl: remove_peer keeps the peer's prepared requests, which re-post unchecked",
        "test_re_adding_a_peer_refreshes_it",
        _RemovePeerKeepsKeptRequests,
    ),
    (
        "nixl_add_peer_raw_error",
        "Peers and metadata",
        "nixl: a blob NIXL refuses escapes as NIXL's own exception",
        "test_foreign_metadata_is_refused",
        _AddPeerRawError,
    ),
    (
        "nixl_drain_keeps_inbox",
        "Notifications",
        "nixl: drain hands out the inbox without emptying it",
        "test_notifications_arrive_exactly_once",
        _DrainKeepsInbox,
    ),
]

VARIANTS = adapter_variants(_LIBRARY, "nixl", __name__)
