"""One side of a P/D pair in its own process: every TP rank's runtime over its own buffer.

Run as ``python -m kvwire.pairs.worker`` by :class:`kvwire.pairs.run.PairRunner`. Commands
arrive as frames on stdin, one answer per command leaves on stdout:

* ``setup`` (``case``, ``role``, ``request_id``): build each rank's buffer and geometry from
  the oracle, start the engine's one handshake listener when peers dial this side, register;
  the producer lays the prompt's KV out as prefill would.
* ``prefill`` (producer): ``prefill_finished`` on every rank; answers rank 0's
  ``kv_transfer_params`` (what vLLM's P returns), or the call's refusal.
* ``receive`` (consumer, ``params``): ``add_request`` on every rank with the consumer's
  blocks, then wait for every rank's outcome and check the bytes with the oracle.
* ``drain`` (producer): wait until every rank freed the request, then check its KV was
  only read.
* ``teardown``: close every runtime and the listener.

Every wait is bounded by ``wait_s``; a refusal is reported with the exception's type and
message, so the caller can tell a named refusal from a silent wrong answer.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

from kvwire.config import KVWireConfig
from kvwire.errors import KVWireError
from kvwire.framing import commands, write_frame
from kvwire.pairs.oracle import (
    HEAD_DIM,
    Case,
    RankBuffer,
    Request,
    check_consumer,
    check_producer,
    engine_ids,
    lay_out,
    make_rank,
    make_request,
)
from kvwire.pairs.plants import PLANTS
from kvwire.runtime import Consumer, Producer
from kvwire.sidechannel import HandshakeListener
from kvwire.wire.compat import CompatFactors


def compat_factors(case: Case) -> CompatFactors:
    return CompatFactors.build(
        vllm_version="0.31.0",
        model="kvwire/pairs",
        dtype="float32",
        num_kv_heads=case.total_heads,
        head_size=HEAD_DIM,
        num_hidden_layers=case.layers,
        attn_backend_name="FLASH_ATTN",
        transfer_mode=case.mode,
    )


def refusal(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Side:
    """The ranks of one engine, producer or consumer."""

    def __init__(self, case: Case, role: str, request_id: str, wait_s: float) -> None:
        self.case = case
        self.role = role
        self.request_id = request_id
        self.wait_s = wait_s
        self.request: Request = make_request(case)
        who = 0 if role == "producer" else 1
        side = case.p if who == 0 else case.d
        dialled = role == "producer" or case.mode == "push"
        self.listener = HandshakeListener({}).start() if dialled else None
        self.buffers: list[RankBuffer] = []
        self.ranks: list[Producer | Consumer] = []
        payloads: dict[tuple[int, int], bytes] = {}
        kind = Producer if role == "producer" else Consumer
        for rank in range(side.tp):
            rb = make_rank(case, who, rank, real=True)
            self.buffers.append(rb)
            config = KVWireConfig(
                engine_id=f"{role}-engine",
                compat=compat_factors(case),
                mode=case.mode,
                tp_rank=rank,
                tp_size=side.tp,
                transport="shm",
                coalesce=case.coalesce,
                side_channel_port=self.listener.port if self.listener else 0,
            )
            runtime = kind(config)
            self.ranks.append(runtime)
            runtime.register_kv_caches(rb.geometry)
            if self.listener is not None:
                payloads[(0, rank)] = runtime.handshake_payload()
                if isinstance(runtime, Producer):
                    self.listener.set_lease_source((0, rank), runtime.lease_deadlines)
            if who == 0:
                lay_out(self.case, rb, self.request.p_ids, self.request.p_starts, self.request)
        if self.listener is not None:
            self.listener.set_payloads(payloads)

    def ids(self) -> list[Any]:
        own = self.request.p_ids if self.role == "producer" else self.request.d_ids
        return engine_ids(self.case, own)

    def prefill(self) -> dict[str, Any]:
        case = self.case
        num_tokens = case.tokens + case.past if case.pass_tokens else None
        params: dict[str, Any] = {}
        try:
            for rank in self.ranks:
                assert isinstance(rank, Producer)
                out = rank.prefill_finished(self.request_id, self.ids(), num_tokens=num_tokens)
                params = params or out
        except KVWireError as exc:
            return {"refused": refusal(exc)}
        return {"params": params}

    def receive(self, params: dict[str, Any]) -> dict[str, Any]:
        try:
            for rank in self.ranks:
                assert isinstance(rank, Consumer)
                # The prompt's own length, where the producer computed past it.
                own = self.case.tokens if self.case.past else None
                rank.add_request(self.request_id, params, self.ids(), num_tokens=own)
        except KVWireError as exc:
            return {"refused": refusal(exc)}
        outcomes: list[dict[str, Any]] = []
        deadline = time.monotonic() + self.wait_s
        for rank in self.ranks:
            assert isinstance(rank, Consumer)
            finished = rank.get_finished()
            while not finished and rank.wait_finished(max(0.0, deadline - time.monotonic())):
                finished = rank.get_finished()
            if self.request_id in finished.done:
                outcomes.append({"done": True})
            elif self.request_id in finished.failed:
                failure = finished.failed[self.request_id]
                outcomes.append({"done": False, "reason": failure.reason, "detail": failure.detail})
            else:
                outcomes.append({"done": False, "reason": "no outcome", "detail": ""})
        problems: list[str] = []
        for rb, outcome in zip(self.buffers, outcomes, strict=True):
            if outcome["done"]:
                zeroed = self.case.mode == "pull"  # push leaves unwritten slots as they were
                problems += check_consumer(self.case, rb, self.request, zeroed=zeroed)
        return {"outcomes": outcomes, "problems": problems}

    def drain(self) -> dict[str, Any]:
        reasons: list[str] = []
        deadline = time.monotonic() + self.wait_s
        for rank in self.ranks:
            assert isinstance(rank, Producer)
            freed = [f for f in rank.get_finished() if f.request_id == self.request_id]
            while not freed and rank.wait_finished(max(0.0, deadline - time.monotonic())):
                freed = [f for f in rank.get_finished() if f.request_id == self.request_id]
            reasons.append(freed[0].reason if freed else "still held")
        problems = [p for rb in self.buffers for p in check_producer(self.case, rb, self.request)]
        return {"freed": reasons, "problems": problems}

    def close(self) -> None:
        for rank in self.ranks:
            with contextlib.suppress(Exception):
                rank.close()
        if self.listener is not None:
            self.listener.close()


def main(argv: list[str]) -> None:
    if argv[:1] == ["--plant"]:
        PLANTS[argv[1]]()
    side: Side | None = None
    out = sys.stdout.buffer
    for message in commands(sys.stdin.buffer):
        op = message["op"]
        try:
            if op == "setup":
                case = Case.from_dict(message["case"])
                side = Side(case, message["role"], message["request_id"], message["wait_s"])
                answer: dict[str, Any] = {}
            elif op == "teardown":
                if side is not None:
                    side.close()
                side = None
                answer = {}
            else:
                assert side is not None, f"{op} before setup"
                if op == "prefill":
                    answer = side.prefill()
                elif op == "receive":
                    answer = side.receive(message["params"])
                else:
                    assert op == "drain", op
                    answer = side.drain()
        except KVWireError as exc:
            answer = {"refused": refusal(exc)}
        write_frame(out, answer)
    if side is not None:
        side.close()


if __name__ == "__main__":
    main(sys.argv[1:])
