"""A minimal etcd v3 client over etcd's JSON gateway, standard library only.

Why not a gRPC client package: ``etcd3`` pins protobuf 3 (and grpcio), ``etcd3gw`` pulls
requests, futurist and pbr, the asyncio ones want an event loop the runtime does not run.
kvwire needs six calls (grant, keepalive, revoke, put, range, watch), all of which etcd
serves as JSON over HTTP/1.1 on its client port (``/v3/...``, keys and values base64), so
they cost ~200 lines here and no dependency. Every failure is a
:class:`~kvwire.errors.MetadataStoreError`; callers fall back to ZMQ on it.

The watch is a long-lived chunked HTTP response read from a raw socket, so a read timeout
is a plain ``socket.timeout`` between messages and never corrupts a half-read chunk.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import http.client
import json
import socket
import threading
from dataclasses import dataclass
from typing import Any

from kvwire.errors import MetadataStoreError

_MAX_LINE = 64 << 20
"""Largest watch message accepted (many engines' records in one event batch)."""


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    key: bytes
    value: bytes | None
    """None for a delete (a lease that expired or was revoked, or a delete)."""
    mod_revision: int


def parse_store_url(url: str) -> tuple[str, int]:
    """``etcd://host:port`` -> (host, port); the config has normalized it already."""
    scheme, _, rest = url.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "etcd" or not host or not port.isdigit():
        raise MetadataStoreError(f"not an etcd://host:port address: {url!r}")
    return host.strip("[]"), int(port)


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range or a watch cover every key under ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any) -> bytes:
    return base64.b64decode(text) if isinstance(text, str) else b""


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


class EtcdClient:
    """One etcd endpoint; each call opens a short connection (thread safe, no pooling)."""

    def __init__(self, url: str, *, timeout: float = 2.0) -> None:
        self.url = url
        self.host, self.port = parse_store_url(url)
        self.timeout = timeout
        self._lock = threading.Lock()
        self.calls: collections.Counter[str] = collections.Counter()
        """Calls made by kind (each one request and one answer; a watch's later messages
        are counted by its reader): what ``kvwire bench fleet`` counts."""

    @property
    def requests(self) -> int:
        return sum(self.calls.values())

    def _count(self, kind: str) -> None:
        with self._lock:
            self.calls[kind] += 1

    def call(self, path: str, body: dict[str, Any], *, kind: str = "") -> dict[str, Any]:
        """POST ``body`` to ``/v3/{path}``; the decoded answer, or MetadataStoreError.
        Counted under ``kind``, by default the path."""
        self._count(kind or path)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(
                "POST", f"/v3/{path}", json.dumps(body), {"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            data = resp.read(_MAX_LINE)
        except (OSError, http.client.HTTPException) as exc:
            raise MetadataStoreError(f"etcd at {self.url} unreachable: {exc}") from None
        finally:
            conn.close()
        try:
            doc = json.loads(data)
        except ValueError:
            raise MetadataStoreError(f"etcd at {self.url} answered non-JSON") from None
        if resp.status != 200 or not isinstance(doc, dict):
            why = doc.get("message") if isinstance(doc, dict) else None
            raise MetadataStoreError(f"etcd at {self.url}: {path} failed: {why or resp.status}")
        return doc

    # -- leases ---------------------------------------------------------------------------

    def grant(self, ttl: float) -> int:
        doc = self.call("lease/grant", {"TTL": max(1, round(ttl))})
        lease = _int(doc.get("ID"))
        if lease == 0:
            raise MetadataStoreError(f"etcd at {self.url} granted no lease: {doc}")
        return lease

    def keepalive(self, lease: int) -> int:
        """The lease's renewed TTL; 0 when etcd no longer knows it (expired)."""
        doc = self.call("lease/keepalive", {"ID": str(lease)})
        result = doc.get("result")
        return _int(result.get("TTL")) if isinstance(result, dict) else 0

    def revoke(self, lease: int) -> None:
        """Drop the lease and every key attached to it (an unknown lease is not an error)."""
        try:
            self.call("lease/revoke", {"ID": str(lease)})
        except MetadataStoreError as exc:
            if "not found" not in str(exc):
                raise

    # -- keys -----------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Store ``value``; the store's revision after the write."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        doc = self.call("kv/put", body)
        return _int(doc.get("header", {}).get("revision"))

    def get_prefix(self, prefix: bytes) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` and the revision the answer is a snapshot of."""
        doc = self.call("kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        revision = _int(doc.get("header", {}).get("revision"))
        kvs = [
            KeyValue(_unb64(kv.get("key")), _unb64(kv.get("value")),
                     _int(kv.get("mod_revision")), _int(kv.get("lease")))
            for kv in doc.get("kvs", []) if isinstance(kv, dict)
        ]  # fmt: skip
        return revision, kvs

    def probe(self) -> None:
        """A cheap read that proves etcd answers (a count of one absent key)."""
        self.call("kv/range", {"key": "AA==", "count_only": True}, kind="probe")

    def delete(self, key: bytes) -> None:
        self.call("kv/deleterange", {"key": _b64(key)})

    def watch(self, prefix: bytes, start_revision: int) -> WatchStream:
        """Events under ``prefix`` from ``start_revision`` on (see :class:`WatchStream`)."""
        self._count("watch")
        return WatchStream(self, prefix, start_revision)


class WatchStream:
    """One watch: a socket reading etcd's stream of JSON messages, one per line.

    :meth:`events` returns the next batch, ``[]`` on a quiet read timeout, and raises
    MetadataStoreError when the stream ends (etcd stopped, the connection broke, the watch
    was cancelled or compacted); the caller lists again and starts a new watch.
    """

    def __init__(self, client: EtcdClient, prefix: bytes, start_revision: int) -> None:
        self._buffer = b""
        self._body_left = 0
        self._crlf_left = 0
        self._ended = False
        self._decoded = b""
        self._closed = False
        body = json.dumps(
            {
                "create_request": {
                    "key": _b64(prefix),
                    "range_end": _b64(prefix_end(prefix)),
                    "start_revision": str(start_revision),
                }
            }
        ).encode()
        head = (
            f"POST /v3/watch HTTP/1.1\r\nHost: {client.host}:{client.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        try:
            self._sock = socket.create_connection((client.host, client.port), client.timeout)
        except OSError as exc:
            raise MetadataStoreError(f"etcd at {client.url} unreachable: {exc}") from None
        try:
            self._sock.sendall(head + body)
            self._read_headers(client.url)
            created = self._next_message(client.timeout)
        except BaseException:
            self.close()
            raise
        if created is None or not created.get("created"):
            self.close()
            raise MetadataStoreError(f"etcd at {client.url} did not create the watch")
        self.url = client.url

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()

    def events(self, timeout: float) -> list[WatchEvent]:
        message = self._next_message(timeout)
        if message is None:
            return []
        if message.get("canceled") or message.get("compact_revision"):
            raise MetadataStoreError(f"etcd watch ended: {message.get('cancel_reason', '')}")
        out: list[WatchEvent] = []
        for ev in message.get("events", []):
            kv = ev.get("kv", {}) if isinstance(ev, dict) else {}
            deleted = ev.get("type") == "DELETE"
            out.append(
                WatchEvent(
                    _unb64(kv.get("key")),
                    None if deleted else _unb64(kv.get("value")),
                    _int(kv.get("mod_revision")),
                )
            )
        return out

    # -- the HTTP framing ----------------------------------------------------------------

    def _recv(self, timeout: float) -> bytes:
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(1 << 16)
        except TimeoutError:
            raise
        except OSError as exc:
            raise MetadataStoreError(f"etcd watch broke: {exc}") from None
        if not data:
            raise MetadataStoreError("etcd closed the watch")
        return data

    def _read_headers(self, url: str) -> None:
        while b"\r\n\r\n" not in self._buffer:
            try:
                self._buffer += self._recv(5.0)
            except TimeoutError:
                raise MetadataStoreError(f"etcd at {url} did not answer the watch") from None
            if len(self._buffer) > 65536:
                raise MetadataStoreError(f"etcd at {url} sent oversized headers")
        head, _, self._buffer = self._buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        if " 200 " not in f"{lines[0]} ":
            raise MetadataStoreError(f"etcd at {url} refused the watch: {lines[0]}")
        if not any(h.lower().replace(" ", "") == "transfer-encoding:chunked" for h in lines[1:]):
            raise MetadataStoreError(f"etcd at {url} answered the watch unchunked")

    def _dechunk(self) -> None:
        """Move whole chunk bodies from the raw buffer into the decoded stream."""
        while True:
            if self._body_left == 0 and self._crlf_left == 0:
                line, sep, rest = self._buffer.partition(b"\r\n")
                if not sep:
                    return
                try:
                    size = int(line.split(b";")[0], 16)
                except ValueError:
                    raise MetadataStoreError("etcd watch: bad chunk header") from None
                if size == 0:  # the last chunk: what was decoded is still to be read
                    self._ended = True
                    self._buffer = b""
                    return
                self._buffer = rest
                self._body_left, self._crlf_left = size, 2
            take = min(self._body_left, len(self._buffer))
            self._decoded += self._buffer[:take]
            self._buffer = self._buffer[take:]
            self._body_left -= take
            if self._body_left:
                return
            take = min(self._crlf_left, len(self._buffer))
            self._buffer = self._buffer[take:]
            self._crlf_left -= take
            if self._crlf_left:
                return

    def _next_message(self, timeout: float) -> dict[str, Any] | None:
        """The next JSON message, or None when ``timeout`` passes with none complete."""
        self._dechunk()
        while b"\n" not in self._decoded:
            if self._ended:
                raise MetadataStoreError("etcd ended the watch")
            if len(self._decoded) > _MAX_LINE:
                raise MetadataStoreError("etcd watch: oversized message")
            try:
                self._buffer += self._recv(timeout)
            except TimeoutError:
                return None
            self._dechunk()
        line, _, self._decoded = self._decoded.partition(b"\n")
        try:
            doc = json.loads(line)
        except ValueError:
            raise MetadataStoreError("etcd watch: a message is not JSON") from None
        if not isinstance(doc, dict) or "error" in doc:
            raise MetadataStoreError(f"etcd watch failed: {doc}")
        result = doc.get("result")
        return result if isinstance(result, dict) else {}
