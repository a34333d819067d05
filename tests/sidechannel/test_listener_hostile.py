"""The listener under attack keeps serving, within bounded memory, and sheds what it must.

The listener runs alone in a process (listener_proc.py) so that its RSS, its open file
descriptors and its Python allocations are its own; the attackers run in another
(attack_proc.py). This process is the legitimate client: it handshakes (authenticated, the
heavier path) over and over while the attack runs and measures every handshake.

Everything is on loopback: the attackers use source addresses 127.0.0.3-17 so that the
per-address rate limits tell them from the client on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import queue
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvwire import encode_handshake_request
from kvwire.config import RetryPolicy
from kvwire.errors import HandshakeError
from kvwire.sidechannel import (
    HandshakeClient,
    HandshakeListener,
    ListenerLimits,
    RateLimit,
    refusal_reason,
)

HERE = Path(__file__).resolve().parent
SECRET = os.urandom(32)
HANDSHAKE_TIMEOUT_S = 2.0
PAYLOAD_BYTES = 8192


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"not reached within {timeout:g} s: {what}")


def _fd_budget() -> int:
    """Raise our soft descriptor limit as far as allowed; children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class _Proc:
    """A helper process speaking JSON lines; stdout is read on a thread."""

    def __init__(self, script: str, config: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / script), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(None)

    def next(self, timeout: float = 60.0) -> dict[str, Any]:
        line = self._lines.get(timeout=timeout)
        if line is None:
            raise AssertionError(f"helper exited with {self.proc.wait(10)}")
        return line

    def poll_line(self) -> dict[str, Any] | None:
        try:
            return self._lines.get_nowait()
        except queue.Empty:
            return None

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


class _Listener(_Proc):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__("listener_proc.py", config)
        self.port = int(self.next()["port"])

    def stats(self) -> dict[str, Any]:
        self.send("stats")
        return self.next()


MAX_CONNECTIONS = 1500


@pytest.fixture
def listener() -> Iterator[_Listener]:
    proc = _Listener(
        {
            "secret": SECRET.hex(),
            "payload_bytes": PAYLOAD_BYTES,
            # Shorter than the defaults so the test sees them act; the rest are defaults
            # (512 connections per address, the overall rate limit, sizes). The per-address
            # rate is low enough that a flood source exceeds it however slowly a loaded
            # machine lets the listener read (at the default 500/s it engaged only when the
            # flood was served fast enough: a load-dependent assertion).
            "limits": {
                "handshake_timeout_s": HANDSHAKE_TIMEOUT_S,
                "max_connections": MAX_CONNECTIONS,
                "per_peer": [50.0, 100.0],
            },
        }
    )
    try:
        yield proc
    finally:
        proc.close()


def _half_open_sources() -> list[tuple[str, int]]:
    """600 from one address (88 over its cap of 512) and 200 from each of eight others:
    2,200 connections against a cap of 1,500, fewer where descriptors are scarce."""
    plan = [("127.0.0.3", 600)] + [(f"127.0.0.{30 + i}", 200) for i in range(8)]
    budget = _fd_budget() - 512
    scale = min(1.0, budget / (2 * sum(n for _, n in plan)))
    return [(source, int(n * scale)) for source, n in plan]


def _handshake(client: HandshakeClient, port: int) -> float:
    t0 = time.perf_counter()
    got = client.fetch_payloads("127.0.0.1", port, [(0, 0), (0, 1)])
    assert all(len(r.payload) == PAYLOAD_BYTES for r in got.replies.values())
    return time.perf_counter() - t0


def test_listener_survives_a_hostile_network_and_keeps_serving(listener: _Listener) -> None:
    sources = _half_open_sources()
    half_open = sum(n for _, n in sources)
    policy = RetryPolicy(timeout=5.0, retries=2)
    with HandshakeClient(policy, secret=SECRET) as client:
        calm = [_handshake(client, listener.port) for _ in range(20)]
        before = listener.stats()
        attack = _Proc(
            "attack_proc.py",
            {"port": listener.port, "half_open": sources, "seconds": 8.0, "slow": 64,
             "garbage": 300, "claims": 40, "endless": 40},
        )  # fmt: skip
        try:
            assert attack.next()["half_open"] == half_open
            # Handshake for as long as the flood lasts; sample the listener meanwhile.
            latencies: list[float] = []
            samples = [listener.stats()]
            flooded = None
            while flooded is None:
                latencies.append(_handshake(client, listener.port))
                samples.append(listener.stats())
                flooded = attack.poll_line()
            assert flooded["event"] == "flooded"
            # The half-open connections are still open on the attacker's side; the
            # listener must have closed them (greeting timeout) and the slow clients too.
            _wait_until(
                lambda: listener.stats()["connections_open"] == 0,
                timeout=8 * HANDSHAKE_TIMEOUT_S + 10,
                what="listener closes half-open connections",
            )
            attack.send("check")
            reaped = attack.next()
            latencies.append(_handshake(client, listener.port))
            after = listener.stats()
        finally:
            attack.close()
    samples.append(after)

    _report(calm, latencies, before, samples, flooded, half_open)

    # Served throughout: every handshake succeeded, each served once (``served`` below),
    # and none waited out the client's timeout (a dropped request would, then be retried).
    # How long they took is reported (docs/security.md), not bounded tighter: a bound on
    # time flips with the machine's load.
    assert len(latencies) >= 10
    assert max(latencies) < policy.timeout, sorted(latencies)[-5:]

    # Connections: capped, per address and overall, and every one of them reaped.
    assert max(s["connections_open"] for s in samples) <= MAX_CONNECTIONS
    assert max(s["fds"] for s in samples) <= before["fds"] + MAX_CONNECTIONS + 16
    assert after["fds"] <= before["fds"] + 2
    assert after["connections_refused"] >= 88 * half_open // 2200
    assert after["connections_evicted"] > 0
    assert reaped["closed"] == reaped["open"] == half_open
    assert flooded["slow_dropped_by_listener"] == flooded["slow_clients"]
    assert flooded["slow_bytes_sent_max"] < 64 + 2  # dropped before the greeting was done
    assert flooded["length_claims_dropped"] == flooded["length_claims"]
    assert flooded["endless_dropped"] == flooded["endless_messages"]
    assert after["connections_broken"] >= flooded["length_claims"] + flooded["endless_messages"]

    # Bounded memory: RSS and Python allocations, peak over the attack.
    rss_growth = max(s["rss_kib"] for s in samples) - before["rss_kib"]
    py_peak = max(s["py_peak"] for s in samples)
    assert rss_growth < 48 * 1024, f"RSS grew by {rss_growth} KiB"
    assert py_peak < 24 << 20, f"Python peak {py_peak} bytes"

    # Everything hostile was counted, the rate limit engaged, nothing broke.
    assert after["internal_errors"] == 0
    assert after["refused_rate_limited"] > 0 and flooded["flood_rate_limited"] > 0
    assert after["refused_malformed"] > 0 and after["refused_oversize"] > 0
    assert after["refused_unknown_rank"] == 0  # with a secret, ranks are checked after auth
    assert after["refused_auth"] > 0 and after["dropped"] > 0
    assert after["served"] == 2 * (len(calm) + len(latencies))


def _report(
    calm: list[float],
    attacked: list[float],
    before: dict[str, Any],
    samples: list[dict[str, Any]],
    flooded: dict[str, Any],
    half_open: int,
) -> None:
    """The measurements, for ``pytest -s`` and docs/security.md."""

    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    print(
        f"\nhostile listener: {half_open} half-open, {flooded['slow_clients']} slow, "
        f"{flooded['garbage_connections']} garbage, {flooded['length_claims']} length claims, "
        f"{flooded['endless_messages']} endless messages, "
        f"{flooded['flood_sent']} flood requests ({flooded['flood_rate_limited']} rate limited)"
        f"\n  handshake (2 ranks, authenticated) calm p50 {pct(calm, 0.5):.1f} ms, "
        f"under attack p50 {pct(attacked, 0.5):.1f} ms p99 {pct(attacked, 0.99):.1f} ms "
        f"max {max(attacked) * 1e3:.1f} ms over {len(attacked)}"
        f"\n  RSS {before['rss_kib']} KiB -> peak {max(s['rss_kib'] for s in samples)} KiB; "
        f"fds {before['fds']} -> peak {max(s['fds'] for s in samples)} -> {samples[-1]['fds']}; "
        f"Python peak {max(s['py_peak'] for s in samples) / 1e6:.2f} MB"
        f"; connections open peak {max(s['connections_open'] for s in samples)}"
        f"\n  final counters {json.dumps({k: v for k, v in samples[-1].items() if v})}"
    )


def test_rate_limits_per_address_and_overall() -> None:
    """A flooding address is refused (and counted) while another address is still served;
    the overall bucket caps everyone together."""
    limits = ListenerLimits(per_peer=RateLimit(rate=1.0, burst=5), total=RateLimit(1.0, 12))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with HandshakeListener({(0, 0): b"payload"}, limits=limits) as listener:

            def ask_from(source: str, count: int) -> list[bytes]:
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.setsockopt(zmq.RCVTIMEO, 10_000)
                dealer.connect(f"tcp://{source}:0;127.0.0.1:{listener.port}")
                for _ in range(count):
                    dealer.send_multipart([b"", encode_handshake_request(0, 0)])
                answers = [dealer.recv_multipart()[1] for _ in range(count)]
                dealer.close(linger=0)
                return answers

            flood = ask_from("127.0.0.20", 8)
            assert flood[:5] == [b"payload"] * 5
            assert [refusal_reason(a) for a in flood[5:]] == ["rate limited"] * 3
            assert ask_from("127.0.0.21", 5) == [b"payload"] * 5  # its own bucket
            third = ask_from("127.0.0.22", 5)  # overall budget: 12 - 10 served = 2 left
            assert third[:2] == [b"payload"] * 2
            assert [refusal_reason(a) for a in third[2:]] == ["rate limited"] * 3
            stats = listener.stats()
            assert (stats.served, stats.refused_rate_limited) == (12, 6)

            # The client retries a rate-limited rank after its backoff, then says why.
            policy = RetryPolicy(timeout=5.0, retries=1, backoff=0.01)
            with (
                HandshakeClient(policy) as client,
                pytest.raises(HandshakeError, match="rate limited by"),
            ):
                client.fetch_payloads("127.0.0.1", listener.port, [(0, 0)])
            assert listener.stats().refused_rate_limited == 8
    finally:
        ctx.destroy(linger=0)


def test_limits_are_validated() -> None:
    from kvwire.errors import ConfigError

    for bad in ({"handshake_timeout_s": 0}, {"queued_per_peer": 0}, {"max_request_bytes": 10}):
        with pytest.raises(ConfigError):
            ListenerLimits(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        RateLimit(rate=0, burst=1)
    with pytest.raises(ConfigError):
        RateLimit(rate=1, burst=0.5)
