"""The factory's keyword options, checked once (values may arrive as JSON from a CLI)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvwire.errors import ConfigError

PROGRESS_MODES = ("thread", "inline", "nixl")
"""``thread``: a light kvwire thread progresses the agent with backoff (the default);
``inline``: progress only inside poll / wait / drain_notifications (the caller must keep
calling in on *both* sides); ``nixl``: NIXL's own progress thread, which spins a core."""

UCX_DEFAULTS = {"ucx_error_handling_mode": "none"}
"""Without it an initiator's transfer waits for an idle target to call into NIXL (seconds,
or forever); a killed peer is still detected."""


@dataclass(frozen=True)
class NixlOptions:
    backend: str = "UCX"
    backend_options: dict[str, str] = field(default_factory=dict)
    progress: str = "thread"
    progress_min_us: float = 50.0
    progress_max_us: float = 1000.0
    spin_us: float = 100.0
    telemetry: bool = False
    num_threads: int = 0
    """vLLM's ``num_threads``, accepted and checked so a vLLM config loads, but not passed
    on: NIXL's UCX plugin would take it as the size of its own thread pool, a different
    progress model from the one this adapter runs (see :mod:`kvwire_nixl._progress`)."""
    cache_size: int = 256

    @property
    def effective_backend_options(self) -> dict[str, str]:
        base = dict(UCX_DEFAULTS) if self.backend == "UCX" else {}
        base.update(self.backend_options)
        return base


def parse_options(options: Mapping[str, Any]) -> NixlOptions:
    """Raise ConfigError naming the option for anything unknown or of the wrong type."""
    known = set(NixlOptions.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"unknown nixl transport option(s) {unknown}; known: {sorted(known)}")
    values: dict[str, Any] = {}
    for key, raw in options.items():
        values[key] = _convert(key, raw)
    parsed = NixlOptions(**values)
    if parsed.progress not in PROGRESS_MODES:
        raise ConfigError(f"progress must be one of {PROGRESS_MODES}, got {parsed.progress!r}")
    if not 0 < parsed.progress_min_us <= parsed.progress_max_us:
        raise ConfigError("need 0 < progress_min_us <= progress_max_us")
    if parsed.spin_us < 0 or parsed.cache_size < 0 or parsed.num_threads < 0:
        raise ConfigError("spin_us, cache_size and num_threads must not be negative")
    return parsed


def _convert(key: str, raw: Any) -> Any:
    kind = NixlOptions.__dataclass_fields__[key].type
    try:
        if kind == "str":
            if not isinstance(raw, str) or not raw:
                raise TypeError
            return raw
        if kind == "bool":
            if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0"):
                return raw.lower() in ("true", "1")
            if not isinstance(raw, bool):
                raise TypeError
            return raw
        if kind == "int":
            if isinstance(raw, bool):
                raise TypeError
            return int(raw)
        if kind == "float":
            if isinstance(raw, bool):
                raise TypeError
            return float(raw)
        # backend_options: a mapping of strings, as NIXL's plugins take them
        if not isinstance(raw, Mapping):
            raise TypeError
        return {str(k): v if isinstance(v, str) else _plugin_value(v) for k, v in raw.items()}
    except (TypeError, ValueError):
        raise ConfigError(f"nixl transport option {key}={raw!r} is not a valid {kind}") from None


def _plugin_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    raise TypeError
