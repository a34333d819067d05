"""Every knob of :class:`~kvwire.config.KVWireConfig` and the layers that fill them.

One table (:data:`KNOBS`) names each field's parser, its ``KVWIRE_*`` variable and its
meaning; the environment, the configuration file and vLLM's ``kv_transfer_config`` are each
read into plain ``{field: value}`` dicts by one function, and every value passes through the
same parser whatever its source, so a bad value is reported the same way from anywhere.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from kvwire.config.secret import check_secret
from kvwire.errors import ConfigError
from kvwire.wire.compat import CompatFactors
from kvwire.wire.schemas import TransferMode
from kvwire.wire.versions import SUPPORTED_VERSIONS

ENV_PREFIX = "KVWIRE_"
CONFIG_FILE_VAR = "KVWIRE_CONFIG"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MAX_SECONDS = 7 * 24 * 3600.0
"""Longest duration any knob takes (a week): a bigger value is a typo, not a setting."""


_log = logging.getLogger("kvwire.config")


# -- parsers: raw value -> typed value, ValueError with a short reason ----------------------


def _text(raw: Any) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError("expected a non-empty string")
    return raw.strip()


def _optional_text(raw: Any) -> str | None:
    return None if raw is None else _text(raw)


def _engine_id(raw: Any) -> str:
    if raw == "":
        return ""
    value = _text(raw)
    if "," in value:
        raise ValueError("expected an engine id without ','")
    return value


def _mode(raw: Any) -> TransferMode:
    value = str(raw.value if isinstance(raw, TransferMode) else raw).strip().lower()
    if value not in ("pull", "push"):
        raise ValueError("expected 'pull' or 'push'")
    return TransferMode(value)


def _int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError("expected an integer")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    if isinstance(raw, str):
        try:
            return int(raw.strip(), 10)
        except ValueError:
            pass
    raise ValueError("expected an integer")


def _count(raw: Any) -> int:
    value = _int(raw)
    if not 0 <= value <= 1000:
        raise ValueError("expected an integer from 0 to 1000")
    return value


def _size(raw: Any) -> int:
    value = _int(raw)
    if not 1 <= value <= 1024:
        raise ValueError("expected an integer from 1 to 1024")
    return value


def _capacity(raw: Any) -> int:
    value = _int(raw)
    if not 1 <= value <= 100_000_000:
        raise ValueError("expected an integer from 1 to 100000000")
    return value


def _metrics_port(raw: Any) -> int | None:
    if raw is None:
        return None
    value = _int(raw)
    if not 1 <= value <= 65535:
        raise ValueError("expected a port from 1 to 65535")
    return value


def _rank(raw: Any) -> int:
    value = _int(raw)
    if not 0 <= value < 1024:
        raise ValueError("expected an integer from 0 to 1023")
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


def _seconds(raw: Any) -> float:
    value = _seconds_or_zero(raw)
    if value == 0:
        raise ValueError("expected a positive number of seconds")
    return value


def _seconds_or_zero(raw: Any) -> float:
    if isinstance(raw, bool):
        raise ValueError("expected a number of seconds")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError("expected a number of seconds") from None
    if not math.isfinite(value):
        raise ValueError("expected a finite number of seconds")
    if value < 0:
        raise ValueError("expected a number of seconds >= 0")
    if value > MAX_SECONDS:
        raise ValueError(f"expected at most {MAX_SECONDS:g} s")
    return value


def _optional_seconds(raw: Any) -> float | None:
    return None if raw is None else _seconds(raw)


def _optional_seconds_or_zero(raw: Any) -> float | None:
    return None if raw is None else _seconds_or_zero(raw)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
        return raw.strip().lower() in _TRUE
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


def _log_level(raw: Any) -> str:
    value = str(raw).strip().upper()
    if value not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}")
    return value


def _compat(raw: Any) -> CompatFactors | None:
    if raw is None or isinstance(raw, CompatFactors):
        return raw
    if isinstance(raw, Mapping):
        return CompatFactors.from_dict(raw)
    raise ValueError("expected CompatFactors")


def _secret(raw: Any) -> bytes | None:
    if raw is None:
        return None
    if not isinstance(raw, bytes):
        raise ValueError("expected bytes")
    check_secret(raw, "secret")
    return raw


STORE_SCHEMES = ("etcd",)


def _metadata_store(raw: Any) -> str | None:
    """``etcd://host:port`` (port 2379 when left out), kept as that normalized text."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    text = _text(raw)
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in STORE_SCHEMES:
        raise ValueError("expected etcd://host:port")
    host, colon, port_text = rest.rstrip("/").rpartition(":")
    if not colon:
        host, port_text = rest.rstrip("/"), "2379"
    host = host.strip("[]")
    if not host or "/" in host or "@" in host:
        raise ValueError("expected etcd://host:port")
    try:
        port = int(port_text, 10)
    except ValueError:
        raise ValueError("expected etcd://host:port with a numeric port") from None
    if not 1 <= port <= 65535:
        raise ValueError("expected a port from 1 to 65535")
    return f"etcd://[{host}]:{port}" if ":" in host else f"etcd://{host}:{port}"


def _store_ttl(raw: Any) -> float:
    value = _seconds(raw)
    if not 2.0 <= value <= 3600.0:
        raise ValueError("expected a lease TTL from 2 to 3600 s")
    return value


def _transport(raw: Any) -> Any:
    """A transport name, or an already created transport object (kept as given)."""
    if isinstance(raw, str):
        return _text(raw)
    if raw is None:
        raise ValueError("expected a transport name")
    return raw


Parser = Callable[[Any], Any]


@dataclass(frozen=True)
class Knob:
    """One configuration field: how a raw value is parsed and which variable sets it."""

    parse: Parser
    env: str | None
    help: str


KNOBS: dict[str, Knob] = {
    "engine_id": Knob(_engine_id, "KVWIRE_ENGINE_ID", "this engine's id (no ',')"),
    "mode": Knob(_mode, "KVWIRE_MODE", "pull (D READs) or push (P WRITEs)"),
    "version": Knob(_version, "KVWIRE_PROTOCOL_VERSION", "13 (vLLM 0.31), 14 (0.32), 15 (0.33)"),
    "transport": Knob(_transport, "KVWIRE_TRANSPORT", "shm, nixl, ucx or module:factory"),
    "transport_options": Knob(
        _json_object, "KVWIRE_TRANSPORT_OPTIONS", "the transport factory's options"
    ),
    "side_channel_host": Knob(
        _text, "KVWIRE_SIDE_CHANNEL_HOST", "where this engine's handshake listener binds"
    ),
    "side_channel_port": Knob(
        _port, "KVWIRE_SIDE_CHANNEL_PORT", "its port (0: the runtime starts a listener)"
    ),
    "advertise_host": Knob(
        _optional_text, "KVWIRE_ADVERTISE_HOST", "the address peers dial (default: derived)"
    ),
    "enforce_compat": Knob(_bool, "KVWIRE_ENFORCE_COMPAT", "refuse peers whose hash differs"),
    "compat": Knob(_compat, None, "the compatibility factors"),
    "compat_hash": Knob(_optional_text, "KVWIRE_COMPAT_HASH", "use this hash, not the factors'"),
    "secret_file": Knob(_optional_text, "KVWIRE_SECRET_FILE", "file of the handshake secret"),
    "secret": Knob(_secret, None, "the handshake secret itself"),
    "metadata_store": Knob(
        _metadata_store, "KVWIRE_METADATA_STORE", "etcd://host:port: publish and watch metadata"
    ),
    "metadata_store_ttl_s": Knob(
        _store_ttl, "KVWIRE_METADATA_STORE_TTL_S", "etcd lease of a published rank (2..3600 s)"
    ),
    "lease_s": Knob(_seconds, "KVWIRE_LEASE_S", "how long P holds blocks D has not read"),
    "heartbeat_interval_s": Knob(
        _optional_seconds, "KVWIRE_HEARTBEAT_INTERVAL_S", "D's lease heartbeat (lease / 6)"
    ),
    "registration_timeout_s": Knob(
        _seconds, "KVWIRE_REGISTRATION_TIMEOUT_S", "push: how long writes may take"
    ),
    "engine_idle_ttl_s": Knob(
        _seconds, "KVWIRE_ENGINE_IDLE_TTL_S", "forget a peer engine unused this long"
    ),
    "expiry_margin_s": Knob(
        _optional_seconds_or_zero, "KVWIRE_EXPIRY_MARGIN_S", "no READ this close to P's lease end"
    ),
    "completion_margin_s": Knob(
        _optional_seconds_or_zero, "KVWIRE_COMPLETION_MARGIN_S", "a READ done this late fails"
    ),
    "lease_grace_s": Knob(
        _optional_seconds_or_zero,
        "KVWIRE_LEASE_GRACE_S",
        "P quarantines expired blocks this long (0: frees at expiry)",
    ),
    "transfer_timeout_s": Knob(
        _optional_seconds, "KVWIRE_TRANSFER_TIMEOUT_S", "longest a READ/WRITE may run"
    ),
    "handshake_timeout_s": Knob(_seconds, "KVWIRE_HANDSHAKE_TIMEOUT_S", "per handshake attempt"),
    "handshake_retries": Knob(_count, "KVWIRE_HANDSHAKE_RETRIES", "retries of a silent peer"),
    "handshake_backoff_s": Knob(
        _seconds_or_zero, "KVWIRE_HANDSHAKE_BACKOFF_S", "first retry delay (doubles)"
    ),
    "poll_interval_s": Knob(_seconds, "KVWIRE_POLL_INTERVAL_S", "longest idle sleep"),
    "coalesce": Knob(_bool, "KVWIRE_COALESCE", "merge adjacent blocks into one descriptor"),
    "stream_layers": Knob(
        _bool, "KVWIRE_STREAM_LAYERS", "push: write each layer while the prompt is computed"
    ),
    "check_invariants": Knob(_bool, "KVWIRE_CHECK_INVARIANTS", "the machines' self-checks"),
    "max_parked_completions": Knob(
        _capacity, "KVWIRE_MAX_PARKED_COMPLETIONS", "push: early write notifications held"
    ),
    "release_retry_s": Knob(
        _seconds, "KVWIRE_RELEASE_RETRY_S", "retry a failed handle release after this"
    ),
    "metrics_port": Knob(
        _metrics_port, "KVWIRE_METRICS_PORT", "serve /metrics on this port + the TP rank"
    ),
    "bound_reads_by_lease": Knob(_bool, None, "end every READ before P's lease (keep on)"),
    "agent_name": Knob(_optional_text, None, "the transport agent's name"),
    "log_level": Knob(_log_level, "KVWIRE_LOG_LEVEL", "DEBUG, INFO, WARNING or ERROR"),
    "tp_rank": Knob(_rank, None, "this rank's tensor-parallel index"),
    "tp_size": Knob(_size, None, "tensor-parallel size"),
    "pp_rank": Knob(_rank, None, "this rank's pipeline stage"),
    "pp_size": Knob(_size, None, "pipeline-parallel size"),
}
"""Every field of :class:`KVWireConfig`: parser, environment variable (None: the engine
knows it, or it is an object), one-line meaning."""

ENV_VARS: dict[str, str] = {k.env: name for name, k in KNOBS.items() if k.env is not None}
"""``KVWIRE_*`` variable -> field."""

_NOT_KNOBS = frozenset({CONFIG_FILE_VAR})

VLLM_CONNECTORS: dict[str, str] = {"NixlConnector": "pull", "NixlPushConnector": "push"}
"""vLLM's ``kv_connector`` names kvwire stands in for, and the mode each means."""

KVWIRE_CONNECTOR = "KVWireConnector"
"""The ``kv_connector`` name of kvwire's own vLLM connector (``kvwire.integrations.vllm``):
its mode and transport come from ``kv_connector_extra_config`` (default pull over nixl, the
stock connector's), not from the name."""


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


VLLM_EXTRA_CONFIG_KEYS: dict[str, tuple[str, Parser]] = {
    "kv_lease_duration": ("lease_s", _seconds),
    "enforce_handshake_compat": ("enforce_compat", _bool),
    "engine_ttl": ("engine_idle_ttl_s", _seconds),
    "push_registration_timeout": ("registration_timeout_s", _seconds),
    "decoder_kv_blocks_ttl": ("registration_timeout_s", _seconds),
    "backends": ("transport_options", _nixl_backend),
    "num_threads": ("transport_options", _nixl_threads),
    "transport": ("transport", _transport),
    "transfer_mode": ("mode", _mode),
    "transport_options": ("transport_options", _json_object),
    "secret_file": ("secret_file", _optional_text),
    "coalesce": ("coalesce", _bool),
    "stream_layers": ("stream_layers", _bool),
    "handshake_timeout": ("handshake_timeout_s", _seconds),
    "metrics_port": ("metrics_port", _metrics_port),
    "metadata_store": ("metadata_store", _metadata_store),
    "metadata_store_ttl": ("metadata_store_ttl_s", _store_ttl),
}
"""vLLM ``kv_connector_extra_config`` key -> (field, parser).

``decoder_kv_blocks_ttl`` counts only as vLLM uses it for push: the registration timeout
when ``push_registration_timeout`` is absent. ``backends`` and ``num_threads`` become
options of the ``nixl`` transport. The keys from ``transport`` on are kvwire's own (vLLM's
connectors ignore them), read by :data:`KVWIRE_CONNECTOR` deployments."""

VLLM_EXTRA_CONFIG_IGNORED = frozenset({"bidirectional_kv_xfer", "kv_recompute_threshold"})
"""Extra-config keys vLLM knows that are no :class:`KVWireConfig` field (not warned): they
mean something only inside vLLM's scheduler, where ``kvwire.integrations.vllm`` reads them."""

VLLM_TRANSFER_CONFIG_IGNORED = frozenset(
    {
        "kv_role",
        "kv_rank",
        "kv_parallel_size",
        "kv_ip",
        "kv_port",
        "kv_buffer_device",
        "kv_buffer_size",
        "kv_connector_module_path",
        "kv_load_failure_policy",
        "enable_permute_local_kv",
    }
)
"""``kv_transfer_config`` fields vLLM knows that mean nothing to kvwire."""


def suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def parsed(source: str, raw: Any, parse: Parser) -> Any:
    try:
        return parse(raw)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}={raw!r}: {exc}") from None


# -- the layers -------------------------------------------------------------------------------


def env_layer(environ: Mapping[str, str]) -> dict[str, Any]:
    """The fields ``KVWIRE_*`` variables set (empty means unset); unknown names warned."""
    values: dict[str, Any] = {}
    for var, raw in environ.items():
        if not var.startswith(ENV_PREFIX):
            continue
        name = ENV_VARS.get(var)
        if name is None:
            if var not in _NOT_KNOBS:
                _log.warning(
                    "ignoring unknown environment variable %s%s", var, suggest(var, list(ENV_VARS))
                )
            continue
        if raw.strip():
            values[name] = parsed(var, raw, KNOBS[name].parse)
    return values


def file_layer(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The fields a TOML (``.toml``) or JSON file sets; keys are field names."""
    text_path = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {text_path}: {exc.strerror or exc}") from None
    try:
        if text_path.endswith(".toml"):
            doc: Any = tomllib.loads(data.decode())
        else:
            doc = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"config file {text_path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {text_path}: expected a table/object of settings")
    values: dict[str, Any] = {}
    for key, raw in doc.items():
        if key == "kv_transfer_config":
            continue
        knob = KNOBS.get(key)
        if knob is None or knob.env is None:  # ranks and objects come from the engine
            hint = suggest(key, [k for k, v in KNOBS.items() if v.env is not None])
            raise ConfigError(f"config file {text_path}: unknown setting {key!r}{hint}")
        values[key] = parsed(f"{text_path}: {key}", raw, knob.parse)
    if "kv_transfer_config" in doc:
        values.update(vllm_layer(doc["kv_transfer_config"]))
    return values


def vllm_layer(config: Mapping[str, Any] | str) -> dict[str, Any]:
    """The fields vLLM's whole ``kv_transfer_config`` sets (a dict, or its JSON text).

    ``kv_connector`` gives the mode (``NixlPushConnector``: push) and the ``nixl``
    transport; ``engine_id`` the engine id; ``kv_connector_extra_config`` the knobs of
    :data:`VLLM_EXTRA_CONFIG_KEYS`. Unknown keys are warned about with a suggestion.
    """
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError as exc:
            raise ConfigError(f"kv_transfer_config is not JSON: {exc}") from None
    if not isinstance(config, Mapping):
        raise ConfigError(f"kv_transfer_config must be a mapping, got {config!r}")
    values: dict[str, Any] = {}
    known = ["kv_connector", "engine_id", "kv_connector_extra_config"]
    for key in config:
        if key not in known and key not in VLLM_TRANSFER_CONFIG_IGNORED:
            hint = suggest(key, known + sorted(VLLM_TRANSFER_CONFIG_IGNORED))
            _log.warning("ignoring unknown kv_transfer_config key %r%s", key, hint)
    connector = config.get("kv_connector")
    if connector == KVWIRE_CONNECTOR:
        values["transport"] = "nixl"
    elif connector is not None:
        if connector not in VLLM_CONNECTORS:
            raise ConfigError(
                f"kv_transfer_config['kv_connector']={connector!r}: kvwire stands in for "
                f"{' or '.join(VLLM_CONNECTORS)}"
            )
        values["mode"] = VLLM_CONNECTORS[connector]
        values["transport"] = "nixl"
    if config.get("engine_id") is not None:
        values["engine_id"] = parsed(
            "kv_transfer_config['engine_id']", config["engine_id"], _engine_id
        )
    extra = config.get("kv_connector_extra_config") or {}
    if not isinstance(extra, Mapping):
        raise ConfigError(f"kv_connector_extra_config must be a mapping, got {extra!r}")
    options: dict[str, Any] = {}
    for key, raw in extra.items():
        entry = VLLM_EXTRA_CONFIG_KEYS.get(key)
        if entry is None:
            if key not in VLLM_EXTRA_CONFIG_IGNORED:
                hint = suggest(
                    key, sorted(VLLM_EXTRA_CONFIG_KEYS) + sorted(VLLM_EXTRA_CONFIG_IGNORED)
                )
                _log.warning("ignoring unknown kv_connector_extra_config key %r%s", key, hint)
            continue
        if raw is None:
            continue
        name, parse = entry
        value = parsed(f"kv_connector_extra_config[{key!r}]", raw, parse)
        if name == "transport_options":
            options.update(value)
        elif key == "decoder_kv_blocks_ttl" and "push_registration_timeout" in extra:
            continue  # push_registration_timeout wins, as in vLLM
        else:
            values[name] = value
    if options:
        values["transport_options"] = options
    return values
