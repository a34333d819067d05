"""Engine metadata in a cluster store (etcd): publish, read and watch handshake payloads.

vLLM's protocol finds peers lazily, one ZMQ round trip per (consumer rank, producer
rank) pair, and learns of a producer restart only when a transfer fails. With a store,
each rank publishes once the exact payload its listener serves, under an etcd lease a
keepalive renews; consumers list and watch the store, so a cold fleet costs N + M
messages instead of N x M, and a restarted (new metadata) or vanished (lease expired)
producer is seen by every consumer before its next request.

The store is an accelerator, never a dependency: while it is unreachable,
:meth:`Directory.lookup` answers None and the runtime handshakes over ZMQ as before, and
the ZMQ listener keeps serving for peers without a store (stock vLLM among them).

What is stored, and how it is sealed: :mod:`kvwire.sidechannel.store_records`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvwire.errors import HandshakeAuthError, KVWireError, MetadataStoreError
from kvwire.sidechannel.engine_handshake import PeerHandshake, decode_peer_payloads
from kvwire.sidechannel.etcd import EtcdClient, KeyValue, WatchEvent, WatchStream
from kvwire.sidechannel.store_records import (
    CLOCK_UNCERTAINTY_S,
    Rank,
    StoreRecord,
    decode_record,
    group_prefix,
    parse_key,
)
from kvwire.wire.compat import CompatFactors

log = logging.getLogger(__name__)

# -- the producer side ------------------------------------------------------------------------


class Publisher:
    """Keeps one rank's record in the store under a lease it renews every TTL/3.

    Never blocks or fails its rank: with etcd down it retries in the background, and once
    the lease it held is gone (etcd lost it, or it expired while etcd was out of reach)
    it grants a new one and publishes again."""

    def __init__(
        self,
        url: str,
        key: bytes,
        record: Callable[[], bytes],
        *,
        ttl: float,
        client: EtcdClient | None = None,
    ) -> None:
        self.client = client or EtcdClient(url)
        self.key = key
        self._record = record
        self._ttl = ttl
        self._lease = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.published = threading.Event()
        """Set while the record is in the store (cleared when a renewal fails)."""
        self.publications = 0
        self._thread = threading.Thread(target=self._run, name="kvwire-store-publish", daemon=True)

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def close(self, *, withdraw: bool = True) -> None:
        """Stop renewing; ``withdraw`` revokes the lease (peers forget the rank at once),
        else the record lives until its lease runs out, as after a crash."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        if withdraw and self._lease:
            try:
                self.client.revoke(self._lease)
            except MetadataStoreError as exc:
                log.info("withdrawing %s: %s", self.key.decode(errors="replace"), exc)
        self._lease = 0
        self.published.clear()

    def _run(self) -> None:
        retry = min(1.0, self._ttl / 4)
        while not self._stop.is_set():
            try:
                if not self._lease:
                    lease = self.client.grant(self._ttl)
                    self.client.put(self.key, self._record(), lease)
                    self._lease = lease
                    self.publications += 1
                    self.published.set()
                elif self.client.keepalive(self._lease) <= 0:
                    self._lease = 0  # expired while etcd was away: publish anew
                    self.published.clear()
                    continue
                else:
                    self.published.set()  # renewed: the record is there (again)
                self._wake.wait(self._ttl / 3)
            except MetadataStoreError as exc:
                log.info("metadata store: %s (retrying in %.1fs)", exc, retry)
                self.published.clear()
                self._wake.wait(retry)


# -- the consumer side ------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One producer rank as the store shows it, payload opened."""

    record: StoreRecord
    mod_revision: int


Change = Callable[[str, Rank, "bytes | None"], None]
"""``(engine id, rank, new payload or None when it is gone)``, called on the watch thread."""


class Directory:
    """A consumer's view of one compatibility group: a cache filled by a list and kept by a
    watch. While the watch runs, :meth:`lookup` serves handshakes from the cache; while it
    does not (etcd down, partitioned, not yet connected), :meth:`lookup` answers None.

    ``on_change`` hears of every rank whose payload changed or vanished, so the runtime
    drops a cached agent before a request can read from it."""

    def __init__(
        self,
        url: str,
        compat_hash: str,
        *,
        secret: bytes | None,
        on_change: Change | None = None,
        probe_s: float = 2.0,
        client: EtcdClient | None = None,
    ) -> None:
        self.client = client or EtcdClient(url)
        self.prefix = group_prefix(compat_hash)
        self._secret = secret
        self._on_change = on_change
        self._probe_s = probe_s
        self._lock = threading.Lock()
        self._cache: dict[bytes, Entry] = {}
        self._watch: WatchStream | None = None
        self._stop = threading.Event()
        self.healthy = threading.Event()
        """Set while the cache is current (listed and watched)."""
        self.rejected = 0
        """Records refused (undecodable, unauthenticated, tampered)."""
        self.messages = 0
        """Watch messages received (each a batch of changes), beside ``client.requests``."""
        self._thread = threading.Thread(target=self._run, name="kvwire-store-watch", daemon=True)

    def start(self) -> Directory:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            watch = self._watch
        if watch is not None:
            watch.close()
        if self._thread.is_alive():
            self._thread.join(5.0)

    # -- reading ------------------------------------------------------------------------

    def lookup(self, engine_id: str, ranks: Iterable[Rank]) -> dict[Rank, StoreRecord] | None:
        """Every asked rank's record, or None unless the cache is current and has them all."""
        if not self.healthy.is_set():
            return None
        out: dict[Rank, StoreRecord] = {}
        with self._lock:
            for pp, tp in ranks:
                entry = self._cache.get(self.prefix + f"{engine_id}/{pp}/{tp}".encode())
                if entry is None:
                    return None
                out[(pp, tp)] = entry.record
        return out

    def unchanged(self, engine_id: str, used: Mapping[Rank, bytes]) -> bool:
        """Whether the cache still holds exactly these payloads for the engine's ranks."""
        records = self.lookup(engine_id, used)
        return records is not None and all(records[k].payload == p for k, p in used.items())

    def engines(self) -> dict[str, dict[Rank, StoreRecord]]:
        """Every engine of the group the cache holds (for introspection and the bench)."""
        out: dict[str, dict[Rank, StoreRecord]] = {}
        with self._lock:
            for key, entry in self._cache.items():
                parsed = parse_key(key)
                if parsed is not None:
                    out.setdefault(parsed[1], {})[parsed[2]] = entry.record
        return out

    def handshake(
        self,
        engine_id: str,
        ranks: Iterable[Rank],
        *,
        local_hash: str | None,
        version: int,
        local_factors: CompatFactors | None,
        clock: Callable[[], float],
    ) -> tuple[PeerHandshake, dict[Rank, bytes]] | None:
        """A handshake served from the cache and the payloads it used (to check with
        :meth:`unchanged` later), or None (the caller handshakes over ZMQ)."""
        records = self.lookup(engine_id, ranks)
        if not records:
            return None
        used = {key: r.payload for key, r in records.items()}
        try:
            decoded, features, lease = decode_peer_payloads(
                used,
                where=f"store {self.client.url}",
                local_hash=local_hash,
                expected_engine_id=engine_id,
                version=version,
                local_factors=local_factors,
            )
        except KVWireError as exc:
            log.info("store record of %s unusable, handshaking over ZMQ: %s", engine_id, exc)
            return None
        anchor = next(iter(records.values()))
        # Remote clock minus ours through wall time: (their clock - their wall) - (ours - our wall).
        offset = (anchor.clock - anchor.wall) - (clock() - time.time())
        handshake = PeerHandshake(decoded, offset, 2 * CLOCK_UNCERTAINTY_S, 0, features, lease)
        return handshake, used

    # -- the watch thread -------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            try:
                revision, kvs = self.client.get_prefix(self.prefix)
                self._replace(kvs)
                watch = self.client.watch(self.prefix, revision + 1)
                with self._lock:
                    self._watch = watch
                if self._stop.is_set():
                    watch.close()
                    return
                self.healthy.set()
                backoff = 0.05
                self._follow(watch)
            except MetadataStoreError as exc:
                if not self._stop.is_set():
                    log.info("metadata store watch: %s", exc)
            finally:
                self.healthy.clear()
                with self._lock:
                    current, self._watch = self._watch, None
                if current is not None:
                    current.close()
            self._stop.wait(backoff)
            backoff = min(1.0, backoff * 2)

    def _follow(self, watch: WatchStream) -> None:
        quiet_since = time.monotonic()
        while not self._stop.is_set():
            events = watch.events(timeout=min(0.5, self._probe_s))
            if events:
                self.messages += 1
                self._apply(events)
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= self._probe_s:
                # A partition sends no FIN: a quiet watch is confirmed by a cheap read.
                self.client.probe()
                quiet_since = time.monotonic()

    def _open(self, key: bytes, value: bytes) -> StoreRecord | None:
        try:
            return decode_record(key, value, self._secret)
        except (MetadataStoreError, HandshakeAuthError) as exc:
            self.rejected += 1
            log.warning("store record %s refused: %s", key.decode(errors="replace"), exc)
            return None

    def _replace(self, kvs: list[KeyValue]) -> None:
        """A fresh listing: the cache becomes it; ranks that changed, vanished or appeared
        are told (one that appeared may have been handshaken over ZMQ before a restart)."""
        fresh: dict[bytes, Entry] = {}
        for kv in kvs:
            record = self._open(kv.key, kv.value)
            if record is not None:
                fresh[kv.key] = Entry(record, kv.mod_revision)
        with self._lock:
            old, self._cache = self._cache, fresh
        for key, entry in old.items():
            now = fresh.get(key)
            if now is None or now.record.payload != entry.record.payload:
                self._tell(key, now.record.payload if now is not None else None)
        for key in fresh.keys() - old.keys():
            self._tell(key, fresh[key].record.payload)

    def _apply(self, events: list[WatchEvent]) -> None:
        told: list[tuple[bytes, bytes | None]] = []
        with self._lock:
            for ev in events:
                record = self._open(ev.key, ev.value) if ev.value is not None else None
                old = self._cache.pop(ev.key, None)
                if record is not None:
                    self._cache[ev.key] = Entry(record, ev.mod_revision)
                if old is not None and (record is None or record.payload != old.record.payload):
                    told.append((ev.key, record.payload if record is not None else None))
                elif old is None and record is not None:
                    told.append((ev.key, record.payload))  # a rank seen over ZMQ may be stale
        for key, payload in told:
            self._tell(key, payload)

    def _tell(self, key: bytes, payload: bytes | None) -> None:
        parsed = parse_key(key)
        if parsed is None or self._on_change is None:
            return
        try:
            self._on_change(parsed[1], parsed[2], payload)
        except Exception:  # the runtime's callback must not stop the watch
            log.exception("metadata store change handler failed")
