"""A demo rank process: one Producer or Consumer over its own KV cache.

Run as ``python -m kvwire.demo.worker`` by the demo's schedulers; commands arrive as frames
on stdin, answers and events leave on stdout. Logging goes to stderr.

Prefill rank commands: ``init`` -> ``{payload}``; ``prefill`` (fill the blocks with the
request's content, then ``prefill_finished``) -> ``{params}``; ``freed`` -> the requests
whose blocks are free again; ``stats``; ``exit``.

Decode rank commands: ``init``; ``recv`` (``add_request`` with the params and blocks);
``stats``; ``exit``. Finished requests are verified here and reported as ``finished``
events without being asked.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvwire.config import KVWireConfig
from kvwire.demo.content import count_wrong_bytes, fill, scribble
from kvwire.demo.models import BLOCK_TOKENS, CacheSpec, preset
from kvwire.errors import KVWireError
from kvwire.framing import FrameWriter, commands, read_frame
from kvwire.layout.geometry import KVGeometry
from kvwire.runtime import Consumer, Producer
from kvwire.transport import load
from kvwire.wire.compat import CompatFactors

log = logging.getLogger("kvwire.demo.worker")


def allocate(transport: str, nbytes: int, *, own: bool = True) -> npt.NDArray[np.uint8]:
    """Host memory for the KV cache, from the transport's own allocator when it has one
    and ``own`` (the shm transport maps such memory directly instead of using a syscall
    per copy), else plain memory as an engine's own tensors would be."""
    specs = getattr(load(transport), "conformance_allocators", ()) if own else ()
    for spec in specs:
        module_name, _, attr = str(spec).partition(":")
        try:
            alloc = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            continue
        array: npt.NDArray[np.uint8] = alloc(nbytes)
        array.fill(0)  # fault the pages in now, not during the first transfers
        return array
    array = np.empty(nbytes, dtype=np.uint8)
    array.fill(0)
    return array


def _spec(init: dict[str, Any]) -> CacheSpec:
    return CacheSpec(
        model=preset(init["model"]),
        layers=int(init["layers"]),
        num_blocks=int(init["num_blocks"]),
        tp_rank=int(init["tp_rank"]),
        tp_size=int(init["tp_size"]),
        block_tokens=int(init.get("block_tokens") or BLOCK_TOKENS),
    )


def _geometry(init: dict[str, Any], spec: CacheSpec, buffer: npt.NDArray[np.uint8]) -> KVGeometry:
    """The rank's regions; ``layout``, ``region_names`` and ``attn_backend`` in ``init``
    describe a peer engine's (a real vLLM's) choices, else the demo's own."""
    return spec.geometry(
        int(buffer.ctypes.data),
        layout=init.get("layout") or "LBHNC",
        region_names=init.get("region_names"),
        attn_backend_name=init.get("attn_backend"),
    )


def _compat(init: dict[str, Any], spec: CacheSpec) -> CompatFactors:
    """The demo's factors, or ``init["compat"]`` (a factor dict, e.g. a vLLM engine's)."""
    factors = init.get("compat")
    if factors is None:
        return spec.compat(init["mode"])
    return msgspec.convert(factors, CompatFactors)


def _config(init: dict[str, Any], spec: CacheSpec) -> KVWireConfig:
    """This rank's configuration: what the scheduler decided, explicitly; everything else
    (handshake timeouts, ...) from the ``KVWIRE_*`` variables the demo inherited."""
    # A peer engine's protocol version (what its vLLM release speaks), else the variables'.
    version: dict[str, Any] = {"version": int(init["version"])} if init.get("version") else {}
    return KVWireConfig(
        engine_id=init["engine_id"],
        tp_rank=spec.tp_rank,
        tp_size=spec.tp_size,
        mode=init["mode"],
        transport=init["transport"],
        side_channel_host=init["side_channel_host"],
        side_channel_port=int(init["side_channel_port"]),
        compat=_compat(init, spec),
        lease_s=float(init.get("lease_s", 30.0)),
        secret=bytes.fromhex(init["secret"]) if init.get("secret") else None,
        **version,
    )


def run_prefill(reader: Any, out: FrameWriter, init: dict[str, Any]) -> None:
    spec = _spec(init)
    buffer = allocate(init["transport"], spec.total_bytes)
    producer = Producer(
        _config(init, spec), init["transport"], transport_options=init.get("transport_options")
    )
    try:
        producer.register_kv_caches(_geometry(init, spec, buffer))
        out.send({"ok": True, "payload": producer.handshake_payload(), "pid": os.getpid()})
        for cmd in commands(reader):
            op = cmd["op"]
            if op == "prefill":
                blocks = list(cmd["blocks"])
                fill(spec, buffer, int(cmd["index"]), blocks)
                params = producer.prefill_finished(
                    cmd["rid"], [blocks], num_tokens=int(cmd["num_tokens"])
                )
                out.send({"ok": True, "params": params})
            elif op == "freed":
                freed = producer.get_finished()
                out.send({"ok": True, "freed": [[f.request_id, f.reason] for f in freed]})
            elif op == "stats":
                out.send({"ok": True, "metrics": producer.metrics.snapshot()["totals"],
                          "machine": producer.machine_stats(), "held": producer.held_blocks(),
                          "errors": producer.errors})  # fmt: skip
            else:
                out.send({"ok": False, "error": f"unknown op {op!r}"})
    finally:
        producer.close()


def run_decode(reader: Any, out: FrameWriter, init: dict[str, Any]) -> None:
    spec = _spec(init)
    buffer = allocate(init["transport"], spec.total_bytes)
    consumer = Consumer(
        _config(init, spec), init["transport"], transport_options=init.get("transport_options")
    )
    pending: dict[str, tuple[int, list[int], float]] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def report() -> None:
        """Verify each finished request and tell the scheduler, as soon as it ends."""
        while not stop.is_set():
            if not consumer.wait_finished(0.05):
                continue
            fin = consumer.get_finished()
            now = time.perf_counter()
            for rid in fin.done:
                with lock:
                    index, blocks, started = pending.pop(rid)
                wrong, checked = count_wrong_bytes(spec, buffer, index, blocks)
                out.send({"event": "finished", "rid": rid, "ok": True, "wrong": wrong,
                          "checked": checked, "kv_s": now - started})  # fmt: skip
            for rid, failure in fin.failed.items():
                with lock:
                    started = pending.pop(rid, (0, [], now))[2]
                out.send({"event": "finished", "rid": rid, "ok": False, "kv_s": now - started,
                          "reason": failure.reason, "detail": failure.detail,
                          "invalid": [list(g) for g in failure.invalid_block_ids]})  # fmt: skip

    reporter = threading.Thread(target=report, name="demo-decode-report", daemon=True)
    try:
        consumer.register_kv_caches(_geometry(init, spec, buffer))
        out.send({"ok": True, "payload": consumer.handshake_payload(), "pid": os.getpid()})
        reporter.start()
        for cmd in commands(reader):
            op = cmd["op"]
            if op == "recv":
                # ``hit`` leading blocks are a local prefix-cache hit: they hold the
                # request's content already and only the rest is received (and checked
                # with them, so a suffix written at the wrong offset is caught).
                blocks = list(cmd["blocks"])
                hit = int(cmd.get("hit", 0))
                if hit:
                    fill(spec, buffer, int(cmd["index"]), blocks)
                    scribble(spec, buffer, blocks[hit:])
                with lock:
                    pending[cmd["rid"]] = (int(cmd["index"]), blocks, time.perf_counter())
                # ``wait``: the request queues for blocks (heartbeats keep P's lease) until
                # an ``alloc`` command.
                allocated = None if cmd.get("wait") else [blocks[hit:]]
                consumer.add_request(cmd["rid"], cmd["params"], allocated)
            elif op == "alloc":
                with lock:
                    blocks = pending[cmd["rid"]][1]
                consumer.blocks_allocated(cmd["rid"], [blocks[int(cmd.get("hit", 0)) :]])
            elif op == "stats":
                metrics = consumer.metrics.snapshot()["totals"]
                stats = {"metrics": metrics, "machine": consumer.machine_stats(),
                         "store": _store_view(consumer)}  # fmt: skip
                out.send({"event": "stats", **stats, "errors": consumer.errors})
            else:
                out.send({"event": "error", "error": f"unknown op {op!r}"})
    finally:
        stop.set()
        if reporter.is_alive():
            reporter.join()
        consumer.close()


def _store_view(rank: Consumer) -> list[str] | None:
    """The engines the rank's metadata store view holds while it is current; None without
    a store or while it is not (etcd unreachable, not listed yet)."""
    directory = rank.directory
    if directory is None or not directory.healthy.is_set():
        return None
    return sorted(directory.engines())


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the scheduler ends us, in order
    logging.basicConfig(
        stream=sys.stderr,
        level=KVWireConfig().log_level,  # KVWIRE_LOG_LEVEL, as `kvwire -v` exports it
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
    )
    reader = sys.stdin.buffer
    out = FrameWriter(sys.stdout.buffer)
    sys.stdout = sys.stderr  # nothing else may write frames' stream
    init = read_frame(reader)
    if init is None:
        return 1
    try:
        if init["role"] == "prefill":
            run_prefill(reader, out, init)
        else:
            run_decode(reader, out, init)
    except BrokenPipeError:
        return 1  # the scheduler is gone: nobody to tell
    except KVWireError as exc:  # a cause the scheduler prints in its one line
        with contextlib.suppress(OSError):
            out.send({"ok": False, "event": "error", "error": str(exc)})
        return 1
    except Exception as exc:
        log.exception("demo rank failed")
        with contextlib.suppress(OSError):
            out.send({"ok": False, "event": "error", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
