"""The in-flight revocation cases, for ``revocation_probe.py --in-flight`` (a command).

P in one network namespace, D in the other, UCX on TCP over the veth with peer error
handling, P's egress throttled so a 4 MiB READ takes about two seconds; D posts the READ,
the probe checks it is still running, P revokes and writes another pattern over the
memory, and D waits for the READ. What the READ then reports is how NIXL and UCX resolve a
race between P's worker and the link, not a kvwire guarantee, so it is measured by the
command (docs/reliability.md section 2.1), never asserted by a test. kvwire's own
guarantee (no request done with reused bytes under its lease rules) is what
tests/netns/test_netns_stale.py and tests/runtime/test_runtime_stale_read.py assert.
"""

from __future__ import annotations

import subprocess

from netns_fixtures import NetnsPair
from revocation_probe import Case, InFlight

SLOW_RATE = "16mbit"
"""4 MiB take about two seconds: P acts well inside the READ."""

CASES = [Case(t, "tcp", m) for t in ("nixl", "ucx") for m in ("deregister", "remove_peer", "unmap")]

CASES = [Case(t, "tcp", m) for t in ("nixl", "ucx") for m in ("deregister", "remove_peer", "unmap")]


def in_flight(pair: NetnsPair) -> InFlight:
    def slow(on: bool) -> None:
        ns = pair.a
        tail = ["tbf", "rate", SLOW_RATE, "burst", "64kb", "latency", "100ms"] if on else []
        argv = ["tc", "-n", ns.name, "qdisc", "add" if on else "del", "dev", ns.device, "root"]
        subprocess.run([*argv, *tail], check=True, capture_output=True, timeout=30)

    return InFlight(
        p_prefix=pair.a.exec_argv([]),
        d_prefix=pair.b.exec_argv([]),
        p_env=pair.a.ucx_env(),
        d_env=pair.b.ucx_env(),
        slow=slow,
    )
