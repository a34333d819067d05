"""What a runtime advertises, the ids it accepts, and how its failures are counted."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kvwire.config import KVWireConfig
from kvwire.errors import ConfigError, LocalProtocolError
from kvwire.layout.geometry import BlockRegion, KVGeometry
from kvwire.runtime import Consumer, Producer
from kvwire.sidechannel import HandshakeListener
from kvwire.sidechannel.advertise import advertised_host, interface_addresses
from kvwire.wire.compat import CompatFactors

FACTORS = CompatFactors.build(
    vllm_version="0.31.0", model="m", dtype="bfloat16", num_kv_heads=8, head_size=128,
    num_hidden_layers=2, attn_backend_name="FLASH_ATTN",
)  # fmt: skip
_keep: list[Any] = []


def geometry(blocks: int = 64) -> KVGeometry:
    memory = np.zeros(blocks * 4096, dtype=np.uint8)
    _keep.append(memory)
    region = BlockRegion(
        base_addr=memory.ctypes.data, block_len=4096, num_blocks=blocks, mem_kind="DRAM"
    )
    return KVGeometry(regions=[region], kv_cache_layout="HND", block_size=16, total_kv_heads=8)


def config(engine_id: str, **kw: Any) -> KVWireConfig:
    return KVWireConfig(engine_id=engine_id, compat=FACTORS, transport="shm", environ={}, **kw)


def test_a_producer_without_a_port_starts_its_listener_and_advertises_it() -> None:
    with Producer(config("p-own")) as producer:
        producer.register_kv_caches(geometry())
        params = producer.prefill_finished("r", [[0, 1]])
        host, port = params["remote_host"], params["remote_port"]
        assert (host, port) == producer.side_channel
        assert host == "127.0.0.1" and port > 0
        with Consumer(config("d-own")) as consumer:
            consumer.register_kv_caches(geometry())
            consumer.add_request("r", params, [[2, 3]])
            deadline = time.monotonic() + 30
            while not (fin := consumer.get_finished()) and time.monotonic() < deadline:
                consumer.wait_finished(0.05)
            assert fin.done == ["r"], fin.failed


def test_a_wildcard_bind_is_advertised_as_a_routable_address() -> None:
    with Producer(config("p-any", side_channel_host="0.0.0.0")) as producer:
        producer.register_kv_caches(geometry())
        host, port = producer.side_channel
        assert host not in ("0.0.0.0", "", "::") and port > 0
        assert host == advertised_host("0.0.0.0")
        assert host in interface_addresses()  # an address of this host, not a guess
    with Producer(
        config("p-named", side_channel_host="0.0.0.0", advertise_host="p.example")
    ) as named:
        named.register_kv_caches(geometry())
        assert named.side_channel[0] == "p.example"


def test_advertise_host_must_be_an_address() -> None:
    with pytest.raises(ConfigError, match="is a wildcard"):
        advertised_host("0.0.0.0", "0.0.0.0")


def test_port_zero_with_several_ranks_asks_for_the_engine_listener() -> None:
    with pytest.raises(ConfigError, match=r"pass side_channel_port=listener\.port"):
        Producer(config("p-tp2", tp_size=2))


def test_prefill_finished_checks_block_ids_against_the_pool() -> None:
    with Producer(config("p-pool")) as producer:
        producer.register_kv_caches(geometry(64))
        with pytest.raises(
            LocalProtocolError, match="block id 999 is outside the registered pool of 64 blocks"
        ):
            producer.prefill_finished("r", [[1, 999]])
        with pytest.raises(LocalProtocolError, match="block id -1 is outside"):
            producer.prefill_finished("r2", [[-1]])
        assert producer.held_blocks() == 0


def test_a_failed_handshake_is_counted_once_under_its_kind() -> None:
    listener = HandshakeListener({}).start()
    port = listener.port
    listener.close()  # nothing listens there any more
    with (
        Producer(config("p-gone", side_channel_port=port)) as producer,
        Consumer(config("d-gone")) as consumer,
    ):
        producer.register_kv_caches(geometry())
        consumer.register_kv_caches(geometry())
        consumer.add_request("r", producer.prefill_finished("r", [[0]]), [[1]])
        deadline = time.monotonic() + 10
        while not (fin := consumer.get_finished()) and time.monotonic() < deadline:
            consumer.wait_finished(0.05)
        assert fin.failed["r"].reason == "handshake"
        assert "connection refused" in fin.failed["r"].detail
        totals = consumer.metrics.snapshot()["totals"]
        assert totals["failures"] == {"handshake": 1}
        assert totals["handshake_failures"] == {"unreachable": 1}
        text = consumer.metrics.prometheus_text()
        assert 'kvwire_failures_total{role="consumer",kind="handshake"} 1.0' in text
        assert 'kvwire_handshake_failures_total{role="consumer",kind="unreachable"} 1.0' in text
        assert text.count("kind=") == 2


def test_metrics_port_serves_the_ranks_counters_and_closes_with_it() -> None:
    """``metrics_port`` + the TP rank serves Prometheus text from the rank's own counters;
    a taken port is a ConfigError naming it; closing the runtime frees the port."""
    import socket
    import urllib.error
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = int(probe.getsockname()[1])
    with Producer(config("p-metrics", metrics_port=base)) as producer:
        assert producer.metrics_port == base  # TP rank 0
        producer.metrics.count("notifications_sent")
        url = f"http://127.0.0.1:{base}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'kvwire_notifications_total{role="producer",direction="sent"} 1.0' in text
        assert text == producer.metrics.prometheus_text()
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://127.0.0.1:{base}/other", timeout=10)
        assert missing.value.code == 404
        with pytest.raises(ConfigError, match=f"metrics_port.*{base}"):
            Producer(config("p-metrics-2", metrics_port=base))
    with Producer(config("p-metrics-3", metrics_port=base)) as again:  # the port was freed
        assert again.metrics_port == base
