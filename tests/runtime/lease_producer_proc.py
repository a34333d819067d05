"""A kvwire producer alone in a process, for the lease-extension test.

Started by test_runtime_lease_extension.py as ``python lease_producer_proc.py LEASE_S
FEATURES``: FEATURES ``all`` announces every kvwire feature; ``no-lease-query`` announces
the others only, as a kvwire producer from before the lease query. It serves its own
listener (port 0), fills four blocks with prompt 0's KV, holds them for request ``r``
and prints one JSON line with the params. On ``stop`` on stdin it waits for the request
to be freed (up to 3 leases), prints one JSON line with what it freed, its machine's and
its listener's counters, and exits.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict

from kvwire_shm import allocate

from kvwire.config import KVWireConfig
from kvwire.demo.content import fill
from kvwire.demo.models import CacheSpec, preset
from kvwire.runtime import Producer
from kvwire.wire import handshake
from kvwire.wire.schemas import LEASE_QUERY

BLOCKS = [0, 1, 2, 3]


def main(lease_s: float, features: str) -> None:
    if features == "no-lease-query":
        handshake.FEATURES = tuple(f for f in handshake.FEATURES if f != LEASE_QUERY)
    spec = CacheSpec(preset("llama-3-8b"), 2, 32, 0, 1)
    buffer = allocate(spec.total_bytes)
    config = KVWireConfig(
        engine_id="prefill-lease",
        mode="pull",
        side_channel_host="127.0.0.1",
        side_channel_port=0,
        compat=spec.compat("pull"),
        lease_s=lease_s,
    )
    producer = Producer(config, "shm")
    try:
        producer.register_kv_caches(spec.geometry(int(buffer.ctypes.data)))
        fill(spec, buffer, 0, BLOCKS)
        params = producer.prefill_finished("r", [BLOCKS], num_tokens=64)
        print(json.dumps({"params": params}), flush=True)
        assert sys.stdin.readline().strip() == "stop"
        freed = []
        deadline = time.monotonic() + 3 * lease_s
        while not freed and time.monotonic() < deadline:
            producer.wait_finished(0.1)
            freed += [(f.request_id, f.reason) for f in producer.get_finished()]
        listener = producer._listener  # the rank's own listener (side_channel_port=0)
        assert listener is not None
        report = {
            "freed": freed,
            "stats": producer.machine_stats(),
            "listener": {**asdict(listener.stats()), "rejected": listener.stats().rejected},
            "errors": producer.errors,
        }
        print(json.dumps(report), flush=True)
    finally:
        producer.close()


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2])
