"""The watch stream's HTTP framing against a scripted server: messages split across chunks
and chunks split across reads, a quiet read, the end of the stream."""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Iterator

import pytest

from kvwire.errors import MetadataStoreError
from kvwire.sidechannel.etcd import EtcdClient


def _message(result: dict[str, object]) -> bytes:
    return json.dumps({"result": result}).encode() + b"\n"


def _chunked(data: bytes, size: int) -> bytes:
    out = b""
    for i in range(0, len(data), size):
        piece = data[i : i + size]
        out += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    return out


@pytest.fixture
def server() -> Iterator[tuple[int, list[bytes]]]:
    """A one-connection server that answers a watch with the scripted byte pieces, each sent
    on its own, then waits for the client to go."""
    script: list[bytes] = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            for piece in script:
                conn.sendall(piece)
            done.wait(10)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1]), script
    finally:
        done.set()
        thread.join(10)
        listener.close()


def test_messages_split_anywhere_are_read_whole(server: tuple[int, list[bytes]]) -> None:
    port, script = server
    key = base64.b64encode(b"/kvwire/v1/engines/h/e/0/0").decode()
    value = base64.b64encode(b"record").decode()
    stream = (
        _message({"created": True})
        + _message({"events": [{"kv": {"key": key, "value": value, "mod_revision": "7"}}]})
        + _message({"events": [{"type": "DELETE", "kv": {"key": key, "mod_revision": "8"}}]})
    )
    body = _chunked(stream, 5) + b"0\r\n\r\n"
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    whole = head + body
    script.extend(whole[i : i + 3] for i in range(0, len(whole), 3))  # 3-byte reads

    watch = EtcdClient(f"etcd://127.0.0.1:{port}").watch(b"/kvwire/", 1)
    try:
        (put,) = watch.events(timeout=5.0)
        assert (put.key, put.value, put.mod_revision) == (
            b"/kvwire/v1/engines/h/e/0/0",
            b"record",
            7,
        )
        (gone,) = watch.events(timeout=5.0)
        assert gone.value is None and gone.mod_revision == 8
        with pytest.raises(MetadataStoreError, match="ended the watch"):
            watch.events(timeout=5.0)
    finally:
        watch.close()


def test_a_refused_watch_is_a_store_error(server: tuple[int, list[bytes]]) -> None:
    port, script = server
    script.append(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
    with pytest.raises(MetadataStoreError, match="refused the watch"):
        EtcdClient(f"etcd://127.0.0.1:{port}").watch(b"/kvwire/", 1)
