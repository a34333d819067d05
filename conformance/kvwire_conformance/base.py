"""The base every capability mixin shares: what to test, the connected pair, the one place
capabilities are checked, and the helpers the mixins' tests lean on.

What a transport author overrides (the mixins' tests use nothing else)::

    must override
        transport       class attribute: entry-point name (``shm``) or ``module:factory``;
                        or override the ``transport_spec`` classmethod instead
    may override
        options         class attribute: factory keyword options, used on both sides
        peer_env        class attribute: extra environment for the peer agent process
        allocators      class attribute: host allocators the memory tests run over
        region_bytes    class attribute: bytes registered per side and allocator
        timeout         class attribute: longest any single wait may take
        spec            fixture (class scope): what both sides start, from the above
        link            fixture (class scope): the connected pair, its memory registered

Every mixin derives from :class:`SuiteBase`, so any subset composes:
``class TestMine(TransferTests, NotificationTests): transport = "mine"``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import pytest

from kvwire.errors import TransportError
from kvwire.peer import protocol as p
from kvwire.peer.agent import PeerAgent
from kvwire.transport import (
    MemKind,
    Transport,
    XferState,
    create,
    load,
    region_of_array,
    wait_for,
)
from kvwire_conformance import memory
from kvwire_conformance.capabilities import declared, missing
from kvwire_conformance.extras import declared_allocators
from kvwire_conformance.link import (
    CLOSE_TIMEOUT_S,
    Link,
    LocalRegion,
    PeerRegion,
    Spec,
    assert_bytes,
    close_within,
    seed,
)


def _test_timeout(config: pytest.Config) -> float:
    try:
        return float(config.getoption("--kvwire-timeout"))
    except ValueError:  # the plugin is not loaded
        return CLOSE_TIMEOUT_S


class SuiteBase:
    """Fixtures and helpers of the suite; set :attr:`transport` in a subclass."""

    transport: ClassVar[str] = ""
    """Must override: entry-point name (``shm``) or ``module:factory``."""
    options: ClassVar[dict[str, Any]] = {}
    """May override: keyword options for ``factory(name, **options)``, used on both sides."""
    peer_env: ClassVar[dict[str, str]] = {}
    """May override: extra environment for the peer agent process."""
    allocators: ClassVar[tuple[str, ...] | None] = None
    """May override: host allocators to run the memory tests over; None: the default set
    (:data:`~kvwire_conformance.memory.DEFAULT_ALLOCATORS`) plus every
    ``conformance_allocators`` (:class:`~kvwire_conformance.extras.DeclaresAllocators`)
    that the factory or the agent's class (or a wrapped agent's) declares."""
    region_bytes: ClassVar[int] = 32 << 20
    """May override: bytes registered on each side for each allocator."""
    timeout: ClassVar[float] = 60.0
    """May override: seconds any single wait may take before the test fails (not how long
    tests take)."""

    @classmethod
    def transport_spec(cls, config: pytest.Config) -> tuple[str, dict[str, Any]]:
        """Which transport to test; the CLI's generic class reads it from the command line."""
        return cls.transport, dict(cls.options)

    # -- fixtures ---------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def spec(cls, request: pytest.FixtureRequest) -> Spec:
        """May override: what both sides start."""
        transport, options = cls.transport_spec(request.config)
        if not transport:
            pytest.fail(f"{cls.__name__} names no transport: set `transport = ...`", pytrace=False)
        allocators = cls.allocators
        if allocators is None:
            allocators = (*memory.DEFAULT_ALLOCATORS, *declared_allocators(load(transport)))
        return Spec(transport, options, dict(cls.peer_env), tuple(allocators))

    @pytest.fixture(scope="class")
    @classmethod
    def link(cls, spec: Spec, request: pytest.FixtureRequest) -> Iterator[Link]:
        """May override: this process's agent and a peer agent process, connected, with
        ``region_bytes`` of each allocator's memory registered on both sides."""
        local_name = f"kvwire-conformance-local-{uuid.uuid4().hex[:8]}"
        local = create(spec.transport, local_name, **spec.options)
        peer: PeerAgent | None = None
        try:
            peer = PeerAgent(spec.transport, spec.options, env=spec.env, timeout=cls.timeout)
            if cls.allocators is None:
                extra = declared_allocators(load(spec.transport), local)
                known = spec.allocators
                spec.allocators = (*known, *(a for a in extra if a not in known))
            link = Link(spec, local, peer, peer.agent_name, local_name, cls.timeout)
            if MemKind.DRAM in local.capabilities.mem_kinds:
                for alloc in spec.allocators:
                    array = memory.allocate(alloc, cls.region_bytes)
                    handle = local.register([region_of_array(array)])
                    link.local_regions[alloc] = LocalRegion(
                        array, int(array.ctypes.data), int(array.nbytes), handle
                    )
                    got = peer.alloc(cls.region_bytes, alloc)
                    link.peer_regions[alloc] = PeerRegion(got["region"], got["addr"], got["nbytes"])
            link.peer_name = local.add_peer(peer.metadata())
            link.local_name = peer.call(p.AddPeer(local.local_metadata()))
            yield link
        finally:
            bound = min(CLOSE_TIMEOUT_S, cls.timeout, _test_timeout(request.config))
            if peer is not None:
                peer.close(bound)
            close_within(local, bound, "the suite's agent")

    @pytest.fixture(autouse=True)
    def _declared_capabilities(self, request: pytest.FixtureRequest, link: Link) -> None:
        """The one check of a test's ``@capability`` needs: skip, with the reason, when the
        transport lacks one."""
        _, needs = declared(request.node)
        reason = missing(link.caps, needs)
        if reason is not None:
            pytest.skip(reason)

    # -- helpers ----------------------------------------------------------------------

    def expect_rejected(
        self, link: Link, post: Callable[[], object], what: str, agent: Transport | None = None
    ) -> None:
        """A bad post must raise TransportError or end FAILED: never DONE, crash or hang.
        ``agent``: the one that posted, when not the link's."""
        try:
            handle = post()
        except TransportError:
            return
        except Exception as exc:
            pytest.fail(f"{what}: raised {type(exc).__name__} ({exc}), not a TransportError")
        poster = link.local if agent is None else agent
        state = link.wait(handle) if agent is None else wait_for(poster, handle, link.timeout)
        assert state is XferState.FAILED, f"{what}: the transfer ended {state.name}, not FAILED"
        with contextlib.suppress(TransportError):
            poster.release(handle)

    def roundtrip(self, link: Link, alloc: str = "numpy", tag: str = "sanity") -> None:
        """A small READ that must succeed: the agent still works after what came before."""
        lr, pr = link.local_regions[alloc], link.peer_regions[alloc]
        link.peer.fill(pr.addr, 4096, seed(tag))
        local = memory.descs(lr.addr, np.array([17]), np.array([4000]))
        remote = memory.descs(pr.addr, np.array([33]), np.array([4000]))
        handle = link.local.read(link.peer_name, local, remote)
        state = link.wait(handle)
        assert state is XferState.DONE, f"{tag}: a plain READ ended {state.name}"
        link.local.release(handle)
        expected = memory.pattern(seed(tag), 4096)[33:4033]
        assert_bytes(lr.view[17:4017].copy(), expected, np.array([0]), np.array([4000]), tag)
