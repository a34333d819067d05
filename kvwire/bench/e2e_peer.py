"""The prefill process of ``kvwire bench e2e``: one kvwire ``Producer`` over a full 8B cache.

Run as ``python -m kvwire.bench.e2e_peer`` by :mod:`kvwire.bench.e2e`; commands arrive as
demo frames (:mod:`kvwire.framing`) on stdin, answers leave on stdout.

``init`` {model, layers, num_blocks, transport, memory} -> {port}: allocate the cache
(``memory`` "plain", or "segment" for the transport's own allocator) and fill it
(every block of every layer holds one byte value, :func:`marker`, so the decode side can
check cheaply that the right block landed), register it and serve the handshake.
``prefill`` {rid, blocks, num_tokens} -> {params, t_start, t_return}: wait until the
previous request's blocks are free again, then time ``prefill_finished`` — ``t_start`` is
"prefill finished", the start of time-to-KV. Clock: ``time.perf_counter``, which is
CLOCK_MONOTONIC on Linux and so comparable between processes of one host.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from kvwire.config import KVWireConfig
from kvwire.demo.models import CacheSpec, preset
from kvwire.demo.worker import allocate
from kvwire.framing import FrameWriter, commands, read_frame
from kvwire.runtime import Producer
from kvwire.sidechannel import HandshakeListener


def marker(layers: int, blocks: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
    """The byte value of block ``blocks[j]`` in layer ``l``, shape ``(layers, len(blocks))``."""
    layer = np.arange(layers, dtype=np.int64)[:, None]
    return ((layer * 31 + blocks[None, :] * 7) % 255 + 1).astype(np.uint8)


def spec_of(init: dict[str, Any]) -> CacheSpec:
    return CacheSpec(preset(init["model"]), int(init["layers"]), int(init["num_blocks"]), 0, 1)


def main() -> int:
    reader, out = sys.stdin.buffer, FrameWriter(sys.stdout.buffer)
    sys.stdout = sys.stderr  # only frames on the real stdout
    init = read_frame(reader)
    if init is None:
        return 1
    spec = spec_of(init)
    buffer = allocate(init["transport"], spec.total_bytes, own=init["memory"] == "segment")
    view = buffer.reshape(spec.layers, spec.num_blocks, spec.block_len)
    view[:] = marker(spec.layers, np.arange(spec.num_blocks, dtype=np.int64))[:, :, None]
    listener = HandshakeListener({}).start()
    config = KVWireConfig(
        engine_id=str(init["engine_id"]),
        side_channel_port=listener.port,
        compat=spec.compat("pull"),
    )
    producer = Producer(config, init["transport"])
    held: str | None = None
    try:
        producer.register_kv_caches(spec.geometry(int(buffer.ctypes.data)))
        listener.set_payloads({(0, 0): producer.handshake_payload()})
        out.send({"ok": True, "port": listener.port})
        for cmd in commands(reader):
            deadline = time.monotonic() + 60
            while held is not None and time.monotonic() < deadline:
                if held in {f.request_id for f in producer.get_finished()}:
                    held = None
                else:
                    producer.wait_finished(1.0)
            if held is not None:
                out.send({"ok": False, "error": f"request {held} was never freed"})
                break
            t_start = time.perf_counter()
            params = producer.prefill_finished(
                cmd["rid"], [cmd["blocks"]], num_tokens=int(cmd["num_tokens"])
            )
            t_return = time.perf_counter()
            held = cmd["rid"]
            out.send({"ok": True, "params": params, "t_start": t_start, "t_return": t_return})
    finally:
        producer.close()
        listener.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
