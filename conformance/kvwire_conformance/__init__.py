"""kvwire transport conformance suite.

Subclass :class:`TransportSuite` in an adapter's tests, or run ``kvwire conformance NAME``.
The pytest plugin (``pytest11`` entry point ``kvwire_conformance.plugin``) adds the
``--kvwire-transport`` / ``--kvwire-option`` options and the capability report.

The suite's names load lazily, so importing the package does not pull in pytest or
Hypothesis. ``PeerAgent`` and ``PeerAgentError`` are re-exported from :mod:`kvwire.peer`,
where the peer process machinery lives (``kvwire bench transport`` drives it too).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CASES": "kvwire_conformance.suite",
    "Link": "kvwire_conformance.suite",
    "TransportSuite": "kvwire_conformance.suite",
    "capability": "kvwire_conformance.suite",
    "PeerAgent": "kvwire.peer.agent",
    "PeerAgentError": "kvwire.peer.agent",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvwire_conformance' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
