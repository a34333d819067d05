"""A free loopback port for a server started later, by another process or call."""

from __future__ import annotations

import os
import random
import socket
import threading

PORTS_VAR = "TEST_PORT_RANGE"
"""``LOW-HIGH``: the ports :func:`free_port` picks from (``make test`` gives each of the
suites it runs side by side a range of its own). Not a ``KVWIRE_`` name: kvwire's
configuration warns about ``KVWIRE_`` variables it does not know, in every process."""

_given: set[int] = set()
_lock = threading.Lock()


def free_port() -> int:
    """A free port for a listener another process binds later, never one this process
    handed out before.

    Below the kernel's ephemeral range by default: port 0's answer is an ephemeral port,
    which any outgoing connection (UCX, ZMQ, etcd clients) may take before that listener
    binds (a fresh ``make test`` once saw a stock engine's listener die of "Address already
    in use" that way). Between suites running side by side, a port one picked may be taken
    by the other's listener before it binds (seen once: a stock engine's listener died
    the same way, its test timing out); :data:`PORTS_VAR` gives each suite its own range.
    """
    low, high = _range()
    pick = random.SystemRandom()
    with _lock:
        for _ in range(400):
            port = pick.randrange(low, high)
            if port in _given:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _given.add(port)
            return port
    raise RuntimeError(f"no free port in [{low}, {high}) not handed out already")


def _range() -> tuple[int, int]:
    spec = os.environ.get(PORTS_VAR)
    if spec:
        try:
            low, high = (int(p) for p in spec.split("-"))
        except ValueError:
            raise ValueError(f"{PORTS_VAR} must be LOW-HIGH, got {spec!r}") from None
        if not 1024 <= low < high <= 65536:
            raise ValueError(f"{PORTS_VAR} must be LOW-HIGH within [1024, 65536], got {spec!r}")
        return low, high
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            ephemeral_low = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    return max(1024, ephemeral_low - 16384), ephemeral_low
