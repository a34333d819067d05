"""The handshake listener: a ZMQ ROUTER that serves each rank's encoded payload.

Wire-compatible with vLLM's listener (one ROUTER serves every (pp_rank, tp_rank) of an
engine, payloads encoded once, a clock reading with every answer) but built so that no
request can stop it: oversize, malformed and unknown-rank requests are answered with a
refusal (or dropped when they carry no REQ envelope to answer on) and counted, and libzmq
drops frames above ``max_request_bytes`` before they reach Python at all.

The ROUTER lives on its own thread, which is the only thread that touches it; ``close``
wakes that thread through an inproc socket and joins it, so shutdown is immediate and
leaves no socket behind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import count

import zmq

from kvwire.errors import ConfigError, HandshakeError, WireDecodeError
from kvwire.sidechannel.address import is_ipv6, tcp_endpoint
from kvwire.sidechannel.frames import decode_request, encode_clock, encode_refusal

log = logging.getLogger(__name__)

Payloads = Mapping[tuple[int, int], bytes]
_instance_ids = count()


@dataclass(frozen=True)
class ListenerStats:
    """What the listener has seen since it started."""

    served: int = 0
    refused_malformed: int = 0
    refused_unknown_rank: int = 0
    refused_oversize: int = 0
    dropped: int = 0
    """Messages with no REQ envelope (nothing to answer on)."""

    @property
    def rejected(self) -> int:
        return (
            self.refused_malformed
            + self.refused_unknown_rank
            + self.refused_oversize
            + (self.dropped)
        )


class HandshakeListener:
    """Serve pre-encoded handshake payloads on ``host:port`` (port 0 picks a free one).

    ``clock`` must be the clock of the process that stamps lease deadlines: the client
    derives its clock offset to us from it.
    """

    def __init__(
        self,
        payloads: Payloads,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_request_bytes: int = 1024,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if max_request_bytes < 64:
            raise ConfigError("max_request_bytes below 64 cannot hold a handshake request")
        self._payloads: dict[tuple[int, int], bytes] = dict(payloads)
        self._host = host
        self._requested_port = port
        self._max_request_bytes = max_request_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._counts = {
            "served": 0,
            "refused_malformed": 0,
            "refused_unknown_rank": 0,
            "refused_oversize": 0,
            "dropped": 0,
        }
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._port: int | None = None
        self._wake_endpoint = f"inproc://kvwire-listener-wake-{next(_instance_ids)}"
        self._wake: zmq.Socket[bytes] | None = None

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> HandshakeListener:
        """Bind and start serving; returns self once the socket is bound."""
        if self._thread is not None:
            raise HandshakeError("listener already started")
        self._ctx = zmq.Context()
        self._wake = self._ctx.socket(zmq.PAIR)
        self._wake.setsockopt(zmq.LINGER, 0)
        self._wake.bind(self._wake_endpoint)
        self._thread = threading.Thread(
            target=self._serve, name="kvwire-handshake-listener", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            self._thread = None
            self._teardown_context()
            raise HandshakeError(
                f"cannot listen on {self._host}:{self._requested_port}: {self._start_error}"
            ) from self._start_error
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and release the socket; safe to call twice."""
        thread, self._thread = self._thread, None
        if thread is not None and self._wake is not None:
            self._wake.send(b"stop")
            thread.join(timeout)
            if thread.is_alive():
                log.error("handshake listener thread did not stop within %.1f s", timeout)
        self._teardown_context()

    def __enter__(self) -> HandshakeListener:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- queries -------------------------------------------------------------------

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        if self._port is None:
            raise HandshakeError("listener is not started")
        return self._port

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> ListenerStats:
        with self._lock:
            return ListenerStats(**self._counts)

    def set_payloads(self, payloads: Payloads) -> None:
        """Replace the served payloads (after a re-registration); takes effect at once."""
        new = dict(payloads)
        with self._lock:
            self._payloads = new

    # -- the serving thread ------------------------------------------------------------

    def _serve(self) -> None:
        assert self._ctx is not None
        router = self._ctx.socket(zmq.ROUTER)
        try:
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, self._max_request_bytes)
            router.setsockopt(zmq.ROUTER_MANDATORY, 0)
            router.setsockopt(zmq.SNDHWM, 1000)
            router.setsockopt(zmq.SNDTIMEO, 0)
            if is_ipv6(self._host):
                router.setsockopt(zmq.IPV6, 1)
            if self._requested_port:
                router.bind(tcp_endpoint(self._host, self._requested_port))
                self._port = self._requested_port
            else:
                self._port = router.bind_to_random_port(
                    tcp_endpoint(self._host, 0).rsplit(":", 1)[0]
                )
        except zmq.ZMQError as exc:
            router.close(linger=0)
            self._start_error = exc
            self._ready.set()
            return
        wake = self._ctx.socket(zmq.PAIR)
        wake.setsockopt(zmq.LINGER, 0)
        wake.connect(self._wake_endpoint)
        self._ready.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if wake in events:
                    break
                if router in events:
                    self._drain(router)
        finally:
            router.close(linger=0)
            wake.close(linger=0)

    def _drain(self, router: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._answer(router, frames)
            except zmq.ZMQError as exc:  # a peer gone before its answer: nothing to do
                log.debug("handshake answer not sent: %s", exc)

    def _answer(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        # A REQ peer's message reaches a ROUTER as [identity, b"", body...].
        if len(frames) < 3 or frames[1] != b"":
            self._count("dropped")
            return
        identity = frames[0]
        body = frames[2:]
        size = sum(len(f) for f in body)
        if size > self._max_request_bytes:
            self._refuse(router, identity, "refused_oversize", f"request of {size} bytes")
            return
        if len(body) != 1:
            self._refuse(router, identity, "refused_malformed", f"{len(body)} frames, not 1")
            return
        try:
            key = decode_request(body[0])
        except WireDecodeError as exc:
            self._refuse(router, identity, "refused_malformed", str(exc))
            return
        with self._lock:
            payload = self._payloads.get(key)
        if payload is None:
            self._refuse(router, identity, "refused_unknown_rank", f"no rank {key} here")
            return
        router.send_multipart([identity, b"", payload, encode_clock(self._clock())])
        self._count("served")

    def _refuse(self, router: zmq.Socket[bytes], identity: bytes, kind: str, why: str) -> None:
        self._count(kind)
        log.debug("handshake request refused (%s): %s", kind, why)
        router.send_multipart([identity, b"", encode_refusal(why), encode_clock(self._clock())])

    def _count(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] += 1

    def _teardown_context(self) -> None:
        if self._wake is not None:
            self._wake.close(linger=0)
            self._wake = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
