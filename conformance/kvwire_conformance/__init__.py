"""kvwire transport conformance suite.

Subclass :class:`TransportSuite` (every mixin) or compose the capability mixins it is made
of in an adapter's tests, or run ``kvwire conformance NAME``. The pytest plugin
(``pytest11`` entry point ``kvwire_conformance.plugin``) registers the ``--kvwire-*``
options and the ``kvwire_capability`` marker; its recording and timeouts act only on a
conformance run (:mod:`kvwire_conformance.plugin`). The optional extras a transport may
offer are Protocols in :mod:`kvwire_conformance.extras`.

The suite's names load lazily, so importing the package does not pull in pytest or
Hypothesis. The peer process the suite drives is :mod:`kvwire.peer` (``kvwire bench
transport`` drives it too).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CASES": "kvwire_conformance.transfers",
    "Link": "kvwire_conformance.link",
    "TransportSuite": "kvwire_conformance.suite",
    "SuiteBase": "kvwire_conformance.base",
    "TransferTests": "kvwire_conformance.transfers",
    "NotificationTests": "kvwire_conformance.notifications",
    "OrderingTests": "kvwire_conformance.ordering",
    "LifecycleTests": "kvwire_conformance.lifecycle",
    "RegistrationTests": "kvwire_conformance.registration",
    "FailureTests": "kvwire_conformance.failures",
    "PathTests": "kvwire_conformance.paths",
    "capability": "kvwire_conformance.capabilities",
    "ExplainsFailures": "kvwire_conformance.extras",
    "CountsResources": "kvwire_conformance.extras",
    "WrapsTransport": "kvwire_conformance.extras",
    "DeclaresAllocators": "kvwire_conformance.extras",
    "DeclaresThresholds": "kvwire_conformance.extras",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvwire_conformance' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
