"""vLLM 0.31.0's own NIXL connector classes against kvwire, over real NIXL, bytes checked.

Every cell moves one request's KV (filled by P with ``kvwire.demo.content``), checks every
byte on D, and checks that P frees the request's blocks exactly once all of D's ranks are
done. vLLM sides are interop/vllm_peer.py processes; kvwire sides are kvwire.demo engines
(``kvwire.runtime`` Producer/Consumer per rank process, transport ``nixl``). The kvwire
side says what a vLLM 0.31.0 engine says (layout ``LBHNC``, vLLM's layer names as region
names, ``CPU_ATTN`` and the hash factors of a CPU engine) through kvwire's own config.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from harness import (
    DecodeEngine,
    Geometry,
    PrefillEngine,
    VllmEngine,
    Zygote,
    factors,
    kvwire_options,
    vllm_compatible_extra,
    wait_until,
)

from kvwire.sidechannel.etcd import EtcdClient
from kvwire.sidechannel.store_records import ROOT
from kvwire.testing.etcd import EtcdServer

TOKENS = 100  # 4 blocks of 32: the last one partly filled
# Request ids as vLLM makes them (``{id}-{8 hex}``): P and D ids differ in the suffix only,
# as when a proxy forwards one request to both; push registrations match on the base.
TP_PAIRS = [(1, 1), (2, 2), (1, 2), (2, 1), (2, 4), (4, 2)]
MLA = Geometry(model="mla", layers=2, num_blocks=32, block_size=16)  # CPU_MLA: 16-token kernels
GQA = Geometry()


def _ids(pairs: list[tuple[int, int]]) -> list[str]:
    return [f"tp{p}->{d}" for p, d in pairs]


class KvwireD:
    """A kvwire decode engine plus the results its ranks reported."""

    def __init__(
        self, mode: str, tp: int, geo: Geometry, names: list[str], lease: float = 30
    ) -> None:
        extra = vllm_compatible_extra(geo, mode, names)
        opts = kvwire_options("D", mode, tp, geo, lease=lease, rank_extra=extra)
        self.engine = DecodeEngine(opts).start()
        self.results: dict[str, Any] = {}

    def poll(self) -> None:
        for result in self.engine.poll(0.0):
            self.results[result.rid] = result

    def close(self) -> None:
        self.engine.close()


class KvwireP:
    def __init__(self, mode: str, tp: int, geo: Geometry, names: list[str], lease: float = 30):
        extra = vllm_compatible_extra(geo, mode, names)
        opts = kvwire_options("P", mode, tp, geo, lease=lease, rank_extra=extra)
        self.engine = PrefillEngine(opts).start()

    def holds(self) -> int:
        self.engine.reclaim()
        return self.engine.held_requests()

    def close(self) -> None:
        self.engine.close()


def vllm_to_kvwire(
    zygote: Zygote, mode: str, p_tp: int, d_tp: int, geo: Geometry, hit: int = 0
) -> None:
    """vLLM P -> kvwire D: D's bytes are right and vLLM P frees once D is done."""
    p = VllmEngine("P", mode, p_tp, geo, zygote=zygote)
    d = KvwireD(mode, d_tp, geo, p.layer_names)
    try:
        params = p.prefill("req-a-aaaaaaaa", 7, TOKENS)
        assert params["transfer_mode"] == mode and params["tp_size"] == p_tp
        d.engine.submit("req-a-dddddddd", 7, params, TOKENS, hit=hit)

        def step() -> None:
            p.step()
            d.poll()

        wait_until(lambda: "req-a-dddddddd" in d.results, step, 40, "kvwire D to finish")
        result = d.results["req-a-dddddddd"]
        assert result.ok, f"kvwire D failed: {result.reasons}: {result.details}"
        assert result.checked_bytes > 0 and result.wrong_bytes == 0
        wait_until(lambda: "req-a-aaaaaaaa" in p.freed, p.step, 10, "vLLM P to free the blocks")
    finally:
        log = p.log
        d.close()
        p.close()
    assert not [line for line in log if "rror" in line], log


def kvwire_to_vllm(
    zygote: Zygote, mode: str, p_tp: int, d_tp: int, geo: Geometry, hit: int = 0
) -> None:
    """kvwire P -> vLLM D: vLLM D's bytes are right and kvwire P frees once D is done."""
    d = VllmEngine("D", mode, d_tp, geo, zygote=zygote)
    p = KvwireP(mode, p_tp, geo, d.layer_names)
    try:
        params = p.engine.prefill("req-b-aaaaaaaa", 9, TOKENS)
        blocks = d.add("req-b-dddddddd", 9, params, TOKENS, hit=hit)

        def step() -> None:
            d.step()

        wait_until(lambda: "req-b-dddddddd" in d.received, step, 40, "vLLM D to receive")
        assert not d.invalid, f"vLLM D failed the request: {[x for x in d.log if 'ailed' in x]}"
        wrong, checked = d.check(9, blocks)
        assert checked > 0 and wrong == 0, f"{wrong} of {checked} bytes wrong"
        d.done("req-b-dddddddd")
        wait_until(lambda: p.holds() == 0, d.step, 10, "kvwire P to free the blocks")
        assert p.engine.freed_reasons["sent"] == 1, p.engine.freed_reasons
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_vllm_to_vllm(zygote: Zygote, mode: str) -> None:
    """The harness itself: vLLM P and vLLM D, both real, bytes checked, P frees."""
    p = VllmEngine("P", mode, 1, GQA, zygote=zygote)
    d = VllmEngine("D", mode, 1, GQA, zygote=zygote)
    try:
        params = p.prefill("req-v-aaaaaaaa", 3, TOKENS)
        blocks = d.add("req-v-dddddddd", 3, params, TOKENS)

        def step() -> None:
            d.step()
            p.step()

        wait_until(lambda: "req-v-dddddddd" in d.received, step, 40, "vLLM D to receive")
        assert not d.invalid
        wrong, checked = d.check(3, blocks)
        assert checked == 4 * 2 * 8 * 32 * 512 and wrong == 0
        wait_until(lambda: "req-v-aaaaaaaa" in p.freed, step, 10, "vLLM P to free")
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS, ids=_ids(TP_PAIRS))
def test_vllm_p_kvwire_d(zygote: Zygote, mode: str, p_tp: int, d_tp: int) -> None:
    vllm_to_kvwire(zygote, mode, p_tp, d_tp, GQA)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS, ids=_ids(TP_PAIRS))
def test_kvwire_p_vllm_d(zygote: Zygote, mode: str, p_tp: int, d_tp: int) -> None:
    kvwire_to_vllm(zygote, mode, p_tp, d_tp, GQA)


MLA_PAIRS = [(1, 1), (2, 1), (1, 2)]


@pytest.mark.parametrize(("p_tp", "d_tp"), MLA_PAIRS, ids=_ids(MLA_PAIRS))
def test_mla_vllm_p_kvwire_d(zygote: Zygote, p_tp: int, d_tp: int) -> None:
    vllm_to_kvwire(zygote, "pull", p_tp, d_tp, MLA)


@pytest.mark.parametrize(("p_tp", "d_tp"), MLA_PAIRS, ids=_ids(MLA_PAIRS))
def test_mla_kvwire_p_vllm_d(zygote: Zygote, p_tp: int, d_tp: int) -> None:
    kvwire_to_vllm(zygote, "pull", p_tp, d_tp, MLA)


@pytest.mark.parametrize("geo", [GQA, MLA], ids=["gqa", "mla"])
def test_prefix_hit_on_kvwire_d(zygote: Zygote, geo: Geometry) -> None:
    """D holds the first block locally: only the tail of P's blocks lands, in place."""
    vllm_to_kvwire(zygote, "pull", 1, 1, geo, hit=1)


@pytest.mark.parametrize("geo", [GQA, MLA], ids=["gqa", "mla"])
def test_prefix_hit_on_vllm_d(zygote: Zygote, geo: Geometry) -> None:
    kvwire_to_vllm(zygote, "pull", 1, 1, geo, hit=1)


# -- leases and heartbeats (MLA, so that only the lease rules are under test) ----------

LEASE = 6  # vLLM's kv_lease_duration is whole seconds; heartbeats every LEASE // 6


def test_vllm_p_lease_expires_without_consumer(zygote: Zygote) -> None:
    """vLLM P frees a request nobody reads once its lease runs out, not before."""
    p = VllmEngine("P", "pull", 1, MLA, lease=2, zygote=zygote)
    try:
        p.prefill("req-e-aaaaaaaa", 1, TOKENS)
        started = time.monotonic()
        wait_until(lambda: "req-e-aaaaaaaa" in p.freed, p.step, 15, "the lease to expire")
        assert time.monotonic() - started >= 1.5
    finally:
        p.close()


def test_kvwire_p_lease_expires_without_consumer(zygote: Zygote) -> None:
    """kvwire P, told the names and factors of a vLLM engine, frees on expiry too."""
    p = KvwireP("pull", 1, MLA, [f"model.layers.{i}.self_attn.attn" for i in range(2)], lease=2)
    try:
        p.engine.prefill("req-e-aaaaaaaa", 1, TOKENS)
        started = time.monotonic()
        wait_until(lambda: p.holds() == 0, lambda: time.sleep(0.05), 15, "the lease to expire")
        assert time.monotonic() - started >= 1.5
        assert p.engine.freed_reasons["expired"] == 1, p.engine.freed_reasons
    finally:
        p.close()


def test_kvwire_d_heartbeats_extend_vllm_p_lease(zygote: Zygote) -> None:
    """A request queued at kvwire D for twice vLLM P's lease: kvwire's heartbeats keep
    vLLM P's blocks; once D allocates, the bytes arrive and P frees them."""
    p = VllmEngine("P", "pull", 1, MLA, lease=LEASE, zygote=zygote)
    d = KvwireD("pull", 1, MLA, p.layer_names, lease=LEASE)
    try:
        params = p.prefill("req-h-aaaaaaaa", 5, TOKENS)
        d.engine.submit("req-h-dddddddd", 5, params, TOKENS, wait=True)
        end = time.monotonic() + 2 * LEASE
        while time.monotonic() < end:
            p.step()
            d.poll()
            time.sleep(0.05)
        assert "req-h-aaaaaaaa" not in p.freed, "vLLM P let the lease run out despite heartbeats"
        d.engine.allocate("req-h-dddddddd")

        def step() -> None:
            p.step()
            d.poll()

        wait_until(lambda: "req-h-dddddddd" in d.results, step, 30, "kvwire D to finish")
        result = d.results["req-h-dddddddd"]
        assert result.ok and result.checked_bytes > 0 and result.wrong_bytes == 0, result
        wait_until(lambda: "req-h-aaaaaaaa" in p.freed, p.step, 10, "vLLM P to free")
    finally:
        d.close()
        p.close()


def test_vllm_d_heartbeats_extend_kvwire_p_lease(zygote: Zygote) -> None:
    """A request waiting at vLLM D for twice kvwire P's lease: vLLM's heartbeats keep
    kvwire P's blocks; then the read completes and P frees them as sent."""
    d = VllmEngine("D", "pull", 1, MLA, lease=LEASE, zygote=zygote)
    p = KvwireP("pull", 1, MLA, d.layer_names, lease=LEASE)
    try:
        params = p.engine.prefill("req-h-aaaaaaaa", 6, TOKENS)
        d.add("req-h-dddddddd", 6, params, TOKENS, allocate=False)
        end = time.monotonic() + 2 * LEASE
        while time.monotonic() < end:
            d.step()
            time.sleep(0.05)
        assert p.holds() == 1, f"kvwire P freed early: {p.engine.freed_reasons}"
        blocks = d.allocate("req-h-dddddddd", 6, TOKENS)
        wait_until(lambda: "req-h-dddddddd" in d.received, d.step, 30, "vLLM D to receive")
        wrong, checked = d.check(6, blocks)
        assert checked > 0 and wrong == 0
        wait_until(lambda: p.holds() == 0, d.step, 10, "kvwire P to free")
        assert p.engine.freed_reasons["sent"] == 1, p.engine.freed_reasons
    finally:
        d.close()
        p.close()


# -- protocol versions ------------------------------------------------------------------


def test_a_vllm_peer_of_another_release_is_refused_naming_both_versions(
    zygote_other: Zygote,
) -> None:
    """vLLM 0.31.0 speaks v13 and 0.32.0 v14: a kvwire D speaking this suite's release's
    version refuses the other release's P at its handshake and names both."""
    p = VllmEngine("P", "pull", 1, MLA, zygote=zygote_other)
    d = KvwireD("pull", 1, MLA, p.layer_names)
    try:
        params = p.prefill("req-x-aaaaaaaa", 2, TOKENS)
        d.engine.submit("req-x-dddddddd", 2, params, TOKENS)

        def step() -> None:
            p.step()
            d.poll()

        wait_until(lambda: "req-x-dddddddd" in d.results, step, 30, "kvwire D to refuse")
        result = d.results["req-x-dddddddd"]
        assert not result.ok and result.reasons == ["handshake"], result
        assert result.invalid_blocks, "the refused request's blocks must be reported invalid"
    finally:
        d.close()
        p.close()
    detail = " ".join(result.details)
    assert "version 13" in detail and "version 14" in detail, detail


def test_kvwire_default_factors_match_a_vllm_engine(zygote: Zygote) -> None:
    """kvwire's default compatibility factors (nothing but the model facts given) hash as a
    default vLLM 0.31.0 engine with the NIXL connector does: is_hma_enabled resolves true."""
    p = VllmEngine("P", "pull", 1, MLA, zygote=zygote)
    extra = vllm_compatible_extra(MLA, "pull", p.layer_names)
    extra["compat"] = factors(MLA, "pull", backend="CPU_MLA", hma=None)
    d = DecodeEngine(kvwire_options("D", "pull", 1, MLA, rank_extra=extra)).start()
    try:
        params = p.prefill("req-f-aaaaaaaa", 4, TOKENS)
        d.submit("req-f-dddddddd", 4, params, TOKENS)
        results: dict[str, Any] = {}

        def step() -> None:
            p.step()
            results.update((r.rid, r) for r in d.poll(0.0))

        wait_until(lambda: "req-f-dddddddd" in results, step, 30, "kvwire D to finish")
        result = results["req-f-dddddddd"]
        assert result.ok, f"kvwire D failed: {result.reasons}: {result.details}"
    finally:
        d.close()
        p.close()


# -- a mixed fleet on a metadata store --------------------------------------------------------
# kvwire engines with ``metadata_store`` set, stock vLLM engines without one. kvwire publishes
# and still serves its ZMQ listener, so a vLLM decode engine handshakes as before; a vLLM
# prefill engine is not published, so a kvwire decode engine falls back to ZMQ.


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with EtcdServer() as server:
        monkeypatch.setenv("KVWIRE_METADATA_STORE", server.url)  # kvwire's rank processes
        yield server.url


def test_stock_vllm_d_reads_from_a_published_kvwire_p(zygote: Zygote, store: str) -> None:
    kvwire_to_vllm(zygote, "pull", 1, 1, GQA)
    # The kvwire prefill rank published (a put) and withdrew its record when it closed (the
    # revoked lease deleted it): a fresh etcd is at revision 1.
    revision, records = EtcdClient(store).get_prefix(ROOT)
    assert revision >= 3 and records == []


def test_kvwire_d_with_a_store_reads_from_stock_vllm_p_over_zmq(zygote: Zygote, store: str) -> None:
    vllm_to_kvwire(zygote, "pull", 1, 1, GQA)
