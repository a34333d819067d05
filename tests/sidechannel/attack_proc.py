"""Attackers of a handshake listener, in their own process (loopback addresses only).

Started by test_listener_hostile.py as ``python attack_proc.py CONFIG_JSON``; talks in JSON
lines. Sequence:

1. open ``half_open`` (``[[source address, count], ...]``) raw TCP connections that send
   nothing or a partial ZMTP greeting, print ``{"event": "connected"}``;
2. for ``seconds``: slow clients trickling their greeting a byte at a time, connections
   that send random bytes, ZMTP frames claiming 1 GiB and 2^63-1 bytes, messages that
   never end (frames with MORE set, 2.5 MB per connection), and ZMQ DEALERs
   from several source addresses flooding malformed, wrong-frame-count, unknown-rank,
   oversize-claim and forged-authentication requests; print ``{"event": "flooded", ...}``
   with what each attack did and saw;
3. on ``check`` from stdin: count the half-open connections the listener has closed,
   print ``{"event": "reaped", ...}``; on ``quit``: exit.

Every loop is bounded by a count or by the deadline.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import socket
import struct
import sys
import threading
import time
from typing import Any

import zmq

TARGET = "127.0.0.1"
SLOW_SOURCE = "127.0.0.5"
GARBAGE_SOURCE = "127.0.0.6"
FLOOD_SOURCES = [f"127.0.0.{i}" for i in range(10, 18)]
SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"


def greeting() -> bytes:
    """A ZMTP 3.0 greeting with the NULL mechanism, as a client sends it."""
    return SIGNATURE + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def ready_command(socket_type: bytes = b"DEALER") -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return b"\x04" + bytes([len(body)]) + body


def raw_connect(port: int, source: str, timeout: float = 20.0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(timeout)
    sock.connect((TARGET, port))
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end has closed: EOF or reset after any unread bytes."""
    sock.setblocking(False)
    for _ in range(64):  # at most 64 x 64 KiB of unread greeting bytes, far more than sent
        try:
            if not sock.recv(65536):
                return True
        except BlockingIOError:
            return False
        except OSError as exc:
            return exc.errno in (errno.ECONNRESET, errno.EPIPE)
    return False


def half_open(port: int, sources: list[tuple[str, int]]) -> list[socket.socket]:
    socks = []
    for source, count in sources:
        for i in range(count):
            sock = raw_connect(port, source)
            if i % 2:
                sock.sendall(SIGNATURE[: 1 + i % 10])  # part of the greeting, then silence
            socks.append(sock)
    return socks


def slow_clients(port: int, count: int, deadline: float, out: dict[str, Any]) -> None:
    """Trickle the greeting one byte per 0.25 s: slower than any handshake timeout."""
    socks = [raw_connect(port, SLOW_SOURCE) for _ in range(count)]
    message = greeting() + ready_command()
    sent = [0] * count
    dropped = set()
    while time.monotonic() < deadline and len(dropped) < count:
        for i, sock in enumerate(socks):
            if i in dropped or sent[i] >= len(message):
                continue
            try:
                sock.send(message[sent[i] : sent[i] + 1])
                sent[i] += 1
            except OSError:
                dropped.add(i)
        time.sleep(0.25)  # the attack's pace, not a wait for a condition
    dropped.update(i for i, s in enumerate(socks) if i not in dropped and closed_by_peer(s))
    out["slow_clients"] = count
    out["slow_dropped_by_listener"] = len(dropped)
    out["slow_bytes_sent_max"] = max(sent)
    for sock in socks:
        sock.close()


def garbage(port: int, count: int, rng: random.Random, out: dict[str, Any]) -> None:
    """Connections that send random bytes, some after a valid ZMTP signature."""
    for i in range(count):
        sock = raw_connect(port, GARBAGE_SOURCE)
        junk = rng.randbytes(rng.randint(1, 4096))
        with contextlib.suppress(OSError):  # the listener may drop us mid-send
            sock.sendall((greeting() if i % 3 == 0 else b"") + junk)
        sock.close()
    out["garbage_connections"] = count


def length_claims(port: int, count: int, out: dict[str, Any]) -> None:
    """ZMTP message frames whose 8-byte length claims 1 GiB (or 2^63-1), then some bytes."""
    closed = 0
    for i in range(count):
        claim = (1 << 63) - 1 if i % 5 == 4 else 1 << 30
        sock = raw_connect(port, GARBAGE_SOURCE)
        try:
            sock.sendall(greeting() + ready_command())
            sock.sendall(b"\x01\x00")  # the empty REQ delimiter frame, MORE set
            sock.sendall(b"\x02" + struct.pack(">Q", claim) + b"\x00" * 65536)
        except OSError as exc:
            closed += exc.errno in (errno.ECONNRESET, errno.EPIPE)
        else:
            closed += closed_after(sock)
        sock.close()
    out["length_claims"] = count
    out["length_claims_dropped"] = closed


def endless_messages(port: int, count: int, out: dict[str, Any]) -> None:
    """Messages that never end: frame after frame with MORE set, up to 2.5 MB each.

    libzmq's ROUTER would buffer all of it (ZMQ_MAXMSGSIZE bounds a frame, not a message):
    these connections alone would grow the listener by hundreds of MB.
    """
    frame = b"\x01\xfa" + b"m" * 250  # MORE, 250 bytes
    chunk = frame * 400
    closed = 0
    for _ in range(count):
        sock = raw_connect(port, GARBAGE_SOURCE)
        try:
            sock.sendall(greeting() + ready_command() + b"\x01\x00")
            for _ in range(25):
                sock.sendall(chunk)
        except OSError as exc:
            closed += exc.errno in (errno.ECONNRESET, errno.EPIPE)
        else:
            closed += closed_after(sock)
        sock.close()
    out["endless_messages"] = count
    out["endless_dropped"] = closed


def closed_after(sock: socket.socket, timeout: float = 20.0) -> bool:
    """Wait for the listener to close ``sock`` (reading and discarding what it sent)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError as exc:
        return exc.errno in (errno.ECONNRESET, errno.EPIPE)
    return True


def hostile_bodies(rng: random.Random) -> list[list[bytes]]:
    """Bodies after the REQ delimiter, each wrong in its own way."""
    hello = b"\x93\xc4\x0ekvwire_auth_v1\x00\x00"
    proof_tag = b"kvwire_auth_v1_proof"
    nonce, challenge, mac = rng.randbytes(32), rng.randbytes(40), rng.randbytes(32)
    forged_proof = b"\x96\xc4\x14" + proof_tag + b"\x00\x00\xc4\x20" + nonce
    forged_proof += b"\xc4\x28" + challenge + b"\xc4\x20" + mac
    bodies: list[list[bytes]] = [
        [rng.randbytes(rng.randint(0, 300))],  # random bytes
        [b"\x93\xc4\x0cget_meta_msg\x00\x00"] * 3,  # wrong frame count
        [b"\x93\xc4\x0cget_meta_msg\xcd\x10\x00\x07"],  # unknown rank (4096, 7)
        [b"\x93\xc6\x40\x00\x00\x00" + b"x" * 40],  # msgpack bin32 claiming 1 GiB
        [b"\xdd\x40\x00\x00\x00" + b"\x00" * 40],  # msgpack array32 claiming 1 G entries
        [b"x" * 900, b"y" * 900],  # oversize across frames
        [hello],  # a real hello: a challenge back (work the listener must bound)
        [hello[:-2] + b"\xce\xff\xff\xff\xff\x00"],  # hello naming rank 2^32-1
        [forged_proof],  # a proof with random fields: refused
        [b"\x93\xc4\x0cget_meta_msg\x00\x00"],  # plain request (refused with a secret)
    ]
    return bodies


def dealer_flood(port: int, deadline: float, rng: random.Random, out: dict[str, Any]) -> None:
    """DEALERs from several addresses, sending as fast as the listener lets them."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealers = []
    for source in FLOOD_SOURCES:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, 64)
        dealer.connect(f"tcp://{source}:0;{TARGET}:{port}")
        dealers.append(dealer)
    sent = answered = refused_rate = challenges = no_envelope = 0
    while time.monotonic() < deadline:
        for dealer in dealers:
            for body in hostile_bodies(rng):
                try:
                    dealer.send_multipart([b"", *body], zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    break
            try:
                dealer.send(b"no envelope", zmq.NOBLOCK)
                no_envelope += 1
            except zmq.Again:
                pass
            while dealer.poll(0):
                frames = dealer.recv_multipart()
                answered += 1
                refused_rate += frames[1].startswith(b"KVWIRE_ERROR:rate limited")
                challenges += frames[1].startswith(b"KVWIRE_CHALLENGE:")
    out.update(
        flood_sent=sent,
        flood_answered=answered,
        flood_rate_limited=refused_rate,
        flood_challenges=challenges,
        flood_no_envelope=no_envelope,
    )
    ctx.destroy(linger=0)


def main() -> int:
    config = json.loads(sys.argv[1])
    port = int(config["port"])
    rng = random.Random(int(config.get("seed", 7)))
    socks = half_open(port, [(str(src), int(n)) for src, n in config["half_open"]])
    print(json.dumps({"event": "connected", "half_open": len(socks)}), flush=True)

    out: dict[str, Any] = {"event": "flooded"}
    deadline = time.monotonic() + float(config["seconds"])
    attacks = [
        threading.Thread(target=slow_clients, args=(port, config["slow"], deadline, out)),
        threading.Thread(target=garbage, args=(port, config["garbage"], rng, out)),
        threading.Thread(target=length_claims, args=(port, config["claims"], out)),
        threading.Thread(target=endless_messages, args=(port, config["endless"], out)),
        threading.Thread(target=dealer_flood, args=(port, deadline, random.Random(1), out)),
    ]
    for thread in attacks:
        thread.start()
    for thread in attacks:
        thread.join()
    print(json.dumps(out), flush=True)

    for line in sys.stdin:
        if line.strip() == "check":
            closed = sum(closed_by_peer(s) for s in socks)
            print(json.dumps({"event": "reaped", "closed": closed, "open": len(socks)}), flush=True)
        else:
            break
    for sock in socks:
        sock.close()
    os._exit(0)  # skip interpreter teardown of thousands of sockets


if __name__ == "__main__":
    raise SystemExit(main())
