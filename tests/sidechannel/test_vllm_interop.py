"""Interop with vLLM's side channel, using definitions of its messages made apart from ours.

vLLM's side is the plain dataclasses of :mod:`kvwire.bench.wire`, written from PROTOCOL.md
("Side-channel handshake", "Wire schemas") independently of kvwire.wire and checked against
the golden vectors by tests/bench: msgspec encodes a dataclass as a map keyed by field name
in declaration order, which is what vLLM 0.31.0 puts on the wire.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import zmq
from kvwire_shm import allocate

from kvwire import cli
from kvwire.bench.wire import VllmAgentMetadata, VllmHandshakePayload
from kvwire.config import KVWireConfig
from kvwire.demo.content import count_wrong_bytes, fill
from kvwire.demo.models import CacheSpec, preset, vllm_layer_name
from kvwire.runtime import Consumer, Producer
from kvwire.sidechannel import HandshakeClient, HandshakeListener, fetch_agent_metadata
from kvwire.transport import create, region_of_array

GET_META = b"get_meta_msg"
SPEC = CacheSpec(preset("llama-3-8b"), 2, 16, 0, 1)


def vllm_factors() -> dict[str, object]:
    return {
        "vllm_version": "0.31.0", "nixl_connector_version": 13,
        "model": "meta-llama/Meta-Llama-3-8B", "dtype": "torch.bfloat16", "num_kv_heads": 8,
        "head_size": 128, "num_hidden_layers": 32, "attn_backend_name": "FLASH_ATTN",
        "cache_dtype": "auto", "is_hma_enabled": True, "speculative_config": None,
        "transfer_mode": "pull",
    }  # fmt: skip


def vllm_hash(factors: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


class VllmStyleListener:
    """vLLM's listener loop as PROTOCOL.md describes it (minus its fragility)."""

    def __init__(self, payloads: dict[tuple[int, int], bytes]) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.payloads = payloads
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                identity, _, msg = self.sock.recv_multipart()
            except zmq.Again:
                continue
            tag, pp, tp = msgspec.msgpack.decode(msg)
            assert tag == GET_META
            ts = msgspec.msgpack.encode(time.perf_counter())
            self.sock.send_multipart([identity, b"", self.payloads[(pp, tp)], ts])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def vllm_producer() -> Iterator[tuple[VllmStyleListener, VllmAgentMetadata, np.ndarray, object]]:
    """A 'vLLM prefill engine': its KV in shm memory, registered with an shm agent, and its
    metadata encoded with this test's own dataclasses."""
    buffer = allocate(SPEC.total_bytes)
    agent = create("shm", "vllm-prefill-agent")
    agent.register([region_of_array(buffer)])
    base = int(buffer.ctypes.data)
    md = VllmAgentMetadata(
        engine_id="vllm-prefill-0",
        agent_metadata=agent.local_metadata(),
        kv_caches_base_addr=[base + i * SPEC.region_bytes for i in range(SPEC.layers)],
        device_id=0,
        num_blocks=SPEC.num_blocks,
        block_lens=[SPEC.block_len] * SPEC.layers,
        block_strides=[SPEC.block_len] * SPEC.layers,
        kv_cache_layout="HND",
        block_size=16,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[SPEC.num_blocks] * SPEC.layers,
        region_group_ids=[0] * SPEC.layers,
        region_names=[
            vllm_layer_name(i) for i in range(SPEC.layers)
        ],  # kvwire pairs regions by name
        region_mem_types=["DRAM"] * SPEC.layers,
    )
    encoder = msgspec.msgpack.Encoder()
    payload = encoder.encode(VllmHandshakePayload(vllm_hash(vllm_factors()), encoder.encode(md)))
    listener = VllmStyleListener({(0, 0): payload})
    try:
        yield listener, md, buffer, agent
    finally:
        listener.close()
        agent.close()  # type: ignore[attr-defined]


def test_probe_reads_a_vllm_listener(vllm_producer, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    listener, md, _, _ = vllm_producer
    factors = tmp_path / "factors.json"
    factors.write_text(json.dumps(vllm_factors()))
    code = cli.main(["probe", f"127.0.0.1:{listener.port}", "--factors", str(factors), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["peer"].startswith("vLLM")
    assert report["compatibility"]["compatible"] is True
    got = report["metadata"]
    assert got["engine_id"] == md.engine_id
    assert got["block_lens"] == md.block_lens
    assert got["kv_caches_base_addr"] == md.kv_caches_base_addr
    assert got["region_names"] == md.region_names

    other = dict(vllm_factors(), transfer_mode="push")
    factors.write_text(json.dumps(other))
    code = cli.main(["probe", f"127.0.0.1:{listener.port}", "--factors", str(factors), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert report["compatibility"]["differing"] == {"transfer_mode": ["push", "pull"]}


def test_runtime_client_reads_a_vllm_listener(vllm_producer) -> None:  # type: ignore[no-untyped-def]
    listener, md, _, _ = vllm_producer
    with HandshakeClient() as client:
        result = fetch_agent_metadata(
            client, "127.0.0.1", listener.port, [(0, 0)],
            local_hash=vllm_hash(vllm_factors()), expected_engine_id="vllm-prefill-0",
        )  # fmt: skip
    got = result.metadata[(0, 0)]
    assert got.engine_id == md.engine_id and got.agent_metadata == md.agent_metadata
    assert list(got.block_lens) == md.block_lens and got.region_mem_types == md.region_mem_types
    assert abs(result.clock_offset) < 1.0  # one host: perf_counter is one clock


def test_kvwire_consumer_pulls_blocks_from_a_vllm_producer(vllm_producer) -> None:  # type: ignore[no-untyped-def]
    listener, _, p_buffer, agent = vllm_producer
    fill(SPEC, p_buffer, 7, [2, 3, 4])
    d_buffer = allocate(SPEC.total_bytes)
    config = KVWireConfig(
        engine_id="kvwire-decode-0",
        compat_hash=vllm_hash(vllm_factors()),
        side_channel_port=1,
    )
    params = {  # what vLLM's P returns, under vLLM's key names
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[2, 3, 4]],
        "remote_engine_id": "vllm-prefill-0", "remote_request_id": "cmpl-abc-0",
        "remote_host": "127.0.0.1", "remote_port": listener.port, "tp_size": 1,
        "remote_num_tokens": 48,
    }  # fmt: skip
    with Consumer(config, "shm") as consumer:
        consumer.register_kv_caches(SPEC.geometry(int(d_buffer.ctypes.data)))
        consumer.add_request("d-req-1", params, [[9, 10, 11]])
        assert consumer.wait_finished(30)
        fin = consumer.get_finished()
        assert fin.done == ["d-req-1"], fin
    assert count_wrong_bytes(SPEC, d_buffer, 7, [9, 10, 11]) == (
        0,
        3 * SPEC.layers * SPEC.block_len,
    )
    # The completion a vLLM producer counts: "{remote_request_id}:{consumer world size}".
    deadline = time.monotonic() + 10
    notes: list[bytes] = []
    while b"cmpl-abc-0:1" not in notes and time.monotonic() < deadline:
        notes += [m for _, m in agent.drain_notifications()]
        time.sleep(0.01)
    assert notes.count(b"cmpl-abc-0:1") == 1
    # Anything else is a lease heartbeat naming the producer's request id.
    assert {m for m in notes if m != b"cmpl-abc-0:1"} <= {b"HB:cmpl-abc-0"}


def test_vllm_style_client_reads_kvwire_listener() -> None:
    buffer = np.zeros(SPEC.total_bytes, dtype=np.uint8)
    config = KVWireConfig(engine_id="kvwire-prefill-0", compat=SPEC.compat("pull"))
    with Producer(config, "shm") as producer:
        producer.register_kv_caches(SPEC.geometry(int(buffer.ctypes.data)))
        with HandshakeListener({(0, 0): producer.handshake_payload()}) as listener:
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            sock.connect(f"tcp://127.0.0.1:{listener.port}")
            try:
                t0 = time.perf_counter()
                sock.send(msgspec.msgpack.encode((GET_META, 0, 0)))
                frames = sock.recv_multipart()
                t1 = time.perf_counter()
                assert len(frames) == 2
                payload = msgspec.msgpack.Decoder(VllmHandshakePayload).decode(frames[0])
                remote_ts = msgspec.msgpack.decode(frames[1])
                assert isinstance(remote_ts, float) and t0 - 1 < remote_ts < t1 + 1
                # Our hash, computed our way, is the one kvwire advertises.
                assert payload.compatibility_hash == vllm_hash(vllm_factors())
                md = msgspec.msgpack.Decoder(VllmAgentMetadata).decode(payload.agent_metadata_bytes)
                assert md.engine_id == "kvwire-prefill-0"
                assert md.block_lens == [SPEC.block_len] * SPEC.layers
                assert md.kv_caches_base_addr[0] == int(buffer.ctypes.data)
                assert md.agent_metadata == producer.transport.local_metadata()

                # Asking for a rank kvwire does not serve: an answer (not a hang) that a
                # vLLM client fails to decode as a payload -- a clean error on its side.
                sock.send(msgspec.msgpack.encode((GET_META, 0, 5)))
                frames = sock.recv_multipart()
                assert len(frames) == 2
                with pytest.raises(msgspec.DecodeError):
                    msgspec.msgpack.Decoder(VllmHandshakePayload).decode(frames[0])
            finally:
                sock.close(linger=0)
                ctx.term()
