"""kvwire's one configuration: a typed, frozen object filled in documented layers.

A serving engine has its own configuration system, an operator has ``KVWIRE_*`` variables
and maybe a file, and a deployment moving from vLLM has its ``kv_transfer_config``.
:class:`KVWireConfig` is where they meet, on every path: the runtime
(:class:`~kvwire.runtime.Producer`, :class:`~kvwire.runtime.Consumer`), the demo and every
``kvwire`` command build one the same way. Each knob is filled from the first of

1. an explicit argument (a constructor keyword, a command-line flag);
2. its ``KVWIRE_*`` environment variable;
3. vLLM's ``kv_transfer_config`` (``kv_transfer_config=``; the connector name gives the
   mode, ``kv_connector_extra_config`` the knobs it shares with kvwire);
4. the configuration file (``config_file=`` or ``KVWIRE_CONFIG``: TOML or JSON);
5. the default,

so ``KVWireConfig(engine_id="p0", compat=factors)`` already honours
``KVWIRE_HANDSHAKE_TIMEOUT_S``, while a value the code passes is never overridden behind its
back. Every bad value is a :class:`~kvwire.errors.ConfigError` naming where it came from
(``KVWIRE_LEASE_S='soon': ...``), and a misspelt key or variable is reported with the
closest known name, because a knob that silently does nothing costs an operator an hour.

The sans-IO machines take the same object (:class:`~kvwire.machine.ConsumerMachine`,
``ProducerMachine``): a duration left unset is derived from the lease by one property here
(:attr:`KVWireConfig.expiry_margin` and its neighbours), so the runtime, the simulator and
the tests cannot derive it two ways. Only this package's own modules are below it: the knob
table and the layers (:mod:`~kvwire.config.knobs`), the secret file
(:mod:`~kvwire.config.secret`) and the handshake retry policy (:mod:`~kvwire.config.retry`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvwire.config.knobs import (
    CONFIG_FILE_VAR,
    ENV_PREFIX,
    ENV_VARS,
    KNOBS,
    LOG_LEVELS,
    MAX_SECONDS,
    VLLM_CONNECTORS,
    VLLM_EXTRA_CONFIG_KEYS,
    Knob,
    env_layer,
    file_layer,
    parsed,
    suggest,
    vllm_layer,
)
from kvwire.config.retry import RetryPolicy
from kvwire.config.secret import load_secret
from kvwire.errors import ConfigError
from kvwire.wire.compat import CompatFactors
from kvwire.wire.schemas import TransferMode

__all__ = [
    "CONFIG_FILE_VAR",
    "ENV_PREFIX",
    "ENV_VARS",
    "KNOBS",
    "LOG_LEVELS",
    "MAX_SECONDS",
    "VLLM_CONNECTORS",
    "VLLM_EXTRA_CONFIG_KEYS",
    "KVWireConfig",
    "Knob",
    "RetryPolicy",
    "TransferMode",
    "env_layer",
    "file_layer",
    "layered",
    "vllm_layer",
]

# -- the layers -------------------------------------------------------------------------------


def layered(
    environ: Mapping[str, str],
    config_file: str | os.PathLike[str] | None = None,
    kv_transfer_config: Mapping[str, Any] | str | None = None,
) -> dict[str, Any]:
    """The knobs the operator set, parsed, each from the highest layer that sets it: the
    config file (``config_file``, else ``$KVWIRE_CONFIG``), vLLM's ``kv_transfer_config``,
    then ``KVWIRE_*`` variables. An integration that fixes a knob itself reads here whether
    the operator set it otherwise."""
    values: dict[str, Any] = {}
    path = config_file if config_file is not None else environ.get(CONFIG_FILE_VAR) or None
    if path is not None:
        values.update(file_layer(path))
    if kv_transfer_config is not None:
        values.update(vllm_layer(kv_transfer_config))
    values.update(env_layer(environ))
    return values


# -- the object -------------------------------------------------------------------------------


@dataclass(frozen=True, init=False)
class KVWireConfig:
    """Every knob of one rank's transfer runtime and of the ``kvwire`` commands.

    Build it with keywords (the explicit layer); ``environ`` (default ``os.environ``),
    ``config_file`` (default ``$KVWIRE_CONFIG``) and ``kv_transfer_config`` supply the other
    layers. Rank facts and the compatibility factors come from the engine.
    ``dataclasses.replace`` works and keeps every value as it is.
    """

    engine_id: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    mode: TransferMode = TransferMode.PULL
    version: int = 13
    """Protocol version: 13 (vLLM 0.31), 14 (0.32) or 15 (0.33)."""
    transport: Any = "shm"
    """``shm``, ``nixl``, ``ucx``, ``module:factory``, or a created transport object."""
    transport_options: Mapping[str, Any] = field(default_factory=dict)
    side_channel_host: str = "127.0.0.1"
    """Where this engine's handshake listener binds (``0.0.0.0``: every interface)."""
    side_channel_port: int = 0
    """The engine's listener port; 0: the runtime starts a listener of its own."""
    advertise_host: str | None = None
    """The address put in ``kv_transfer_params`` and registrations; None: the bind host,
    or for a wildcard bind the host's one routable address (else a ConfigError)."""
    enforce_compat: bool = True
    compat: CompatFactors | None = None
    compat_hash: str | None = None
    secret_file: str | None = None
    """A file holding the handshake secret (read and checked when the config is built)."""
    secret: bytes | None = field(default=None, repr=False)
    """Shared secret of the authenticated handshake (``kvwire.sidechannel.auth``); never in
    a repr or a log. None: vLLM's plain handshake."""
    metadata_store: str | None = None
    """``etcd://host:port``: each rank publishes its handshake payload there (under an etcd
    lease) and peers read and watch it instead of a ZMQ round trip, falling back to ZMQ
    whenever the store is unreachable (docs/operations.md). None: ZMQ handshakes only."""
    metadata_store_ttl_s: float = 10.0
    """The etcd lease of a published rank: a rank whose keepalive stops is forgotten by its
    peers this long after (a restart is seen at once)."""
    lease_s: float = 30.0
    heartbeat_interval_s: float | None = None
    registration_timeout_s: float = 30.0
    engine_idle_ttl_s: float = 3600.0
    expiry_margin_s: float | None = None
    """A READ is not started this close to the producer's lease end; default
    ``min(5 s, L/6)`` (vLLM's 5 s, scaled down for short leases)."""
    completion_margin_s: float | None = None
    """A READ completion observed this close to (or after) the producer's lease end fails
    the request instead of finishing it; default ``min(1 s, L/10)``."""
    lease_grace_s: float | None = None
    """Producer: how long blocks of an expired lease stay quarantined before they are
    freed; default L/2."""
    transfer_timeout_s: float | None = None
    """Longest a posted READ/WRITE may run before it is cancelled; default ``max(30 s, L)``."""
    handshake_timeout_s: float = 5.0
    """Per attempt; a handshake may take ``(retries + 1)`` times this plus backoff."""
    handshake_retries: int = 2
    handshake_backoff_s: float = 0.1
    poll_interval_s: float = 0.02
    """Longest the background thread sleeps when nothing wakes it (timers, handshakes)."""
    coalesce: bool = True
    stream_layers: bool = True
    """Push, producer: a consumer's registration is matched while the prompt is still
    computed, and each layer's full blocks are written as the engine reports them
    (:meth:`~kvwire.runtime.Producer.chunk_scheduled`,
    :meth:`~kvwire.runtime.Producer.layer_computed`); the completion still rides on the
    last write. An engine that reports nothing gets whole-request writes, as with it off.
    Ignored in pull mode."""
    check_invariants: bool = True
    """The machines' self-checks (raise :class:`~kvwire.machine.InvariantViolation`); cheap."""
    max_parked_completions: int = 10_000
    """Push, consumer: write notifications held for requests not yet awaiting writes (over
    all requests); beyond this they are dropped and counted. Each expires after
    ``registration_timeout_s``."""
    release_retry_s: float = 1.0
    """How long to wait before asking again to release a handle whose release failed."""
    metrics_port: int | None = None
    """Serve this rank's counters for Prometheus at ``http://side_channel_host:P/metrics``
    with ``P = metrics_port + tp_rank`` (one port per rank of an engine); None: no server
    (the counters stay available through ``metrics``)."""
    bound_reads_by_lease: bool = True
    """Pull, consumer: a READ must end before the producer's lease does (docs/reliability.md
    2.1). Off only to reproduce the old, unsafe rule in tests and the simulator."""
    agent_name: str | None = None
    """The transport agent's name; default ``{engine_id}-{role}-pp{p}-tp{t}-{pid}``."""
    log_level: str = "WARNING"

    def __init__(
        self,
        *,
        environ: Mapping[str, str] | None = None,
        config_file: str | os.PathLike[str] | None = None,
        kv_transfer_config: Mapping[str, Any] | str | None = None,
        **given: Any,
    ) -> None:
        env = os.environ if environ is None else environ
        unknown = sorted(set(given) - set(KNOBS))
        if unknown:
            hint = suggest(unknown[0], list(KNOBS))
            raise ConfigError(f"unknown configuration field {unknown[0]!r}{hint}")
        values: dict[str, Any] = {
            f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING
            else f.default
            for f in dataclasses.fields(self)
        }  # fmt: skip
        values.update(layered(env, config_file, kv_transfer_config))
        for name, raw in given.items():
            values[name] = parsed(name, raw, KNOBS[name].parse)
        if values["secret"] is None and values["secret_file"] is not None:
            values["secret"] = load_secret(values["secret_file"])
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._validate()

    def _validate(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} outside [0, {self.tp_size})")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ConfigError(f"pp_rank {self.pp_rank} outside [0, {self.pp_size})")
        self._validate_durations()
        if self.compat is not None and self.compat.transfer_mode != self.mode:
            raise ConfigError(
                f"compat factors say transfer_mode {self.compat.transfer_mode!r}, "
                f"the runtime runs {self.mode!r} (set both, or build the factors "
                "with transfer_mode=config.mode)"
            )

    def _validate_durations(self) -> None:
        """Durations that each parse but together make every request fail: refused here,
        naming the knobs, instead of failing each request far from the setting."""
        lease = self.lease_s
        for name, value in (
            ("expiry_margin_s", self.expiry_margin),
            ("completion_margin_s", self.completion_margin),
        ):
            if value >= lease:
                raise ConfigError(
                    f"{name} {value:g} is not below lease_s {lease:g}: no READ could start "
                    "and finish inside the producer's lease"
                )
        if self.heartbeat_s >= self.lease_extension_s:
            raise ConfigError(
                f"heartbeat_interval_s {self.heartbeat_s:g} is not below 2/3 of lease_s "
                f"{lease:g} ({self.lease_extension_s:g}): a heartbeat extends a lease by that "
                "much, so leases would run out between heartbeats"
            )

    # -- views for the parts ---------------------------------------------------------

    @property
    def handshake(self) -> RetryPolicy:
        """The handshake client's retry policy."""
        return RetryPolicy(
            timeout=self.handshake_timeout_s,
            retries=self.handshake_retries,
            backoff=self.handshake_backoff_s,
        )

    @property
    def local_hash(self) -> str | None:
        """The hash peers must present (None: unchecked)."""
        if not self.enforce_compat:
            return None
        if self.compat_hash is not None:
            return self.compat_hash
        return self.compat.hash() if self.compat is not None else None

    @property
    def advertised_hash(self) -> str:
        """The hash this rank puts in its own handshake payload."""
        if self.compat_hash is not None:
            return self.compat_hash
        if self.compat is not None:
            return self.compat.hash()
        raise ConfigError("a rank that serves handshakes needs compat factors or compat_hash")

    def handshake_budget_s(self) -> float:
        """Longest a handshake may take with every retry: the machine's own timeout."""
        policy = self.handshake
        waits = sum(policy.delay(i) for i in range(1, policy.retries + 1))
        return policy.timeout * (policy.retries + 1) + waits + 1.0

    # -- durations derived from the lease when left unset -----------------------------

    @property
    def heartbeat_s(self) -> float:
        """Seconds between a consumer's heartbeats to one producer engine (L/6 unless set)."""
        hb = self.heartbeat_interval_s
        return self.lease_s / 6.0 if hb is None else hb

    @property
    def lease_extension_s(self) -> float:
        """A heartbeat moves a producer's lease to at least ``now + 2L/3``."""
        return self.lease_s * 2.0 / 3.0

    @property
    def lease_grace(self) -> float:
        """Seconds an expired lease's blocks stay quarantined (L/2 unless set)."""
        return self.lease_s / 2.0 if self.lease_grace_s is None else self.lease_grace_s

    @property
    def expiry_margin(self) -> float:
        """No READ starts this close to the producer's lease end (``min(5 s, L/6)`` unless
        set: vLLM's 5 s, scaled down for short leases)."""
        margin = self.expiry_margin_s
        return min(5.0, self.lease_s / 6.0) if margin is None else margin

    @property
    def completion_margin(self) -> float:
        """A READ completion observed this close to the lease end fails (``min(1 s, L/10)``)."""
        margin = self.completion_margin_s
        return min(1.0, self.lease_s / 10.0) if margin is None else margin

    @property
    def transfer_timeout(self) -> float:
        """Longest a posted READ/WRITE may run (``max(30 s, L)`` unless set)."""
        timeout = self.transfer_timeout_s
        return max(30.0, self.lease_s) if timeout is None else timeout

    def transport_kwargs(self) -> dict[str, Any]:
        """The options to create :attr:`transport` with."""
        return dict(self.transport_options)

    def as_env(self) -> dict[str, str]:
        """This configuration as ``KVWIRE_*`` variables (to hand to a worker process);
        fields without a variable (ranks, factors, the secret's bytes) are left out."""
        out: dict[str, str] = {}
        for var, name in ENV_VARS.items():
            value = getattr(self, name)
            if value is None or (name == "transport" and not isinstance(value, str)):
                continue
            if isinstance(value, bool):
                out[var] = "1" if value else "0"
            elif isinstance(value, TransferMode):
                out[var] = value.value
            elif isinstance(value, Mapping):
                out[var] = json.dumps(dict(value), sort_keys=True)
            else:
                out[var] = str(value)
        return out
