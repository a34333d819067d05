"""KVWireConnector inside vLLM: vLLM's KVConnectorFactory loads it by module path, vLLM's
real Scheduler drives a P and a D engine (separate processes, real DRAM KV tensors), and
D checks the bytes it received the moment its model would first read them."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from harness import (
    Geometry,
    PeerError,
    SchedulerEngine,
    Zygote,
    assert_moved,
    engines,
    free_port,
    moved,
    prefill,
    registered_by_each,
    step_both,
    transfer,
    transfer_many,
    wait_until,
)

TOKENS = 100  # 3 full blocks + a partial one (32-token blocks)


def _pair(
    zygote: Zygote,
    p_conn: str,
    d_conn: str,
    extra: dict[str, Any],
    mode: str = "pull",
    d_extra: dict[str, Any] | None = None,
    tp: tuple[int, int] = (1, 1),
    layout: str = "LBHNC",
) -> Iterator[tuple[SchedulerEngine, SchedulerEngine]]:
    """A P and a D engine; D's extra config is ``d_extra`` when given, else P's; ``tp``:
    their TP sizes; ``layout``: vLLM's KV cache layout on both."""
    p_options = {"extra_config": extra, "tp": tp[0]}
    d_options = {"extra_config": extra if d_extra is None else d_extra, "tp": tp[1]}
    with engines(zygote, p_conn, d_conn, p_options, d_options, mode=mode, layout=layout) as pair:
        yield pair


METRICS_PORT = free_port()
"""D's worker serves its counters here (``metrics_port`` in the extra config)."""


@pytest.fixture(scope="module")
def shm_pull(zygote: Zygote) -> Iterator[tuple[SchedulerEngine, SchedulerEngine]]:
    shm = {"transport": "shm"}
    d_extra = {**shm, "metrics_port": METRICS_PORT}
    yield from _pair(zygote, "KVWireConnector", "KVWireConnector", shm, d_extra=d_extra)


def test_factory_loads_the_connector_by_module_path(shm_pull: Any) -> None:
    """... and vLLM keeps its hybrid KV cache manager on (its default) for it, as for its
    own NixlConnector: a KVWireConnector supports the hybrid manager."""
    p, d = shm_pull
    for engine in (p, d):
        state = engine.peer.call({"op": "state"})
        assert state["connector"] == "KVWireConnector" and state["hma"] is True


def test_pull_shm_bytes_checked(shm_pull: Any) -> None:
    p, d = shm_pull
    free_p = p.peer.call({"op": "state"})["free_blocks"]
    state = transfer(p, d, "req-a", 3, TOKENS)
    wrong, checked = state["checked"]["req-a"]
    assert checked > 0 and wrong == 0
    assert "req-a" in state["received"]
    stats = d.peer.call({"op": "stats"})["stats"]  # what vLLM's stats logger gets
    assert stats["descriptors"] > 0 and stats["requests_done"] >= 1
    # ... and what Prometheus scrapes from D's worker (metrics_port + TP rank 0).
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10)
    moved = re.search(r'^kvwire_transferred_bytes_total\{role="consumer"\} (\S+)$',
                      scraped.read().decode(), re.M)  # fmt: skip
    assert moved is not None and float(moved.group(1)) >= checked
    assert p.peer.call({"op": "state"})["free_blocks"] == free_p


def test_d_done_before_p_holds(shm_pull: Any) -> None:
    """D reads and reports before P's worker has stepped again (vLLM hands the params out a
    step before P's worker holds the blocks): P still frees at once when it steps, not after
    the 30 s lease."""
    p, d = shm_pull
    p.add("req-e", 31, TOKENS)
    wait_until(lambda: "req-e" in p.state.get("outputs", {}), p.step, 30, "P to finish req-e")
    d.add("req-e", 31, TOKENS, p.state["outputs"]["req-e"])
    wait_until(lambda: "req-e" in d.state.get("outputs", {}), d.step, 30, "D, P idle")
    assert d.state["checked"]["req-e"][0] == 0
    wait_until(lambda: "req-e" in p.state.get("sent", []), p.step, 10, "P to free req-e")


def test_prefix_hit_on_d(shm_pull: Any) -> None:
    """A request repeating an earlier prompt and more: D's own prefix cache covers the
    shared full blocks, only the rest is fetched, and the whole prompt checks."""
    p, d = shm_pull
    first = transfer(p, d, "req-b", 5, 64)
    assert first["checked"]["req-b"][0] == 0
    state = transfer(p, d, "req-b2", 5, TOKENS)
    wrong, checked = state["checked"]["req-b2"]
    assert checked > 0 and wrong == 0
    assert state["hits"]["req-b2"] == 64  # two full blocks were D's own


def test_prefix_hit_on_p_while_the_first_is_held(shm_pull: Any) -> None:
    """The second of two prompts sharing a prefix hits the first's cached blocks on P
    while the first is still held for D: P holds those blocks for both (an engine counts
    references); D then fetches both, every byte checked, and P frees both."""
    p, d = shm_pull
    free_p = p.peer.call({"op": "state"})["free_blocks"]
    prompts = {"req-p1": 64, "req-p2": TOKENS}
    transfer_many(p, d, 6, prompts)
    assert p.state["hits"]["req-p2"] == 64  # the first prompt's two full blocks
    for rid in prompts:
        wrong, checked = d.state["checked"][rid]
        assert checked > 0 and wrong == 0, rid
    assert p.peer.call({"op": "state"})["free_blocks"] == free_p


def test_abort_on_d_while_loading(shm_pull: Any) -> None:
    """D aborts a request whose KV is in flight: vLLM holds its blocks until the connector
    reports the request received, and then every block is free again."""
    p, d = shm_pull
    free_d = d.peer.call({"op": "state"})["free_blocks"]
    p.add("req-x", 13, TOKENS)
    wait_until(lambda: "req-x" in p.state.get("outputs", {}), p.step, 30, "P to finish req-x")
    d.add("req-x", 13, TOKENS, p.state["outputs"]["req-x"])
    d.step()
    d.abort("req-x")
    wait_until(
        lambda: "req-x" in d.state.get("received", []) and d.state["free_blocks"] == free_d,
        d.step, 30, "D to end req-x and free its blocks",
    )  # fmt: skip
    assert "req-x" not in d.state["checked"]  # never computed


def test_p_restart(zygote: Zygote) -> None:
    """P's engine dies and comes back under the same engine id and side-channel port (new
    NIXL agent, new memory). D's first READ after the restart hits the dead agent: that
    request ends as a load failure (its blocks reported to vLLM, nothing read stale); D
    forgets the lost peer, re-handshakes, and the next request's bytes check."""
    extra = {"transport": "nixl"}
    p = SchedulerEngine("P", "KVWireConnector", zygote, extra_config=extra)
    d = SchedulerEngine("D", "KVWireConnector", zygote, extra_config=extra)
    try:
        state = transfer(p, d, "req-r1", 17, TOKENS)
        assert state["checked"]["req-r1"][0] == 0
        p.close()
        p = SchedulerEngine(
            "P", "KVWireConnector", zygote, extra_config=extra, engine_id=p.engine_id, port=p.port
        )
        p.add("req-r2", 19, TOKENS)
        wait_until(lambda: "req-r2" in p.state.get("outputs", {}), p.step, 30, "P")
        d.add("req-r2", 19, TOKENS, p.state["outputs"]["req-r2"])
        wait_until(lambda: "req-r2" in d.state.get("outputs", {}), d.step, 30, "D to end r2")
        first = d.state
        assert "req-r2" in first["received"]
        if "req-r2" not in first["checked"]:  # failed: vLLM was told which blocks
            assert first["invalid"]
        state = transfer(p, d, "req-r3", 21, TOKENS)
        wrong, checked = state["checked"]["req-r3"]
        assert checked > 0 and wrong == 0
    finally:
        d.close()
        p.close()


def test_preemption_on_p(zygote: Zygote) -> None:
    """Two prompts prefill in 32-token chunks on a P with five usable blocks: vLLM's
    scheduler preempts the second (its blocks freed, its prefill restarted), which then
    waits for the blocks the first holds for D. Both reach D with checked bytes."""
    extra = {"transport": "shm"}
    small = Geometry(num_blocks=6)  # block 0 is vLLM's null block
    chunks = {"batch_tokens": 64, "chunk_tokens": 32}
    p = SchedulerEngine("P", "KVWireConnector", zygote, geo=small, extra_config=extra,
                        scheduler=chunks)  # fmt: skip
    d = SchedulerEngine("D", "KVWireConnector", zygote, extra_config=extra)
    try:
        p.add("req-p1", 23, TOKENS)
        p.add("req-p2", 29, TOKENS)

        def both() -> None:
            p.step()
            for rid in ("req-p1", "req-p2"):
                params = p.state["outputs"].get(rid)
                if params is not None and rid not in forwarded:
                    forwarded.add(rid)
                    d.add(rid, 23 if rid == "req-p1" else 29, TOKENS, params)
            d.step()

        forwarded: set[str] = set()
        wait_until(
            lambda: {"req-p1", "req-p2"} <= set(d.state.get("checked", {})),
            both, 60, "both prompts to reach D",
        )  # fmt: skip
        assert p.state["preemptions"]["req-p2"] >= 1
        for rid in ("req-p1", "req-p2"):
            wrong, checked = d.state["checked"][rid]
            assert checked > 0 and wrong == 0, rid
    finally:
        d.close()
        p.close()


PAIRS = {
    "kvwire-nixl": ("KVWireConnector", "KVWireConnector"),
    "stock-P-kvwire-D": ("NixlConnector", "KVWireConnector"),
    "kvwire-P-stock-D": ("KVWireConnector", "NixlConnector"),
}


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_pull_nixl(zygote: Zygote, pair: str) -> None:
    """Real NIXL between the engines; the mixed pairs are a stock vLLM NixlConnector engine
    on one side and KVWireConnector on the other, each built by vLLM's factory."""
    p_conn, d_conn = PAIRS[pair]
    for p, d in _pair(zygote, p_conn, d_conn, {"transport": "nixl"}):
        assert_moved(p, d, "req-n", 9, TOKENS)


PUSH = {
    "kvwire-shm": ("KVWireConnector", "KVWireConnector", "shm"),
    "kvwire-nixl": ("KVWireConnector", "KVWireConnector", "nixl"),
    "stock-P-kvwire-D": ("NixlConnector", "KVWireConnector", "nixl"),
    "kvwire-P-stock-D": ("KVWireConnector", "NixlConnector", "nixl"),
}


@pytest.mark.parametrize("pair", sorted(PUSH))
def test_push(zygote: Zygote, pair: str) -> None:
    """Push: D registers its blocks with P, P's worker WRITEs them."""
    p_conn, d_conn, transport = PUSH[pair]
    # No UCX setting: in push over NIXL the connector runs UCX's peer error handling, as
    # vLLM's agents do (without it UCX cannot open endpoints both ways with them).
    for p, d in _pair(zygote, p_conn, d_conn, {"transport": transport}, "push"):
        assert_moved(p, d, "req-w", 11, TOKENS)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_regions_are_where_stock_registers(zygote: Zygote, layout: str) -> None:
    """vLLM backs every layer with one allocation: the regions must be read from each
    layer's own view, and be the ones a stock engine registers (so a mixed pair agrees
    region for region) in every layout kvwire supports."""
    stock, ours = registered_by_each(zygote, extra_config={"transport": "nixl"}, layout=layout)
    assert ours["layout"] == stock["layout"] == layout
    assert ours["regions"] and ours["regions"] == stock["regions"]
    assert ours["names"] == stock["names"]


KERNEL_GEO = Geometry(layers=2, num_blocks=16, block_size=64)
"""Blocks of 64 tokens, each four kernel blocks of 16 where the backend runs only 16."""
KERNEL_PAIRS = {
    "kvwire-shm": ("KVWireConnector", "KVWireConnector", "shm", 16, 16),
    "kvwire-nixl": ("KVWireConnector", "KVWireConnector", "nixl", 16, 16),
    "stock-P-kvwire-D": ("NixlConnector", "KVWireConnector", "nixl", 16, 16),
    "kvwire-P-stock-D": ("KVWireConnector", "NixlConnector", "nixl", 16, 16),
    "kvwire-P16-D32": ("KVWireConnector", "KVWireConnector", "nixl", 16, 32),
    "kvwire-P64-D16": ("KVWireConnector", "KVWireConnector", "nixl", 0, 16),
}


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", sorted(KERNEL_PAIRS))
def test_kernel_blocks_smaller_than_the_block(zygote: Zygote, pair: str, mode: str) -> None:
    """An attention backend that runs smaller kernel blocks than the engine's blocks: each
    layer's view holds that many more blocks, and a block id names several. P writes and D
    checks every prompt token through the kernel-block views; kvwire pairs may split their
    blocks differently (0: not split)."""
    p_conn, d_conn, transport, p_kernel, d_kernel = KERNEL_PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn, {"kernel_block": p_kernel}, {"kernel_block": d_kernel},
        geo=KERNEL_GEO, extra_config={"transport": transport}, mode=mode,
    ) as (p, d):  # fmt: skip
        assert_moved(p, d, "req-k", 17, 150)  # 2 blocks and 22 tokens


BLOCK_SIZE_PAIRS = {
    "kvwire-P32-D64": ("KVWireConnector", "KVWireConnector", 32, 64, "pull push"),
    "kvwire-P64-D32": ("KVWireConnector", "KVWireConnector", 64, 32, "pull push"),
    "stock-P32-kvwire-D64": ("NixlConnector", "KVWireConnector", 32, 64, "pull"),
}
"""Unequal block sizes (vLLM's matrix: "hetero block size"). kvwire places whole lists by
token, so either side may have the larger blocks. With a stock engine only stock P -> kvwire
D in pull is claimed: here stock's own pairs of unequal block sizes fail (two stock engines
leave D's bytes wrong in pull and never finish in push), so those cells say nothing about
kvwire."""


@pytest.mark.parametrize("model", ["llama-3-8b", "qwen3-30b-a3b"], ids=["dense", "moe"])
@pytest.mark.parametrize(
    ("pair", "mode"),
    [(pair, mode) for pair, case in sorted(BLOCK_SIZE_PAIRS.items()) for mode in case[4].split()],
)
def test_unequal_block_sizes(zygote: Zygote, pair: str, mode: str, model: str) -> None:
    """P and D with different block sizes: every prompt token (150: a partial last block on
    both sides) reaches D, checked through D's own blocks; a mixture of experts' KV as a
    dense model's."""
    p_conn, d_conn, p_block, d_block, _ = BLOCK_SIZE_PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn,
        {"geo": Geometry(model=model, layers=2, num_blocks=32, block_size=p_block)},
        {"geo": Geometry(model=model, layers=2, num_blocks=32, block_size=d_block)},
        extra_config={"transport": "nixl"}, mode=mode,
        hma=None if d_conn == p_conn else False,
    ) as (p, d):  # fmt: skip
        assert_moved(p, d, "req-b", 3, 150)


def test_a_stock_d_of_another_block_size_is_refused_by_a_pushing_p(zygote: Zygote) -> None:
    """vLLM 0.31.0's push consumer rearranges blocks of another size by its own rule and,
    written to by a kvwire producer, stops on an index error (measured here before the
    refusal). kvwire's P refuses it at the handshake, naming both block sizes, before any
    write, and frees the prompt's blocks; the stock D keeps serving and checks nothing."""
    with engines(
        zygote, "KVWireConnector", "NixlConnector",
        {"geo": Geometry(layers=2, num_blocks=32, block_size=32)},
        {"geo": Geometry(layers=2, num_blocks=32, block_size=64)},
        extra_config={"transport": "nixl"}, mode="push", hma=False,
    ) as (p, d):  # fmt: skip
        d.add("req-bs", 3, 150, prefill(p, "req-bs", 3, 150))
        step_both(p, d, lambda: "req-bs" in p.state.get("sent", []), "P to free it", 30)
        refusal = "with blocks of 64 tokens, and this producer's hold 32"
        assert any(refusal in line for line in p.state["log"] + p.peer.log), p.peer.log[-3:]
        assert p.peer.call({"op": "stats"})["stats"]["bytes"] == 0  # nothing written
        d.step()  # D still serves
        assert "req-bs" not in d.state["checked"]


@pytest.mark.parametrize(("p_block", "d_block"), [(64, 32), (32, 64)])
def test_a_stock_p_of_another_block_size_is_refused_by_a_pushed_d(
    zygote: Zygote, p_block: int, d_block: int
) -> None:
    """vLLM 0.31.0's push producer places blocks of another size by its own rule: measured
    here before the refusal, its 64-token blocks pushed into a kvwire D's 32-token ones
    ended the request done with 1075200 of its 1228800 bytes wrong. kvwire's D, which
    handshakes P to register with it, refuses it there, naming both block sizes, before
    any write, and fails the request (vLLM computes it): nothing is reported received
    whole."""
    with engines(
        zygote, "NixlConnector", "KVWireConnector",
        {"geo": Geometry(layers=2, num_blocks=32, block_size=p_block)},
        {"geo": Geometry(layers=2, num_blocks=32, block_size=d_block)},
        extra_config={"transport": "nixl"}, mode="push",
    ) as (p, d):  # fmt: skip
        d.add("req-bs", 3, 150, prefill(p, "req-bs", 3, 150))
        step_both(p, d, lambda: "req-bs" in d.state.get("received", []), "D to end it", 30)
        refusal = f"with blocks of {p_block} tokens, and this consumer's hold {d_block}"
        assert any(refusal in line for line in d.state["log"] + d.peer.log), d.peer.log[-3:]
        d.step(2)
        assert d.state["invalid"] and "req-bs" not in d.state["checked"]


def test_kernel_blocks_are_advertised_as_stock_advertises_them(zygote: Zygote) -> None:
    """Regions of kernel blocks, and the block size, ratio and count a peer plans by, are
    what a stock engine registers and advertises over the same allocation."""
    stock, ours = registered_by_each(
        zygote, geo=KERNEL_GEO, extra_config={"transport": "nixl"}, kernel_block=16
    )
    assert ours["blocks"] == stock["blocks"] == [16, 4, KERNEL_GEO.num_blocks * 4]
    assert ours["regions"] and ours["regions"] == stock["regions"]
    assert ours["names"] == stock["names"]


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_unsupported_layouts_are_refused_by_name(zygote: Zygote, layout: str) -> None:
    """Layouts that put heads outside a block's page: the worker refuses at registration
    and the error names the layout."""
    with pytest.raises(PeerError, match=f"kv_cache_layout.*{layout} is not supported"):
        SchedulerEngine("P", "KVWireConnector", zygote, extra_config={"transport": "shm"},
                        layout=layout).close()  # fmt: skip


def test_cuda_backends_resolve_the_stock_layout(zygote: Zygote) -> None:
    """On CUDA, FlashAttention and Triton take any layout, and vLLM's engine core asks the
    connector which one; without an answer it takes LBNHC. A kvwire engine must resolve
    what a stock one does, or a mixed pair differs in layout."""
    found = {}
    for connector in ("NixlConnector", "KVWireConnector"):
        engine = SchedulerEngine("P", connector, zygote, extra_config={"transport": "nixl"})
        try:
            found[connector] = engine.peer.call({"op": "resolve_layout"})
        finally:
            engine.close()
    stock, ours = found["NixlConnector"], found["KVWireConnector"]
    for backend in ("flash_attn", "triton"):
        assert ours[backend] == stock[backend] == "LBHNC"
        assert ours[f"none.{backend}"] == "LBNHC"  # what a connector without an answer gets


TP_SIZES = {"2-2": (2, 2), "2-1": (2, 1), "1-2": (1, 2)}
TP_PAIRS = {
    "kvwire-shm": ("KVWireConnector", "KVWireConnector", "shm"),
    "kvwire-nixl": ("KVWireConnector", "KVWireConnector", "nixl"),
    "stock-P-kvwire-D": ("NixlConnector", "KVWireConnector", "nixl"),
    "kvwire-P-stock-D": ("KVWireConnector", "NixlConnector", "nixl"),
}
ALL_HEADS = TOKENS * Geometry().layers * 8 * 2 * 128 * 2
"""Bytes of every prompt token (3 full blocks and 4 tokens of the last) in every layer, all
8 heads (K and V of 128 bf16 values each), whichever ranks hold them."""


@pytest.mark.parametrize("sizes", sorted(TP_SIZES))
@pytest.mark.parametrize("pair", sorted(TP_PAIRS))
def test_tensor_parallel(zygote: Zygote, pair: str, sizes: str) -> None:
    """Engines with TP > 1: one connector per rank (each told its rank the way vLLM's
    parallel groups tell it), each with its own KV allocation and share of the heads;
    vLLM's output aggregator finishes a request once every rank reported it. Equal and
    unequal TP sizes, kvwire on both sides or a stock engine on one; D's ranks together
    check every head."""
    p_conn, d_conn, transport = TP_PAIRS[pair]
    p_tp, d_tp = TP_SIZES[sizes]
    extra = {"transport": transport}
    for p, d in _pair(zygote, p_conn, d_conn, extra, tp=(p_tp, d_tp)):
        state = transfer(p, d, "req-tp", 13, TOKENS)
        assert tuple(state["checked"]["req-tp"]) == (0, ALL_HEADS)


LAYOUT_PAIRS = {k: TP_PAIRS[k] for k in ("kvwire-nixl", "stock-P-kvwire-D", "kvwire-P-stock-D")}
REFUSED = {
    ("BLNHC", "stock-P-kvwire-D"): "whole block rows of 2 layers",
    ("LBNHC", "kvwire-P-stock-D"): "",
    ("BLNHC", "kvwire-P-stock-D"): "",
}
"""Unequal TP sizes a D refuses: vLLM refuses tokens-before-heads layouts (its rule, the
same between two stock engines); kvwire refuses a stock P's whole block rows, which no
slicing can take apart by heads (a kvwire P names its layers' pages in a row, so two
kvwire engines move it)."""


@pytest.mark.parametrize("sizes", ["1-1", "2-1"])
@pytest.mark.parametrize("pair", sorted(LAYOUT_PAIRS))
@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC", "BLNHC"])
def test_layouts(zygote: Zygote, layout: str, pair: str, sizes: str) -> None:
    """Bytes checked in the other layouts kvwire moves, through vLLM's own per-layer views
    of its one allocation: equal and unequal TP sizes, kvwire on both sides or stock on
    one. Where a D refuses, the request fails on D with its blocks marked invalid (vLLM's
    load-failure path), and nothing is checked as delivered."""
    p_conn, d_conn, transport = LAYOUT_PAIRS[pair]
    tp = {"1-1": (1, 1), **TP_SIZES}[sizes]
    refused = REFUSED.get((layout, pair)) if sizes != "1-1" else None
    for p, d in _pair(zygote, p_conn, d_conn, {"transport": transport}, tp=tp, layout=layout):
        if refused is None:
            state = transfer(p, d, "req-l", 13, TOKENS)
            assert tuple(state["checked"]["req-l"]) == (0, ALL_HEADS)
            continue
        p.add("req-l", 13, TOKENS)
        wait_until(lambda p=p: "req-l" in p.state.get("outputs", {}), p.step, 30, "P to finish")
        d.add("req-l", 13, TOKENS, p.state["outputs"]["req-l"])
        wait_until(lambda d=d: "req-l" in d.state.get("outputs", {}), d.step, 30, "D to fail it")
        assert d.state["invalid"] and "req-l" not in d.state["checked"]
        if refused:
            assert any(refused in line for line in d.state["log"] + d.peer.log), d.peer.log[-3:]


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_a_mixture_of_experts_moves_as_dense(zygote: Zygote, pair: str) -> None:
    """A mixture-of-experts model (Qwen3-30B-A3B's attention: 4 KV heads of 128): its
    experts are in the MLP, so vLLM gives its KV cache the dense model's one full-attention
    group, and it moves as a dense model's, hashed with its own name."""
    p_conn, d_conn = PAIRS[pair]
    geo = Geometry(model="qwen3-30b-a3b", layers=2)
    with engines(zygote, p_conn, d_conn, geo=geo, extra_config={"transport": "nixl"}) as (p, d):
        checked = assert_moved(p, d, "req-moe", 79, TOKENS)
    assert checked == TOKENS * geo.layers * 4 * 2 * 128 * 2


MOE = "qwen3-30b-a3b"
MOE_CELLS: dict[str, dict[str, Any]] = {
    "spec-decode": {"geo": Geometry(model=MOE, layers=3), "drafter": "eagle:1"},
    "hetero-tp-1-2": {"d": {"tp": 2}},
    "hetero-tp-2-1": {"p": {"tp": 2}},
    "cross-layer": {"layout": "BLHNC"},
    "window": {"window": 48, "hma": True},
    "host-buffer": {"host_buffer": True},
}
"""vLLM's matrix columns for a mixture of experts, each as the dense model's (``p``/``d``:
one side's options; a host buffer stages on kvwire's engines, as a CPU stock one stages
nothing)."""


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("cell", sorted(MOE_CELLS))
def test_a_mixture_of_experts_in_every_column(zygote: Zygote, cell: str, pair: str) -> None:
    """Each column of vLLM's matrix for a mixture of experts (an EAGLE drafter beside it,
    unequal TP, a block-outermost layout, sliding-window layers beside full ones, a host
    buffer): its KV moves byte for byte as a dense model's, with either kind of engine on
    either side."""
    p_conn, d_conn = PAIRS[pair]
    options = {"geo": Geometry(model=MOE, layers=2), **MOE_CELLS[cell]}
    p_options, d_options = dict(options.pop("p", {})), dict(options.pop("d", {}))
    if options.pop("host_buffer", False):
        p_options["host_buffer"] = p_conn == "KVWireConnector"
        d_options["host_buffer"] = d_conn == "KVWireConnector"
    with engines(
        zygote, p_conn, d_conn, p_options, d_options, extra_config={"transport": "nixl"},
        **options,
    ) as (p, d):  # fmt: skip
        assert_moved(p, d, f"req-moe-{cell}", 83, TOKENS)


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_a_multimodal_prompt_moves_as_dense(zygote: Zygote, pair: str) -> None:
    """A prompt with an image in it: vLLM's scheduler has P encode the image (its
    placeholder tokens are then computed as any others) and D, which loads those tokens,
    encode nothing; the image's KV is in the model's one full-attention group and moves
    as a dense model's, byte for byte."""
    p_conn, d_conn = PAIRS[pair]
    image = (10, 64)
    with engines(zygote, p_conn, d_conn, multimodal=True, extra_config={"transport": "nixl"}) as (
        p,
        d,
    ):
        p.add("req-image", 81, TOKENS, images=[image])
        wait_until(lambda: "req-image" in p.state.get("outputs", {}), p.step, 30, "P's prefill")
        params = p.state["outputs"]["req-image"]
        d.add("req-image", 81, TOKENS, params, images=[image])
        state = moved(p, d, "req-image")
        wrong, checked = state["checked"]["req-image"]
        assert wrong == 0 and checked == assert_moved(p, d, "req-text", 82, TOKENS)
        assert p.state["encoded"]["req-image"] == [0]
        assert "req-image" not in state["encoded"]
