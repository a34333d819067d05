"""What :class:`~kvwire.runtime.Producer` and :class:`~kvwire.runtime.Consumer` share.

Both are a :class:`~kvwire.runtime.driver.Driver` (machine, transport, side channel and
threads) behind the engine's calls, plus a buffer of ended requests the driver's threads
fill and the engine drains. The two sides differ only in what that buffer holds and how an
outcome lands in it, which each names with :meth:`_Endpoint._empty_finished` and
:meth:`_Endpoint._on_outcome`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from kvwire.geometry import KVGeometry
from kvwire.runtime.config import RuntimeConfig
from kvwire.runtime.driver import Driver, Outcome
from kvwire.runtime.metrics import Metrics
from kvwire.transport import Region, Transport

FinishedT = TypeVar("FinishedT")
EndpointT = TypeVar("EndpointT", bound="_Endpoint[Any]")


class _Endpoint(Generic[FinishedT]):
    """One rank's runtime of either side; ``_role`` picks the machine the driver runs."""

    _role = ""

    def __init__(
        self,
        config: RuntimeConfig,
        transport: Transport | str,
        *,
        transport_options: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self._finished = self._empty_finished()
        self._cv = threading.Condition()
        self._driver = Driver(
            self._role,
            config,
            transport,
            transport_options=transport_options,
            on_outcome=self._on_outcome,
        )

    # -- setup ---------------------------------------------------------------------

    def register_kv_caches(
        self, geometry: KVGeometry, regions: Sequence[Region] | None = None
    ) -> None:
        """Register the rank's KV cache; ``regions`` default to the spans the geometry covers."""
        self._driver.attach(geometry, regions)

    # -- engine calls --------------------------------------------------------------

    def wait_finished(self, timeout: float) -> bool:
        """Block until get_finished has something, or ``timeout`` seconds; True if it has."""
        with self._cv:
            return self._cv.wait_for(lambda: bool(self._finished), timeout)

    # -- introspection -------------------------------------------------------------

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

    def close(self) -> None:
        """Stop every thread, release transfers, deregister, close an owned transport."""
        self._driver.close()

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
