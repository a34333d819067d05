"""The two-namespace fixture works: TCP, ZMQ and NIXL-over-UCX cross the veth link, a cut
link stops them within a timeout, and a restored link carries traffic again.

The functions at module level run inside a namespace (``Namespace.start``); the tests run
in the root namespace and only orchestrate.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
from netns_fixtures import ADDRESS_B, NetnsPair, b64, emit, receive, ucx_lanes, unb64

CUT_TIMEOUT_S = 2.0
"""How long a client waits on a cut link before calling it failed."""

pytestmark = pytest.mark.timeout(240)


# --------------------------------------------------------------- run inside a namespace


def tcp_echo_server(address: str) -> None:
    """Echo every connection's bytes back; runs until killed."""
    server = socket.create_server((address, 0))
    emit(server.getsockname()[1])

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def tcp_round_trip(address: str, port: int, timeout: float) -> str:
    """One connect-send-receive; the echoed text."""
    with socket.create_connection((address, port), timeout=timeout) as conn:
        conn.sendall(b"ping")
        return conn.recv(16).decode()


def tcp_across_a_cut(address: str, port: int) -> dict[str, Any]:
    """Connect and echo, wait for the parent to cut the link, then try both an established
    connection and a new one; report how each failed and how long it took."""
    conn = socket.create_connection((address, port), timeout=10)
    conn.sendall(b"before")
    before = conn.recv(16).decode()
    emit("connected")
    receive()  # the parent has cut the link
    out: dict[str, Any] = {"before": before}
    conn.settimeout(CUT_TIMEOUT_S)
    start = time.monotonic()
    try:
        conn.sendall(b"during")
        out["established"] = f"echoed {conn.recv(16)!r}"
    except OSError as exc:
        out["established"] = type(exc).__name__
    out["established_s"] = time.monotonic() - start
    start = time.monotonic()
    try:
        socket.create_connection((address, port), timeout=CUT_TIMEOUT_S).close()
        out["new"] = "connected"
    except OSError as exc:
        out["new"] = type(exc).__name__
    out["new_s"] = time.monotonic() - start
    conn.close()
    return out


def zmq_rep_server(address: str, replies: int) -> int:
    """A REP socket answering ``replies`` requests with their reversed bytes."""
    import zmq

    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    rep.bind(f"tcp://{address}:*")
    emit(rep.getsockopt_string(zmq.LAST_ENDPOINT))
    for _ in range(replies):
        rep.send(rep.recv()[::-1])
    rep.close()
    ctx.term()
    return replies


def zmq_req_client(endpoint: str) -> dict[str, Any]:
    """Request 1 on a good link; request 2 sent while the parent cuts the link, waited for
    in vain, then (after the parent restores it) answered on the same socket."""
    import zmq

    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    out: dict[str, Any] = {}
    req.send(b"abc")
    out["first"] = req.recv().decode() if req.poll(30_000) else None
    emit("first done")
    receive()  # link is cut
    req.send(b"xyz")
    out["during_cut"] = bool(req.poll(int(CUT_TIMEOUT_S * 1000)))
    emit("waited")
    receive()  # link is restored
    out["after_restore"] = req.recv().decode() if req.poll(60_000) else None
    req.close()
    ctx.term()
    return out


PATTERN_BYTES = 1 << 20


def _pattern() -> Any:
    import numpy as np

    return (np.arange(PATTERN_BYTES, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)


def nixl_target() -> list[str]:
    """A NIXL agent (UCX backend, no progress thread) exposing 1 MiB; it progresses until
    the initiator's notification arrives and returns the notifications it saw."""
    from nixl_cu12 import nixl_agent, nixl_agent_config

    agent = nixl_agent(
        "netns-target", nixl_agent_config(backends=["UCX"], enable_prog_thread=False)
    )
    src = _pattern()
    agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    emit({"metadata": b64(agent.get_agent_metadata()), "addr": src.ctypes.data})
    seen: list[str] = []
    deadline = time.monotonic() + 90
    while "moved" not in seen and time.monotonic() < deadline:
        for messages in agent.get_new_notifs().values():
            seen += [m.decode() for m in messages]
        time.sleep(0.001)  # the target only answers; a busy loop would starve the initiator
    return seen


def nixl_initiator(metadata: str, addr: int) -> dict[str, Any]:
    """READ the target's 1 MiB over NIXL, with a notification; report state and contents."""
    import numpy as np
    from nixl_cu12 import nixl_agent, nixl_agent_config

    agent = nixl_agent(
        "netns-initiator", nixl_agent_config(backends=["UCX"], enable_prog_thread=False)
    )
    dst = np.zeros(PATTERN_BYTES, dtype=np.uint8)
    agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent(unb64(metadata))
    local = agent.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
    remote = agent.get_xfer_descs([(addr, PATTERN_BYTES, 0)], "DRAM")
    handle = agent.initialize_xfer("READ", local, remote, peer, b"moved")
    agent.transfer(handle)
    deadline = time.monotonic() + 90
    state = agent.check_xfer_state(handle)
    while state not in ("DONE", "ERR") and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    return {"state": state, "intact": bool(np.array_equal(dst, _pattern()))}


# -------------------------------------------------------------------------------- tests


def test_netns_pair_has_the_documented_shape(netns_pair: NetnsPair) -> None:
    for ns in (netns_pair.a, netns_pair.b):
        shown = ns.run(["ip", "-o", "addr", "show"]).stdout
        assert f"{ns.address}/24" in shown and ns.device in shown
        routes = ns.run(["ip", "route", "show"]).stdout
        assert "default" not in routes, "the test network must have no way out"
        assert "<LOOPBACK,UP," in ns.run(["ip", "-o", "link", "show", "lo"]).stdout


def test_netns_tcp_connect_cut_and_restore(netns_pair: NetnsPair) -> None:
    server = netns_pair.b.start(tcp_echo_server, ADDRESS_B)
    try:
        port = server.message(timeout=60)
        assert netns_pair.a.call(tcp_round_trip, ADDRESS_B, port, 10.0) == "ping"

        client = netns_pair.a.start(tcp_across_a_cut, ADDRESS_B, port)
        assert client.message(timeout=60) == "connected"
        with netns_pair.link_cut():
            client.send("cut")
            cut = client.result(timeout=60)
        assert cut["before"] == "before"
        # An established connection times out; a new one is refused (no route) or times out.
        assert cut["established"] in ("TimeoutError", "timeout"), cut
        assert cut["new"] != "connected", cut
        assert cut["established_s"] < CUT_TIMEOUT_S + 5 and cut["new_s"] < CUT_TIMEOUT_S + 5

        assert _eventually(lambda: netns_pair.a.call(tcp_round_trip, ADDRESS_B, port, 5.0))
    finally:
        server.kill()


def _eventually(attempt: Any, timeout: float = 60) -> Any:
    """``attempt()``'s first success within ``timeout`` (the link may need a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return attempt()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_netns_zmq_req_rep_survives_a_cut(netns_pair: NetnsPair) -> None:
    server = netns_pair.b.start(zmq_rep_server, ADDRESS_B, 2)
    client = None
    try:
        endpoint = server.message(timeout=60)
        assert endpoint.startswith(f"tcp://{ADDRESS_B}:")
        client = netns_pair.a.start(zmq_req_client, endpoint)
        assert client.message(timeout=60) == "first done"
        with netns_pair.link_cut():
            client.send("cut")
            assert client.message(timeout=60) == "waited"
        client.send("restored")
        out = client.result(timeout=90)
        assert out == {"first": "cba", "during_cut": False, "after_restore": "zyx"}
        assert server.result(timeout=30) == 2
    finally:
        server.kill()
        if client is not None:
            client.kill()


def test_ucx_lane_parser_sees_every_transport() -> None:
    line = "[1] UCX  INFO    d intra-node cfg#1 rma_am(tcp/veth0)  am(tcp/veth0 cma/memory)"
    assert ucx_lanes([line]) == {("tcp", "veth0"), ("cma", "memory")}


def test_netns_nixl_ucx_moves_a_buffer_over_tcp(netns_pair: NetnsPair) -> None:
    """NIXL's UCX backend across the veth, forced onto TCP; UCX's own log proves it."""
    pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")
    target = netns_pair.b.start(nixl_target, env=netns_pair.b.ucx_env(log_level="info"))
    initiator = None
    try:
        offer = target.message(timeout=90)
        initiator = netns_pair.a.start(
            nixl_initiator,
            offer["metadata"],
            offer["addr"],
            env=netns_pair.a.ucx_env(log_level="info"),
        )
        assert initiator.result(timeout=120) == {"state": "DONE", "intact": True}
        assert "moved" in target.result(timeout=60)
    finally:
        target.kill()
        if initiator is not None:
            initiator.kill()
    for child, ns in ((initiator, netns_pair.a), (target, netns_pair.b)):
        assert child is not None
        # UCX logs one line per endpoint configuration: "<name> inter-node cfg#1
        # rma_am(tcp/<dev>) am(tcp/<dev>) ...": every lane must be TCP on our veth.
        lanes = ucx_lanes(child.output)
        assert lanes == {("tcp", ns.device)}, f"{lanes}\n{child.log()}"
