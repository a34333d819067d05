"""The simulator with streaming push (``kvwire sim --stream``): the producer engine computes
each push prompt in chunks and layers over simulated time, feeding the real machine
``ChunkScheduled``/``LayersComputed``/``PrefillFinished``, while consumers register before
the prompt ends. Every round's rectangles are copied cell by cell into the consumer's
blocks, so a byte written before it was computed, from blocks the engine took back, or into
blocks the consumer had freed, is found.

Each run is about a second; the seeds and faults below are the property's sample, and the
planted bugs show the checks can fail."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest

from kvwire.cli import main
from kvwire.machine import LayersComputed, ProducerMachine
from kvwire.sim import Faults, SimResult, parse_faults, simulate

STREAM_FAULTS = "preempt,stall,vanish,abort,crash"


def assert_clean(result: SimResult) -> None:
    assert result.done + result.failed == result.requests
    assert result.corrupt == 0 and result.stale_done == 0 and result.late_writes == 0
    assert result.leaked_blocks == 0 and result.double_frees == 0 and result.stuck == 0
    assert result.invariant_violations == 0 and not result.violations, result.violations
    assert result.ok


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_streams_under_every_fault_never_complete_partial_kv_nor_leak(seed: int) -> None:
    result = simulate(seed, 1500, parse_faults("all"), False, True)
    assert_clean(result)
    assert result.streamed > 0 and result.preemptions > 0  # streams really ran, and broke
    assert result.failed > 0 and result.done > result.requests // 2
    assert result.bytes_verified > 0


@pytest.mark.parametrize("seed", [5, 6])
def test_stream_faults_alone_on_a_stream_heavy_run(seed: int) -> None:
    """Without the network faults nearly every push request streams, so the stream faults
    strike mid-stream: preempted prompts are rewritten from their new blocks, a stalled
    one outlives its consumer's watchdog, consumers die while being written to."""
    result = simulate(seed, 1500, parse_faults(STREAM_FAULTS), False, True)
    assert_clean(result)
    assert result.preemptions > 0 and result.stalls > 0
    assert result.failures_by_reason.get("timeout", 0) > 0  # the watchdog ended streams
    assert result.quarantined_blocks > 0  # held until the producer's writes were bounded
    assert result.failures_by_reason.get("aborted", 0) > 0


def test_consumers_vanishing_mid_stream() -> None:
    faults = dataclasses.replace(parse_faults("vanish"), vanish=0.002)
    result = simulate(7, 1000, faults, False, True)
    assert_clean(result)
    assert result.vanished > 0 and result.failures_by_reason.get("consumer crashed", 0) > 0


def test_without_faults_a_good_share_streams_and_all_is_done() -> None:
    result = simulate(3, 1000, parse_faults("none"), False, True)
    assert_clean(result)
    assert result.done == 1000
    assert result.streamed > 100  # of ~300 push requests, registered while computing
    assert result.stream_rounds > result.streamed


def test_the_stream_faults_do_nothing_without_stream() -> None:
    a = dataclasses.asdict(simulate(4, 300, parse_faults("none")))
    b = dataclasses.asdict(simulate(4, 300, parse_faults("preempt,stall,vanish")))
    for d in (a, b):
        d.pop("wall_s")
        d.pop("faults")
    assert a == b and a["streamed"] == 0


def test_a_streaming_seed_reproduces_its_run() -> None:
    a = dataclasses.asdict(simulate(8, 400, parse_faults("all"), False, True))
    b = dataclasses.asdict(simulate(8, 400, parse_faults("all"), False, True))
    for d in (a, b):
        d.pop("wall_s")
    assert a == b


def test_command_stream_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sim", "--requests", "300", "--seed", "2", "--stream", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["streamed"] > 0 and out["invariant_violations"] == 0
    assert main(["sim", "--requests", "200", "--stream", "--faults", "preempt"]) == 0
    assert "streamed" in capsys.readouterr().out


# ----------------------------------------------------------------- the checks have teeth


def test_a_layer_written_before_it_is_computed_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted machine bug: each layer is taken as computed one layer early, so rounds
    carry bytes the engine has not computed yet; successes then hold wrong KV."""
    original = ProducerMachine._on_layers

    def ahead(self: ProducerMachine, event: LayersComputed, now: float, out: Any) -> None:
        original(self, LayersComputed(event.request_ids, event.units + 1), now, out)

    monkeypatch.setattr(ProducerMachine, "_on_layers", ahead)
    result = simulate(1, 400, parse_faults("none"), False, True)
    assert result.corrupt > 0 and not result.ok
    assert any("holds wrong KV" in v for v in result.violations)


def test_a_round_after_the_consumers_watchdog_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted machine bug: the producer ignores the consumer's watchdog (its writes are
    unbounded), so a stalled stream writes into blocks the consumer freed at
    ``writes_until``; the landing is counted as a late write and as corrupt."""
    original = ProducerMachine._start_push

    def unbounded(self: ProducerMachine, req: Any, *args: Any) -> None:
        original(self, req, *args)
        req.write_deadline = math.inf

    monkeypatch.setattr(ProducerMachine, "_start_push", unbounded)
    monkeypatch.setattr(ProducerMachine, "_transfer_deadline", lambda self, req, now: now + 30.0)
    result = simulate(1, 1000, parse_faults("stall"), False, True)
    assert result.late_writes > 0 and result.corrupt > 0 and not result.ok


def test_not_rewriting_after_a_preemption_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted machine bug: Preempted is ignored, so what was written from the blocks the
    engine took back is never rewritten from the new ones (the machine's own chunk check
    also objects)."""
    monkeypatch.setattr(ProducerMachine, "_on_preempted", lambda self, event, now, out: None)
    result = simulate(1, 1000, parse_faults("preempt"), False, True)
    assert result.preemptions > 0 and not result.ok
    assert result.corrupt > 0 or result.invariant_violations > 0


def test_a_handshake_timing_out_mid_stream() -> None:
    faults = Faults(handshake_silence=0.5, stall=0.3, kinds=("handshake", "stall"))
    result = simulate(0, 200, faults, False, True)
    assert_clean(result)
