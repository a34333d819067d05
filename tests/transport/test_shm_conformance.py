"""The shm transport passes the whole conformance suite, P and D in separate processes."""

from __future__ import annotations

from kvwire_conformance import TransportSuite


class TestShmConformance(TransportSuite):
    transport = "shm"
