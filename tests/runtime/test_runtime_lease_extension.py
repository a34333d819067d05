"""A READ that outlives the lease P first stated, with P and D in separate processes over
real ZMQ (P's own listener) and shm.

D's transport holds the READ back until P's stated expiry has passed by a whole lease;
heartbeats still flow, so P keeps the blocks (its lease moves on each one). With the
``lease-query`` extension D asks P, learns the later lease and the READ ends done with
P's bytes. Against a kvwire P that does not announce the extension D asks nothing, its
deadline stays the stated one, and the same READ fails ``expired`` with its blocks invalid.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kvwire_shm import allocate

from kvwire.config import KVWireConfig
from kvwire.demo.content import count_wrong_bytes
from kvwire.demo.models import CacheSpec, preset
from kvwire.runtime import Consumer, Finished
from kvwire.transport import create

from .conftest import wait_until
from .test_runtime_stale_read import StallingTransport

pytestmark = pytest.mark.slow

LEASE_S = 3.0
PEER = Path(__file__).with_name("lease_producer_proc.py")
LOCAL = [8, 9, 10, 11]


class HeldReads(StallingTransport):
    """READs wait for :meth:`heal`; notifications (heartbeats) pass."""

    def notify(self, peer: str, message: bytes) -> None:
        self.inner.notify(peer, message)


def _run(features: str) -> tuple[Finished, dict[str, Any], dict[str, int], int, int]:
    """P in its own process; D here. Returns D's outcome, P's report, D's machine counters
    and (wrong, checked) bytes of D's blocks against prompt 0."""
    proc = subprocess.Popen(
        [sys.executable, str(PEER), str(LEASE_S), features],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    spec = CacheSpec(preset("llama-3-8b"), 2, 32, 0, 1)
    buffer = allocate(spec.total_bytes)
    held = HeldReads(create("shm", "decode-lease"))
    config = KVWireConfig(
        engine_id="decode-lease", mode="pull", compat=spec.compat("pull"), lease_s=LEASE_S
    )
    consumer = Consumer(config, held)
    try:
        consumer.register_kv_caches(spec.geometry(int(buffer.ctypes.data)))
        params = json.loads(proc.stdout.readline())["params"]
        expiry = params["remote_blocks_expiry_time"]
        consumer.add_request("r", params, [LOCAL])
        seen = Finished()

        def ended() -> bool:
            got = consumer.get_finished()
            seen.done.extend(got.done)
            seen.failed.update(got.failed)
            return bool(seen.done or seen.failed)

        # Hold the READ until P's stated expiry (same clock: CLOCK_MONOTONIC on Linux) has
        # passed by a whole lease, or D gave up on it.
        wait_until(lambda: time.perf_counter() > expiry + LEASE_S or ended(), 30.0)
        held.heal()
        wait_until(lambda: ended(), 30.0)
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        report = json.loads(proc.stdout.readline())
        wrong, checked = count_wrong_bytes(spec, buffer, 0, LOCAL)
        stats = consumer.machine_stats()
        assert consumer.errors == []
        return seen, report, stats, wrong, checked
    finally:
        consumer.close()
        held.inner.close()
        proc.stdin.close()
        assert proc.wait(30) == 0


def test_with_the_extension_a_read_longer_than_ps_first_lease_ends_done() -> None:
    seen, report, stats, wrong, checked = _run("all")
    assert seen.done == ["r"] and not seen.failed
    # Every byte P held: 2 layers x 4 blocks x 16 tokens x 8 KV heads x 128 x bf16, K and V.
    assert wrong == 0 and checked == 2 * 4 * 16 * 8 * 128 * 2 * 2
    assert stats["lease_queries"] >= 1 and stats["read_deadlines_extended"] >= 1
    assert stats["transfers_timed_out"] == 0 and stats["reads_late"] == 0
    assert report["listener"]["leases_answered"] >= 1
    assert report["stats"]["lease_extensions"] >= 1  # heartbeats moved P's lease
    assert report["freed"] == [["r", "sent"]] and report["errors"] == []


def test_without_it_the_same_read_fails_expired_and_p_is_never_asked() -> None:
    seen, report, stats, _, _ = _run("no-lease-query")
    assert seen.done == []
    failure = seen.failed["r"]
    assert failure.reason == "expired" and failure.invalid_block_ids == (tuple(LOCAL),)
    assert stats["lease_queries"] == 0 and stats["read_deadlines_extended"] == 0
    listener = report["listener"]
    assert listener["leases_answered"] == 0 and listener["rejected"] == 0
    assert listener["served"] == 1  # the handshake, and nothing else
    assert report["errors"] == []
