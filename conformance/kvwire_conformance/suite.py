"""The conformance suite: a base class an adapter's tests subclass (zarr.testing style).

::

    from kvwire_conformance import TransportSuite

    class TestMyTransport(TransportSuite):
        transport = "mine"            # entry-point name or "module:factory"
        options = {"device": "lo"}    # keyword options for the factory, both sides

The test process runs one agent; a peer agent process (:mod:`kvwire.peer.process`)
runs the other with the same factory and options. Memory is checked with oracle reads and
writes that never go through the transport. A test whose capability the transport does not
claim is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pytest

from kvwire.errors import TransportError
from kvwire.peer import protocol as p
from kvwire.peer.agent import PeerAgent
from kvwire.transport import (
    Capabilities,
    MemKind,
    Transport,
    XferState,
    create,
    load,
    region_of_array,
    wait_for,
)
from kvwire_conformance import memory
from kvwire_conformance.lifecycle import LifecycleTests
from kvwire_conformance.memory import I64, U8
from kvwire_conformance.paths import PathTests, agent_classes_declare
from kvwire_conformance.resources import leaks_after, snapshot

capability = pytest.mark.kvwire_capability
"""Tag a test with the capability it exercises; the report groups results by it."""

# name -> (descriptor count, min length, max length)
CASES: dict[str, tuple[int, int, int]] = {
    "one-byte": (1, 1, 1),
    "large-8MiB": (3, 8 << 20, 8 << 20),
    "mixed-1B-256KiB": (100, 1, 256 << 10),
    "many-small-1B-16KiB": (2_000, 1, 16 << 10),
    "100k-tiny-1B-64B": (100_000, 1, 64),
}


def _seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


@dataclass
class LocalRegion:
    array: Any
    addr: int
    nbytes: int
    handle: object

    @property
    def view(self) -> U8:
        return memory.view(self.addr, self.nbytes)


@dataclass
class PeerRegion:
    region: int
    addr: int
    nbytes: int


@dataclass
class Spec:
    transport: str
    options: dict[str, Any]
    env: dict[str, str]
    allocators: tuple[str, ...]


@dataclass
class Link:
    """A connected pair: this process's agent and a peer agent process."""

    spec: Spec
    local: Transport
    peer: PeerAgent
    peer_name: str
    local_name: str
    timeout: float
    local_regions: dict[str, LocalRegion] = field(default_factory=dict)
    peer_regions: dict[str, PeerRegion] = field(default_factory=dict)

    @property
    def caps(self) -> Capabilities:
        return self.local.capabilities

    def wait(self, handle: object) -> XferState:
        """The state the transfer ends in; a terminal state must poll the same again."""
        state = wait_for(self.local, handle, self.timeout)
        if state is not XferState.PENDING:
            again = [self.local.poll(handle) for _ in range(2)]
            assert again == [state, state], (
                f"a transfer that ended {state.name} polled again as "
                f"{[s.name for s in again]}: a terminal state is final"
            )
        return state

    def local_notifications(self, at_least: int) -> list[tuple[str, bytes]]:
        """Drain this agent's notifications until ``at_least`` are in hand or timeout."""
        got: list[tuple[str, bytes]] = []
        deadline = _deadline(self.timeout)
        while True:
            got += self.local.drain_notifications()
            if len(got) >= at_least or _expired(deadline):
                return got
            self.local.wait(0.05)


CLOSE_TIMEOUT_S = 10.0
"""How long a fixture's teardown waits for an agent's ``close()``."""


def _test_timeout(config: pytest.Config) -> float:
    try:
        return float(config.getoption("--kvwire-timeout"))
    except ValueError:  # the plugin is not loaded
        return CLOSE_TIMEOUT_S


def close_within(agent: Transport, seconds: float, what: str) -> None:
    """``agent.close()`` on a helper thread, failing the test if it does not return in time.

    pytest-timeout fires once per test: after a test body timed out, its teardown runs
    unbounded, so a ``close()`` that hangs there needs its own limit.
    """
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            agent.close()
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="kvwire-conformance-close", daemon=True).start()
    if not done.wait(seconds):
        pytest.fail(f"{what}: close() did not return within {seconds:g} s", pytrace=False)
    if errors:
        raise errors[0]


def _with_declared_allocators(
    allocators: tuple[str, ...], link_agent: Transport
) -> tuple[str, ...]:
    """``allocators`` plus those the agent's class (or a wrapped agent's, through
    ``.inner``) declares: a plain-function factory or a wrapper must not lose them."""
    out = list(allocators)
    for declared in agent_classes_declare(link_agent, "conformance_allocators"):
        out += [str(spec) for spec in declared if str(spec) not in out]
    return tuple(out)


def _deadline(seconds: float) -> float:
    import time

    return time.monotonic() + seconds


def _expired(deadline: float) -> bool:
    import time

    return time.monotonic() >= deadline


def _reason(transport: Transport, handle: object) -> str:
    explain = getattr(transport, "failure_reason", None)
    if explain is None:
        return ""
    try:
        return f" ({explain(handle)})"
    except TransportError:
        return ""


def assert_bytes(got: U8, expected: U8, offsets: I64, lengths: I64, where: str) -> None:
    """Equal, or a message naming the first wrong byte and the descriptor that covers it."""
    if got.shape == expected.shape and np.array_equal(got, expected):
        return
    if got.shape != expected.shape:
        pytest.fail(f"{where}: got {got.shape[0]} bytes, expected {expected.shape[0]}")
    first = int(np.flatnonzero(got != expected)[0])
    wrong = int(np.count_nonzero(got != expected))
    hit = np.flatnonzero((offsets <= first) & (first < offsets + lengths))
    which = (
        f"inside descriptor {int(hit[0])} of {offsets.shape[0]}"
        if hit.shape[0]
        else "outside every descriptor (a stray write)"
    )
    pytest.fail(f"{where}: {wrong} wrong bytes; the first at offset {first}, {which}")


class TransportSuite(PathTests, LifecycleTests):
    """Subclass and set :attr:`transport` (and :attr:`options`) to run the whole suite."""

    transport: ClassVar[str] = ""
    """Entry-point name (``shm``) or ``module:factory``."""
    options: ClassVar[dict[str, Any]] = {}
    """Keyword options for ``factory(name, **options)``, used on both sides."""
    peer_env: ClassVar[dict[str, str]] = {}
    """Extra environment for the peer agent process."""
    allocators: ClassVar[tuple[str, ...] | None] = None
    """Host allocators to run the memory tests over; None: the default set
    (:data:`~kvwire_conformance.memory.DEFAULT_ALLOCATORS`) plus every
    ``conformance_allocators`` (``module:function(nbytes) -> uint8 array``) that the
    factory or the agent's class (or a wrapped agent's) declares."""
    region_bytes: ClassVar[int] = 32 << 20
    timeout: ClassVar[float] = 60.0
    """Seconds any single wait may take before the test fails (not how long tests take)."""

    # -- hooks -----------------------------------------------------------------------

    @classmethod
    def transport_spec(cls, config: pytest.Config) -> tuple[str, dict[str, Any]]:
        """Which transport to test; the CLI's generic class reads it from the command line."""
        return cls.transport, dict(cls.options)

    # -- fixtures ---------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def spec(cls, request: pytest.FixtureRequest) -> Spec:
        transport, options = cls.transport_spec(request.config)
        if not transport:
            pytest.fail(f"{cls.__name__} names no transport: set `transport = ...`", pytrace=False)
        allocators = cls.allocators
        if allocators is None:
            extra = getattr(load(transport), "conformance_allocators", ())
            allocators = (*memory.DEFAULT_ALLOCATORS, *tuple(extra))
        return Spec(transport, options, dict(cls.peer_env), tuple(allocators))

    @pytest.fixture(scope="class")
    @classmethod
    def link(cls, spec: Spec, request: pytest.FixtureRequest) -> Iterator[Link]:
        local_name = f"kvwire-conformance-local-{uuid.uuid4().hex[:8]}"
        local = create(spec.transport, local_name, **spec.options)
        peer: PeerAgent | None = None
        try:
            peer = PeerAgent(spec.transport, spec.options, env=spec.env, timeout=cls.timeout)
            if cls.allocators is None:
                spec.allocators = _with_declared_allocators(spec.allocators, local)
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

    # -- helpers ----------------------------------------------------------------------

    @staticmethod
    def require(link: Link, *needs: str) -> None:
        caps = link.caps
        for need in needs:
            if need == "dram":
                if MemKind.DRAM not in caps.mem_kinds:
                    pytest.skip("transport does not register host (DRAM) memory")
            elif not getattr(caps, need):
                pytest.skip(f"transport does not claim capability {need!r}")

    def expect_rejected(self, link: Link, post: Callable[[], object], what: str) -> None:
        """A bad post must raise TransportError or end FAILED: never DONE, crash or hang."""
        try:
            handle = post()
        except TransportError:
            return
        except Exception as exc:
            pytest.fail(f"{what}: raised {type(exc).__name__} ({exc}), not a TransportError")
        state = link.wait(handle)
        assert state is XferState.FAILED, f"{what}: the transfer ended {state.name}, not FAILED"
        with contextlib.suppress(TransportError):
            link.local.release(handle)

    def roundtrip(self, link: Link, alloc: str = "numpy", tag: str = "sanity") -> None:
        """A small READ that must succeed: the agent still works after what came before."""
        lr, pr = link.local_regions[alloc], link.peer_regions[alloc]
        link.peer.fill(pr.addr, 4096, _seed(tag))
        local = memory.descs(lr.addr, np.array([17]), np.array([4000]))
        remote = memory.descs(pr.addr, np.array([33]), np.array([4000]))
        handle = link.local.read(link.peer_name, local, remote)
        state = link.wait(handle)
        assert state is XferState.DONE, f"{tag}: a plain READ ended {state.name}"
        link.local.release(handle)
        expected = memory.pattern(_seed(tag), 4096)[33:4033]
        assert_bytes(lr.view[17:4017].copy(), expected, np.array([0]), np.array([4000]), tag)

    # -- READ / WRITE correctness -----------------------------------------------------

    @capability("read")
    @pytest.mark.parametrize("case", list(CASES))
    def test_read_moves_exact_bytes(self, link: Link, case: str) -> None:
        self.require(link, "read", "dram")
        for alloc in link.spec.allocators:
            self._read_case(link, alloc, case)

    def _read_case(self, link: Link, alloc: str, case: str) -> None:
        count, lo, hi = CASES[case]
        lr, pr = link.local_regions[alloc], link.peer_regions[alloc]
        n = lr.nbytes
        rng = np.random.default_rng(_seed("read", alloc, case))
        loff, lengths = memory.random_spans(rng, n, count, lo, hi)
        roff = memory.place(rng, pr.nbytes, lengths)
        src_seed, bg_seed = _seed("src", case), _seed("bg", case)
        link.peer.fill(pr.addr, pr.nbytes, src_seed)
        background = memory.cached_pattern(bg_seed, n)
        lr.view[:] = background
        handle = link.local.read(
            link.peer_name,
            memory.descs(lr.addr, loff, lengths),
            memory.descs(pr.addr, roff, lengths),
        )
        state = link.wait(handle)
        assert state is XferState.DONE, (
            f"READ {case} ended {state.name}{_reason(link.local, handle)}"
        )
        got = lr.view.copy()
        link.local.release(handle)
        expected = background.copy()
        moved = memory.gather(memory.cached_pattern(src_seed, pr.nbytes), roff, lengths)
        memory.scatter(expected, loff, lengths, moved)
        assert_bytes(got, expected, loff, lengths, f"READ {case} [{alloc}] local memory")

    @capability("write")
    @pytest.mark.parametrize("case", list(CASES))
    def test_write_moves_exact_bytes(self, link: Link, case: str) -> None:
        self.require(link, "write", "dram")
        for alloc in link.spec.allocators:
            self._write_case(link, alloc, case)

    def _write_case(self, link: Link, alloc: str, case: str) -> None:
        count, lo, hi = CASES[case]
        lr, pr = link.local_regions[alloc], link.peer_regions[alloc]
        rng = np.random.default_rng(_seed("write", alloc, case))
        loff, lengths = memory.random_spans(rng, lr.nbytes, count, lo, hi)
        roff = memory.place(rng, pr.nbytes, lengths)
        src_seed, bg_seed = _seed("wsrc", case), _seed("wbg", case)
        lr.view[:] = memory.cached_pattern(src_seed, lr.nbytes)
        link.peer.fill(pr.addr, pr.nbytes, bg_seed)
        handle = link.local.write(
            link.peer_name,
            memory.descs(lr.addr, loff, lengths),
            memory.descs(pr.addr, roff, lengths),
        )
        state = link.wait(handle)
        assert state is XferState.DONE, (
            f"WRITE {case} ended {state.name}{_reason(link.local, handle)}"
        )
        link.local.release(handle)
        whole = memory.descs(pr.addr, np.array([0]), np.array([pr.nbytes]))
        expected = memory.cached_pattern(bg_seed, pr.nbytes).copy()
        memory.scatter(expected, roff, lengths, memory.gather(lr.view, loff, lengths))
        if link.peer.digest(whole) != zlib.crc32(expected.tobytes()):
            got = np.frombuffer(link.peer.read(whole), dtype=np.uint8)
            assert_bytes(got, expected, roff, lengths, f"WRITE {case} [{alloc}] peer memory")

    @capability("read")
    def test_empty_descriptor_list_is_not_a_crash(self, link: Link) -> None:
        self.require(link, "read", "dram")
        empty = np.zeros((0, 3), dtype=np.int64)
        try:
            handle = link.local.read(link.peer_name, empty, empty)
        except TransportError:
            return
        state = link.wait(handle)
        assert state is not XferState.PENDING, "an empty READ never finished"
        link.local.release(handle)

    # -- notifications ----------------------------------------------------------------

    def _bulk(self, link: Link, alloc: str, tag: str, fine: bool) -> tuple[I64, I64, I64]:
        """Spans that take a while to move, so a too-early notification wins its race:
        24 x 1 MiB, or (``fine``) 128k x 64 B, where per-descriptor costs dominate."""
        lr, pr = link.local_regions[alloc], link.peer_regions[alloc]
        rng = np.random.default_rng(_seed(tag))
        count, size = (128 << 10, 64) if fine else (24, 1 << 20)
        lengths = np.full(count, size, dtype=np.int64)
        return memory.place(rng, lr.nbytes, lengths), memory.place(rng, pr.nbytes, lengths), lengths

    @capability("notifications")
    def test_write_notification_arrives_after_its_data(self, link: Link) -> None:
        self.require(link, "write", "notifications", "dram")
        for alloc in link.spec.allocators:
            lr, pr = link.local_regions[alloc], link.peer_regions[alloc]
            # Coarse spans for one allocator, fine for the next: each catches an early
            # notification (the peer checks at once), so one round per allocator does.
            for round_ in (link.spec.allocators.index(alloc),):
                loff, roff, lengths = self._bulk(link, alloc, f"wnotify{round_}", round_ % 2 == 1)
                src_seed = _seed("wnotify-src", round_)
                lr.view[:] = memory.cached_pattern(src_seed, lr.nbytes)
                link.peer.fill(pr.addr, pr.nbytes, _seed("wnotify-bg", round_))
                message = f"conformance:write-notify:{uuid.uuid4().hex}".encode()
                # The peer reads the last descriptors first: the ones a too-early
                # notification would beat.
                rev = slice(None, None, -1)
                remote = memory.descs(pr.addr, roff, lengths)
                link.peer.start(p.AwaitThenRead(message, remote[rev].tobytes(), self.timeout))
                handle = link.local.write(
                    link.peer_name, memory.descs(lr.addr, loff, lengths), remote, message
                )
                answer = link.peer.finish(self.timeout * 2)
                state = link.wait(handle)
                assert state is XferState.DONE, f"WRITE ended {state.name}"
                link.local.release(handle)
                assert answer["found"], "the WRITE's notification never reached the peer"
                expected = memory.gather(lr.view, loff[rev], lengths[rev])
                got = np.frombuffer(answer["data"], dtype=np.uint8)
                assert_bytes(
                    got,
                    expected,
                    np.cumsum(lengths[rev]) - lengths[rev],
                    lengths[rev],
                    f"[{alloc}] peer memory when the WRITE's notification arrived",
                )

    @capability("notifications")
    def test_read_notification_arrives_after_its_data(self, link: Link) -> None:
        """The READ's target may reuse its memory once notified: the reader's bytes stay."""
        self.require(link, "read", "notifications", "dram")
        for alloc in link.spec.allocators:
            lr, pr = link.local_regions[alloc], link.peer_regions[alloc]
            # Coarse spans for one allocator, fine for the next: each catches an early
            # notification (the peer checks at once), so one round per allocator does.
            for round_ in (link.spec.allocators.index(alloc),):
                loff, roff, lengths = self._bulk(link, alloc, f"rnotify{round_}", round_ % 2 == 1)
                src_seed = _seed("rnotify-src", round_)
                link.peer.fill(pr.addr, pr.nbytes, src_seed)
                message = f"conformance:read-notify:{uuid.uuid4().hex}".encode()
                link.peer.start(
                    p.AwaitThenFill(
                        message, pr.addr, pr.nbytes, _seed("over", round_), self.timeout
                    )
                )
                handle = link.local.read(
                    link.peer_name,
                    memory.descs(lr.addr, loff, lengths),
                    memory.descs(pr.addr, roff, lengths),
                    message,
                )
                state = link.wait(handle)
                found = link.peer.finish(self.timeout * 2)
                assert state is XferState.DONE, f"READ ended {state.name}"
                assert found, "the READ's notification never reached the peer"
                got = memory.gather(lr.view, loff, lengths)
                link.local.release(handle)
                expected = memory.gather(memory.cached_pattern(src_seed, pr.nbytes), roff, lengths)
                assert_bytes(
                    got,
                    expected,
                    np.cumsum(lengths) - lengths,
                    lengths,
                    f"[{alloc}] READ data (the source was reused when its notification came)",
                )

    @capability("notifications")
    def test_notifications_arrive_exactly_once(self, link: Link) -> None:
        self.require(link, "read", "notifications", "dram")
        lr, pr = link.local_regions["numpy"], link.peer_regions["numpy"]
        link.peer.drain()
        tag = uuid.uuid4().hex
        expected: list[bytes] = []
        handles = []
        for i in range(20):
            message = f"once:{tag}:xfer:{i}".encode()
            local = memory.descs(lr.addr, np.array([i * 8192]), np.array([4096]))
            remote = memory.descs(pr.addr, np.array([i * 8192 + 3]), np.array([4096]))
            handles.append(link.local.read(link.peer_name, local, remote, message))
            expected.append(message)
            message = f"once:{tag}:plain:{i}".encode()
            link.local.notify(link.peer_name, message)
            expected.append(message)
        for handle in handles:
            assert link.wait(handle) is XferState.DONE
            link.local.release(handle)
        got = link.peer.drain(at_least=len(expected), timeout=self.timeout)
        marker = f"once:{tag}:marker".encode()
        link.local.notify(link.peer_name, marker)
        got += link.peer.drain(at_least=1, timeout=self.timeout)
        messages = [m for _, m in got]
        assert marker in messages, "the marker notification never arrived"
        messages.remove(marker)
        assert sorted(messages) == sorted(expected), (
            f"expected each of {len(expected)} notifications once; "
            f"missing {sorted(set(expected) - set(messages))[:3]}, "
            f"extra {[m for m in set(messages) if messages.count(m) != 1 or m not in expected][:3]}"
        )
        assert {peer for peer, _ in got} == {link.local_name}, (
            "notifications named the wrong sender"
        )

    @capability("notifications")
    def test_notifications_without_transfers_both_ways(self, link: Link) -> None:
        self.require(link, "notifications")
        link.peer.drain()
        link.local.drain_notifications()
        messages = [
            b"\x00binary\xff" + bytes(range(256)),
            b"x",
            b"k" * 4096,
            "\u00e9t\u00e9".encode(),
        ]
        for message in messages:
            link.local.notify(link.peer_name, message)
        got = link.peer.drain(at_least=len(messages), timeout=self.timeout)
        assert sorted(m for _, m in got) == sorted(messages)
        assert {peer for peer, _ in got} == {link.local_name}
        for message in messages:
            link.peer.call(p.Notify(link.local_name, message))
        back = link.local_notifications(len(messages))
        assert sorted(m for _, m in back) == sorted(messages)
        assert {peer for peer, _ in back} == {link.peer_name}, "wrong sender name on arrival"

    @capability("ordered_notifications")
    def test_notifications_keep_their_order(self, link: Link) -> None:
        self.require(link, "notifications", "ordered_notifications", "dram")
        lr, pr = link.local_regions["numpy"], link.peer_regions["numpy"]
        link.peer.drain()
        tag = uuid.uuid4().hex
        sent: list[bytes] = []
        for i in range(200):
            message = f"order:{tag}:{i:04d}".encode()
            if i % 20 == 10:  # a completed transfer's notification sits among plain ones
                local = memory.descs(lr.addr, np.array([0]), np.array([4096]))
                remote = memory.descs(pr.addr, np.array([0]), np.array([4096]))
                handle = link.local.read(link.peer_name, local, remote, message)
                assert link.wait(handle) is XferState.DONE
                link.local.release(handle)
            else:
                link.local.notify(link.peer_name, message)
            sent.append(message)
        got = [m for _, m in link.peer.drain(at_least=len(sent), timeout=self.timeout)]
        assert got == sent, "notifications from one agent arrived out of order"

    # -- many transfers at once, release ------------------------------------------------

    @capability("read")
    def test_many_concurrent_transfers(self, link: Link) -> None:
        self.require(link, "read", "write", "dram")
        lr, pr = link.local_regions["numpy"], link.peer_regions["numpy"]
        slots, per = 64, 8
        slot = lr.nbytes // slots
        rng = np.random.default_rng(_seed("concurrent"))
        local_seed, peer_seed = _seed("conc-local"), _seed("conc-peer")
        lr.view[:] = memory.pattern(local_seed, lr.nbytes)
        link.peer.fill(pr.addr, pr.nbytes, peer_seed)
        local_expected = memory.pattern(local_seed, lr.nbytes).copy()
        peer_expected = memory.pattern(peer_seed, pr.nbytes).copy()
        posted = []
        for i in range(slots):
            loff, lengths = memory.random_spans(rng, slot, per, 1, slot // per)
            roff = memory.place(rng, slot, lengths)
            loff, roff = loff + i * slot, roff + i * slot
            if i % 2:
                moved = memory.gather(peer_expected, roff, lengths)
                memory.scatter(local_expected, loff, lengths, moved)
                post = link.local.read
            else:
                moved = memory.gather(local_expected, loff, lengths)
                memory.scatter(peer_expected, roff, lengths, moved)
                post = link.local.write
            local, remote = (
                memory.descs(lr.addr, loff, lengths),
                memory.descs(pr.addr, roff, lengths),
            )
            posted.append(post(link.peer_name, local, remote))
        states = [link.wait(h) for h in posted]
        assert all(s is XferState.DONE for s in states), [s.name for s in states]
        for handle in posted:
            link.local.release(handle)
        everything = np.array([0]), np.array([lr.nbytes])
        assert_bytes(lr.view.copy(), local_expected, *everything, "local memory")
        whole = memory.descs(pr.addr, np.array([0]), np.array([pr.nbytes]))
        got = np.frombuffer(link.peer.read(whole), dtype=np.uint8)
        assert_bytes(got, peer_expected, *everything, "peer memory")

    @capability("read")
    def test_release_of_a_running_transfer(self, link: Link) -> None:
        self.require(link, "read", "dram")
        lr, pr = link.local_regions["numpy"], link.peer_regions["numpy"]
        lengths = np.full(8192, 4096, dtype=np.int64)
        offsets = np.arange(8192, dtype=np.int64) * 4096
        handle = link.local.read(
            link.peer_name,
            memory.descs(lr.addr, offsets, lengths),
            memory.descs(pr.addr, offsets, lengths),
        )
        try:
            link.local.release(handle)
        except TransportError:
            # Allowed: a transport that cannot abort says so; it must then finish and let go.
            assert link.wait(handle) is not XferState.PENDING
            link.local.release(handle)
        with pytest.raises(TransportError):
            link.local.poll(handle)
        with pytest.raises(TransportError):
            link.local.release(handle)
        self.roundtrip(link, tag="after-release")

    def test_foreign_handles_are_rejected(self, link: Link) -> None:
        for bogus in (object(), None, 12345, "handle"):
            with pytest.raises(TransportError):
                link.local.poll(bogus)
            with pytest.raises(TransportError):
                link.local.release(bogus)

    # -- bad input ------------------------------------------------------------------------

    @capability("read")
    @pytest.mark.parametrize(
        "defect",
        [
            "remote-past-region",
            "remote-straddles-end",
            "local-unregistered",
            "unknown-peer",
            "length-mismatch",
            "count-mismatch",
            "wrong-shape",
        ],
    )
    @pytest.mark.parametrize("op", ["read", "write"])
    def test_bad_descriptors_are_a_transport_error(self, link: Link, defect: str, op: str) -> None:
        self.require(link, op, "dram")
        lr, pr = link.local_regions["numpy"], link.peer_regions["numpy"]
        stray = np.zeros(1 << 16, dtype=np.uint8)
        peer = link.peer_name
        local = memory.descs(lr.addr, np.array([64]), np.array([256]))
        remote = memory.descs(pr.addr, np.array([64]), np.array([256]))
        if defect == "remote-past-region":
            remote = memory.descs(pr.addr + pr.nbytes + 4096, np.array([0]), np.array([256]))
        elif defect == "remote-straddles-end":
            remote = memory.descs(pr.addr, np.array([pr.nbytes - 100]), np.array([256]))
        elif defect == "local-unregistered":
            local = memory.descs(int(stray.ctypes.data), np.array([0]), np.array([256]))
        elif defect == "unknown-peer":
            peer = f"no-such-agent-{uuid.uuid4().hex[:6]}"
        elif defect == "length-mismatch":
            remote = memory.descs(pr.addr, np.array([64]), np.array([512]))
        elif defect == "count-mismatch":
            remote = memory.descs(pr.addr, np.array([64, 4096]), np.array([128, 128]))
        else:
            local = local[:, :2].copy()
        post = link.local.read if op == "read" else link.local.write
        self.expect_rejected(link, lambda: post(peer, local, remote), f"{op} with {defect}")
        self.roundtrip(link, tag=f"after-{defect}")

    @capability("read")
    def test_deregistered_memory_is_refused(self, link: Link) -> None:
        self.require(link, "read", "dram")
        pr = link.peer_regions["numpy"]
        extra = np.zeros(1 << 20, dtype=np.uint8)
        handle = link.local.register([region_of_array(extra)])
        local = memory.descs(int(extra.ctypes.data), np.array([5]), np.array([1000]))
        remote = memory.descs(pr.addr, np.array([7]), np.array([1000]))
        link.peer.fill(pr.addr, 4096, _seed("dereg"))
        xfer = link.local.read(link.peer_name, local, remote)
        assert link.wait(xfer) is XferState.DONE
        link.local.release(xfer)
        assert np.array_equal(extra[5:1005], memory.pattern(_seed("dereg"), 4096)[7:1007])
        link.local.deregister(handle)
        self.expect_rejected(
            link, lambda: link.local.read(link.peer_name, local, remote), "READ into deregistered"
        )
        self.roundtrip(link, tag="after-deregister")

    # -- peer death -------------------------------------------------------------------

    def _doomed_peer(self, link: Link) -> tuple[PeerAgent, str, dict[str, int]]:
        doomed = PeerAgent(
            link.spec.transport, link.spec.options, env=link.spec.env, timeout=self.timeout
        )
        region = doomed.alloc(self.region_bytes)
        doomed.fill(region["addr"], region["nbytes"], _seed("doomed"))
        name = link.local.add_peer(doomed.metadata())
        return doomed, name, region

    @capability("cross_process")
    def test_transfers_to_a_dead_peer_fail(self, link: Link) -> None:
        self.require(link, "read", "write", "dram")
        lr = link.local_regions["numpy"]
        doomed, name, region = self._doomed_peer(link)
        local = memory.descs(lr.addr, np.array([0]), np.array([65536]))
        remote = memory.descs(region["addr"], np.array([0]), np.array([65536]))
        handle = link.local.read(name, local, remote)
        assert link.wait(handle) is XferState.DONE, "a READ from a live peer failed"
        link.local.release(handle)
        doomed.die()
        self.expect_rejected(link, lambda: link.local.read(name, local, remote), "READ, dead peer")
        self.expect_rejected(
            link, lambda: link.local.write(name, local, remote), "WRITE, dead peer"
        )
        with contextlib.suppress(TransportError):
            link.local.notify(name, b"anyone there?")
        with contextlib.suppress(TransportError):
            link.local.remove_peer(name)
        self.roundtrip(link, tag="other-peer-after-death")

    @capability("cross_process")
    def test_peer_dying_mid_transfer_is_never_done_with_wrong_data(self, link: Link) -> None:
        self.require(link, "read", "dram")
        lr = link.local_regions["numpy"]
        doomed, name, region = self._doomed_peer(link)
        lr.view[:] = 0
        per, chunk = 64, 64 << 10
        handles = []
        for i in range(lr.nbytes // (per * chunk)):
            offsets = np.arange(per, dtype=np.int64) * chunk + i * per * chunk
            lengths = np.full(per, chunk, dtype=np.int64)
            handles.append(
                link.local.read(
                    name,
                    memory.descs(lr.addr, offsets, lengths),
                    memory.descs(region["addr"], offsets, lengths),
                )
            )
        doomed.die()
        states = [link.wait(h) for h in handles]
        assert XferState.PENDING not in states, "a transfer hung after its peer died"
        source = memory.pattern(_seed("doomed"), region["nbytes"])
        span = per * chunk
        for i, state in enumerate(states):
            if state is XferState.DONE:
                window = slice(i * span, (i + 1) * span)
                assert np.array_equal(lr.view[window], source[window]), (
                    f"transfer {i} reported DONE but its bytes are not all there"
                )
            link.local.release(handles[i])
        local = memory.descs(lr.addr, np.array([0]), np.array([4096]))
        remote = memory.descs(region["addr"], np.array([0]), np.array([4096]))
        self.expect_rejected(link, lambda: link.local.read(name, local, remote), "after death")

    # -- lifecycle --------------------------------------------------------------------

    def _full_cycle(self, link: Link, tag: str) -> None:
        agent = create(
            link.spec.transport,
            f"kvwire-conformance-{tag}-{uuid.uuid4().hex[:6]}",
            **link.spec.options,
        )
        try:
            array = np.zeros(1 << 20, dtype=np.uint8)
            handle = agent.register([region_of_array(array)])
            peer = agent.add_peer(link.peer.metadata())
            pr = link.peer_regions.get("numpy")
            if pr is not None and agent.capabilities.read:
                xfer = agent.read(
                    peer,
                    memory.descs(int(array.ctypes.data), np.array([0]), np.array([4096])),
                    memory.descs(pr.addr, np.array([0]), np.array([4096])),
                    b"cycle",
                )
                assert wait_for(agent, xfer, self.timeout) is XferState.DONE
                agent.release(xfer)
            if agent.capabilities.notifications:
                agent.notify(peer, b"cycle-plain")
                link.peer.drain(at_least=2, timeout=self.timeout)
            agent.remove_peer(peer)
            agent.deregister(handle)
        finally:
            agent.close()

    @capability("close")
    def test_close_leaves_no_threads_fds_or_mappings(self, link: Link) -> None:
        self.require(link, "dram")
        self._full_cycle(link, "warmup")  # lets libraries set up their process-wide state
        before = snapshot()
        self._full_cycle(link, "measured")
        leaks = leaks_after(before, timeout=5.0)
        assert not leaks, "after close(): " + "; ".join(leaks)

    @capability("close")
    def test_a_closed_agent_refuses_every_call(self, link: Link) -> None:
        """Contract: after ``close()`` (idempotent) every call raises TransportError."""
        agent = create(
            link.spec.transport,
            f"kvwire-conformance-closed-{uuid.uuid4().hex[:6]}",
            **link.spec.options,
        )
        array = np.zeros(1 << 16, dtype=np.uint8)
        registration = agent.register([region_of_array(array)])
        peer = agent.add_peer(link.peer.metadata())
        one = memory.descs(int(array.ctypes.data), np.array([0]), np.array([64]))
        pr = next(iter(link.peer_regions.values()), None)
        remote = memory.descs(pr.addr, np.array([0]), np.array([64])) if pr else one
        handle: object = None
        if agent.capabilities.read and pr is not None:
            handle = agent.read(peer, one, remote)
            wait_for(agent, handle, self.timeout)
        agent.close()
        agent.close()  # closing twice is harmless
        calls: list[tuple[str, Callable[[], object]]] = [
            ("register", lambda: agent.register([region_of_array(array)])),
            ("deregister", lambda: agent.deregister(registration)),
            ("local_metadata", agent.local_metadata),
            ("add_peer", lambda: agent.add_peer(link.peer.metadata())),
            ("remove_peer", lambda: agent.remove_peer(peer)),
            ("read", lambda: agent.read(peer, one, remote)),
            ("write", lambda: agent.write(peer, one, remote)),
            ("poll", lambda: agent.poll(handle)),
            ("release", lambda: agent.release(handle)),
            ("notify", lambda: agent.notify(peer, b"x")),
            ("drain_notifications", agent.drain_notifications),
            ("wait", lambda: agent.wait(0.0)),
        ]
        wrong = []
        for what, call in calls:
            try:
                call()
            except TransportError:
                continue
            except Exception as exc:
                wrong.append(f"{what} raised {type(exc).__name__}")
            else:
                wrong.append(f"{what} returned")
        assert not wrong, "after close(), not a TransportError: " + ", ".join(wrong)

    # -- random operation sequences -----------------------------------------------------

    @capability("read")
    def test_random_operation_sequences(self, link: Link) -> None:
        self.require(link, "read", "write", "notifications", "dram")
        from kvwire_conformance.machine import run_machine

        run_machine(link, self.timeout)
