"""One yardstick for any vLLM KV connector, read from outside it (interop/bench_connector.py).

Both connectors are measured by the engine process that hosts them, with nothing asked of
the connector itself, so a figure means the same for stock's ``NixlConnector`` and for
``KVWireConnector``:

* **Time to KV** (D): from the start of the ``start_load_kv`` call whose metadata first
  names a request (the step its fetch begins, pull or push) to the end of the step whose
  ``get_finished`` reports it received (after vLLM's output aggregator, so every rank).
* **Connector CPU** (each engine): the main thread's CPU inside the connector's calls —
  every public method of vLLM's connector base class, scheduler and worker side — plus all
  the CPU the process's other threads spend (NIXL's, UCX's and kvwire's background threads;
  the harness starts none of its own). The model stand-in's work (filling and checking KV)
  runs on the main thread outside those calls, so it is not counted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

IDLE_STEP_S = 0.001
"""An engine loop's pause between steps while it only waits for KV: on 2 cores an engine
spinning without one takes a core from the other engine's compute and the transfer, which
a GPU engine's idle loop, on its own host, does not."""
METADATA_FIELDS = ("to_recv", "reqs_to_recv", "push_registrations")
"""Where each connector's per-step metadata names the requests whose KV D starts to fetch:
kvwire's, stock pull's and stock push's."""


def connector_calls() -> tuple[str, ...]:
    """The public methods of vLLM's connector base class (and the hybrid manager's
    interface): the calls an engine makes into any connector."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    names = {
        name
        for name, value in vars(KVConnectorBase_V1).items()
        if not name.startswith("_") and callable(value) and not isinstance(value, classmethod)
    }
    names.add("request_finished_all_groups")
    return tuple(sorted(names))


class ConnectorClock:
    """CPU a process's connectors spend, from a :meth:`mark` to a :meth:`read`.

    ``mark`` and ``read`` must run on the thread that makes the connector calls (the
    engine's main thread): its own CPU is what separates the connector's calls from
    everything else it does.
    """

    def __init__(self) -> None:
        self._main = threading.get_ident()
        self._inside = 0.0
        self._depth = 0
        self._process = self._thread = 0.0
        self.mark()

    def wrap(self, connector: Any) -> None:
        """Time every connector call made on this object from now on (calls the connector
        makes to itself count once, inside the outer one)."""
        for name in connector_calls():
            method = getattr(connector, name, None)
            if callable(method):
                setattr(connector, name, self._timed(method))

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth or threading.get_ident() != self._main:
                return method(*args, **kwargs)  # nested, or a background thread's (counted there)
            self._depth = 1
            began = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self._inside += time.thread_time() - began
                self._depth = 0

        return timed

    def mark(self) -> None:
        self._inside = 0.0
        self._process = time.process_time()
        self._thread = time.thread_time()

    def read(self) -> dict[str, float]:
        """Seconds since the mark: in the connector's calls, in other threads, and both."""
        others = (time.process_time() - self._process) - (time.thread_time() - self._thread)
        others = max(others, 0.0)
        return {"calls_s": self._inside, "threads_s": others, "cpu_s": self._inside + others}


class FetchClock:
    """D's time to KV per request (perf_counter seconds)."""

    def __init__(self) -> None:
        self.began: dict[str, float] = {}
        self.done: dict[str, float] = {}

    def step_began(self, meta: Any, now: float) -> None:
        for field in METADATA_FIELDS:
            for rid in getattr(meta, field, None) or ():
                self.began.setdefault(rid, now)

    def received(self, rids: Any, now: float) -> None:
        for rid in rids or ():
            self.done.setdefault(rid, now)

    def seconds(self) -> dict[str, float]:
        return {rid: self.done[rid] - t for rid, t in self.began.items() if rid in self.done}
