"""The knobs of one transfer state machine (one engine rank), validated once at construction.

Every duration is in seconds of the clock the driver passes as ``now``; the machine never
reads a clock itself, so the same numbers mean the same thing in the runtime and in the
simulator.
"""

from __future__ import annotations

import math

import msgspec

from kvwire.errors import ConfigError
from kvwire.wire.schemas import TransferMode


class MachineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Configuration of a :class:`~kvwire.machine.ConsumerMachine` or ``ProducerMachine``.

    One machine drives one rank (one worker) of an engine; ``tp_rank``/``pp_rank`` say which.
    """

    engine_id: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    mode: TransferMode = TransferMode.PULL
    host: str = ""
    port: int = 0
    """This engine's side channel, sent to producers in push registrations."""
    mla: bool = False
    """MLA caches are replicated on every TP rank instead of split by heads."""
    lease_s: float = 30.0
    """L: how long a producer keeps finished blocks for a consumer that has not read them."""
    heartbeat_interval_s: float | None = None
    """Defaults to L/6 (vLLM's cadence); a consumer heartbeats each remote engine this often."""
    handshake_timeout_s: float = 5.0
    engine_idle_ttl_s: float = 3600.0
    """A handshaken engine unused this long (and with nothing in flight) is evicted."""
    expiry_margin_s: float = 5.0
    """A read whose remote blocks expire within this margin is declined, not started."""
    registration_timeout_s: float = 30.0
    """Push, consumer: fail a request whose writes have not all arrived by then.
    Push, producer: drop an unmatched registration (or remember a finished one) this long."""
    max_parked_completions: int = 10_000
    """Push, consumer: write notifications held for requests not yet awaiting writes (over
    all requests); beyond this they are dropped and counted. Each expires after
    ``registration_timeout_s``."""
    release_retry_s: float = 1.0
    """How long to wait before asking again to release a handle whose release failed."""
    transfer_timeout_s: float = 30.0
    """Every posted READ/WRITE is bounded: one still running this long after its post is
    cancelled and its request fails (a pull READ is also bounded by the producer's lease,
    see ``completion_margin_s``)."""
    bound_reads_by_lease: bool = True
    """Pull, consumer: a READ must end before the producer's lease does. The read deadline is
    ``remote_blocks_expiry_time`` (producer clock) minus the handshake's clock offset and its
    uncertainty, or, when the producer sends none (vLLM), the request's arrival plus
    ``lease_s``. A READ still running ``completion_margin_s`` before it is cancelled, and one
    whose completion is observed after that moment fails with its blocks invalid, never done:
    the producer may have handed the blocks to another request. Off only to reproduce the
    old (unsafe) rule in tests and the simulator."""
    completion_margin_s: float = 1.0
    """Pull, consumer: how long before the read deadline a READ's completion stops counting."""
    lease_grace_s: float | None = None
    """Producer: blocks whose lease ran out without every completion are quarantined this
    long before they are freed, so a READ stalled past the lease (a consumer that does not
    bound its reads, such as vLLM's) finds them unchanged if it resumes within the grace.
    Defaults to L/2; 0 frees at expiry (the old rule)."""
    check_invariants: bool = True
    """Self-checks that raise :class:`~kvwire.machine.InvariantViolation`; cheap, keep on."""

    def __post_init__(self) -> None:
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ConfigError("engine_id must be a non-empty string")
        for name in ("tp_size", "pp_size", "max_parked_completions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} outside [0, {self.tp_size})")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ConfigError(f"pp_rank {self.pp_rank} outside [0, {self.pp_size})")
        if not isinstance(self.mode, TransferMode):
            raise ConfigError(f"mode must be a TransferMode, got {self.mode!r}")
        for name in (
            "lease_s",
            "handshake_timeout_s",
            "engine_idle_ttl_s",
            "registration_timeout_s",
            "release_retry_s",
            "transfer_timeout_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
        if not math.isfinite(self.expiry_margin_s) or self.expiry_margin_s < 0:
            raise ConfigError("expiry_margin_s must be a finite number >= 0")
        if not math.isfinite(self.completion_margin_s) or self.completion_margin_s < 0:
            raise ConfigError("completion_margin_s must be a finite number >= 0")
        grace = self.lease_grace_s
        if grace is not None and (not math.isfinite(grace) or grace < 0):
            raise ConfigError(f"lease_grace_s must be a finite number >= 0, got {grace!r}")
        hb = self.heartbeat_interval_s
        if hb is not None and (not math.isfinite(hb) or hb <= 0):
            raise ConfigError(f"heartbeat_interval_s must be positive, got {hb!r}")

    @property
    def heartbeat_s(self) -> float:
        """Seconds between heartbeats to one remote engine (L/6 unless set)."""
        if self.heartbeat_interval_s is not None:
            return self.heartbeat_interval_s
        return self.lease_s / 6.0

    @property
    def lease_grace(self) -> float:
        """Seconds an expired lease's blocks stay quarantined (L/2 unless set)."""
        if self.lease_grace_s is not None:
            return self.lease_grace_s
        return self.lease_s / 2.0

    @property
    def lease_extension_s(self) -> float:
        """A heartbeat moves a lease to at least ``now + 2L/3``."""
        return self.lease_s * 2.0 / 3.0
