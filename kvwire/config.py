"""Deployment configuration: one typed object, environment overrides, vLLM's extra config.

A serving engine already has its own configuration system, and an operator already has a
habit: ``KVWIRE_*`` environment variables. :class:`KVWireConfig` is the meeting point. It is
flat (one field per knob, so every knob has exactly one environment variable), it is built
in layers — defaults, then the engine's values, then vLLM's ``kv_connector_extra_config``,
then the environment — and it turns into the per-rank
:class:`~kvwire.runtime.RuntimeConfig` plus the transport name and options the runtime
takes. Every bad value is a :class:`~kvwire.errors.ConfigError` naming where it came from
(``KVWIRE_LEASE_S='soon': ...``), because "invalid float" without the variable's name costs
an operator an hour.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvwire.errors import ConfigError
from kvwire.runtime.config import RuntimeConfig
from kvwire.sidechannel import RetryPolicy, load_secret
from kvwire.wire.versions import SUPPORTED_VERSIONS

__all__ = [
    "ENV_PREFIX",
    "ENV_VARS",
    "VLLM_EXTRA_CONFIG_KEYS",
    "KVWireConfig",
]

ENV_PREFIX = "KVWIRE_"

_log = logging.getLogger("kvwire.config")


@dataclass(frozen=True)
class KVWireConfig:
    """Every knob of one rank's transfer runtime, with the transport it runs on.

    Rank facts (``tp_rank``, ``tp_size``, ``pp_rank``, ``pp_size``) and the compatibility
    factors come from the engine, not from the environment; pass them as keyword arguments
    to :meth:`from_env` / :meth:`load` or to :meth:`runtime_config`.
    """

    engine_id: str = ""
    mode: Literal["pull", "push"] = "pull"
    version: int = 13
    """Protocol version: 13 (vLLM 0.31), 14 (0.32) or 15 (0.33)."""
    transport: str = "nixl"
    """``shm``, ``nixl``, ``ucx`` or ``module:factory``."""
    transport_options: Mapping[str, Any] = field(default_factory=dict)
    nixl_options: Mapping[str, Any] = field(default_factory=dict)
    """Options for the ``nixl`` transport only (vLLM's ``backends``, ``num_threads``);
    :meth:`transport_kwargs` merges them in when ``transport == "nixl"``."""
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    enforce_compat: bool = True
    compat_hash: str | None = None
    secret_file: str | None = None
    """A file holding the shared secret of the authenticated handshake; read (and checked:
    not world-readable) by :meth:`runtime_config`. The secret itself never sits in the
    environment or in this object."""
    lease_s: float = 30.0
    heartbeat_interval_s: float | None = None
    registration_timeout_s: float = 30.0
    engine_idle_ttl_s: float = 3600.0
    handshake_timeout_s: float = 5.0
    """Per attempt; the whole handshake may take ``(retries + 1)`` times this plus backoff."""
    handshake_retries: int = 2
    handshake_backoff_s: float = 0.1
    poll_interval_s: float = 0.02
    coalesce: bool = True
    check_invariants: bool = True
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    # -- building ------------------------------------------------------------------

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **fields: Any) -> KVWireConfig:
        """``fields`` (the engine's values) overridden by ``KVWIRE_*`` variables."""
        return cls._build(fields).with_env(os.environ if environ is None else environ)

    @classmethod
    def from_vllm_extra_config(cls, extra: Mapping[str, Any], **fields: Any) -> KVWireConfig:
        """``fields`` overridden by the keys of vLLM's ``kv_connector_extra_config`` that
        mean the same thing in kvwire (see :data:`VLLM_EXTRA_CONFIG_KEYS`)."""
        return cls._build(fields).with_vllm_extra_config(extra)

    @classmethod
    def load(
        cls,
        *,
        extra_config: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        **fields: Any,
    ) -> KVWireConfig:
        """All layers in order: ``fields``, then vLLM's extra config, then the environment
        (``os.environ`` unless given), so an operator's variable always wins."""
        config = cls._build(fields)
        if extra_config is not None:
            config = config.with_vllm_extra_config(extra_config)
        return config.with_env(os.environ if environ is None else environ)

    @classmethod
    def _build(cls, fields: Mapping[str, Any]) -> KVWireConfig:
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"unknown configuration field(s) {unknown}")
        return cls(**fields)

    def with_env(self, environ: Mapping[str, str]) -> KVWireConfig:
        """A copy with every ``KVWIRE_*`` variable of :data:`ENV_VARS` applied."""
        changes: dict[str, Any] = {}
        for var, (name, parse) in ENV_VARS.items():
            raw = environ.get(var)
            if raw is None or raw.strip() == "":
                continue
            changes[name] = _parsed(var, raw.strip(), parse)
        _warn_unknown(environ)
        return dataclasses.replace(self, **changes)

    def with_vllm_extra_config(self, extra: Mapping[str, Any]) -> KVWireConfig:
        """A copy with the meaningful keys of vLLM's ``kv_connector_extra_config`` applied;
        keys without a kvwire meaning are left for vLLM."""
        if not isinstance(extra, Mapping):
            raise ConfigError(f"kv_connector_extra_config must be a mapping, got {extra!r}")
        changes: dict[str, Any] = {}
        for key, (name, parse) in VLLM_EXTRA_CONFIG_KEYS.items():
            if key in extra and extra[key] is not None:
                value = _parsed(f"kv_connector_extra_config[{key!r}]", extra[key], parse)
                if name == "nixl_options":
                    options = dict(changes.get(name, self.nixl_options))
                    options.update(value)
                    value = options
                if name in changes and key == "decoder_kv_blocks_ttl":
                    continue  # push_registration_timeout wins, as in vLLM
                changes[name] = value
        return dataclasses.replace(self, **changes)

    # -- using -----------------------------------------------------------------------

    def runtime_config(self, **overrides: Any) -> RuntimeConfig:
        """The :class:`~kvwire.runtime.RuntimeConfig` of this rank.

        ``overrides`` are RuntimeConfig fields with no place here (``compat``,
        ``agent_name``, ...) or values to force.
        """
        if not self.engine_id:
            raise ConfigError("engine_id is not set (pass engine_id=... or set KVWIRE_ENGINE_ID)")
        values: dict[str, Any] = {
            "engine_id": self.engine_id,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "pp_rank": self.pp_rank,
            "pp_size": self.pp_size,
            "mode": self.mode,
            "side_channel_host": self.side_channel_host,
            "side_channel_port": self.side_channel_port,
            "compat_hash": self.compat_hash,
            "enforce_compat": self.enforce_compat,
            "version": self.version,
            "lease_s": self.lease_s,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "registration_timeout_s": self.registration_timeout_s,
            "engine_idle_ttl_s": self.engine_idle_ttl_s,
            "handshake": RetryPolicy(
                timeout=self.handshake_timeout_s,
                retries=self.handshake_retries,
                backoff=self.handshake_backoff_s,
            ),
            "coalesce": self.coalesce,
            "poll_interval_s": self.poll_interval_s,
            "check_invariants": self.check_invariants,
        }
        if self.secret_file is not None:
            values["secret"] = load_secret(self.secret_file)
        values.update(overrides)
        return RuntimeConfig(**values)

    def transport_kwargs(self) -> dict[str, Any]:
        """The options to create :attr:`transport` with (``Producer(..., transport_options=)``)."""
        options = dict(self.nixl_options) if self.transport == "nixl" else {}
        options.update(self.transport_options)
        return options

    def as_env(self) -> dict[str, str]:
        """This configuration as ``KVWIRE_*`` variables (to hand to a worker process).

        ``nixl_options`` travel merged into ``KVWIRE_TRANSPORT_OPTIONS`` (see
        :meth:`transport_kwargs`); rank fields have no variable and are left out.
        """
        out: dict[str, str] = {}
        for var, (name, _) in ENV_VARS.items():
            value = self.transport_kwargs() if name == "transport_options" else getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool):
                out[var] = "1" if value else "0"
            elif isinstance(value, Mapping):
                out[var] = json.dumps(dict(value), sort_keys=True)
            else:
                out[var] = str(value)
        return out


# -- parsers: raw value -> typed value, ValueError with a short reason ----------------------


def _text(raw: Any) -> str:
    if not isinstance(raw, str) or not raw:
        raise ValueError("expected a non-empty string")
    return raw


def _engine_id(raw: Any) -> str:
    value = _text(raw)
    if "," in value:
        raise ValueError("expected an engine id without ','")
    return value


def _mode(raw: Any) -> str:
    value = str(raw).lower()
    if value not in ("pull", "push"):
        raise ValueError("expected 'pull' or 'push'")
    return value


def _int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError("expected an integer")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    if isinstance(raw, str):
        try:
            return int(raw, 10)
        except ValueError:
            pass
    raise ValueError("expected an integer")


def _count(raw: Any) -> int:
    value = _int(raw)
    if value < 0:
        raise ValueError("expected an integer >= 0")
    return value


def _port(raw: Any) -> int:
    value = _int(raw)
    if not 0 <= value < 65536:
        raise ValueError("expected a port number 0..65535")
    return value


def _version(raw: Any) -> int:
    value = _int(raw)
    if value not in SUPPORTED_VERSIONS:
        raise ValueError(f"expected one of {', '.join(map(str, SUPPORTED_VERSIONS))}")
    return value


def _number(raw: Any) -> float:
    if isinstance(raw, bool):
        raise ValueError("expected a number")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError("expected a number of seconds") from None
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
    return value


def _seconds(raw: Any) -> float:
    value = _number(raw)
    if value <= 0:
        raise ValueError("expected a positive number of seconds")
    return value


def _seconds_or_zero(raw: Any) -> float:
    value = _number(raw)
    if value < 0:
        raise ValueError("expected a number of seconds >= 0")
    return value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.lower() in _TRUE + _FALSE:
        return raw.lower() in _TRUE
    if isinstance(raw, int) and raw in (0, 1):
        return bool(raw)
    raise ValueError(f"expected a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)})")


def _json_object(raw: Any) -> dict[str, Any]:
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        raise ValueError("expected a JSON object") from None
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def _nixl_backend(raw: Any) -> dict[str, Any]:
    """vLLM's ``backends`` list (NIXL plugin names) -> the nixl transport's ``backend``."""
    names = [raw] if isinstance(raw, str) else raw
    if (
        not isinstance(names, (list, tuple))
        or len(names) != 1
        or not isinstance(names[0], str)
        or not names[0]
    ):
        raise ValueError("kvwire's nixl transport runs exactly one backend, e.g. ['UCX']")
    return {"backend": names[0]}


def _nixl_threads(raw: Any) -> dict[str, Any]:
    return {"num_threads": _count(raw)}


def _parsed(source: str, raw: Any, parse: Callable[[Any], Any]) -> Any:
    try:
        return parse(raw)
    except ValueError as exc:
        raise ConfigError(f"{source}={raw!r}: {exc}") from None


Parser = Callable[[Any], Any]

ENV_VARS: dict[str, tuple[str, Parser]] = {
    "KVWIRE_ENGINE_ID": ("engine_id", _engine_id),
    "KVWIRE_MODE": ("mode", _mode),
    "KVWIRE_PROTOCOL_VERSION": ("version", _version),
    "KVWIRE_TRANSPORT": ("transport", _text),
    "KVWIRE_TRANSPORT_OPTIONS": ("transport_options", _json_object),
    "KVWIRE_SIDE_CHANNEL_HOST": ("side_channel_host", _text),
    "KVWIRE_SIDE_CHANNEL_PORT": ("side_channel_port", _port),
    "KVWIRE_ENFORCE_COMPAT": ("enforce_compat", _bool),
    "KVWIRE_COMPAT_HASH": ("compat_hash", _text),
    "KVWIRE_SECRET_FILE": ("secret_file", _text),
    "KVWIRE_LEASE_S": ("lease_s", _seconds),
    "KVWIRE_HEARTBEAT_INTERVAL_S": ("heartbeat_interval_s", _seconds),
    "KVWIRE_REGISTRATION_TIMEOUT_S": ("registration_timeout_s", _seconds),
    "KVWIRE_ENGINE_IDLE_TTL_S": ("engine_idle_ttl_s", _seconds),
    "KVWIRE_HANDSHAKE_TIMEOUT_S": ("handshake_timeout_s", _seconds),
    "KVWIRE_HANDSHAKE_RETRIES": ("handshake_retries", _count),
    "KVWIRE_HANDSHAKE_BACKOFF_S": ("handshake_backoff_s", _seconds_or_zero),
    "KVWIRE_POLL_INTERVAL_S": ("poll_interval_s", _seconds),
    "KVWIRE_COALESCE": ("coalesce", _bool),
    "KVWIRE_CHECK_INVARIANTS": ("check_invariants", _bool),
}
"""Environment variable -> (:class:`KVWireConfig` field, parser)."""

VLLM_EXTRA_CONFIG_KEYS: dict[str, tuple[str, Parser]] = {
    "kv_lease_duration": ("lease_s", _seconds),
    "enforce_handshake_compat": ("enforce_compat", _bool),
    "engine_ttl": ("engine_idle_ttl_s", _seconds),
    "push_registration_timeout": ("registration_timeout_s", _seconds),
    "decoder_kv_blocks_ttl": ("registration_timeout_s", _seconds),
    "backends": ("nixl_options", _nixl_backend),
    "num_threads": ("nixl_options", _nixl_threads),
}
"""vLLM ``kv_connector_extra_config`` key -> (:class:`KVWireConfig` field, parser).

``decoder_kv_blocks_ttl`` counts only as vLLM uses it for push: the registration timeout
when ``push_registration_timeout`` is absent. ``backends`` and ``num_threads`` become
options of the ``nixl`` transport. Keys with no kvwire meaning (``bidirectional_kv_xfer``,
``kv_recompute_threshold``) are left to vLLM."""

_NOT_CONFIG = frozenset({"KVWIRE_DEMO_LOG"})
"""``KVWIRE_*`` variables read elsewhere (not knobs of this object)."""


def _warn_unknown(environ: Mapping[str, str]) -> None:
    """A mistyped variable does nothing silently otherwise: say so, with a suggestion."""
    for var in environ:
        if var.startswith(ENV_PREFIX) and var not in ENV_VARS and var not in _NOT_CONFIG:
            close = difflib.get_close_matches(var, list(ENV_VARS), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            _log.warning("ignoring unknown environment variable %s%s", var, hint)
