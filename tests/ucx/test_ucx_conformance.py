"""The ucx transport passes the whole conformance suite, the two sides in separate processes.

Twice: with the default error handling (same-host peers over shared memory and CMA, watched
by pidfd) and with UCX peer error handling on every endpoint (UCX then uses TCP).
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvwire_conformance import TransportSuite


class TestUcxConformance(TransportSuite):  # type: ignore[misc]
    transport = "ucx"


class TestUcxPeerErrorHandlingConformance(TransportSuite):  # type: ignore[misc]
    transport = "ucx"
    options: ClassVar[dict[str, Any]] = {"error_handling": "peer"}
