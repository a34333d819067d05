"""A ucx agent in its own process, driven line by line over stdin/stdout (JSON).

Tests start it with ``subprocess`` so the two sides of a transfer really live in different
processes (CMA / shared memory / TCP, never UCX's in-process ``self`` transport). It owns
one buffer filled with a known pattern and answers commands; it never initiates transfers.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
import time

# UCX logs to stdout by default, which is this script's reply channel.
os.environ.setdefault("UCX_LOG_FILE", "/dev/stderr")

import numpy as np
from kvwire_ucx import UcxTransport

from kvwire.transport import region_of_array


def pattern(size: int, seed: int) -> np.ndarray:
    return ((np.arange(size, dtype=np.int64) * 31 + seed) % 251).astype(np.uint8)


def main() -> int:
    name, size, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    buf = pattern(size, seed)
    agent = UcxTransport(name, **options)
    agent.register([region_of_array(buf)])

    def reply(**fields: object) -> None:
        sys.stdout.write(json.dumps(fields) + "\n")
        sys.stdout.flush()

    reply(meta=base64.b64encode(agent.local_metadata()).decode(), addr=int(buf.ctypes.data))
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["cmd"]
        if op == "add_peer":
            reply(peer=agent.add_peer(base64.b64decode(cmd["meta"])))
        elif op == "digest":
            start, length = cmd["offset"], cmd["length"]
            reply(digest=hashlib.sha256(buf[start : start + length].tobytes()).hexdigest())
        elif op == "notifs":
            got: list[list[str]] = []
            deadline = time.monotonic() + cmd.get("timeout", 30.0)
            while len(got) < cmd["count"] and time.monotonic() < deadline:
                agent.wait(0.05)
                got.extend([peer, msg.decode()] for peer, msg in agent.drain_notifications())
            reply(notifs=got)
        elif op == "notify":
            agent.notify(cmd["peer"], cmd["message"].encode())
            reply(ok=True)
        elif op == "exit":
            agent.close()
            reply(ok=True)
            return 0
        else:
            reply(error=f"unknown command {op}")
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
