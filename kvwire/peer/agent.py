"""The commanding side's handle on a peer agent process.

The peer is a fresh interpreter (``subprocess``, not ``multiprocessing``: nothing is
pickled, and the child inherits nothing but one socket), so the transport's two sides share
no memory, no threads and no library state.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvwire.framing import receive_frame, send_frame
from kvwire.peer import protocol as p
from kvwire.peer.memory import I64

DEFAULT_TIMEOUT_S = 120.0


class PeerAgentError(RuntimeError):
    """The peer agent reported an error; ``kind`` is the exception's class name there."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"peer agent: {kind}: {message}")
        self.kind = kind


class PeerAgent:
    """A peer process running one agent of a transport, commanded from this process."""

    def __init__(
        self,
        transport: str,
        options: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.name = name or f"kvwire-peer-{uuid.uuid4().hex[:8]}"
        self.timeout = timeout
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._chan = ours
        self._in_step = False
        """A command was sent, or a reply read, only in part or not answered yet: Ctrl-C
        landed mid-call, the channel is out of step, and :meth:`close` only kills."""
        cmd = [
            sys.executable,
            "-m",
            "kvwire.peer.process",
            "--fd",
            str(theirs.fileno()),
            "--transport",
            transport,
            "--name",
            self.name,
            "--options",
            json.dumps(dict(options or {})),
        ]
        child_env = dict(os.environ)
        child_env.update(env or {})
        try:
            self.process = subprocess.Popen(
                cmd,
                pass_fds=[theirs.fileno()],
                env=child_env,
                stdin=subprocess.DEVNULL,
                process_group=0,  # Ctrl-C reaches the parent, which ends us in order
            )
        finally:
            theirs.close()
        self._chan.settimeout(timeout)
        try:
            self._reply()
            hello = self.call(p.Hello())
        except BaseException:
            self.kill()
            raise
        self.pid: int = hello["pid"]
        self.agent_name: str = hello["name"]

    def _reply(self) -> Any:
        try:
            raw = receive_frame(self._chan)
        except (EOFError, OSError) as exc:
            code = self.process.poll()
            raise PeerAgentError("Gone", f"no answer ({exc}); exit status {code}") from exc
        reply = p.reply_decoder.decode(raw)
        self._in_step = False
        if "error" in reply:
            raise PeerAgentError(*reply["error"])
        return reply["ok"]

    def call(self, request: Any, timeout: float | None = None) -> Any:
        """Send one command and return its answer (raises PeerAgentError on its failure)."""
        self.start(request)
        return self.finish(timeout)

    def start(self, request: Any) -> None:
        """Send a command without waiting; :meth:`finish` collects its answer."""
        self._in_step = True
        send_frame(self._chan, p.request_encoder.encode(request))

    def finish(self, timeout: float | None = None) -> Any:
        self._chan.settimeout(timeout or self.timeout)
        return self._reply()

    # -- conveniences -----------------------------------------------------------------

    def alloc(self, nbytes: int, allocator: str = "numpy", register: int = 0) -> dict[str, int]:
        """Allocate and register memory in the peer; ``register``: only its first bytes."""
        out: dict[str, int] = self.call(p.Alloc(nbytes, allocator, register))
        return out

    def metadata(self) -> bytes:
        blob: bytes = self.call(p.Metadata())
        return blob

    def fill(self, addr: int, nbytes: int, seed: int) -> None:
        self.call(p.Fill(addr, nbytes, seed))

    def read(self, descs: I64) -> bytes:
        data: bytes = self.call(p.ReadDescs(np.ascontiguousarray(descs, np.int64).tobytes()))
        return data

    def digest(self, descs: I64) -> int:
        """CRC-32 of what :meth:`read` would return, computed in the peer."""
        raw = np.ascontiguousarray(descs, np.int64).tobytes()
        crc: int = self.call(p.ReadDescs(raw, digest=True))
        return crc

    def drain(self, at_least: int = 0, timeout: float = 0.0) -> list[tuple[str, bytes]]:
        got = self.call(p.Drain(at_least, timeout), timeout=timeout + self.timeout)
        return [(str(peer), bytes(msg)) for peer, msg in got]

    def die(self) -> None:
        """SIGKILL the peer from inside (it stops mid-whatever) and reap it."""
        send_frame(self._chan, p.request_encoder.encode(p.Die()))
        self.process.wait(timeout=self.timeout)
        self._chan.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=self.timeout)
        self._chan.close()

    def close(self, timeout: float = 30.0) -> None:
        """Close the peer's transport, let it exit, and reap it (killed after ``timeout``)."""
        if self.process.poll() is None and not self._in_step:
            try:
                self.call(p.Close(), timeout=timeout)
                self.process.wait(timeout=timeout)
            except (PeerAgentError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
