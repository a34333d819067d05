"""The peer agent: a separate process that runs the other side of a transport.

Started by :class:`kvwire.peer.agent.PeerAgent` as
``python -m kvwire.peer.process --fd N --transport SPEC --name NAME --options JSON``.
It creates the transport with the same factory and options as its commander (the
conformance suite's test process, or ``kvwire bench transport``), then obeys commands from
:mod:`kvwire.peer.protocol` until told to close or die.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
import traceback
import zlib
from typing import Any

import numpy as np

from kvwire.framing import receive_frame, send_frame
from kvwire.peer import memory
from kvwire.peer import protocol as p
from kvwire.transport import Transport, XferState, create, region_of_array


class _Agent:
    def __init__(self, transport: Transport) -> None:
        self.t = transport
        self.arrays: dict[int, Any] = {}
        """Every allocated region's array, kept alive as long as the agent may touch it."""
        self.handles: dict[int, object] = {}
        self.xfers: dict[int, object] = {}
        self.inbox: list[tuple[str, bytes]] = []
        self.next_id = 1
        self.gated: _Gated | None = None

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _collect(self) -> None:
        self.inbox.extend(self.t.drain_notifications())

    def _await_message(self, message: bytes, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self._collect()
            if any(msg == message for _, msg in self.inbox):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.t.wait(min(left, 0.05))

    def handle(self, req: Any) -> Any:
        t = self.t
        if isinstance(req, p.Hello):
            caps = t.capabilities
            return {"name": t.name, "pid": os.getpid(), "ordered": caps.ordered_notifications}
        if isinstance(req, p.Alloc):
            array = memory.allocate(req.allocator, req.nbytes)
            registered = array[: req.register] if req.register else array
            handle = t.register([region_of_array(registered)])
            rid = self._id()
            self.arrays[rid] = array
            self.handles[rid] = handle
            nbytes = int(registered.nbytes)
            return {"region": rid, "addr": int(array.ctypes.data), "nbytes": nbytes}
        if isinstance(req, p.Deregister):
            t.deregister(self.handles.pop(req.region))
            return None
        if isinstance(req, p.Fill):
            memory.view(req.addr, req.nbytes)[:] = memory.pattern(req.seed, req.nbytes)
            return None
        if isinstance(req, p.ReadDescs):
            data = memory.read_descs(_descs(req.descs))
            return zlib.crc32(data) if req.digest else data
        if isinstance(req, p.Metadata):
            return t.local_metadata()
        if isinstance(req, p.AddPeer):
            return t.add_peer(req.blob)
        if isinstance(req, p.Post):
            post = t.read if req.op == "read" else t.write
            xfer = post(req.peer, _descs(req.local), _descs(req.remote), req.notify)
            xid = self._id()
            self.xfers[xid] = xfer
            return xid
        if isinstance(req, p.WaitXfer):
            handle = self.xfers[req.xfer]
            deadline = time.monotonic() + req.timeout
            state = t.poll(handle)
            while state is XferState.PENDING and time.monotonic() < deadline:
                t.wait(0.05)
                state = t.poll(handle)
            return state.value
        if isinstance(req, p.Release):
            t.release(self.xfers.pop(req.xfer))
            return None
        if isinstance(req, p.Notify):
            t.notify(req.peer, req.message)
            return None
        if isinstance(req, p.Drain):
            deadline = time.monotonic() + req.timeout
            self._collect()
            while len(self.inbox) < req.at_least and time.monotonic() < deadline:
                t.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                self._collect()
            out, self.inbox = self.inbox, []
            return [[peer, msg] for peer, msg in out]
        if isinstance(req, p.AwaitThenRead):
            read = memory.reader(_descs(req.descs))  # ready before the race starts
            found = self._await_message(req.message, req.timeout)
            data = read()
            return {"found": found, "data": data}
        if isinstance(req, p.AwaitThenFill):
            fresh = memory.pattern(req.seed, req.nbytes)  # ready before the race starts
            found = self._await_message(req.message, req.timeout)
            memory.view(req.addr, req.nbytes)[:] = fresh
            return found
        if isinstance(req, p.GateOpen | p.GateArm | p.GateStep | p.GateLook | p.GateShut):
            return self._gate(req)
        if isinstance(req, p.Close):
            if self.gated is not None:
                self.gated.gate.close()
            t.close()
            return None
        if isinstance(req, p.Die):
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"unknown command {req!r}")

    def _gate(self, req: Any) -> Any:
        """The gate commands: a WRITE's destination held back here (kvwire.peer.gate)."""
        if isinstance(req, p.GateOpen):
            from kvwire.peer.gate import GateUnavailable, open_gate

            try:
                gate = open_gate(req.nbytes)
            except GateUnavailable as exc:
                return {"unavailable": str(exc)}
            self.t.register([region_of_array(gate.array)])
            self.gated = _Gated(gate)
            return {"addr": gate.addr, "nbytes": gate.nbytes}
        gated = self.gated
        if gated is None:
            raise ValueError("no gate: send GateOpen first")
        if isinstance(req, p.GateArm):
            gated.gate.let_through(req.through)
            gated.arm(_ints(req.offsets), _ints(req.lengths), req.note)
            return None
        if isinstance(req, p.GateStep):
            if req.release >= 0:
                gated.gate.release(req.release)
            gated.gate.wait_fault(req.wait)
            mark = gated.gate.recorded()
            self._collect()
            gated.look_for_note(self.inbox)
            return {"mark": mark, "noticed": gated.noticed}
        if isinstance(req, p.GateLook):
            seen = gated.seen()
            self._collect()
            gated.look_for_note(self.inbox)
            return {**seen, "noticed": gated.noticed, "stalled": gated.gate.stalled()}
        gated.gate.open()
        return None


class _Gated:
    """A gate, the spans armed in it, and what was there when the armed note arrived."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate
        self.offsets = np.zeros(0, dtype=np.int64)
        self.lengths = np.zeros(0, dtype=np.int64)
        self.note: bytes | None = None
        self.noticed: dict[str, Any] | None = None

    def arm(self, offsets: memory.I64, lengths: memory.I64, note: bytes | None) -> None:
        self.gate.open()
        self.gate.array[:] = 0
        self.offsets, self.lengths, self.note, self.noticed = offsets, lengths, note, None
        self.gate.protect(offsets, lengths)

    def seen(self) -> dict[str, Any]:
        """Held faults and the armed spans' bytes, taken together now."""
        held = self.gate.held()
        data = memory.gather(self.gate.array, self.offsets, self.lengths).tobytes()
        return {"held": held, "data": data}

    def look_for_note(self, inbox: list[tuple[str, bytes]]) -> None:
        waiting = self.note is not None and self.noticed is None
        if waiting and any(msg == self.note for _, msg in inbox):
            self.noticed = self.seen()


def _ints(raw: bytes) -> memory.I64:
    return np.frombuffer(raw, dtype=np.int64).copy()


def _descs(raw: bytes) -> memory.I64:
    return np.frombuffer(raw, dtype=np.int64).reshape(-1, 3).copy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvwire.peer.process")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--transport", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--options", default="{}")
    args = parser.parse_args(argv)
    chan = socket.socket(fileno=args.fd)
    try:
        transport = create(args.transport, args.name, **json.loads(args.options))
    except Exception as exc:
        send_frame(chan, p.request_encoder.encode({"error": [type(exc).__name__, str(exc)]}))
        return 1
    agent = _Agent(transport)
    send_frame(chan, p.request_encoder.encode({"ok": None}))
    while True:
        try:
            raw = receive_frame(chan)
        except EOFError:
            return 0
        req: Any = None
        try:
            req = p.request_decoder.decode(raw)
            reply: dict[str, Any] = {"ok": agent.handle(req)}
        except Exception as exc:
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            reply = {"error": [type(exc).__name__, detail]}
        send_frame(chan, p.request_encoder.encode(reply))
        if isinstance(req, p.Close):
            return 0


if __name__ == "__main__":
    sys.exit(main())
