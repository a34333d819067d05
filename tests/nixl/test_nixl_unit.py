"""Parts of the NIXL adapter that need no agent: loading, options, errors, descriptors."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvwire_nixl import _loader
from kvwire_nixl._descs import prepare
from kvwire_nixl._errors import status_of, translate
from kvwire_nixl._options import parse_options
from kvwire_nixl._progress import POST_SKIPS, ProgressThread

from kvwire.errors import (
    ConfigError,
    DescriptorError,
    PeerMetadataError,
    TransportUnavailableError,
)
from kvwire.layout import coalesce
from kvwire.transport import load


def test_importing_the_adapter_does_not_import_nixl() -> None:
    code = (
        "import sys, kvwire_nixl, kvwire.transport as t; t.load('nixl');"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('nixl', 'nixl_cu12', 'nixl_cu13', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_an_agent_process_exits_cleanly() -> None:
    """Creating and closing an agent, then exiting, must not crash the process (UCX's
    InfiniBand modules with the system's rdma-core beside the wheel's did, at exit)."""
    code = (
        "import os; os.environ.setdefault('UCX_NET_DEVICES', 'lo');"
        "from kvwire_nixl import NixlTransport;"
        "NixlTransport('kvwire-test-exit').close(); print('closed')"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert (out.returncode, out.stdout.strip()) == (0, "closed"), out.stderr[-2000:]


def test_ib_modules_are_skipped_only_without_rdma_devices(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("UCX_MODULES", raising=False)
    assert _loader.skip_unusable_ib_modules(str(tmp_path / "absent")) is True
    assert os.environ["UCX_MODULES"] == "^ib*"
    monkeypatch.setenv("UCX_MODULES", "ib,cma")  # the user's choice stands
    assert _loader.skip_unusable_ib_modules(str(tmp_path / "absent")) is False
    assert os.environ["UCX_MODULES"] == "ib,cma"
    monkeypatch.delenv("UCX_MODULES")
    assert _loader.skip_unusable_ib_modules(str(tmp_path)) is False  # a device directory
    assert "UCX_MODULES" not in os.environ


def test_entry_point_names_the_factory() -> None:
    from kvwire_nixl import NixlTransport

    assert load("nixl") is NixlTransport


def test_missing_binding_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_loader, "_cached", None)
    monkeypatch.setattr(_loader, "CANDIDATES", ("kvwire_test_no_such_nixl",))
    with pytest.raises(TransportUnavailableError, match=r"pip install 'kvwire\[nixl\]'"):
        _loader.load_nixl()
    from kvwire_nixl import NixlTransport

    with pytest.raises(TransportUnavailableError, match="kvwire_test_no_such_nixl"):
        NixlTransport("agent-without-nixl")


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"backend_opts": {}}, "unknown nixl transport option"),
        ({"progress": "spin"}, "progress must be one of"),
        ({"telemetry": "maybe"}, "telemetry"),
        ({"cache_size": "many"}, "cache_size"),
        ({"progress_min_us": 500, "progress_max_us": 10}, "progress_min_us"),
        ({"backend": ""}, "backend"),
        ({"backend_options": ["ucx"]}, "backend_options"),
    ],
)
def test_bad_options_are_config_errors(options: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_options(options)


def test_options_from_a_command_line_are_converted() -> None:
    opts = parse_options(
        {"telemetry": "true", "cache_size": "8", "backend_options": {"num_workers": 2}}
    )
    assert opts.telemetry is True and opts.cache_size == 8
    assert opts.effective_backend_options == {
        "ucx_error_handling_mode": "none",
        "num_workers": "2",
    }
    assert parse_options({"backend": "POSIX"}).effective_backend_options == {}


def test_status_names_come_from_nixl_exceptions() -> None:
    class nixlNotFoundError(Exception):  # mimics the binding's class name
        pass

    class nixlRemoteDisconnectError(Exception):
        pass

    assert status_of(nixlNotFoundError("NIXL_ERR_NOT_FOUND")) == "NIXL_ERR_NOT_FOUND"
    assert status_of(nixlRemoteDisconnectError("")) == "NIXL_ERR_REMOTE_DISCONNECT"
    assert status_of(ValueError("bad")) is None
    err = translate(nixlNotFoundError("NIXL_ERR_NOT_FOUND"), PeerMetadataError, "loading")
    assert isinstance(err, PeerMetadataError)
    assert err.status == "NIXL_ERR_NOT_FOUND" and "loading failed" in str(err)


def _naive_coalesce(local: np.ndarray, remote: np.ndarray) -> list[list[int]]:
    rows: list[list[int]] = []
    for (la, ln, ld), (ra, _, rd) in zip(local.tolist(), remote.tolist(), strict=True):
        if rows:
            pla, pln, pld, pra, prd = rows[-1]
            if pla + pln == la and pra + pln == ra and pld == ld and prd == rd:
                rows[-1][1] += ln
                continue
        rows.append([la, ln, ld, ra, rd])
    return rows


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 64), st.booleans(), st.booleans(), st.integers(0, 1)),
        min_size=0,
        max_size=40,
    )
)
def test_coalesce_merges_exactly_the_runs_adjacent_on_both_sides(
    spec: list[tuple[int, bool, bool, int]],
) -> None:
    local, remote = [], []
    laddr, raddr = 4096, 1 << 20
    for length, lgap, rgap, device in spec:
        laddr += 8 if lgap else 0
        raddr += 8 if rgap else 0
        local.append((laddr, length, 0))
        remote.append((raddr, length, device))
        laddr += length
        raddr += length
    loc = np.array(local, dtype=np.int64).reshape(-1, 3)
    rem = np.array(remote, dtype=np.int64).reshape(-1, 3)
    merged_l, merged_r = coalesce(loc, rem)
    expected = _naive_coalesce(loc, rem)
    got = [[*a, b[0], b[2]] for a, b in zip(merged_l.tolist(), merged_r.tolist(), strict=True)]
    assert got == expected
    assert np.array_equal(merged_l[:, 1], merged_r[:, 1])
    assert int(merged_l[:, 1].sum()) == int(loc[:, 1].sum())


def test_prepare_rejects_what_cannot_pair_up() -> None:
    good = np.array([[0, 8, 0]], dtype=np.int64)
    with pytest.raises(DescriptorError):
        prepare(good, np.array([[0, 16, 0]], dtype=np.int64))
    with pytest.raises(DescriptorError):
        prepare(good[:, :2], good[:, :2])


def _run_until(thread: ProgressThread, rounds: int) -> None:
    thread.start()
    deadline = time.monotonic() + 30
    while thread.rounds < rounds and time.monotonic() < deadline:
        time.sleep(0.001)
    thread.stop()


def test_progress_thread_runs_every_turn_for_an_idle_owner() -> None:
    calls: list[int] = []

    def progress() -> bool:
        calls.append(1)
        return False  # nothing happened: the idle case

    thread = ProgressThread("idle", progress, lambda: 0.0, min_s=1e-4, max_s=1e-4)
    _run_until(thread, 5)
    assert thread.rounds >= 5 and thread.skipped == 0 and len(calls) == thread.rounds


def test_progress_thread_yields_to_a_posting_owner_but_never_starves() -> None:
    posted = itertools.count()  # the owner posts between every two turns
    thread = ProgressThread(
        "busy", lambda: False, lambda: 0.0, min_s=1e-4, max_s=1e-4, posts=lambda: next(posted)
    )
    _run_until(thread, 4)
    # every round comes after exactly POST_SKIPS skipped turns (the last may be cut short)
    assert thread.rounds >= 4
    assert POST_SKIPS * thread.rounds <= thread.skipped <= POST_SKIPS * (thread.rounds + 1)
