"""Run one P/D pair through real runtimes in two processes and judge the outcome.

:class:`PairRunner` keeps one producer process and one consumer process for many cases
(each case builds and tears down its ranks), so a property test pays for interpreter start-up
once. :meth:`PairRunner.run` returns a :class:`Verdict`: ``done`` (every consumer rank
finished and holds exactly the producer's tokens, the producer freed its blocks and its KV
was only read), ``refused`` (a call or the request failed with a named cause), or a
``violation`` that says what kvwire promised and broke: done with wrong bytes, a failure
without a cause, no outcome at all, a supported pair refused.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

from kvwire.errors import KVWireError
from kvwire.framing import close_pipes, read_frame, spawn, wait_or_kill, write_frame
from kvwire.pairs.oracle import Case, make_request, producer_lacks


class PairProcessError(KVWireError):
    """A side's process died or stopped answering."""


@dataclass
class Verdict:
    case: Case
    kind: str
    """``done``, ``refused`` or ``violation``."""
    detail: str = ""
    outcomes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.kind != "violation"

    def __str__(self) -> str:
        return f"{self.kind}: {self.case}" + (f": {self.detail}" if self.detail else "")


def unsupported(case: Case) -> str | None:
    """Why kvwire refuses this pair by design, or None when it must move the bytes.

    Block ids passed in any form but one list of ints per group are an engine's mistake,
    refused at the call. Without the prompt's token count a consumer with smaller blocks
    cannot tell where the prompt ends inside the producer's last block, so kvwire refuses
    rather than guess; a push producer plans every write, so it always needs the count.
    A producer that computed past the consumer's prompt places the consumer's lists by
    its own count when pushing (PUSH_REG carries none), so the consumer refuses that; a
    pulling consumer places both, and refuses where the producer's list no longer starts
    early enough for its own (a window clipped at the producer's end) or its ring is for
    its own count.
    """
    if case.ids_form != "lists":
        return f"block ids passed as {case.ids_form}"
    if not case.pass_tokens and case.mode == "push":
        return "push mode needs the token count"
    if not case.pass_tokens and case.p.block > case.d.block:
        return "token count needed"
    if case.past and case.mode == "push":
        return "a pushing producer that computed past the prompt"
    if case.past and producer_lacks(case, make_request(case))[1]:
        return "the producer's window or ring no longer holds what the consumer's lists ask for"
    return None


class _Child:
    def __init__(self, module: str, *args: str) -> None:
        self.proc = spawn(module, *args)

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            write_frame(self.proc.stdin, message)
        except (BrokenPipeError, OSError):
            raise PairProcessError(f"{message['op']}: the pair process is gone") from None
        answer = read_frame(self.proc.stdout)
        if answer is None:
            raise PairProcessError(
                f"{message['op']}: the pair process died (exit {self.proc.poll()})"
            )
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            write_frame(self.proc.stdin, {"op": "exit"})
        wait_or_kill(self.proc, 10)
        close_pipes(self.proc)


class PairRunner:
    """A producer process and a consumer process that run cases one after another."""

    def __init__(self, wait_s: float = 20.0, *, plant: str | None = None) -> None:
        """``plant`` names a known bug for the workers to plant (:mod:`kvwire.pairs.plants`)."""
        self.wait_s = wait_s
        self._ids = itertools.count()
        args = ("--plant", plant) if plant else ()
        self._producer = _Child("kvwire.pairs.worker", *args)
        self._consumer = _Child("kvwire.pairs.worker", *args)

    def run(self, case: Case) -> Verdict:
        rid = f"req-{next(self._ids)}"
        setup = {"op": "setup", "case": case.to_dict(), "request_id": rid, "wait_s": self.wait_s}
        try:
            return self._judge(case, setup)
        finally:
            self._producer.ask({"op": "teardown"})
            self._consumer.ask({"op": "teardown"})

    def _judge(self, case: Case, setup: dict[str, Any]) -> Verdict:
        for child, role in ((self._producer, "producer"), (self._consumer, "consumer")):
            answer = child.ask({**setup, "role": role})
            if "refused" in answer:
                return self._refused(case, f"{role} setup: {answer['refused']}")
        answer = self._producer.ask({"op": "prefill"})
        if "refused" in answer:
            return self._refused(case, f"prefill_finished: {answer['refused']}")
        answer = self._consumer.ask({"op": "receive", "params": answer["params"]})
        if "refused" in answer:
            return self._refused(case, f"add_request: {answer['refused']}")
        outcomes: list[dict[str, Any]] = answer["outcomes"]
        if answer["problems"]:
            detail = "done with wrong bytes: " + "; ".join(answer["problems"][:3])
            return Verdict(case, "violation", detail, outcomes)
        failed = [o for o in outcomes if not o["done"]]
        for outcome in failed:
            if outcome["reason"] == "no outcome" or not outcome["detail"]:
                detail = f"failed without a cause: {outcome}"
                return Verdict(case, "violation", detail, outcomes)
        if failed:
            return self._refused(case, f"{failed[0]['reason']}: {failed[0]['detail']}", outcomes)
        drained = self._producer.ask({"op": "drain"})
        if drained["problems"] or set(drained["freed"]) != {"sent"}:
            detail = f"producer after done: freed {drained['freed']}, {drained['problems']}"
            return Verdict(case, "violation", detail, outcomes)
        if unsupported(case):
            return Verdict(case, "violation", f"done although {unsupported(case)}", outcomes)
        return Verdict(case, "done", "", outcomes)

    @staticmethod
    def _refused(case: Case, detail: str, outcomes: list[dict[str, Any]] | None = None) -> Verdict:
        if unsupported(case) is None:
            return Verdict(case, "violation", f"a supported pair was refused: {detail}")
        return Verdict(case, "refused", detail, outcomes or [])

    def close(self) -> None:
        self._producer.close()
        self._consumer.close()

    def __enter__(self) -> PairRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
