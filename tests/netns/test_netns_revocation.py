"""A READ already in flight when P revokes and reuses its memory (issue 18), across a link.

The in-flight half of :mod:`revocation_probe` (tests/transport): P in one namespace, D in
the other, UCX on TCP over the veth with peer error handling, P's egress throttled so a
4 MiB READ takes about two seconds; D posts the READ, the probe checks it is still running,
P revokes and writes another pattern over the memory, and D waits for the READ. The
expectations are the measured table of docs/reliability.md section 2.1.
"""

from __future__ import annotations

import subprocess

import pytest
from netns_fixtures import NetnsPair
from revocation_probe import Case, InFlight, run_case

pytestmark = pytest.mark.slow

SLOW_RATE = "16mbit"
"""4 MiB take about two seconds: P acts well inside the READ."""

CASES = [Case(t, "tcp", m) for t in ("nixl", "ucx") for m in ("deregister", "remove_peer", "unmap")]

REUSED = "done with reused bytes"
"""``done:other`` (a mix: the part already in P's socket buffer is old, 30-43% measured) or
``done:new``; which depends on the kernel's send buffer, what matters is that it is done."""

ENDED_WITH_P = "failed, or unanswered as P died"
"""After ``munmap`` P dies of SIGSEGV while serving the READ; whether D's failed READ is
reported before the probe sees P gone is a race (both seen here). Either way it is not done."""

EXPECTED: dict[str, tuple[str, str, str]] = {
    "nixl/tcp/deregister": (REUSED, "done:new", "alive"),
    "nixl/tcp/remove_peer": (REUSED, "done:new", "alive"),
    "nixl/tcp/unmap": (ENDED_WITH_P, "n/a (P's memory is gone)", "P died: signal SIGSEGV"),
    "ucx/tcp/deregister": (REUSED, "done:new", "alive"),
    "ucx/tcp/remove_peer": ("failed", "failed", "alive"),
    "ucx/tcp/unmap": (ENDED_WITH_P, "n/a (P's memory is gone)", "P died: signal SIGSEGV"),
}


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


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.label)
def test_a_read_in_flight_when_the_producer_revokes_and_reuses(
    netns_pair: NetnsPair, case: Case
) -> None:
    result = run_case(case, 30.0, in_flight=in_flight(netns_pair))
    in_flight_read = result.after_revoke
    if in_flight_read in ("done:other", "done:new"):
        in_flight_read = REUSED
    if case.method == "unmap" and in_flight_read in ("failed", "no answer (a process died)"):
        in_flight_read = ENDED_WITH_P
    observed = (in_flight_read, result.after_reuse, result.p)
    assert observed == EXPECTED[case.label], result.row()
