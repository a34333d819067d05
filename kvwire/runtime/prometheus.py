"""Prometheus export of a rank's counters, two ways, neither a dependency of kvwire.

``register(metrics)`` adds a collector to a ``prometheus_client`` registry (the default one
unless given), so a serving engine that already exposes ``/metrics`` gets kvwire's counters
with no extra endpoint. :func:`serve` is for an engine that exposes nothing kvwire can join
(a vLLM worker process): a small standard-library HTTP server answering ``GET /metrics``
with :meth:`Metrics.prometheus_text`, started by the runtime when ``metrics_port`` is set.
"""

from __future__ import annotations

import http.server
import importlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from kvwire.errors import ConfigError
from kvwire.runtime.metrics import Metrics, prometheus_text


def register(metrics: Metrics, registry: Any = None, *, prefix: str = "kvwire") -> Any:
    """Register a collector for ``metrics``; returns it (pass to ``registry.unregister``)."""
    try:
        # Imported by name so kvwire type-checks and installs without the package.
        client = importlib.import_module("prometheus_client")
        core = importlib.import_module("prometheus_client.core")
    except ImportError:
        raise ConfigError(
            "prometheus_client is not installed; use Metrics.prometheus_text() instead"
        ) from None

    class _Collector:
        def collect(self) -> Iterator[Any]:
            for name, _kind, help_text, samples in metrics.prometheus_families(prefix):
                labels = sorted({k for _, lab, _ in samples for k in lab})
                family = core.CounterMetricFamily(name, help_text, labels=labels)
                for _suffix, lab, value in samples:
                    family.add_metric([lab.get(k, "") for k in labels], float(value))
                yield family

    collector = _Collector()
    (registry if registry is not None else client.REGISTRY).register(collector)
    return collector


class MetricsServer:
    """``GET /metrics`` on ``host:port`` from a daemon thread; :meth:`close` stops it."""

    def __init__(
        self, metrics: Metrics | Sequence[Metrics], host: str, port: int, *, prefix: str = "kvwire"
    ) -> None:
        served = [metrics] if isinstance(metrics, Metrics) else list(metrics)

        class _Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404)
                    return
                body = prometheus_text(served, prefix).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return  # scrapes are not worth a log line each

        try:
            self._server = http.server.ThreadingHTTPServer((host, port), _Handler)
        except OSError as exc:
            raise ConfigError(
                f"metrics_port: cannot serve /metrics on {host}:{port}: {exc.strerror or exc}"
            ) from None
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvwire-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def serve(
    metrics: Metrics | Sequence[Metrics], host: str, port: int, *, prefix: str = "kvwire"
) -> MetricsServer:
    """Serve ``metrics`` (one runtime's, or several runtimes' of one rank) for Prometheus
    at ``http://host:port/metrics``."""
    return MetricsServer(metrics, host, port, prefix=prefix)
