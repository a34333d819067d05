"""shm's own partition fault: a READ that stalls past the producer's lease is never done.

Shared memory cannot lose a link, so the fault is a transport wrapper that holds D's READ
back (the copy does not start, the handle stays pending) until the test "heals" it; then
the real shm copy runs, moving whatever P's blocks hold by then, as a resumed DMA would.
Meanwhile P's lease runs out, P frees the blocks after the grace and refills them with
another prompt. D must report the request failed with its blocks, never done.
"""

from __future__ import annotations

import threading

from kvwire.demo.content import count_wrong_bytes, fill
from kvwire.runtime import Consumer, Finished, Producer
from kvwire.transport import DelegatingTransport, Descs, XferState, create

from .conftest import config, make_side, wait_until

LEASE_S = 1.0


class _Stalled:
    def __init__(self, args: tuple[str, Descs, Descs, bytes | None]) -> None:
        self.args = args
        self.inner: object | None = None
        self.released = False


class StallingTransport(DelegatingTransport):
    """READs wait for :meth:`heal`, and notifications are lost until then; then the real
    copy runs (even for a released handle: the DMA of a cut link is not stopped by the
    reader giving up)."""

    def __init__(self, inner: object) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.stalled: list[_Stalled] = []
        self.lock = threading.Lock()
        self.healed = False

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        with self.lock:
            if self.healed:
                return self.inner.read(peer, local, remote, notify)
            handle = _Stalled((peer, local, remote, notify))
            self.stalled.append(handle)
            return handle

    def notify(self, peer: str, message: bytes) -> None:
        with self.lock:
            if not self.healed:
                return  # the cut link loses heartbeats and completions too
        self.inner.notify(peer, message)

    def heal(self) -> list[object]:
        with self.lock:
            self.healed = True
            late = []
            for h in self.stalled:
                h.inner = self.inner.read(*h.args)
                late.append(h.inner)
            return late

    def poll(self, handle: object) -> XferState:
        if isinstance(handle, _Stalled):
            with self.lock:
                if handle.inner is None:
                    return XferState.PENDING
            return self.inner.poll(handle.inner)
        return self.inner.poll(handle)

    def release(self, handle: object) -> None:
        if isinstance(handle, _Stalled):
            with self.lock:
                handle.released = True
                if handle.inner is not None:
                    self.inner.release(handle.inner)
            return
        self.inner.release(handle)


def _ended(consumer: Consumer, rid: str, into: Finished) -> None:
    def ended() -> bool:
        got = consumer.get_finished()
        into.done.extend(got.done)
        into.failed.update(got.failed)
        return rid in into.done or rid in into.failed

    wait_until(ended, 30.0)


def test_a_read_stalled_past_the_lease_is_failed_while_p_reuses_its_blocks() -> None:
    p_side, d_side = make_side(), make_side()
    stalling = StallingTransport(create("shm", "decode-stalling"))
    producer = Producer(config(p_side, "prefill-e", "pull", lease_s=LEASE_S), "shm")
    consumer = Consumer(config(d_side, "decode-e", "pull", lease_s=LEASE_S), stalling)
    try:
        producer.register_kv_caches(p_side.spec.geometry(int(p_side.buffer.ctypes.data)))
        consumer.register_kv_caches(d_side.spec.geometry(int(d_side.buffer.ctypes.data)))
        p_side.listener.set_payloads({(0, 0): producer.handshake_payload()})

        fill(p_side.spec, p_side.buffer, 0, [0, 1, 2, 3])
        params = producer.prefill_finished("cut", [[0, 1, 2, 3]], num_tokens=64)
        assert params["remote_blocks_expiry_time"] is not None  # P states its lease
        consumer.add_request("cut", params, [[8, 9, 10, 11]])
        seen = Finished()
        _ended(consumer, "cut", seen)  # D's read deadline passes while the READ hangs
        assert "cut" not in seen.done
        failure = seen.failed["cut"]
        assert failure.reason == "expired" and failure.invalid_block_ids == ((8, 9, 10, 11),)

        freed: list[object] = []
        wait_until(lambda: bool(freed.extend(producer.get_finished()) or freed), 10.0)
        assert [(f.request_id, f.reason) for f in freed] == [("cut", "expired")]  # type: ignore[attr-defined]
        assert producer.machine_stats()["leases_quarantined"] == 1
        fill(p_side.spec, p_side.buffer, 7, [0, 1, 2, 3])  # P reuses the blocks at once

        late = stalling.heal()  # the stalled copy resumes and moves prompt 7's KV
        wait_until(lambda: all(stalling.inner.poll(h) is XferState.DONE for h in late), 10.0)
        assert count_wrong_bytes(d_side.spec, d_side.buffer, 7, [8, 9, 10, 11])[0] == 0
        more = consumer.get_finished()
        assert not more.done and not more.failed  # nothing more is reported for "cut"

        # The healed path serves the next request intact.
        params = producer.prefill_finished("next", [[0, 1, 2, 3]], num_tokens=64)
        consumer.add_request("next", params, [[12, 13, 14, 15]])
        after = Finished()
        _ended(consumer, "next", after)
        assert after.done == ["next"]
        assert count_wrong_bytes(d_side.spec, d_side.buffer, 7, [12, 13, 14, 15])[0] == 0
        assert consumer.machine_stats()["transfers_timed_out"] == 1
        assert consumer.errors == [] and producer.errors == []
    finally:
        consumer.close()
        producer.close()
        stalling.inner.close()
        p_side.listener.close()
        d_side.listener.close()
