"""The shm transport's executor: jobs in order, chunks shared between the worker and
helpers, errors handed to ``finish``, and a stop that leaves nothing running."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest
from kvwire_shm._executor import Executor, Split


class _Worker:
    """The worker loop as the transport runs it, on a real thread."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            if self.executor.step():
                continue
            if self.executor.stopped:
                return
            self.executor.wait_ready()

    def stop(self) -> None:
        self.executor.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()


def _record(log: list[str], what: str) -> Callable[[], None]:
    return lambda: log.append(what)


def test_jobs_and_their_splits_end_in_submission_order() -> None:
    log: list[str] = []
    executor = Executor()
    worker = _Worker(executor)
    try:
        for job in range(20):

            def start(job: int = job) -> Split | None:
                if job % 3:
                    log.append(f"job{job}")
                    return None
                chunks = [_record(log, f"chunk{job}") for _ in range(4)]
                return Split(chunks, lambda _: log.append(f"job{job}"))

            executor.submit(start)
        done = threading.Event()
        executor.submit(lambda: done.set())
        assert done.wait(30)
    finally:
        worker.stop()
    finished = [entry for entry in log if entry.startswith("job")]
    assert finished == [f"job{i}" for i in range(20)]
    for job in range(0, 20, 3):  # every chunk of a split ran before its finish
        end = log.index(f"job{job}")
        assert log[:end].count(f"chunk{job}") == 4


def test_a_helper_shares_a_shared_split_and_not_a_private_one() -> None:
    """Chunk 0 waits for chunk 1 to have run on another thread: the split can end only if
    the helper took part, and the worker alone would block in chunk 0."""
    executor = Executor()
    helped: dict[str, set[str]] = {"shared": set(), "private": set()}
    ran_1 = threading.Event()
    ends: dict[str, threading.Event] = {"shared": threading.Event(), "private": threading.Event()}

    def chunks(kind: str) -> list[Callable[[], None]]:
        def first() -> None:
            helped[kind].add(threading.current_thread().name)
            if kind == "shared":
                assert ran_1.wait(30), "no second thread ran chunk 1"

        def second() -> None:
            helped[kind].add(threading.current_thread().name)
            ran_1.set()

        return [first, second]

    executor.submit(lambda: Split(chunks("shared"), lambda _: ends["shared"].set()))
    executor.submit(lambda: Split(chunks("private"), lambda _: ends["private"].set(), shared=False))
    worker = _Worker(executor)
    try:
        while not ends["shared"].is_set():
            executor.help()
        assert ends["private"].wait(30)
        assert not executor.help()  # nothing left to help with
    finally:
        worker.stop()
    assert helped["shared"] == {"MainThread", worker.thread.name}
    assert helped["private"] == {worker.thread.name}


def test_a_failing_chunk_stops_the_split_and_reaches_finish() -> None:
    executor = Executor()
    ran: list[int] = []
    ended: list[BaseException | None] = []

    def chunk(i: int) -> Callable[[], None]:
        def run() -> None:
            ran.append(i)
            if i == 1:
                raise OSError("copy failed")

        return run

    executor.submit(lambda: Split([chunk(i) for i in range(5)], ended.append, shared=False))
    while executor.step():
        pass
    assert ran == [0, 1]
    assert len(ended) == 1 and isinstance(ended[0], OSError)
    executor.submit(lambda: None)
    assert executor.step(), "the executor is free for the next job"


def test_a_split_of_one_chunk_runs_where_its_job_started() -> None:
    executor = Executor()
    ran: list[str] = []
    executor.submit(lambda: Split([lambda: ran.append("chunk")], lambda _: ran.append("end")))
    assert executor.step()
    assert ran == ["chunk", "end"]
    assert not executor.help()


def test_an_empty_split_finishes_at_once_and_a_raising_job_frees_the_executor() -> None:
    executor = Executor()
    ended: list[BaseException | None] = []
    executor.submit(lambda: Split([], ended.append))
    assert executor.step()
    assert ended == [None]

    def broken() -> Split | None:
        raise RuntimeError("bug")

    executor.submit(broken)
    with pytest.raises(RuntimeError):
        executor.step()
    assert executor.exclusive(lambda: None), "a raising job left the executor busy"


def test_exclusive_runs_only_when_nothing_is_queued_or_running() -> None:
    executor = Executor()
    held = threading.Event()
    release = threading.Event()

    def blocking_chunk() -> None:
        held.set()
        assert release.wait(30)

    executor.submit(lambda: Split([blocking_chunk, lambda: None], lambda _: None))
    assert executor.step()  # starts the job; its two chunks are now claimable
    runner = threading.Thread(target=executor.step)
    runner.start()
    assert held.wait(30)
    assert not executor.exclusive(lambda: pytest.fail("ran while a chunk was running"))
    release.set()
    runner.join(30)
    assert executor.step()  # the second chunk, then the job's finish
    executor.submit(lambda: None)
    assert not executor.exclusive(lambda: pytest.fail("ran ahead of a queued job"))
    assert executor.step()
    assert executor.exclusive(lambda: None)


def test_stop_returns_the_jobs_never_started_and_drain_waits_for_a_running_chunk() -> None:
    executor = Executor()
    held, release = threading.Event(), threading.Event()
    finished = threading.Event()

    def blocking_chunk() -> None:
        held.set()
        assert release.wait(30)

    executor.submit(lambda: Split([blocking_chunk, lambda: None], lambda _: finished.set()))
    never = [lambda: None, lambda: None]
    for job in never:
        executor.submit(job)
    assert executor.step()
    helper = threading.Thread(target=executor.help)
    helper.start()
    assert held.wait(30)
    assert executor.stop() == never
    assert executor.step(), "the running job's last chunk can still be claimed"
    assert not executor.step(), "a stopped executor started a job"
    drained = threading.Thread(target=executor.drain)
    drained.start()
    drained.join(0.05)
    assert drained.is_alive(), "drain returned while a chunk was still running"
    release.set()
    drained.join(30)
    helper.join(30)
    assert finished.is_set() and not drained.is_alive()


def test_start_now_hands_a_shared_split_out_and_wakes_the_worker() -> None:
    """The job starts on the calling thread, which gets control back before any chunk ran;
    the sleeping worker is woken and copies, and helpers are called."""
    invited = threading.Event()
    executor = Executor(on_split=invited.set)
    worker = _Worker(executor)
    gate, ended = threading.Event(), threading.Event()
    ran: list[str] = []
    started_on: list[str] = []

    def chunk() -> None:
        assert gate.wait(30)
        ran.append(threading.current_thread().name)

    def job() -> Split:
        started_on.append(threading.current_thread().name)
        return Split([chunk, chunk, chunk], lambda _: ended.set())

    try:
        assert executor.start_now(job)  # returns with chunk 0 still held at the gate
        assert started_on == ["MainThread"] and invited.is_set() and not ran
        gate.set()
        assert ended.wait(30), "the worker was not woken to run the chunks"
    finally:
        worker.stop()
    assert ran == [worker.thread.name] * 3


def test_start_now_leaves_a_private_split_to_the_worker_ahead_of_later_jobs() -> None:
    executor = Executor()
    log: list[str] = []

    def job() -> Split:
        chunks = [lambda: log.append(threading.current_thread().name)] * 2
        return Split(chunks, lambda _: log.append("end"), shared=False)

    assert executor.start_now(job)
    assert not log, "a private split ran on the calling thread"

    def next_job() -> None:
        log.append("next job")

    executor.submit(next_job)
    assert not executor.start_now(lambda: pytest.fail("started ahead of a queued job"))
    worker = _Worker(executor)
    done = threading.Event()
    executor.submit(lambda: done.set())
    try:
        assert done.wait(30)
    finally:
        worker.stop()
    assert log == [worker.thread.name, worker.thread.name, "end", "next job"]


def test_start_now_refuses_while_a_job_runs_and_a_raising_job_frees_the_executor() -> None:
    executor = Executor()
    executor.submit(lambda: Split([lambda: None, lambda: None], lambda _: None))
    assert executor.step()  # its split is out: the executor is busy
    assert not executor.start_now(lambda: pytest.fail("started while a split ran"))
    while executor.step():
        pass

    def broken() -> Split | None:
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError):
        executor.start_now(broken)
    assert executor.start_now(lambda: None), "a raising job left the executor busy"
    assert executor.exclusive(lambda: None)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
def test_start_now_runs_a_split_itself_when_the_executor_stopped_meanwhile(shared: bool) -> None:
    """``close()`` may stop the executor (and the worker exit) while a caller is inside
    ``start_now``'s job: nobody else would run the split, so the caller does, and a
    ``drain`` after it returns."""
    executor = Executor()
    ran: list[str] = []
    ended: list[BaseException | None] = []

    def job() -> Split:
        executor.stop()  # as close() does from another thread while the job plans
        return Split([lambda: ran.append("chunk")] * 3, ended.append, shared=shared)

    assert executor.start_now(job)
    assert ran == ["chunk"] * 3 and ended == [None]
    drained = threading.Thread(target=executor.drain)
    drained.start()
    drained.join(30)
    assert not drained.is_alive(), "drain hung on a split nobody runs"


def test_start_now_wakes_a_drain_when_it_leaves_a_private_split_to_the_worker() -> None:
    executor = Executor()
    inside, go = threading.Event(), threading.Event()

    def job() -> Split:
        inside.set()
        assert go.wait(30)
        return Split([lambda: None, lambda: None], lambda _: None, shared=False)

    starter = threading.Thread(target=executor.start_now, args=(job,))
    starter.start()
    assert inside.wait(30)
    drained = threading.Thread(target=executor.drain)  # waits for the executor to fall idle
    drained.start()
    go.set()
    starter.join(30)
    drained.join(30)
    assert not drained.is_alive(), "drain was not woken when start_now let go of the executor"


class _Interrupt(KeyboardInterrupt):
    """Ctrl-C as Python raises it in the main thread: in the middle of whatever ran."""


@pytest.mark.parametrize("seed", range(24))
def test_an_interrupted_chunk_ends_its_split_and_frees_the_executor(seed: int) -> None:
    """Ctrl-C raised in a chunk (on the thread that ran it: a helper in ``wait``, or a
    small transfer run in ``read``) goes on up, and still ends the split: ``finish`` gets
    it, nothing more is claimed, the next job starts, and ``drain`` returns."""
    rng = random.Random(seed)
    how = rng.choice(["helped", "run_now", "worker"])
    count = rng.randint(2 if how == "helped" else 1, 6)  # one chunk is never handed out
    cut = rng.randrange(count)
    ran: list[int] = []
    ended: list[BaseException | None] = []

    def chunk(i: int) -> Callable[[], None]:
        def run() -> None:
            ran.append(i)
            if i == cut:
                raise _Interrupt

        return run

    split = Split([chunk(i) for i in range(count)], ended.append, shared=how == "helped")
    executor = Executor()
    with pytest.raises(_Interrupt):
        if how == "run_now":
            assert executor.run_now(lambda: split)
        else:
            executor.submit(lambda: split)
            if how == "helped":
                assert executor.step(), "the worker's turn starts the job and hands it out"
            while executor.step() if how == "worker" else executor.help():
                pass
            pytest.fail(f"the interrupt in chunk {cut} was lost")
    assert ran == list(range(cut + 1)), "a chunk ran after the interrupt"
    assert len(ended) == 1 and isinstance(ended[0], _Interrupt)
    assert not executor.help(), "a chunk was claimed after the interrupt"
    assert executor.exclusive(lambda: None), "the interrupt left the executor busy"
    executor.stop()
    executor.drain()


def test_an_interrupted_helper_leaves_finish_to_the_chunk_still_running() -> None:
    executor = Executor()
    worker_in = threading.Event()
    go_on = threading.Event()
    ended: list[BaseException | None] = []

    def slow() -> None:
        worker_in.set()
        assert go_on.wait(30)

    def interrupted() -> None:
        raise _Interrupt

    executor.submit(lambda: Split([slow, interrupted, slow], ended.append))
    worker = _Worker(executor)
    try:
        assert worker_in.wait(30)
        with pytest.raises(_Interrupt):
            executor.help()
        assert not ended, "finished while the worker's chunk still ran"
        go_on.set()
    finally:
        worker.stop()
        executor.drain()
    assert len(ended) == 1 and isinstance(ended[0], _Interrupt)
