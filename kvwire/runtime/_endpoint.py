"""What :class:`~kvwire.runtime.Producer` and :class:`~kvwire.runtime.Consumer` share.

Both are a :class:`~kvwire.runtime.driver.Driver` (machine, transport, side channel and
threads) behind the engine's calls, plus a buffer of ended requests the driver's threads
fill and the engine drains. The two sides differ only in what that buffer holds and how an
outcome lands in it, which each names with :meth:`_Endpoint._empty_finished` and
:meth:`_Endpoint._on_outcome`.

A rank that peers dial (a producer; a push-mode consumer) must advertise a real address.
With ``side_channel_port`` set, the engine runs the listener (one for all its ranks) and the
rank advertises that port; with port 0 the rank starts a listener of its own, serving its
own handshake, and advertises the port the kernel picked. A wildcard bind host is
advertised as the host's routable address (:mod:`kvwire.sidechannel.advertise`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvwire.config import KVWireConfig
from kvwire.errors import ConfigError
from kvwire.layout.geometry import KVGeometry
from kvwire.runtime.arguments import geometry_arg
from kvwire.runtime.driver import Driver, Outcome
from kvwire.runtime.metrics import Metrics
from kvwire.runtime.prometheus import MetricsServer, serve
from kvwire.sidechannel import HandshakeListener
from kvwire.sidechannel.advertise import advertised_host, advertised_port
from kvwire.transport import Region, Transport

if TYPE_CHECKING:
    from kvwire.sidechannel.store import Directory, Publisher

FinishedT = TypeVar("FinishedT")
EndpointT = TypeVar("EndpointT", bound="_Endpoint[Any]")


class _Endpoint(Generic[FinishedT]):
    """One rank's runtime of either side; ``_role`` picks the machine the driver runs."""

    _role = ""

    def __init__(
        self,
        config: KVWireConfig,
        transport: Transport | str | None = None,
        *,
        transport_options: dict[str, Any] | None = None,
    ) -> None:
        """``transport`` and ``transport_options`` default to the config's."""
        self.config = config
        self._finished = self._empty_finished()
        self._cv = threading.Condition()
        self._listener: HandshakeListener | None = None
        self._publisher: Publisher | None = None
        self._metrics_server: MetricsServer | None = None
        self._dialled = self._role == "producer" or config.mode == "push"
        if self._dialled and config.side_channel_port == 0 and config.tp_size * config.pp_size > 1:
            raise ConfigError(
                f"side_channel_port=0 starts a listener serving only this rank, but the engine "
                f"has {config.tp_size * config.pp_size} ranks: run one HandshakeListener for "
                "all of them and pass side_channel_port=listener.port"
            )
        self._driver = Driver(
            self._role,
            config,
            config.transport if transport is None else transport,
            transport_options=(
                config.transport_kwargs() if transport_options is None else transport_options
            ),
            on_outcome=self._on_outcome,
        )
        if config.metrics_port is not None:
            try:
                self._metrics_server = serve(
                    self._driver.metrics,
                    config.side_channel_host,
                    config.metrics_port + config.tp_rank,
                )
            except BaseException:
                self._driver.close()
                raise

    # -- setup ---------------------------------------------------------------------

    def register_kv_caches(
        self, geometry: KVGeometry, regions: Sequence[Region] | None = None
    ) -> None:
        """Register the rank's KV cache; ``regions`` default to the spans the geometry covers.

        A rank peers dial starts its own handshake listener here when the config names no
        port, and serves its handshake from it."""
        geometry = geometry_arg(geometry)
        cfg = self.config
        advertise = ("", 0)
        if self._dialled:
            host = advertised_host(cfg.side_channel_host, cfg.advertise_host)
            port = cfg.side_channel_port
            if port == 0:
                self._listener = HandshakeListener(
                    {}, host=cfg.side_channel_host, port=0, secret=cfg.secret
                ).start()
                port = advertised_port(self._listener.port)
            advertise = (host, port)
        try:
            self._driver.attach(geometry, regions, advertise=advertise)
            if self._listener is not None:
                key = (cfg.pp_rank, cfg.tp_rank)
                self._listener.set_payloads({key: self._driver.handshake_payload()})
                if self._role == "producer":
                    self._listener.set_lease_source(key, self._driver.lease_deadlines)
            if self._dialled and cfg.metadata_store is not None:
                self._publish(cfg.metadata_store)
        except BaseException:
            self._close_listener()
            raise

    def _publish(self, url: str) -> None:
        """Put the payload the listener serves into the metadata store, under a lease
        renewed in the background (never blocking: etcd may be down)."""
        from kvwire.sidechannel.store import Publisher
        from kvwire.sidechannel.store_records import encode_record, rank_key

        cfg = self.config
        group = self._driver.store_group()
        if group is None:
            return
        key = rank_key(group, cfg.engine_id, cfg.pp_rank, cfg.tp_rank)
        payload = self._driver.handshake_payload()
        host, port = self._driver.advertise
        clock = self._driver.clock

        def record() -> bytes:
            return encode_record(
                key, payload, host=host, port=port, clock=clock(), wall=time.time(),
                role=self._role, secret=cfg.secret,
            )  # fmt: skip

        self._publisher = Publisher(url, key, record, ttl=cfg.metadata_store_ttl_s).start()

    @property
    def directory(self) -> Directory | None:
        """This rank's view of the metadata store (``metadata_store`` set, the side that
        starts handshakes)."""
        return self._driver.directory

    def peer_agents(self, engine_id: str) -> dict[tuple[int, int], str]:
        """The transport agents held for a peer engine, by (pp, tp); empty: none cached."""
        return self._driver.peer_agents(engine_id)

    @property
    def publisher(self) -> Publisher | None:
        """This rank's metadata-store publisher (``metadata_store`` set, a dialled rank)."""
        return self._publisher

    @property
    def side_channel(self) -> tuple[str, int]:
        """The host and port this rank advertises (after :meth:`register_kv_caches`)."""
        return self._driver.advertise

    # -- engine calls --------------------------------------------------------------

    def wait_finished(self, timeout: float) -> bool:
        """Block until get_finished has something, or ``timeout`` seconds; True if it has."""
        with self._cv:
            return self._cv.wait_for(lambda: bool(self._finished), timeout)

    # -- introspection -------------------------------------------------------------

    @property
    def metrics_port(self) -> int | None:
        """Where this rank serves ``/metrics`` (``metrics_port`` + its TP rank), or None."""
        return self._metrics_server.port if self._metrics_server is not None else None

    @property
    def metrics(self) -> Metrics:
        return self._driver.metrics

    @property
    def transport(self) -> Transport:
        return self._driver.transport

    def machine_stats(self) -> dict[str, int]:
        machine = self._driver.machine
        return machine.stats.as_dict() if machine is not None else {}

    @property
    def errors(self) -> list[str]:
        return list(self._driver.errors)

    def close(self, *, withdraw: bool = True) -> None:
        """Stop every thread, release transfers, deregister, close an owned transport and
        an owned listener. ``withdraw=False`` leaves the rank's metadata-store record to
        expire with its lease, as a crash would (for tests and ``kvwire bench fleet``)."""
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.close(withdraw=withdraw)
        self._close_listener()
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            server.close()
        self._driver.close()

    def _close_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def __enter__(self: EndpointT) -> EndpointT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------

    def _take_finished(self) -> FinishedT:
        """What ended since the last call, leaving an empty buffer in its place."""
        with self._cv:
            out, self._finished = self._finished, self._empty_finished()
        return out

    def _empty_finished(self) -> FinishedT:
        raise NotImplementedError

    def _on_outcome(self, action: Outcome) -> None:
        """Called on a driver thread for every ``RequestDone``/``RequestFailed``/``FreeBlocks``."""
        raise NotImplementedError
