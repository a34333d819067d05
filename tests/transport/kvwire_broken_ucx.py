"""Deliberately broken UCX adapters: subclasses of :class:`UcxTransport`, each with one
plausible bug in the adapter's own code (planning rows, kept plans, notifications, peers,
error mapping). The conformance suite must fail each in the test named beside it.

Loaded by name (``kvwire_broken_ucx:<variant>``); :data:`VARIANTS` joins the library in
:mod:`variant_library`, and docs/writing-a-transport.md lists them with the rest.
"""

from __future__ import annotations

from typing import Any

from kvwire_broken_shm import adapter_variants
from kvwire_ucx import UcxTransport
from kvwire_ucx import transport as ucx

from kvwire.transport import Descs


class _PlanManyDropsLastRow(UcxTransport):
    """The vectorised planner loses the last coalesced row."""

    def _plan_many(self, peer: Any, local: Descs, remote: Descs) -> Any:
        rows = super()._plan_many(peer, local, remote)
        return tuple(column[:-1] if len(column) > 1 else column for column in rows)


class _PlansKeptAcrossReregistration(UcxTransport):
    """Rebuilds the local region table but keeps the rows planned over the old one."""

    def _rebuild_local(self) -> None:
        kept = {name: dict(peer.plans) for name, peer in self._peers.items()}
        super()._rebuild_local()
        for name, plans in kept.items():
            self._peers[name].plans.update(plans)


class _DrainKeepsNotifications(UcxTransport):
    """Hands out the received notifications without emptying the list."""

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            self._check_open()
            self._progress_locked()
            return list(self._notifications)


class _UnknownPeerKeyError(UcxTransport):
    """Looks peers up without translating a miss."""

    def _peer(self, name: str) -> Any:
        return self._peers[name]


class _ReAddKeepsOldRegions(UcxTransport):
    """Returns early for a peer it already knows, keeping its old regions and rkeys."""

    def add_peer(self, blob: bytes) -> str:
        meta = ucx.meta_codec.decode(blob)
        if meta.name in self._peers:
            return meta.name
        return super().add_peer(blob)


_LIBRARY: list[tuple[str, str, str, str, type[UcxTransport]]] = [
    (
        "ucx_plan_many_drops_last_row",
        "Moving bytes",
        "ucx: the vectorised planner loses the last coalesced row",
        "test_read_moves_exact_bytes",
        _PlanManyDropsLastRow,
    ),
    (
        "ucx_plans_kept_across_reregistration",
        "Registration",
        "ucx: rows planned over deregistered memory are re-posted",
        "test_deregistered_memory_is_refused",
        _PlansKeptAcrossReregistration,
    ),
    (
        "ucx_re_add_keeps_old_regions",
        "Peers and metadata",
        "ucx: add_peer of a known peer keeps its old regions",
        "test_re_adding_a_peer_refreshes_it",
        _ReAddKeepsOldRegions,
    ),
    (
        "ucx_drain_keeps_notifications",
        "Notifications",
        "ucx: drain hands out the notifications without emptying the list",
        "test_notifications_arrive_exactly_once",
        _DrainKeepsNotifications,
    ),
    (
        "ucx_unknown_peer_keyerror",
        "Errors",
        "ucx: an unknown peer name raises KeyError",
        "test_bad_descriptors_are_a_transport_error",
        _UnknownPeerKeyError,
    ),
]

VARIANTS = adapter_variants(_LIBRARY, "ucx", __name__)
