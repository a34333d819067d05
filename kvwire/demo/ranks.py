"""Rank processes as the schedulers see them: spawn, talk in frames, kill, restart."""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any

from kvwire.errors import KVWireError
from kvwire.framing import FrameWriter, close_pipes, read_frame, spawn, wait_or_kill


class RankError(KVWireError):
    """A demo rank process failed or answered with an error."""


class RankProcess:
    """One ``python -m kvwire.demo.worker`` child; ``init`` is its first frame.

    With ``events`` set, a reader thread forwards every frame to that queue tagged with the
    rank index (decode ranks report on their own); otherwise calls are request/answer.
    """

    def __init__(
        self,
        index: int,
        init: dict[str, Any],
        events: queue.Queue[tuple[int, dict[str, Any] | None]] | None = None,
    ) -> None:
        self.index = index
        self.init = init
        self.proc = spawn("kvwire.demo.worker")
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._out = FrameWriter(self.proc.stdin)
        self._in = self.proc.stdout
        self._out.send(init)
        hello = self._read()
        if not hello.get("ok"):
            self.kill()
            raise RankError(f"rank {index} failed to start: {hello.get('error', 'no answer')}")
        self.payload: bytes = hello["payload"]
        self.pid: int = hello["pid"]
        self._reader: threading.Thread | None = None
        if events is not None:
            self._reader = threading.Thread(
                target=self._forward, args=(events,), name=f"demo-rank-{index}", daemon=True
            )
            self._reader.start()

    def _read(self) -> dict[str, Any]:
        msg = read_frame(self._in)
        if msg is None:
            code = self.proc.poll()
            raise RankError(f"rank {self.index} (pid {self.proc.pid}) exited, status {code}")
        return msg

    def _forward(self, events: queue.Queue[tuple[int, dict[str, Any] | None]]) -> None:
        try:
            while True:
                msg = read_frame(self._in)
                events.put((self.index, msg))
                if msg is None:
                    return
        except (OSError, ValueError, KVWireError):
            events.put((self.index, None))

    def send(self, message: dict[str, Any]) -> None:
        try:
            self._out.send(message)
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise RankError(f"rank {self.index} is gone: {exc}") from None

    def answer(self) -> dict[str, Any]:
        """The next answer frame; an error answer raises."""
        msg = self._read()
        if not msg.get("ok", True):
            raise RankError(f"rank {self.index}: {msg.get('error')}")
        return msg

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        self.send(message)
        return self.answer()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crashed worker: no cleanup runs in the child."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        close_pipes(self.proc)

    def close(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self._out.send({"op": "exit"})
            wait_or_kill(self.proc, timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        close_pipes(self.proc)
