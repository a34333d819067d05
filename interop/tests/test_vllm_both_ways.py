"""Engines that move KV both ways: ``kv_role: "kv_both"`` (one engine is P for some requests
and D for others) and ``bidirectional_kv_xfer`` (a decode engine keeps a finished
conversation's blocks, and the prefill engine of the next turn reads them back). Each runs
against stock engines as well as kvwire's, every byte checked where it lands."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from harness import (
    Geometry,
    SchedulerEngine,
    Zygote,
    engines,
    free_port,
    moved,
    prefill,
    step_both,
    transfer,
    wait_until,
)

TOKENS = 100  # 3 full blocks and a partial one (32-token blocks)
NEXT_TURN = 140
"""The next turn's prompt: the conversation so far and a new message."""

KVWIRE, STOCK = "KVWireConnector", "NixlConnector"


def _checked(engine: SchedulerEngine, rid: str) -> int:
    """The bytes ``engine`` checked of ``rid``, none of them wrong."""
    assert rid in engine.state["checked"], (engine.state["invalid"], engine.peer.log[-3:])
    wrong, checked = engine.state["checked"][rid]
    assert checked > 0 and wrong == 0, (wrong, checked)
    return int(checked)


# -- kv_both -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("other", [KVWIRE, STOCK])
def test_kv_both(zygote: Zygote, other: str, mode: str) -> None:
    """Two ``kv_both`` engines, a kvwire one and ``other``: a prompt goes from the kvwire
    engine to the other, then another prompt from the other to the kvwire engine, each
    landing byte for byte (one agent per rank on each side, serving reads and making
    them, or writing and being written to)."""
    both = {"kv_role": "kv_both"}
    with engines(zygote, KVWIRE, other, both, both, mode=mode) as (a, b):
        transfer(a, b, "first", 1, TOKENS)
        _checked(b, "first")
        assert "first" in a.state["sent"]

        b.add("second", 2, TOKENS, {"do_remote_decode": True})
        wait_until(lambda: "second" in b.state.get("outputs", {}), b.step, 30, "B's prefill")
        params = dict(b.state["outputs"]["second"])
        assert params["do_remote_prefill"] and params["remote_engine_id"] == b.engine_id
        a.add("second", 2, TOKENS, params)
        step_both(
            b, a, lambda: "second" in a.state.get("checked", {}) and "second" in b.state["sent"],
            "A to receive the second prompt and B to free it",
        )  # fmt: skip
        assert _checked(a, "second") == _checked(b, "first")
        # What vLLM's stats logger gets from the kvwire engine: one rank's counters, its
        # producer's (the first prompt, freed) and its consumer's (the second, done).
        stats = a.peer.call({"op": "stats"})["stats"]
        assert stats["requests_done"] == 1 and sum(stats["freed"].values()) == 1, stats
        assert stats["bytes"] > 0 and stats["requests_failed"] == 0, stats


# -- bidirectional_kv_xfer -------------------------------------------------------------


@contextlib.contextmanager
def _conversation(
    zygote: Zygote, p_conn: str, d_conn: str, *, p_extra: dict[str, Any] | None = None,
    d_extra: dict[str, Any] | None = None, prefix_caching: bool = False, **options: Any,
) -> Iterator[tuple[SchedulerEngine, SchedulerEngine]]:  # fmt: skip
    """A P and a D engine with ``bidirectional_kv_xfer`` on, pull mode; P's prefix cache
    as asked (off: the next turn reads the whole conversation from D)."""
    extra = {"bidirectional_kv_xfer": True}
    p_options = {"extra_config": {**extra, **(p_extra or {})}, "prefix_caching": prefix_caching}
    d_options = {"extra_config": {**extra, **(d_extra or {})}}
    with engines(zygote, p_conn, d_conn, p_options, d_options, **options) as pair:
        yield pair


GENERATED = 3
"""Tokens D generates in turn one: it computes the KV of all but the last, which the next
turn's prompt holds too."""
KEPT = TOKENS + GENERATED - 1


def _first_turn(p: SchedulerEngine, d: SchedulerEngine) -> tuple[dict[str, Any], int]:
    """Turn one, P to D as usual, then D generates: D's params for the next turn (it keeps
    the blocks) and the bytes D checked of the prompt."""
    d.add("turn1", 1, TOKENS, prefill(p, "turn1", 1, TOKENS), max_tokens=GENERATED)
    moved(p, d, "turn1")
    kept = dict(d.state["outputs"]["turn1"])
    assert kept["do_remote_decode"] and not kept["do_remote_prefill"], kept
    assert kept["remote_engine_id"] == d.engine_id and kept["remote_num_tokens"] == KEPT
    assert "turn1" not in d.state["sent"]  # held for the next turn
    return kept, _checked(d, "turn1")


def _next_turn(p: SchedulerEngine, d: SchedulerEngine, kept: dict[str, Any]) -> None:
    """Turn two on P with D's params, into blocks scribbled over since turn one (nothing
    of it may survive there): both step until D has freed turn one's blocks and P has
    finished the prompt (P's params then send it to a decode engine)."""
    assert p.scribble_free() > 0
    p.add("turn2", 1, NEXT_TURN, kept, generated_from=TOKENS)
    step_both(
        p, d, lambda: "turn1" in d.state["sent"] and "turn2" in p.state.get("outputs", {}),
        "D to free turn one and P to finish turn two",
    )  # fmt: skip


PAIRS = [(KVWIRE, KVWIRE), (STOCK, KVWIRE), (KVWIRE, STOCK)]


@pytest.mark.parametrize(
    ("p_conn", "d_conn"), PAIRS, ids=["kvwire", "stockP-kvwireD", "kvwireP-stockD"]
)
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["whole", "after-prefix-hit"])
def test_conversation_read_back(
    zygote: Zygote, p_conn: str, d_conn: str, prefix_caching: bool
) -> None:
    """Turn two's prefill reads what D kept of turn one, byte for byte, into blocks
    scribbled over since, then computes the rest; D frees its blocks once read. With P's
    prefix cache on, P reads only what its cache lacks (the partial last block; the
    threshold set to 0 so that so few tokens still cross)."""
    p_extra = {"kv_recompute_threshold": 0} if prefix_caching else None
    with _conversation(zygote, p_conn, d_conn, p_extra=p_extra, prefix_caching=prefix_caching) as (
        p, d,
    ):  # fmt: skip
        started = time.perf_counter()
        kept, d_checked = _first_turn(p, d)
        # Held decoder_kv_blocks_ttl (480 s by default, in D's clock: the host's monotonic
        # one, as P's) from when turn one ended, not P's lease (30 s here): measured from
        # before the turn began, however long it took.
        assert kept["remote_blocks_expiry_time"] - started > 479
        _next_turn(p, d, kept)
        assert p.state["hits"]["turn2"] == (96 if prefix_caching else 0)
        assert "turn2" in p.state["received"] and not p.state["failed"]
        assert _checked(p, "turn2") == d_checked * KEPT // TOKENS
        params = p.state["outputs"]["turn2"]
        assert params["do_remote_prefill"] and params["remote_num_tokens"] == NEXT_TURN


def test_a_conversation_is_read_back_through_host_buffers(zygote: Zygote) -> None:
    """With a host buffer (``kv_buffer_device: "cpu"``) on both kvwire engines, D's host
    copy holds the prompt it loaded but not the tokens it generated on the device: D
    copies a kept conversation to the host before P reads it (without that copy P read
    stale bytes where D's generated tokens belong)."""
    with _conversation(zygote, KVWIRE, KVWIRE, host_buffer=True) as (p, d):
        kept, d_checked = _first_turn(p, d)
        _next_turn(p, d, kept)
        assert _checked(p, "turn2") == d_checked * KEPT // TOKENS


@pytest.mark.parametrize("p_conn", [KVWIRE, STOCK])
def test_a_few_tokens_are_computed_not_read(zygote: Zygote, p_conn: str) -> None:
    """Under ``kv_recompute_threshold`` (stock's default, 64 tokens) P computes what its
    prefix cache lacks rather than reading it, a kvwire P as a stock one; D still frees
    its blocks at once, told so by P."""
    with _conversation(zygote, p_conn, KVWIRE, prefix_caching=True) as (p, d):
        kept, _ = _first_turn(p, d)
        _next_turn(p, d, kept)
        assert p.state["hits"]["turn2"] == 96
        assert "turn2" not in p.state["received"] and "turn2" not in p.state["checked"]


def test_a_conversation_is_freed_when_its_hold_ends(zygote: Zygote) -> None:
    """D keeps a conversation ``decoder_kv_blocks_ttl`` seconds (2 here) and then frees
    it (after the quarantine a lease's blocks get, half the lease: 2 s here too); a next
    turn that comes later reads nothing (P declines: D no longer holds the blocks) and
    reports them failed, so vLLM computes them or fails the request."""
    with _conversation(zygote, KVWIRE, KVWIRE, d_extra={"decoder_kv_blocks_ttl": 2}, lease=4) as (
        p,
        d,
    ):
        kept, _ = _first_turn(p, d)
        assert kept["remote_blocks_expiry_time"] - time.perf_counter() < 3
        wait_until(lambda: "turn1" in d.state["sent"], d.step, 30, "D's hold to end")
        assert p.scribble_free() > 0
        p.add("turn2", 1, NEXT_TURN, kept, generated_from=TOKENS)
        wait_until(lambda: bool(p.state.get("invalid")), p.step, 30, "P to decline")
        assert "turn2" not in p.state["checked"]


@pytest.mark.parametrize(
    "model",
    [{"window": 64}, {"chunk": 64, "geo": Geometry(layers=4)}, {"rswa": 64}, {"ring": True}],
    ids=["window", "chunked", "rswa", "ring"],
)
def test_a_model_kvwire_does_not_read_back_keeps_nothing(
    zygote: Zygote, model: dict[str, Any]
) -> None:
    """A model with a sliding window, attention chunks, R-SWA (whose decode frees the
    blocks between the prompt and its window) or a ring (its one block for one count):
    kvwire's D says, naming the key, that it does not keep the conversation, and frees its
    blocks at once (its params name none)."""
    with _conversation(zygote, KVWIRE, KVWIRE, **model) as (p, d):
        transfer(p, d, "turn1", 1, TOKENS)
        assert "turn1" in d.state["checked"]
        assert d.state["outputs"]["turn1"] is None
        assert any("bidirectional_kv_xfer is on" in line for line in d.peer.log), d.peer.log[-5:]


def test_a_kept_conversation_kvwire_does_not_read_is_freed(zygote: Zygote) -> None:
    """The same model with a stock D, which keeps the conversation whatever the model: a
    kvwire P reads none of it (it computes the next turn) and tells D at once that it may
    free it, rather than leaving it held until its hold ends."""
    with _conversation(zygote, KVWIRE, STOCK, window=64) as (p, d):
        transfer(p, d, "turn1", 1, TOKENS)
        kept = dict(d.state["outputs"]["turn1"])
        assert kept["do_remote_decode"] and "turn1" not in d.state["sent"]
        p.add("turn2", 1, NEXT_TURN, kept, generated_from=TOKENS)
        step_both(
            p, d, lambda: "turn1" in d.state["sent"] and "turn2" in p.state.get("outputs", {}),
            "D to free turn one and P to finish turn two",
        )  # fmt: skip
        assert "turn2" not in p.state["received"] and "turn2" not in p.state["checked"]


@pytest.mark.parametrize("d_conn", [KVWIRE, STOCK])
def test_a_shorter_next_turn_reads_its_first_tokens(zygote: Zygote, d_conn: str) -> None:
    """A next turn that keeps only the conversation's beginning (a message edited, an
    answer regenerated): a kvwire P reads the first tokens of what D kept, not its last
    blocks, from a kvwire D as from a stock one. (Stock's P pairs the lists by their ends,
    so it reads D's last blocks here: not a pair this suite runs.)"""
    with _conversation(zygote, KVWIRE, d_conn) as (p, d):
        kept, _ = _first_turn(p, d)
        assert p.scribble_free() > 0
        p.add("turn2", 1, 70, kept, generated_from=TOKENS)
        step_both(
            p, d, lambda: "turn1" in d.state["sent"] and "turn2" in p.state.get("outputs", {}),
            "D to free turn one and P to finish turn two",
        )  # fmt: skip
        assert "turn2" in p.state["received"] and not p.state["invalid"]
        assert _checked(p, "turn2") == _checked(d, "turn1") * 70 // TOKENS


def test_the_worker_holds_a_kept_conversation_its_own_time() -> None:
    """What the scheduler says to hold for the next turn reaches the producer with its
    hold (``decoder_kv_blocks_ttl``), a prompt for D with none (the lease)."""
    from kvwire.integrations.vllm import worker
    from kvwire.integrations.vllm.messages import KVWireMetadata

    calls: list[tuple[str, float | None]] = []

    class Producer:
        def prefill_finished(
            self, rid: str, groups: Any, *, num_tokens: int, lease_s: float | None = None
        ) -> None:
            calls.append((rid, lease_s))

    side = worker.WorkerSide.__new__(worker.WorkerSide)
    side.producer, side.consumer, side.in_order = Producer(), None, None  # type: ignore[assignment]
    side.device, side.sending, side.batch, side._after = None, set(), (), None
    side.staging = None
    side.bind(
        KVWireMetadata(to_send={"kept": ([[1]], 16), "prompt": ([[2]], 16)}, held_s={"kept": 480.0})
    )
    assert calls == [("kept", 480.0), ("prompt", None)]


def test_a_kv_both_rank_serves_both_sides_metrics_on_one_port(zygote: Zygote) -> None:
    """``metrics_port`` on a ``kv_both`` engine: the rank's one port serves the producer's
    and the consumer's counters, each labelled with its role (two servers on one port
    would fail the engine's start)."""
    import urllib.request

    port = free_port()
    both = {"kv_role": "kv_both"}
    b_options = {**both, "extra_config": {"metrics_port": port}}
    with engines(zygote, KVWIRE, KVWIRE, both, b_options) as (a, b):
        transfer(a, b, "first", 1, TOKENS)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    moved_bytes = [
        line for line in text.splitlines() if line.startswith("kvwire_transferred_bytes_total")
    ]
    assert {'role="producer"', 'role="consumer"'} <= {
        label
        for line in moved_bytes
        for label in line[line.index("{") + 1 : line.index("}")].split(",")
    }, moved_bytes
    assert text.count("# TYPE kvwire_transferred_bytes counter") == 1
