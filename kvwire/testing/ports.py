"""A free loopback port for a server started later, by another process or call."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A free port below the kernel's ephemeral range, for a listener another process
    binds later. Port 0's answer is an ephemeral port, which any outgoing connection
    (UCX, ZMQ, etcd clients) may take before that listener binds: a fresh ``make test``
    once saw a stock engine's listener die of "Address already in use" that way."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            ephemeral_low = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    pick = random.SystemRandom()
    for _ in range(200):
        port = pick.randrange(max(1024, ephemeral_low - 16384), ephemeral_low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {ephemeral_low}")
