"""The optional extras a transport may offer the suite, as ``typing.Protocol`` classes.

None is part of :class:`kvwire.transport.Transport`: an adapter without them passes the
suite, and one with them gets sharper checks and messages. The suite tests for each with
``isinstance`` (all are ``runtime_checkable``), so an adapter declares one by having the
attribute; subclassing the Protocol is allowed and documents the intent.

Agent extras (on the object the factory returns, or on an agent it wraps through
``inner``): :class:`ExplainsFailures`, :class:`CountsResources`, :class:`WrapsTransport`.
Factory or agent-class extras: :class:`DeclaresAllocators`, :class:`DeclaresThresholds`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ExplainsFailures(Protocol):
    """Says why a transfer ended FAILED; the suite appends it to a failing test's message."""

    def failure_reason(self, handle: object) -> str | None: ...


@runtime_checkable
class CountsResources(Protocol):
    """Counts what the agent holds (records, buffers, ...): the release and peer tests
    require the counts to return to where they were, beside the process-wide checks."""

    def resource_counts(self) -> Mapping[str, int]: ...


@runtime_checkable
class WrapsTransport(Protocol):
    """A wrapper around another agent (fault injection, instrumentation): the suite looks
    through ``inner`` for the other extras, so wrapping an adapter keeps them."""

    inner: Any


@runtime_checkable
class DeclaresAllocators(Protocol):
    """``"module:function"`` host allocators (``function(nbytes) -> uint8 array``) the
    memory tests also run over; ``kvwire bench transport`` reads the same attribute."""

    conformance_allocators: Sequence[str]


@runtime_checkable
class DeclaresThresholds(Protocol):
    """The sizes where the adapter changes strategy, by kind (``transfer_bytes``,
    ``span_bytes``, ``descriptors``): the path tests try one below, at and above each."""

    conformance_thresholds: Mapping[str, Sequence[int]]


def wrapped(agent: object) -> Iterator[object]:
    """The agent, then each agent it wraps through ``inner``, outermost first."""
    seen: set[int] = set()
    current: object = agent
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.inner if isinstance(current, WrapsTransport) else None


def counts(agent: object) -> dict[str, int]:
    """The first ``resource_counts()`` found through the wrappers, or {}."""
    for layer in wrapped(agent):
        if isinstance(layer, CountsResources):
            return {str(k): int(v) for k, v in layer.resource_counts().items()}
    return {}


def failure_reason(agent: object, handle: object) -> str:
    """`` (why)`` for a message when the agent explains its failures, else ``""``."""
    from kvwire.transport import failure_detail

    reason = failure_detail(agent, handle)
    return f" ({reason})" if reason else ""


def declared_allocators(factory: object, agent: object | None = None) -> list[str]:
    """Allocators the factory declares, then those of each wrapped agent's class."""
    owners = [factory] + ([type(layer) for layer in wrapped(agent)] if agent is not None else [])
    out: list[str] = []
    for owner in owners:
        if isinstance(owner, DeclaresAllocators):
            out += [str(spec) for spec in owner.conformance_allocators if str(spec) not in out]
    return out


def declared_thresholds(factory: object, agent: object) -> list[Mapping[str, Sequence[int]]]:
    """Every threshold table the factory and the wrapped agents' classes declare."""
    owners = [factory, *(type(layer) for layer in wrapped(agent))]
    return [o.conformance_thresholds for o in owners if isinstance(o, DeclaresThresholds)]
