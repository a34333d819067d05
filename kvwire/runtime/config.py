"""What one rank's runtime needs to know, validated once.

A ``RuntimeConfig`` is per rank (one Producer or Consumer per worker process). It feeds the
sans-IO machine's :class:`~kvwire.machine.MachineConfig` and the handshake client's retry
policy, so the two agree on how long a handshake may take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from kvwire.compat import CompatFactors
from kvwire.errors import ConfigError
from kvwire.machine import MachineConfig, TransferMode
from kvwire.sidechannel import RetryPolicy
from kvwire.sidechannel.auth import check_secret
from kvwire.wire.versions import SUPPORTED_VERSIONS

Mode = Literal["pull", "push"]


@dataclass(frozen=True)
class RuntimeConfig:
    """One rank of an engine.

    ``side_channel_host``/``side_channel_port`` are where *this engine's* handshake listener
    can be reached; a producer advertises them in ``kv_transfer_params`` and a push-mode
    consumer in its registrations. ``compat`` (or a precomputed ``compat_hash``) is what
    peers are checked against; with ``enforce_compat=False`` any hash is accepted (vLLM's
    ``enforce_handshake_compat=false``).
    """

    engine_id: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    mode: Mode = "pull"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    compat: CompatFactors | None = None
    compat_hash: str | None = None
    enforce_compat: bool = True
    version: int = 13
    lease_s: float = 30.0
    heartbeat_interval_s: float | None = None
    registration_timeout_s: float = 30.0
    engine_idle_ttl_s: float = 3600.0
    handshake: RetryPolicy = field(default_factory=RetryPolicy)
    coalesce: bool = True
    poll_interval_s: float = 0.02
    """Longest the background thread sleeps when nothing wakes it (timers, handshakes)."""
    agent_name: str | None = None
    """The transport agent's name; default ``{engine_id}-{role}-pp{p}-tp{t}-{pid}``."""
    check_invariants: bool = True
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
    secret: bytes | None = field(default=None, repr=False)
    """Shared secret of the authenticated handshake (``kvwire.sidechannel.auth``): this
    rank's handshakes then require peers that hold it. None: vLLM's plain handshake. Load
    it with :func:`~kvwire.sidechannel.load_secret`; it never appears in a repr or a log."""

    def __post_init__(self) -> None:
        if not self.engine_id or "," in self.engine_id:
            raise ConfigError(f"engine_id must be non-empty and free of ',': {self.engine_id!r}")
        if self.mode not in ("pull", "push"):
            raise ConfigError(f"mode must be 'pull' or 'push', got {self.mode!r}")
        if self.version not in SUPPORTED_VERSIONS:
            raise ConfigError(f"protocol version {self.version} is not one of {SUPPORTED_VERSIONS}")
        if not 0 <= self.side_channel_port < 65536:
            raise ConfigError(f"side_channel_port {self.side_channel_port} is not a port")
        if not math.isfinite(self.poll_interval_s) or self.poll_interval_s <= 0:
            raise ConfigError("poll_interval_s must be positive")
        if self.compat is not None and self.compat.transfer_mode != self.mode:
            raise ConfigError(
                f"compat factors say transfer_mode {self.compat.transfer_mode!r}, "
                f"the runtime runs {self.mode!r}"
            )
        if self.secret is not None:
            check_secret(self.secret, "RuntimeConfig.secret")
        self.machine_config()  # validates the rest (ranks, durations)

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

    def machine_config(self, *, mla: bool = False) -> MachineConfig:
        return MachineConfig(
            engine_id=self.engine_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            mode=TransferMode(self.mode),
            host=self.side_channel_host,
            port=self.side_channel_port,
            mla=mla,
            lease_s=self.lease_s,
            heartbeat_interval_s=self.heartbeat_interval_s,
            handshake_timeout_s=self.handshake_budget_s(),
            engine_idle_ttl_s=self.engine_idle_ttl_s,
            registration_timeout_s=self.registration_timeout_s,
            check_invariants=self.check_invariants,
            expiry_margin_s=(
                min(5.0, self.lease_s / 6) if self.expiry_margin_s is None else self.expiry_margin_s
            ),
            completion_margin_s=(
                min(1.0, self.lease_s / 10)
                if self.completion_margin_s is None
                else self.completion_margin_s
            ),
            lease_grace_s=self.lease_grace_s,
            transfer_timeout_s=(
                max(30.0, self.lease_s)
                if self.transfer_timeout_s is None
                else self.transfer_timeout_s
            ),
        )
