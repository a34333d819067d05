"""A handshake listener alone in a process, so its memory and sockets can be measured.

Started by test_listener_hostile.py as ``python listener_proc.py CONFIG_JSON``. Prints one
JSON line with the port, then answers each line on stdin: ``stats`` with the listener's
counters, its process's RSS, open file descriptors and Python allocations (tracemalloc);
``quit`` to exit.
"""

from __future__ import annotations

import json
import os
import sys
import tracemalloc
from dataclasses import asdict

from kvwire.sidechannel import HandshakeListener, ListenerLimits, RateLimit


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def _limits(config: dict[str, object]) -> ListenerLimits:
    raw = dict(config.get("limits", {}))  # type: ignore[call-overload]
    for name in ("per_peer", "total"):
        if name in raw:
            raw[name] = RateLimit(*raw[name]) if raw[name] is not None else None
    return ListenerLimits(**raw)


def main() -> int:
    config = json.loads(sys.argv[1])
    payloads = {(0, r): os.urandom(int(config.get("payload_bytes", 8192))) for r in range(4)}
    secret = bytes.fromhex(config["secret"]) if config.get("secret") else None
    tracemalloc.start()
    with HandshakeListener(payloads, limits=_limits(config), secret=secret) as listener:
        print(json.dumps({"port": listener.port}), flush=True)
        for line in sys.stdin:
            if line.strip() == "quit":
                break
            current, peak = tracemalloc.get_traced_memory()
            stats = asdict(listener.stats())
            stats.update(
                running=listener.running,
                rss_kib=_rss_kib(),
                fds=len(os.listdir("/proc/self/fd")),
                py_current=current,
                py_peak=peak,
            )
            print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
