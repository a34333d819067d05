"""What each transport lets a producer revoke before it reuses expired blocks (issue 18).

Each case runs :mod:`revocation_probe` in two fresh processes with the real libraries and
asserts the outcome measured when docs/reliability.md section 2.1 ("What a transport can
revoke") was written: the table there is this test's expectations. A case that starts to
behave differently (a new UCX or NIXL that invalidates on deregistration, say) fails here,
and the table and the decision not to build a revocation hook must be revisited.

READs already in flight when P acts: tests/netns/test_netns_revocation.py.
"""

from __future__ import annotations

import pytest
from revocation_probe import CASES, GONE, Case, run_case

pytestmark = pytest.mark.slow

NOT_DONE = "not done"
"""A READ that did not report done within the probe's wait: ``failed``, or ``pending``
(which one depends on how soon UCX's keepalive sees the closed endpoint, ~20 s here)."""

EXPECTED: dict[str, tuple[str, str]] = {
    # shm, memory from kvwire_shm.allocate: D has P's memfd mapped, P cannot take it back.
    "shm/mapped/deregister": ("done:old", "done:new"),
    "shm/mapped/remove_peer": ("done:old", "done:new"),
    "shm/mapped/punch_hole": ("done:zeros", "done:new"),
    "shm/mapped/remap": ("done:old", "done:old"),
    # shm, other host memory: D's process_vm_readv reads P's address space as it is now.
    "shm/cma/deregister": ("done:old", "done:new"),
    "shm/cma/remove_peer": ("done:old", "done:new"),
    "shm/cma/mprotect": ("failed", "done:new"),
    "shm/cma/unmap": ("failed", GONE),
    # nixl and ucx: deregistering leaves the memory readable; only unmapping it fails a
    # READ: on one host P lives, over TCP P's worker copies from the bad address and P
    # dies (below).
    **{
        f"{transport}/{path}/{method}": outcome
        for transport in ("nixl", "ucx")
        for path in ("tcp", "same-host")
        for method, outcome in {
            "deregister": ("done:old", "done:new"),
            "remove_peer": ("done:old", "done:new"),
            "unmap": ("failed", GONE),
        }.items()
    },
    # kvwire's ucx transport closes its endpoint to D at remove_peer; over TCP that is the
    # connection D's GETs are served on: they fail (~20 s, when UCX's keepalive notices).
    "ucx/tcp/remove_peer": (NOT_DONE, NOT_DONE),
}


SEGFAULTED = {"nixl/tcp/unmap", "ucx/tcp/unmap", "nixl/tcp/unmap/4KiB", "ucx/tcp/unmap/4KiB"}
"""Over TCP P's own worker serves a GET: from unmapped memory it kills P (D's READ fails
because P is gone), on UCX's zero-copy (4 MiB) and copy (4 KiB) paths alike."""
EXPECTED.update({label: ("failed", GONE) for label in SEGFAULTED})


def _outcome(observed: str, expected: str) -> str:
    return NOT_DONE if expected == NOT_DONE and observed in ("failed", "pending") else observed


def test_every_case_has_an_expectation() -> None:
    assert sorted(EXPECTED) == sorted(case.label for case in CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.label)
def test_what_a_read_observes_after_the_producer_revokes(case: Case) -> None:
    result = run_case(case)
    want_revoked, want_reused = EXPECTED[case.label]
    want_p = "P died: signal SIGSEGV" if case.label in SEGFAULTED else "alive"
    assert result.p == want_p, result.row()
    assert _outcome(result.after_revoke, want_revoked) == want_revoked, result.row()
    assert _outcome(result.after_reuse, want_reused) == want_reused, result.row()
