"""Which faults a simulation injects, and how often: parsed from ``--faults``."""

from __future__ import annotations

from dataclasses import dataclass

from kvwire.errors import ConfigError

FAULT_NAMES: tuple[str, ...] = (
    "drop",
    "delay",
    "duplicate",
    "reorder",
    "transfer",
    "post",
    "handshake",
    "crash",
    "release",
    "skew",
    "abort",
    "short-lease",
    "partition",
    "preempt",
    "stall",
    "vanish",
)
"""Every fault kind, in the order ``--faults all`` lists them. The last three act on
streamed prompts only (``--stream``); without it they inject nothing."""

STREAM_FAULTS = frozenset({"preempt", "stall", "vanish"})
"""The faults of :data:`FAULT_NAMES` that only a streaming push producer meets."""


@dataclass(frozen=True)
class Faults:
    """Per-opportunity probabilities (0 disables a fault)."""

    drop_notification: float = 0.0
    delay_notification: float = 0.0
    duplicate_notification: float = 0.0
    reorder_notification: float = 0.0
    transfer_failure: float = 0.0
    post_failure: float = 0.0
    handshake_failure: float = 0.0
    handshake_silence: float = 0.0
    crash_interval_s: float = 0.0
    """Mean simulated seconds between engine crashes (0: none)."""
    release_failure: float = 0.0
    clock_skew_s: float = 0.0
    abort: float = 0.0
    short_lease: bool = False
    partition: float = 0.0
    """Per posted transfer: the link between its two engines is cut for 1-2.5 producer
    leases. Heartbeats, completions and handshakes across it are lost, and every transfer
    on it stalls until the link heals, then completes with whatever the source blocks hold
    by then."""
    preempt: float = 0.0
    """Per forward step of a streamed prompt: the engine preempts it (``Preempted``),
    hands its blocks to other prompts and computes it again, from the start, into new
    blocks."""
    stall: float = 0.0
    """Per forward step of a streamed prompt after its first: the engine stalls it for
    25-45 s, past the consumer's registration watchdog (30 s), so the stream's write bound
    ends mid-stream."""
    vanish: float = 0.0
    """Per layer a streamed prompt computes: its consumer engine dies (and restarts)."""
    kinds: tuple[str, ...] = ()
    """The ``--faults`` names that produced these settings."""

    @property
    def names(self) -> list[str]:
        return list(self.kinds)


_SETTINGS: dict[str, dict[str, float | bool]] = {
    "drop": {"drop_notification": 0.01},
    "delay": {"delay_notification": 0.05},
    "duplicate": {"duplicate_notification": 0.03},
    "reorder": {"reorder_notification": 0.1},
    "transfer": {"transfer_failure": 0.01},
    "post": {"post_failure": 0.01},
    "handshake": {"handshake_failure": 0.05, "handshake_silence": 0.01},
    "crash": {"crash_interval_s": 4.0},
    "release": {"release_failure": 0.03},
    "skew": {"clock_skew_s": 1.0e5},
    "abort": {"abort": 0.04},
    "short-lease": {"short_lease": True},
    "partition": {"partition": 0.0002},
    "preempt": {"preempt": 0.03},
    "stall": {"stall": 0.01},
    "vanish": {"vanish": 0.0002},
}


def parse_faults(spec: str) -> Faults:
    """``"all"``, ``"none"`` or a comma list of :data:`FAULT_NAMES`."""
    spec = spec.strip()
    if spec in ("", "none"):
        return Faults()
    names = list(FAULT_NAMES) if spec == "all" else [s.strip() for s in spec.split(",")]
    values: dict[str, float | bool] = {}
    for name in names:
        if name not in _SETTINGS:
            known = ", ".join(FAULT_NAMES)
            raise ConfigError(f"unknown fault {name!r} (known: all, none, {known})")
        values.update(_SETTINGS[name])
    return Faults(**values, kinds=tuple(dict.fromkeys(names)))  # type: ignore[arg-type]
