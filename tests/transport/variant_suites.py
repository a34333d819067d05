"""The conformance suite once per broken variant, as an adapter's own tests subclass it.

Not collected by a plain ``pytest`` run (the name does not start with ``test_``):
test_conformance_teeth.py runs it in subprocesses, naming the variants in
``KVWIRE_TEETH_VARIANTS`` and the adapter the wrappers wrap in ``KVWIRE_TEETH_INNER``.
Waits are bounded shorter than in a real run, since every variant here is meant to fail.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from kvwire_conformance import TransportSuite
from variant_library import VARIANTS

INNER = os.environ.get("KVWIRE_TEETH_INNER", "shm")
WAIT_S = 8.0
NEED_FULL_REGIONS = {
    "test_read_moves_exact_bytes",
    "test_write_moves_exact_bytes",
    "test_write_notification_arrives_after_its_data",
    "test_read_notification_arrives_after_its_data",
    "test_release_of_a_running_transfer",
    "test_a_read_is_done_only_after_its_last_byte",
    "test_a_read_notification_follows_its_last_byte",
    "test_a_write_is_done_only_after_its_last_byte",
    "test_a_write_notification_follows_its_last_byte",
}
"""Catching tests whose transfers need the suite's full 32 MiB regions."""


def class_name(variant: str) -> str:
    return f"TestVariant_{variant}_Suite"


def _suite(name: str) -> type[TransportSuite]:
    variant = VARIANTS[name]
    options: dict[str, Any] = {"inner": INNER} if variant.independent else {}
    attrs = {
        "transport": f"{variant.module}:{name}",
        "options": options,
        # shm's two kinds of memory: what its own variants break; any adapter's heap memory
        # for the wrappers, whose bugs do not depend on it.
        "allocators": ("numpy", "kvwire_shm:allocate") if INNER == "shm" else ("numpy",),
        "region_bytes": 32 << 20 if variant.caught_by in NEED_FULL_REGIONS else 4 << 20,
        "timeout": min(WAIT_S, variant.timeout),
        "__module__": __name__,
        "pytestmark": [pytest.mark.timeout(variant.timeout)],
    }
    return type(class_name(name), (TransportSuite,), attrs)


for _name in filter(None, os.environ.get("KVWIRE_TEETH_VARIANTS", "").split(",")):
    globals()[class_name(_name)] = _suite(_name)
