"""A kvwire push consumer alone in a process, for the streaming fault tests.

Started by test_streaming.py as ``python push_consumer_proc.py``: reads one JSON line
``{"params": ..., "blocks": [...], "tokens": N}`` on stdin, registers for request ``r``
with the producer those params name, prints ``{"registered": true}`` and then waits for
the test to kill it (it must vanish mid-stream, as a crashed decode engine does).
"""

from __future__ import annotations

import json
import sys
import time

from kvwire_shm import allocate

from kvwire.config import KVWireConfig
from kvwire.demo.models import CacheSpec, preset
from kvwire.runtime import Consumer


def main() -> None:
    order = json.loads(sys.stdin.readline())
    spec = CacheSpec(preset("llama-3-8b"), order["layers"], order["num_blocks"], 0, 1)
    buffer = allocate(spec.total_bytes)
    config = KVWireConfig(
        engine_id="decode-vanishing",
        mode="push",
        side_channel_host="127.0.0.1",
        side_channel_port=0,
        compat=spec.compat("push"),
    )
    consumer = Consumer(config, "shm")
    consumer.register_kv_caches(spec.geometry(int(buffer.ctypes.data)))
    consumer.add_request("r", order["params"], [order["blocks"]], num_tokens=order["tokens"])
    print(json.dumps({"registered": True}), flush=True)
    while True:
        time.sleep(1)  # killed by the test


if __name__ == "__main__":
    main()
