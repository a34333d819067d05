"""``kvwire bench machine``: events per second of the sans-IO transfer state machines.

One consumer and one producer machine (pull mode, TP 1 on both sides) are driven in one
thread, so the figure is one core's. The driver keeps a fixed number of requests live on each
machine: every step starts a new request and completes the oldest one, so the live count is
the swept quantity and stays constant while it is measured. A step is seven events:

- consumer: ``RequestAdded``, ``AllocationDone`` (-> ``PostRead``), ``TransferPosted`` for
  the new request, ``TransferDone`` (-> ``RequestDone``) for the oldest;
- producer: ``RequestAdded``, ``PrefillFinished`` for the new request,
  ``NotificationReceived`` with the oldest's completion (-> ``FreeBlocks``);

plus ``Timer`` events whenever a machine's deadline comes due, and the consumer's heartbeats
delivered to the producer. The clock is simulated: a step takes 10 ms, or less so that a
request stays live for at most a tenth of the lease; heartbeats fire and leases never expire,
as in a healthy deployment. Each request holds 16 blocks (a 256-token prompt of 16-token blocks).

The timed loop includes what any driver must do besides ``handle``: building and validating
each event and picking the transfer id and notification out of the actions. The baseline is
a dict insert and pop per event with the same number of live keys, in the same run: the
cheapest bookkeeping a request table could possibly do. Time is this process's CPU time
(one core's work, whatever else the machine runs). Python's cyclic garbage collector is
paused while timing (its cost depends on the whole process); ``events_per_s_gc_on`` gives
the figure with it running.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
from collections import deque
from collections.abc import Callable, Sequence

from kvwire.bench.report import Report, Result, Timing, cpu_clock, gc_paused
from kvwire.config import KVWireConfig
from kvwire.machine import (
    Action,
    AllocationDone,
    ConsumerMachine,
    HandshakeDone,
    NotificationReceived,
    PostRead,
    PrefillFinished,
    ProducerMachine,
    RemotePrefill,
    RequestAdded,
    SendNotification,
    StartHandshake,
    Timer,
    TransferDone,
    TransferPosted,
)

BLOCKS_PER_REQUEST = 16
HEADLINE_LIVE = 1000
CONSUMER_ENGINE = "decode-0"
PRODUCER_ENGINE = "prefill-0"
CONSUMER_AGENT = "decode-0-agent-0"
LEASE_S = 30.0
MAX_STEP_S = 0.01
"""Simulated time per step: at least 100 requests complete per second."""


class PullPipeline:
    """A consumer and a producer machine with ``live`` requests in flight on each."""

    def __init__(self, live: int, *, check_invariants: bool = True) -> None:
        if live < 1:
            raise ValueError("live must be >= 1")
        self.live = live
        self.consumer = ConsumerMachine(
            KVWireConfig(
                environ={},
                engine_id=CONSUMER_ENGINE,
                lease_s=LEASE_S,
                check_invariants=check_invariants,
            )
        )
        self.producer = ProducerMachine(
            KVWireConfig(
                environ={},
                engine_id=PRODUCER_ENGINE,
                lease_s=LEASE_S,
                check_invariants=check_invariants,
            )
        )
        # A request's blocks are reused once it is freed: live + 1 slots suffice because the
        # new request is admitted before the oldest is completed.
        self._blocks = [
            (tuple(range(s * BLOCKS_PER_REQUEST, (s + 1) * BLOCKS_PER_REQUEST)),)
            for s in range(live + 1)
        ]
        self._dt = min(MAX_STEP_S, LEASE_S / 10 / live)
        self._now = 1.0
        self._next = 0
        self._inflight: deque[tuple[int, bytes]] = deque()
        self.events = 0
        self._handshake()
        for _ in range(live - 1):
            self._admit()

    def _handshake(self) -> None:
        """The first request makes the consumer handshake; answer it so the engine is READY."""
        actions = self._consumer_add(self._next)
        starts = [a for a in actions if isinstance(a, StartHandshake)]
        if len(starts) != 1:
            raise AssertionError(f"expected one StartHandshake, got {actions!r}")
        self._deliver(
            self.consumer.handle(
                HandshakeDone(PRODUCER_ENGINE, starts[0].attempt, remote_tp_size=1), self._now
            )
        )
        self.events += 1
        self._finish_admit(self._next)
        self._next += 1

    def _consumer_add(self, i: int) -> list[Action]:
        now = self._now
        blocks = self._blocks[i % (self.live + 1)]
        self.producer.handle(RequestAdded(f"p{i}"), now)
        self.producer.handle(PrefillFinished(f"p{i}", blocks), now)
        remote = RemotePrefill(
            engine_id=PRODUCER_ENGINE,
            request_id=f"p{i}",
            host="10.0.0.2",
            port=5600,
            block_ids=blocks,
        )
        self.events += 3
        return self.consumer.handle(RequestAdded(f"d{i}", remote), now)

    def _finish_admit(self, i: int) -> None:
        now = self._now
        blocks = self._blocks[i % (self.live + 1)]
        actions = self.consumer.handle(AllocationDone(f"d{i}", blocks), now)
        post = next(a for a in actions if isinstance(a, PostRead))
        self.consumer.handle(TransferPosted(post.xfer_id), now)
        self._inflight.append((post.xfer_id, post.notification))
        self.events += 2

    def _admit(self) -> None:
        i = self._next
        self._next += 1
        self._deliver(self._consumer_add(i))
        self._finish_admit(i)

    def _complete_oldest(self) -> None:
        now = self._now
        xfer_id, notification = self._inflight.popleft()
        self.consumer.handle(TransferDone(xfer_id), now)
        self.producer.handle(NotificationReceived(CONSUMER_AGENT, notification), now)
        self.events += 2

    def _deliver(self, actions: Sequence[Action]) -> None:
        """Carry the consumer's notifications (heartbeats) to the producer."""
        for action in actions:
            if isinstance(action, SendNotification):
                self.producer.handle(NotificationReceived(CONSUMER_AGENT, action.data), self._now)
                self.events += 1

    def _timers(self) -> None:
        now = self._now
        for machine, is_consumer in ((self.consumer, True), (self.producer, False)):
            deadline = machine.next_deadline()
            if deadline is not None and deadline <= now:
                actions = machine.handle(Timer(), now)
                self.events += 1
                if is_consumer:
                    self._deliver(actions)

    def steps(self, count: int) -> int:
        """Run ``count`` steps (admit one, complete the oldest); return the events handled."""
        before = self.events
        for _ in range(count):
            self._now += self._dt
            self._timers()
            self._admit()
            self._complete_oldest()
        if self.consumer.live_requests() != self.live or self.producer.live_requests() != self.live:
            raise AssertionError("the pipeline lost its live requests")
        return self.events - before


def dict_baseline(live: int, ops: int) -> Callable[[], None]:
    """One insert and one pop per op on a dict holding ``live`` keys, oldest popped first."""
    table: dict[int, int] = {k: k for k in range(live)}
    state = [live]

    def run_ops() -> None:
        k = state[0]
        for _ in range(ops):
            table[k] = k
            del table[k - live]
            k += 1
        state[0] = k

    return run_ops


def _timed(run_once: Callable[[], int], repeats: int, *, gc_on: bool = False) -> tuple[Timing, int]:
    """Operations per CPU second over ``repeats`` runs of ``run_once`` (which returns how many
    operations it did) after one warm-up run; with ``gc_on`` the collector runs, from a clean
    heap each time."""
    rates: list[float] = []
    count = 0
    for rep in range(repeats + 1):
        if gc_on:
            gc.collect()
        with contextlib.nullcontext() if gc_on else gc_paused():
            t0 = cpu_clock()
            count = run_once()
            elapsed = cpu_clock() - t0
        if rep:
            rates.append(count / elapsed)
    return Timing(statistics.median(rates), min(rates), max(rates), tuple(rates)), count


def _rate(
    pipeline: PullPipeline, steps: int, repeats: int, *, gc_on: bool = False
) -> tuple[Timing, int]:
    """Events per second of ``pipeline`` over runs of ``steps`` steps, and events per run."""
    return _timed(lambda: pipeline.steps(steps), repeats, gc_on=gc_on)


def _baseline_rate(live: int, ops: int, repeats: int) -> Timing:
    fn = dict_baseline(live, ops)

    def run_once() -> int:
        fn()
        return ops

    return _timed(run_once, repeats)[0]


def _add_rate(report: Report, name: str, rate: Timing, baseline: Timing | None = None) -> None:
    report.add(
        Result(
            name,
            rate.median,
            "events/s",
            baseline=None if baseline is None else f"dict insert+pop: {baseline.median:.3g} ops/s",
            ratio=None if baseline is None else rate.median / baseline.median,
            min=rate.min,
            max=rate.max,
        )
    )


def run(args: argparse.Namespace) -> Report:
    quick = bool(getattr(args, "quick", False))
    # Short runs, many of them: a burst of load from other processes spoils few, and the
    # median ignores those.
    steps = 1000 if quick else 2000
    repeats = 5 if quick else 11
    report = Report("machine")

    with gc_paused():
        pipeline = PullPipeline(HEADLINE_LIVE)
    rate, events = _rate(pipeline, steps, repeats)
    base = _baseline_rate(HEADLINE_LIVE, events, repeats)
    _add_rate(report, "machine.events_per_s", rate, base)
    report.add(
        Result(
            "machine.us_per_event",
            1e6 / rate.median,
            "us",
            min=1e6 / rate.max,
            max=1e6 / rate.min,
        )
    )
    gc_rate, _ = _rate(pipeline, steps, repeats, gc_on=True)
    _add_rate(report, "machine.events_per_s_gc_on", gc_rate)
    with gc_paused():
        unchecked = PullPipeline(HEADLINE_LIVE, check_invariants=False)
    fast, _ = _rate(unchecked, steps, repeats)
    _add_rate(report, "machine.events_per_s_unchecked", fast)
    report.add(Result("machine.dict_ops_per_s", base.median, "ops/s", min=base.min, max=base.max))
    del pipeline, unchecked
    _live_sweep(report, quick=quick, steps=steps, repeats=repeats)
    return report


def _live_sweep(report: Report, *, quick: bool, steps: int, repeats: int) -> None:
    points = (1, 100, 10_000) if quick else (1, 10, 100, 1_000, 10_000, 100_000)
    ys: list[float] = []
    lo: list[float] = []
    hi: list[float] = []
    gc_on: list[float] = []
    baseline: list[float] = []
    for live in points:
        with gc_paused():
            pipeline = PullPipeline(live)
        rate, events = _rate(pipeline, steps, repeats)
        ys.append(rate.median)
        lo.append(rate.min)
        hi.append(rate.max)
        gc_on.append(_rate(pipeline, steps, max(1, repeats // 2), gc_on=True)[0].median)
        baseline.append(_baseline_rate(live, events, repeats).median)
        del pipeline
        gc.collect()
        report.add(
            Result(
                f"machine.events_per_s.live_{live}",
                rate.median,
                "events/s",
                min=rate.min,
                max=rate.max,
            )
        )
    report.add_sweep(
        "machine.events_vs_live_requests",
        points,
        ys,
        xlabel="live requests per machine",
        ylabel="events/s (one core)",
        label="kvwire machines (pull, consumer + producer)",
        y_min=lo,
        y_max=hi,
        series={"same, garbage collector on": gc_on, "dict insert+pop (baseline)": baseline},
        title="State-machine throughput vs live requests",
    )
