"""How a conformance test says what it needs of the transport: one marker, read in one place.

A test carries a single ``@capability(...)`` (the ``kvwire_capability`` marker). Its
arguments are everything the test needs, and the suite's base class skips the test, with
the reason, when the transport lacks any of them; nothing in a test body checks again.
The first need is the group the report files the test under, unless ``group=`` names a
contract area that is not a capability (``close``); a test without the marker needs
nothing and is filed under ``core``.

Needs are :class:`kvwire.transport.Capabilities` flags (``read``, ``notifications``, ...)
and two memory kinds, ``dram`` and ``vram``. A need may name a parameter of the test in
braces (``"{op}"``): a test parametrized over ``read`` and ``write`` needs the one it runs.

This module imports only pytest: the plugin reads markers through it in every run.
"""

from __future__ import annotations

from typing import Any

import pytest

MARKER = "kvwire_capability"
capability = pytest.mark.kvwire_capability
"""``@capability(*needs, group=None)``: what the test needs of the transport."""

UNCHECKED = "could not check"
"""How a test's skip reason starts when this host cannot verify a claim (the plugin fails
such a test unless the run accepts unchecked claims; the report files it as unchecked)."""
CORE = "core"
"""The group of a test that needs nothing optional."""
MEMORY_KINDS = ("dram", "vram")
"""Needs that are memory kinds (``Capabilities.mem_kinds``), not flags."""


def declared(item: Any) -> tuple[str, tuple[str, ...]]:
    """``(group, needs)`` of a collected test, its ``{param}`` needs filled in."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return CORE, ()
    callspec = getattr(item, "callspec", None)
    params: dict[str, Any] = dict(callspec.params) if callspec is not None else {}
    needs = tuple(str(need).format(**params) for need in marker.args)
    group = marker.kwargs.get("group")
    return str(group) if group else (needs[0] if needs else CORE), needs


def missing(capabilities: Any, needs: tuple[str, ...]) -> str | None:
    """Why a transport with ``capabilities`` cannot run a test that needs ``needs``, or None."""
    from kvwire.transport import MemKind

    for need in needs:
        if need in MEMORY_KINDS:
            if MemKind(need.upper()) not in capabilities.mem_kinds:
                return (
                    "transport does not register host (DRAM) memory"
                    if need == "dram"
                    else "transport does not claim VRAM"
                )
        elif not hasattr(capabilities, need):
            raise ValueError(f"@capability({need!r}): not a transport capability")
        elif not getattr(capabilities, need):
            return f"transport does not claim capability {need!r}"
    return None
