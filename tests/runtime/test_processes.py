"""P and D as separate processes (one per TP rank) over shm, every byte checked on D."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvwire.demo import DemoOptions, run_local
from kvwire.demo.content import count_wrong_bytes  # noqa: F401  (the verifier the ranks use)
from kvwire.demo.engines import DecodeEngine, EngineOptions, PrefillEngine
from kvwire.testing.ports import free_port

from .conftest import finish

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("mode", "p_tp", "d_tp"),
    [("pull", 1, 1), ("push", 1, 1), ("pull", 2, 4), ("push", 2, 4), ("pull", 4, 2),
     ("push", 4, 2)],
)  # fmt: skip
def test_demo_moves_verified_kv(mode: str, p_tp: int, d_tp: int) -> None:
    summary = run_local(
        DemoOptions(
            layers=2,
            tokens=256,
            requests=6,
            concurrency=3,
            mode=mode,
            p_tp=p_tp,
            d_tp=d_tp,
            progress=False,
        )
    )
    assert summary.done == 6 and summary.failed == 0
    assert summary.bytes_wrong == 0
    # Every byte of every request was compared: whole-model KV of 256 tokens x 2 layers.
    assert summary.bytes_checked == 6 * 256 * 2 * 8 * 512
    # One handshake per posting rank with each peer rank it reads from or writes to.
    assert summary.handshakes == (d_tp if mode == "pull" else p_tp)
    assert summary.verified


def _engines(mode: str = "pull", num_blocks: int = 704) -> tuple[PrefillEngine, DecodeEngine]:
    def opts(role: str) -> EngineOptions:
        return EngineOptions("llama-3-8b", 4, 1, num_blocks, mode, "shm", f"{role}-engine")

    return PrefillEngine(opts("prefill")), DecodeEngine(opts("decode"))


def test_killed_prefill_fails_its_requests_then_a_restarted_one_is_handshaken_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVWIRE_HANDSHAKE_TIMEOUT_S", "2")  # the ranks read their knobs so
    prefill, decode = _engines()
    prefill.start()
    decode.start()
    try:
        tokens = 1024  # 16 MiB per request: transfers are still running when P dies
        params = prefill.prefill("warm", 0, tokens)
        decode.submit("warm", 0, params, tokens)
        assert finish(decode, 1)[0].ok

        doomed = [prefill.prefill(f"doomed-{i}", i, tokens) for i in range(1, 9)]
        for i, p in enumerate(doomed, start=1):
            decode.submit(f"doomed-{i}", i, p, tokens)
        prefill.kill_rank(0)
        # A request that arrives after the crash cannot even be started.
        late = dict(doomed[0], remote_request_id="late")
        decode.submit("late", 50, late, tokens)
        results = finish(decode, 9)
        failed = [r for r in results if not r.ok]
        assert failed, "no request noticed the producer's death"
        assert any(r.rid == "late" for r in failed)
        for r in failed:
            assert r.reasons and set(r.reasons) <= {"transfer", "handshake"}
            assert r.invalid_blocks == [r.blocks]  # exactly its local blocks are invalid
        for r in results:
            if r.ok:
                assert r.wrong_bytes == 0 and r.checked_bytes > 0

        prefill.restart_rank(0)
        fresh = [prefill.prefill(f"fresh-{i}", 100 + i, tokens) for i in range(3)]
        for i, p in enumerate(fresh):
            decode.submit(f"fresh-{i}", 100 + i, p, tokens)
        again = finish(decode, 3)
        assert all(r.ok and r.wrong_bytes == 0 for r in again), again
        stats = decode.stats()[0]["metrics"]
        assert stats["handshakes_ok"] == 2
        assert stats["failures"].get("transfer", 0) + stats["failures"].get("handshake", 0) == len(
            failed
        )
    finally:
        decode.close()
        prefill.close()


def test_a_push_producer_that_dies_is_noticed_by_the_heartbeats_not_the_watchdog(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """P dies while its writes are due: D's next heartbeats fail, and every request still
    waiting for writes fails naming the producer, long before the registration watchdog
    (600 s here; the test waits at most 60 s). A request whose writes all landed first
    is done with the right bytes: which requests those are is the race, not asserted."""
    monkeypatch.setenv("KVWIRE_REGISTRATION_TIMEOUT_S", "600")
    monkeypatch.setenv("KVWIRE_LEASE_S", "6")  # heartbeats every second
    monkeypatch.setenv("KVWIRE_HANDSHAKE_TIMEOUT_S", "2")
    prefill, decode = _engines("push")
    prefill.start()
    decode.start()
    try:
        tokens = 1024
        params = [prefill.prefill(f"r{i}", i, tokens) for i in range(6)]
        for i, p in enumerate(params):
            decode.submit(f"r{i}", i, p, tokens)
        prefill.kill_rank(0)
        results = finish(decode, 6)
        for r in results:
            if r.ok:
                assert r.wrong_bytes == 0 and r.checked_bytes > 0
            else:
                assert r.reasons and set(r.reasons) <= {"transfer", "handshake"}, r
    finally:
        decode.close()
        prefill.close()


def test_cli_demo_json_and_split_roles() -> None:
    cmd = [sys.executable, "-m", "kvwire", "demo", "--requests", "4", "--layers", "2",
           "--tokens", "128", "--json", "--no-progress"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["verified"] and report["done"] == 4 and report["bytes_wrong"] == 0
    assert report["memcpy_gbps"] > 0 and report["time_to_kv_p99_ms"] >= report["time_to_kv_p50_ms"]

    port = free_port()
    prefill = subprocess.Popen(
        [sys.executable, "-m", "kvwire", "demo", "--role", "prefill", "--listen",
         f"127.0.0.1:{port}", "--layers", "2", "--tokens", "128", "--mode", "push"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # Refused connections fail at once now, so D starts once P says it listens.
        assert prefill.stderr is not None
        ready = prefill.stderr.readline()
        assert "listening on" in ready, ready
        decode = subprocess.run(
            [sys.executable, "-m", "kvwire", "demo", "--role", "decode", "--connect",
             f"127.0.0.1:{port}", "--requests", "3", "--tokens", "128", "--no-progress"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert decode.returncode == 0, decode.stderr
        assert "push over shm" in decode.stdout and "-> OK" in decode.stdout
        assert prefill.wait(30) == 0
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()


def test_cli_demo_bad_arguments_exit_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvwire", "demo", "--model", "gpt-5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "unknown model" in out.stderr and "Traceback" not in out.stderr
