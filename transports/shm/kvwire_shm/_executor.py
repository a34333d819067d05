"""Jobs run strictly one after another by the agent's worker, with help from idle threads.

One thread copying scattered 64 KiB spans out of cache reaches about half of a single
memcpy's bandwidth here, two threads about 85% (memory latency bound, not CPU bound). A
caller blocked in ``wait`` is a second thread with nothing to do, so it may copy part of
the running transfer.

A job is a callable the worker runs. It may return a :class:`Split`: chunks that the
worker (:meth:`Executor.step`) and helpers (:meth:`Executor.help`) claim one at a time,
and a ``finish`` that the thread ending the last chunk calls. The next job starts only
after ``finish`` returned, so whatever jobs do in order (sending notifications) keeps the
order of submission.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import queue
import threading
from collections.abc import Callable, Sequence

Chunk = Callable[[], object]


class Split:
    """The divisible part of a job: ``chunks`` in any order, then ``finish(error)`` once,
    with the first exception a chunk raised (None if none did).

    ``shared=False`` runs the chunks back to back on the thread that started the job: for
    copies that gain nothing from a second thread, which would only cost both of them
    hand-overs of the GIL.
    """

    __slots__ = ("chunks", "error", "finish", "next", "running", "shared")

    def __init__(
        self,
        chunks: Sequence[Chunk],
        finish: Callable[[BaseException | None], object],
        *,
        shared: bool = True,
    ) -> None:
        self.chunks = chunks
        self.finish = finish
        self.next = 0
        self.running = 0
        self.error: BaseException | None = None
        self.shared = shared


Job = Callable[[], Split | None]


def _raise_interrupt(exc: BaseException) -> None:
    """Re-raise a Ctrl-C or SIGTERM (a helper is often the main thread, where Python raises
    them): the chunk it cut short still ends its split, so ``finish`` reports the transfer
    and a later :meth:`Executor.drain` cannot wait forever for a chunk nobody runs."""
    if not isinstance(exc, Exception):
        raise exc


def _started(split: Split) -> Split:
    """A job whose start already ran (see :meth:`Executor.start_now`)."""
    return split


class Executor:
    """A FIFO of jobs and at most one running Split.

    ``on_split`` is called (on the worker) when a shared Split with more than one chunk
    begins, so threads blocked elsewhere can come and help.
    """

    def __init__(self, on_split: Callable[[], object] = lambda: None) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._busy = False
        """A job started and has not finished (its Split may still have chunks running)."""
        self._split: Split | None = None
        self._stopped = False
        self._on_split = on_split
        self._wakeups: queue.SimpleQueue[None] = queue.SimpleQueue()
        """Where the worker sleeps: C-level and one futex per wake-up, where a Condition
        costs a Python-level waiter lock and a second pass through the GIL."""

    def submit(self, job: Job) -> None:
        with self._cond:
            self._queue.append(job)
        self._wakeups.put(None)

    def stop(self) -> list[Job]:
        """Start no more jobs (chunks of the running one may still be claimed); returns the
        jobs that never started (or, from :meth:`start_now`, never copied), in order."""
        with self._cond:
            self._stopped = True
            left = list(self._queue)
            self._queue.clear()
        self._wakeups.put(None)
        return left

    def _ready(self) -> bool:
        if self._split is not None:
            return self._split.next < len(self._split.chunks)
        return not self._busy and not self._stopped and bool(self._queue)

    def step(self) -> bool:
        """The worker's turn: run one chunk of the running Split, or start the next job;
        False when there is nothing to do now."""
        return self._step(worker=True)

    def help(self) -> bool:
        """Another thread's turn: run one chunk of the running Split; False if there is
        none to claim (a Split not shared never runs chunk by chunk)."""
        return self._step(worker=False)

    def _step(self, *, worker: bool) -> bool:
        with self._cond:
            split = self._split
            if split is not None:
                if split.next >= len(split.chunks):
                    return False
                chunk = split.chunks[split.next]
                split.next += 1
                split.running += 1
            elif not worker or self._busy or self._stopped or not self._queue:
                return False
            else:
                job = self._queue.popleft()
                self._busy = True
                split = None
        if split is None:
            self._start(job)
        else:
            self._run(split, chunk)
        return True

    def _claim(self) -> bool:
        """Take the executor for this thread if nothing is queued, running or stopped."""
        with self._cond:
            if self._busy or self._split is not None or self._queue or self._stopped:
                return False
            self._busy = True
            return True

    def run_now(self, job: Job) -> bool:
        """Run ``job`` whole on this thread (its chunks back to back) if nothing is queued
        or running, so it keeps its place in the order; False (and ``job`` not run)
        otherwise. A small transfer saves the hand-over to the worker and its wake-up."""
        if not self._claim():
            return False
        self._start(job, here=True)
        return True

    def start_now(self, job: Job) -> bool:
        """Start ``job`` on this thread if nothing is queued or running, as the worker
        would, and come back: a shared Split is handed out to the worker (woken to help)
        and to helpers; one to run whole goes to the worker, ahead of anything queued
        since. False (and ``job`` not run) otherwise. Saves the worker's wake-up before
        the first byte of a large transfer moves (~20 us here)."""
        if not self._claim():
            return False
        split = self._open(job)
        if split is None:
            return True
        shared = split.shared and len(split.chunks) > 1
        with self._cond:
            # Stopped meanwhile (the worker may be gone): nobody else would run it.
            handed = bool(split.chunks) and not self._stopped
            if handed and shared:
                self._split = split
            elif handed:
                self._busy = False
                self._queue.appendleft(functools.partial(_started, split))
                self._cond.notify_all()
        if not handed:
            self._run_whole(split)
            return True
        if shared:
            self._on_split()
        self._wakeups.put(None)
        return True

    def _open(self, job: Job) -> Split | None:
        """Run ``job``; the executor is free again if it raised or left nothing to copy."""
        try:
            split = job()
        except BaseException:
            self._idle()
            raise
        if split is None:
            self._idle()
        return split

    def _start(self, job: Job, *, here: bool = False) -> None:
        split = self._open(job)
        if split is None:
            return
        if here or not split.shared or len(split.chunks) <= 1:
            self._run_whole(split)
            return
        with self._cond:
            self._split = split
        self._on_split()

    def _run_whole(self, split: Split) -> None:
        """Run ``split``'s chunks here, back to back (nothing to hand out), then finish."""
        try:
            for chunk in split.chunks:
                chunk()
        except BaseException as exc:  # handed to finish, as from a shared chunk
            split.error = exc
            _raise_interrupt(exc)
        finally:
            self._finish(split)

    def _run(self, split: Split, chunk: Chunk) -> None:
        error: BaseException | None = None
        try:
            chunk()
        except BaseException as exc:  # handed to finish; the job decides what it means
            error = exc
            _raise_interrupt(exc)
        finally:
            with self._cond:
                split.running -= 1
                if error is not None and split.error is None:
                    split.error = error
                    split.next = len(split.chunks)  # claim nothing more
                last = split.next >= len(split.chunks) and split.running == 0
                if last:
                    self._split = None
            if last:
                self._finish(split)

    def _finish(self, split: Split) -> None:
        try:
            split.finish(split.error)
        finally:
            self._idle()

    def _idle(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()
            more = bool(self._queue)
        if more:  # the worker may be asleep behind a job that a helper finished
            self._wakeups.put(None)

    def exclusive(self, action: Callable[[], object]) -> bool:
        """Run ``action`` here as if it were a job, but only if nothing is queued or
        running; False (and ``action`` not run) otherwise."""
        if not self._claim():
            return False
        try:
            action()
        finally:
            self._idle()
        return True

    def wait_ready(self, timeout: float | None = None) -> None:
        """The worker's sleep: until :meth:`step` may have something to do, :meth:`stop`,
        or ``timeout``."""
        with self._cond:
            if self._ready() or self._stopped:
                return
        with contextlib.suppress(queue.Empty):
            self._wakeups.get(timeout=timeout)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def drain(self) -> None:
        """After :meth:`stop` and the worker's exit: return once no chunk runs anywhere."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy)
