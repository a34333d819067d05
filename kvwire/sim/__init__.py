"""Deterministic discrete-event simulation of P/D engines running the real machines."""

from __future__ import annotations

from kvwire.sim.fault_plan import FAULT_NAMES, STREAM_FAULTS, Faults, parse_faults
from kvwire.sim.model import SimResult
from kvwire.sim.world import World, simulate

__all__ = [
    "FAULT_NAMES",
    "STREAM_FAULTS",
    "Faults",
    "SimResult",
    "World",
    "parse_faults",
    "simulate",
]
