"""Rank processes on a real etcd: a prefill rank killed with SIGKILL (its record stays, as
after any crash) and restarted is dropped by the decode rank before the next request."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvwire.demo.engines import DecodeEngine, EngineOptions, PrefillEngine
from kvwire.testing.etcd import EtcdServer

from .conftest import finish

pytestmark = pytest.mark.slow


def _totals(decode: DecodeEngine) -> dict[str, Any]:
    metrics: dict[str, Any] = decode.stats()[0]["metrics"]
    return metrics


def test_a_killed_and_restarted_prefill_rank_costs_no_request(
    etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVWIRE_METADATA_STORE", etcd.url)  # the rank processes inherit it
    monkeypatch.setenv("KVWIRE_METADATA_STORE_TTL_S", "30")  # expiry plays no part here

    def opts(role: str) -> EngineOptions:
        return EngineOptions("llama-3-8b", 2, 1, 64, "pull", "shm", f"{role}-engine")

    prefill, decode = PrefillEngine(opts("prefill")), DecodeEngine(opts("decode"))
    prefill.start()
    decode.start()
    try:
        deadline = time.monotonic() + 30.0
        while "prefill-engine" not in (decode.stats()[0].get("store") or []):
            assert time.monotonic() < deadline, "D's store view never held P"
            time.sleep(0.05)
        params = prefill.prefill("warm", 0, 64)
        decode.submit("warm", 0, params, 64)
        (first,) = finish(decode, 1)
        assert first.ok and first.wrong_bytes == 0
        assert _totals(decode)["store_handshakes"] == 1

        prefill.kill_rank(0)
        prefill.restart_rank(0)
        deadline = time.monotonic() + 30.0
        while _totals(decode)["store_peers_dropped"] < 1:
            assert time.monotonic() < deadline, "D kept the killed rank's agent"
            time.sleep(0.05)

        fresh = [prefill.prefill(f"fresh-{i}", 100 + i, 64) for i in range(3)]
        for i, p in enumerate(fresh):
            decode.submit(f"fresh-{i}", 100 + i, p, 64)
        again = finish(decode, 3)
        assert all(r.ok and r.wrong_bytes == 0 for r in again), again
        totals = _totals(decode)
        assert totals["requests_failed"] == 0 and totals["store_peers_dropped"] == 1
        assert totals["store_handshakes"] == 2 and totals["handshakes_ok"] == 2
    finally:
        decode.close()
        prefill.close()
