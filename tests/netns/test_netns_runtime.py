"""kvwire's runtime across two hosts: P in one network namespace, D in the other.

A prefill rank (``Producer`` + handshake listener on 192.0.2.1) and a decode rank
(``Consumer`` on 192.0.2.2) move demo KV (every value encodes its request, layer, head,
token and element; ``kvwire.demo.content``) over the ``nixl`` and ``ucx`` transports,
forced onto TCP over the veth link. Then the link is cut while transfers run, and the test
checks what an operator relies on: D fails exactly the affected requests and lists the
blocks it allocated for them, P frees their blocks when the lease runs out, every wait is
bounded, and once the link is back new requests are served.

The functions at module level run inside a namespace (``Namespace.start``); the tests
orchestrate from the root namespace, forwarding ``kv_transfer_params`` from P to D as a
proxy would.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest
from netns_fixtures import (
    ADDRESS_A,
    ADDRESS_B,
    Child,
    Namespace,
    NetnsPair,
    await_reads,
    emit,
    receive,
    ucx_lanes,
)

pytestmark = pytest.mark.timeout(300)

MODEL = "llama-3-8b"
LAYERS = 4
BLOCK_BYTES = 64 << 10
"""One block of one layer (8 KV heads x 16 tokens x 2 x 128 bf16 values)."""
TOKENS = 4096
"""Per request: 256 blocks x 4 layers x 64 KiB = 64 MiB."""
BLOCKS_PER_REQUEST = TOKENS // 16
POOL_REQUESTS = 4
"""Each side holds four requests at once (256 MiB), the most any phase posts."""
NUM_BLOCKS = BLOCKS_PER_REQUEST * POOL_REQUESTS
LEASE_S = 3.0

# -------------------------------------------------------------- run inside a namespace


def _spec() -> Any:
    from kvwire.demo.models import CacheSpec, preset

    return CacheSpec(preset(MODEL), LAYERS, NUM_BLOCKS, 0, 1)


def _config(engine_id: str, host: str, port: int, lease_s: float) -> Any:
    from kvwire.config import KVWireConfig

    return KVWireConfig(
        engine_id=engine_id,
        side_channel_host=host,
        side_channel_port=port,
        compat=_spec().compat("pull"),
        lease_s=lease_s,
        handshake_timeout_s=2.0,
        handshake_retries=1,
    )


def prefill_host(transport: str, options: dict[str, Any], lease_s: float) -> dict[str, Any]:
    """P: a KV cache, a listener on ADDRESS_A and a Producer; serves the parent's commands.

    ``{"op": "prefill", "requests": [[rid, index, blocks], ...]}`` fills and holds each
    request's blocks, answering with their params; ``{"op": "drain", "rids": [...],
    "timeout": s}`` waits (bounded) until those requests are freed, answering with why
    and how many blocks P still holds; ``{"op": "exit"}`` ends.
    """
    from kvwire.demo.content import fill
    from kvwire.demo.worker import allocate
    from kvwire.runtime import Producer
    from kvwire.sidechannel import HandshakeListener

    spec = _spec()
    buffer = allocate(transport, spec.total_bytes)
    listener = HandshakeListener({}, host=ADDRESS_A, port=0).start()
    producer = Producer(
        _config("prefill-netns", ADDRESS_A, listener.port, lease_s),
        transport,
        transport_options=options,
    )
    freed: dict[str, str] = {}
    try:
        producer.register_kv_caches(spec.geometry(int(buffer.ctypes.data)))
        listener.set_payloads({(0, 0): producer.handshake_payload()})
        emit({"port": listener.port})
        while True:
            cmd = receive()
            if cmd["op"] == "exit":
                break
            if cmd["op"] == "prefill":
                params = []
                for rid, index, blocks in cmd["requests"]:
                    fill(spec, buffer, index, blocks)
                    params.append(producer.prefill_finished(rid, [blocks], num_tokens=TOKENS))
                emit({"params": params})
            elif cmd["op"] == "drain":
                wanted = set(cmd["rids"])
                start = time.monotonic()
                deadline = start + float(cmd["timeout"])
                while not wanted <= set(freed) and time.monotonic() < deadline:
                    producer.wait_finished(max(0.0, deadline - time.monotonic()))
                    freed.update((f.request_id, f.reason) for f in producer.get_finished())
                emit({
                    "freed": {rid: freed[rid] for rid in wanted if rid in freed},
                    "waited_s": time.monotonic() - start,
                    "held_blocks": producer.held_blocks(),
                })  # fmt: skip
        return {"errors": producer.errors, "stats": producer.machine_stats()}
    finally:
        producer.close()
        listener.close()


def decode_host(transport: str, options: dict[str, Any]) -> dict[str, Any]:
    """D: a KV cache and a Consumer on ADDRESS_B; serves the parent's commands.

    ``{"op": "recv", "requests": [[rid, index, blocks, params], ...], "timeout": s}`` adds
    every request (their READs are posted before ``add_request`` returns once the peer is
    known), says ``posted``, then waits (bounded) for every outcome and answers with what
    arrived intact and what failed with which blocks; ``{"op": "exit"}`` ends.
    """
    from kvwire.demo.content import scribble
    from kvwire.demo.worker import allocate
    from kvwire.runtime import Consumer

    spec = _spec()
    buffer = allocate(transport, spec.total_bytes)
    consumer = Consumer(
        _config("decode-netns", ADDRESS_B, 0, LEASE_S), transport, transport_options=options
    )
    known: dict[str, tuple[int, list[int]]] = {}
    """Every request ever added: an outcome may arrive after its command gave up on it."""
    try:
        consumer.register_kv_caches(spec.geometry(int(buffer.ctypes.data)))
        emit("ready")
        while True:
            cmd = receive()
            if cmd["op"] == "exit":
                break
            requests = {rid: (index, blocks) for rid, index, blocks, _ in cmd["requests"]}
            known.update(requests)
            for _, _, blocks, _ in cmd["requests"]:
                scribble(spec, buffer, blocks)  # stale bytes cannot pass as delivered
            start = time.monotonic()
            for rid, _, blocks, params in cmd["requests"]:
                consumer.add_request(rid, params, [blocks])
            emit({"posted": len(requests), "post_s": time.monotonic() - start})
            done, failed = await_reads(
                consumer, spec, buffer, known, set(requests), start, float(cmd["timeout"])
            )
            emit({
                "done": done,
                "failed": failed,
                "pending": sorted(set(requests) - set(done) - set(failed)),
                "elapsed_s": time.monotonic() - start,
                "totals": consumer.metrics.snapshot()["totals"],
            })  # fmt: skip
        return {"errors": consumer.errors, "stats": consumer.machine_stats()}
    finally:
        consumer.close()


# -------------------------------------------------------------------------------- tests

TRANSPORTS = {
    "nixl": {"backend_options": {"ucx_error_handling_mode": "peer"}},
    "ucx": {"error_handling": "peer"},
}
"""Transport options across hosts: UCX's peer error handling, without which a transfer on
a dead TCP connection never fails (measured: pending for the whole 40 s cut, then
completed after the restore, long after P's lease had freed the blocks). ``ucx``'s
``auto`` picks ``peer`` by itself for a peer on another machine, but both namespaces
share one kernel, so it is named here."""

UCX_FAILURE_DETECTION = {"UCX_TCP_USER_TIMEOUT": "2s"}
"""How soon UCX gives up on a TCP connection: data unacknowledged for 2 s closes the socket
and fails the endpoint's transfers (measured: D fails them ~2.2 s after the cut). The
system default is ~15 minutes of retransmissions: with it, the READs stayed pending for a
45 s cut and then completed after the restore, delivering the bytes P had meanwhile put in
blocks its lease had freed. The bound must sit well below the lease."""

CUT_RATE = "100mbit"
"""P's egress while the cut phase runs: 64 MiB takes ~5.4 s, so no request can finish in
the moments between "posted" and the cut."""

DETECT_BOUND_S = 15.0
"""Longest D may take to fail the requests of a cut link (UCX needs ~2 s; slack for load)."""


def _requests(tag: str, indices: range) -> list[tuple[str, int, list[int], list[int]]]:
    """``(rid, content index, P's blocks, D's blocks)``; D's ids differ from P's (reversed
    pool order) so a failure report names D's blocks or is wrong."""
    out = []
    for slot, index in enumerate(indices):
        p_first = slot * BLOCKS_PER_REQUEST
        d_first = NUM_BLOCKS - (slot + 1) * BLOCKS_PER_REQUEST
        p_blocks = list(range(p_first, p_first + BLOCKS_PER_REQUEST))
        d_blocks = list(range(d_first, d_first + BLOCKS_PER_REQUEST))
        out.append((f"{tag}-{index}", index, p_blocks, d_blocks))
    return out


class Proxy:
    """The parent as the proxy between P and D: params from P go to D unchanged."""

    def __init__(self, prefill: Child, decode: Child) -> None:
        self.prefill = prefill
        self.decode = decode

    def post(self, requests: list[tuple[str, int, list[int], list[int]]], timeout: float) -> Any:
        self.prefill.send({"op": "prefill", "requests": [[r, i, p] for r, i, p, _ in requests]})
        params = self.prefill.message(timeout=60)["params"]
        batch = [[r, i, d, prm] for (r, i, _, d), prm in zip(requests, params, strict=True)]
        self.decode.send({"op": "recv", "requests": batch, "timeout": timeout})
        posted = self.decode.message(timeout=60)
        assert posted["posted"] == len(requests), posted
        return posted

    def outcome(self, timeout: float) -> dict[str, Any]:
        result: dict[str, Any] = self.decode.message(timeout=timeout + 30)
        return result

    def freed(self, rids: list[str], timeout: float) -> dict[str, Any]:
        self.prefill.send({"op": "drain", "rids": rids, "timeout": timeout})
        result: dict[str, Any] = self.prefill.message(timeout=timeout + 30)
        return result


def _assert_served(proxy: Proxy, requests: list[tuple[str, int, list[int], list[int]]]) -> None:
    """Every request arrives intact at D and P frees its blocks as sent."""
    proxy.post(requests, timeout=60)
    outcome = proxy.outcome(timeout=60)
    expected = {rid: [0, len(d) * LAYERS * BLOCK_BYTES] for rid, _, _, d in requests}
    assert outcome["done"] == expected, outcome
    assert not outcome["failed"] and not outcome["pending"], outcome
    rids = [rid for rid, *_ in requests]
    freed = proxy.freed(rids, timeout=30)
    assert freed["freed"] == dict.fromkeys(rids, "sent"), freed
    assert freed["held_blocks"] == 0, freed


def _shape_link(ns: Namespace, rate: str | None) -> None:
    """Limit ``ns``'s egress to ``rate`` (a token bucket), or remove the limit."""
    if rate is None:
        argv = ["tc", "-n", ns.name, "qdisc", "del", "dev", ns.device, "root"]
    else:
        argv = ["tc", "-n", ns.name, "qdisc", "add", "dev", ns.device, "root", "tbf",
                "rate", rate, "burst", "256kb", "latency", "100ms"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{' '.join(argv)}: {proc.stderr}"


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_netns_runtime_moves_kv_and_survives_a_cut_link(
    netns_pair: NetnsPair, transport: str
) -> None:
    """P in one namespace, D in the other, over ``transport`` on TCP across the veth:
    intact KV; a cut mid-transfer fails exactly the affected requests with D's blocks and
    P frees them at lease expiry, all within bounds; after the restore a fresh handshake
    serves new requests."""
    pytest.importorskip(f"kvwire_{transport}", reason=f"the {transport} extra is not installed")
    options = TRANSPORTS[transport]
    env_a = {**netns_pair.a.ucx_env(log_level="info"), **UCX_FAILURE_DETECTION}
    env_b = {**netns_pair.b.ucx_env(log_level="info"), **UCX_FAILURE_DETECTION}
    prefill = netns_pair.a.start(prefill_host, transport, options, LEASE_S, env=env_a)
    decode: Child | None = None
    try:
        assert prefill.message(timeout=90)["port"] > 0
        decode = netns_pair.b.start(decode_host, transport, options, env=env_b)
        assert decode.message(timeout=90) == "ready"
        proxy = Proxy(prefill, decode)

        # 1. A healthy link: KV arrives intact; P frees on D's completion.
        _assert_served(proxy, _requests("before", range(0, 2)))

        # 2. Cut the link while four 64 MiB READs run (P's egress slowed so none can end
        #    before the cut).
        cut = _requests("cut", range(2, 6))
        _shape_link(netns_pair.a, CUT_RATE)
        try:
            proxy.post(cut, timeout=DETECT_BOUND_S)  # D has posted every READ
            netns_pair.cut()
            cut_at = time.monotonic()
            outcome = proxy.outcome(timeout=DETECT_BOUND_S)
            detected_s = time.monotonic() - cut_at
            freed = proxy.freed([rid for rid, *_ in cut], timeout=LEASE_S + 10)
        finally:
            netns_pair.restore()
            _shape_link(netns_pair.a, None)
        assert not outcome["pending"], f"stuck after {DETECT_BOUND_S} s: {outcome}"
        assert not outcome["done"], f"finished across a cut link: {outcome}"
        assert set(outcome["failed"]) == {rid for rid, *_ in cut}, outcome
        for rid, _, _, d_blocks in cut:
            failure = outcome["failed"][rid]
            # The fabric's failure detection ("transfer") or D's read deadline, bounded by
            # P's lease ("expired"), whichever comes first: both fail with D's blocks.
            assert failure["reason"] in ("transfer", "expired"), failure
            assert failure["invalid"] == [d_blocks], f"{rid}: not the blocks D allocated"
        assert freed["freed"] == {rid: "expired" for rid, *_ in cut}, freed
        assert freed["held_blocks"] == 0, freed

        # 3. The restored link serves new requests (after a fresh handshake).
        _assert_served(proxy, _requests("after", range(6, 8)))
        prefill.send({"op": "exit"})
        decode.send({"op": "exit"})
        p_end, d_end = prefill.result(timeout=60), decode.result(timeout=60)
    finally:
        prefill.kill()
        if decode is not None:
            decode.kill()
    assert p_end["errors"] == [] and d_end["errors"] == [], (p_end, d_end)
    assert d_end["stats"]["handshakes_started"] == 2, "a failed peer must be handshaken again"
    assert p_end["stats"]["leases_expired"] == len(cut), p_end["stats"]
    for child, ns in ((prefill, netns_pair.a), (decode, netns_pair.b)):
        lanes = ucx_lanes(child.output)
        assert lanes == {("tcp", ns.device)}, f"UCX left the veth: {lanes}\n{child.log()}"
    print(f"{transport}: D failed the cut requests {detected_s:.2f} s after the cut; "
          f"P freed them {freed['waited_s']:.2f} s after that")  # fmt: skip
