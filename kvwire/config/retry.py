"""How a handshake client waits for a silent peer and retries: part of the configuration
(``handshake_timeout_s``, ``handshake_retries``, ``handshake_backoff_s``), used by the client."""

from __future__ import annotations

from dataclasses import dataclass

from kvwire.errors import ConfigError


@dataclass(frozen=True)
class RetryPolicy:
    """How long to wait for an answer and how to retry a missing one."""

    timeout: float = 5.0
    retries: int = 2
    backoff: float = 0.1
    backoff_max: float = 2.0

    def __post_init__(self) -> None:
        if self.timeout <= 0 or self.retries < 0 or self.backoff < 0 or self.backoff_max < 0:
            raise ConfigError(f"invalid handshake retry policy: {self}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based)."""
        return float(min(self.backoff_max, self.backoff * (2 ** (attempt - 1))))
