"""Initiator here, target in another process: the target never calls into its agent while
the initiator works, which is exactly when NIXL without a progress thread stalls
(unread notifications fill the shared-memory queue and the initiator's transfers stop
completing). kvwire's light progress thread keeps the idle target answering."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from kvwire_nixl import NixlTransport

from kvwire.transport import XferState, wait_for

pytestmark = pytest.mark.slow

TIMEOUT = 60.0
NBYTES = 4 << 20

# Registers a known pattern, prints its metadata and address, then blocks on stdin
# without touching the agent; on a line it drains and prints how many notifications
# arrived, and on EOF it closes.
TARGET = """
import os, sys, time
import numpy as np
from kvwire_nixl import NixlTransport
n = int(sys.argv[2])
agent = NixlTransport(sys.argv[1], progress=sys.argv[3])
src = (np.arange(n, dtype=np.uint64) % 251).astype(np.uint8)
agent.register([src])
print(agent.local_metadata().hex(), int(src.ctypes.data), flush=True)
want = int(sys.stdin.readline())
got, deadline = [], time.monotonic() + 60
while len(got) < want and time.monotonic() < deadline:
    got += agent.drain_notifications()
    agent.wait(0.01)
print(len(got), len({m for _, m in got}), flush=True)
sys.stdin.readline()
agent.close()
"""


def _start_target(progress: str) -> tuple[subprocess.Popen[str], bytes, int, str]:
    name = f"kvwire-test-target-{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen(
        [sys.executable, "-c", TARGET, name, str(NBYTES), progress],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    meta_hex, addr = proc.stdout.readline().split()
    return proc, bytes.fromhex(meta_hex), int(addr), name


def _finish(proc: subprocess.Popen[str], expected: int) -> tuple[int, int]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{expected}\n")
    proc.stdin.flush()
    count, distinct = (int(x) for x in proc.stdout.readline().split())
    proc.stdin.close()
    proc.wait(TIMEOUT)
    return count, distinct


def test_idle_target_with_progress_thread_never_stalls_the_initiator() -> None:
    proc, meta, remote_addr, target_name = _start_target("thread")
    agent = NixlTransport(f"kvwire-test-initiator-{uuid.uuid4().hex[:6]}")
    try:
        sink = np.zeros(NBYTES, dtype=np.uint8)
        agent.register([sink])
        peer = agent.add_peer(meta)
        assert peer == target_name
        rounds = 600  # well past the few hundred unread notifications that stall raw NIXL
        started = time.monotonic()
        for i in range(rounds):
            offset = (i * 4096) % NBYTES
            local = np.array([[int(sink.ctypes.data) + offset, 4096, 0]], dtype=np.int64)
            remote = np.array([[remote_addr + offset, 4096, 0]], dtype=np.int64)
            handle = agent.read(peer, local, remote, f"xfer-{i}".encode())
            assert wait_for(agent, handle, TIMEOUT) is XferState.DONE, f"READ {i} stalled"
            agent.release(handle)
        elapsed = time.monotonic() - started
        expected = (np.arange(NBYTES, dtype=np.uint64) % 251).astype(np.uint8)
        touched = min(rounds * 4096, NBYTES)
        assert np.array_equal(sink[:touched], expected[:touched])
        count, distinct = _finish(proc, rounds)
        assert (count, distinct) == (rounds, rounds)
        assert elapsed < TIMEOUT
    finally:
        agent.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_write_notification_reaches_a_separate_process_after_its_data() -> None:
    proc, meta, remote_addr, _ = _start_target("thread")
    agent = NixlTransport(f"kvwire-test-writer-{uuid.uuid4().hex[:6]}", progress="inline")
    try:
        source = np.full(NBYTES, 7, dtype=np.uint8)
        agent.register([source])
        peer = agent.add_peer(meta)
        sizes = 64 << 10
        count = NBYTES // sizes
        local = np.zeros((count, 3), dtype=np.int64)
        local[:, 0] = int(source.ctypes.data) + np.arange(count) * sizes
        local[:, 1] = sizes
        remote = local.copy()
        remote[:, 0] = remote_addr + np.arange(count)[::-1] * sizes  # nothing merges
        handle = agent.write(peer, local, remote, b"written")
        assert wait_for(agent, handle, TIMEOUT) is XferState.DONE
        agent.release(handle)
        assert _finish(proc, 1) == (1, 1)
    finally:
        agent.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_paired_benchmark_names_its_figures_and_samples_the_memcpy_baseline() -> None:
    """The NIXL half of ``kvwire bench transport``: kvwire and raw NIXL against one target,
    bytes checked before timing; the results are named as the issue asks, kvwire's carry
    raw NIXL as their baseline, and the generic bench's memcpy sampler is called for both
    shapes. Values are not judged here: benchmarks are commands, not tests."""
    from kvwire.bench.nixl_raw import paired_benchmark

    sampled: list[tuple[str, int]] = []
    results = paired_benchmark(quick=True, memcpy=lambda label, n: sampled.append((label, n)))
    by_name = {r.name: r for r in results}
    assert set(by_name) == {
        f"{who}.read.{what}"
        for who in ("nixl", "nixl_raw")
        for what in ("64KiB.GBps", "2MiB.GBps", "4KiB.us")
    } | {"nixl.read.64KiB.vs_raw", "nixl.read.2MiB.vs_raw"}
    assert all(r.value > 0 for r in results)
    for what in ("64KiB.GBps", "2MiB.GBps", "4KiB.us"):
        mine, raw = by_name[f"nixl.read.{what}"], by_name[f"nixl_raw.read.{what}"]
        assert mine.baseline == raw.name
        assert mine.ratio == pytest.approx(mine.value / raw.value)
    assert {label for label, _ in sampled} == {"64KiB", "2MiB"}
    assert (len(sampled) % 2, set(sampled)) == (0, {("64KiB", 16 << 20), ("2MiB", 64 << 20)})
