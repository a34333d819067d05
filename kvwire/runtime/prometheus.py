"""Optional ``prometheus_client`` export; kvwire does not depend on the package.

``register(metrics)`` adds a collector to a registry (the default one unless given), so a
serving engine that already exposes ``/metrics`` gets kvwire's counters with no extra
endpoint. Without ``prometheus_client`` use :meth:`Metrics.prometheus_text` instead.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

from kvwire.errors import ConfigError
from kvwire.runtime.metrics import Metrics


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
