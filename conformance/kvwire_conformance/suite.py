"""The whole conformance suite: every capability mixin, composed (zarr.testing style).

::

    from kvwire_conformance import TransportSuite

    class TestMyTransport(TransportSuite):
        transport = "mine"            # entry-point name or "module:factory"
        options = {"device": "lo"}    # keyword options for the factory, both sides

The test process runs one agent; a peer agent process (:mod:`kvwire.peer.process`)
runs the other with the same factory and options. A test whose needs (its
``@capability``) the transport does not claim is skipped with the reason.

A transport that claims only part of the contract, or a run that wants one area, composes
the mixins it needs instead, as fsspec's abstract tests do; each derives from
:class:`~kvwire_conformance.base.SuiteBase`, whose docstring lists what a subclass must
and may override::

    class TestMyTransportNotifications(NotificationTests):
        transport = "mine"
"""

from __future__ import annotations

from kvwire_conformance.base import SuiteBase
from kvwire_conformance.capabilities import capability
from kvwire_conformance.failures import FailureTests
from kvwire_conformance.lifecycle import LifecycleTests
from kvwire_conformance.link import Link
from kvwire_conformance.notifications import NotificationTests
from kvwire_conformance.ordering import OrderingTests
from kvwire_conformance.paths import PathTests
from kvwire_conformance.registration import RegistrationTests
from kvwire_conformance.transfers import CASES, TransferTests

__all__ = [
    "CASES",
    "FailureTests",
    "LifecycleTests",
    "Link",
    "NotificationTests",
    "OrderingTests",
    "PathTests",
    "RegistrationTests",
    "SuiteBase",
    "TransferTests",
    "TransportSuite",
    "capability",
]


class TransportSuite(
    TransferTests,
    NotificationTests,
    OrderingTests,
    LifecycleTests,
    RegistrationTests,
    FailureTests,
    PathTests,
):
    """Every capability mixin: subclass and set :attr:`transport` (and :attr:`options`)."""
