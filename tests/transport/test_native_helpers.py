"""The transports' optional C helpers: built where a compiler is, byte-exact, and the pure
paths they replace still pass the transports' own tests with the helpers turned off."""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from kvwire_shm import _cma, _memcopy
from kvwire_shm._cma import IOV_MAX, CmaError
from kvwire_shm._native_load import NATIVE as SHM_NATIVE
from kvwire_ucx._native_load import NATIVE as UCX_NATIVE

ROOT = Path(__file__).resolve().parents[2]
DISABLED = os.environ.get("KVWIRE_NO_NATIVE", "") not in ("", "0")


def _compiler() -> str | None:
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    return shutil.which(cc[0])


def test_the_helpers_are_loaded_wherever_they_can_be_built() -> None:
    if DISABLED or _compiler() is None:  # the pure path, which the subprocess test covers
        assert SHM_NATIVE is None and UCX_NATIVE is None
    else:
        assert SHM_NATIVE is not None, "kvwire_shm._native did not build or load"
        assert UCX_NATIVE is not None, "kvwire_ucx._native did not build or load"


needs_shm = pytest.mark.skipif(SHM_NATIVE is None, reason="kvwire_shm._native is off here")


def _layout(rng: np.random.Generator, lengths: np.ndarray) -> np.ndarray:
    """Non-overlapping offsets for spans of ``lengths``, in shuffled order, with gaps."""
    slots = lengths + rng.integers(0, 64, lengths.shape[0])
    order = rng.permutation(lengths.shape[0])
    starts = np.zeros(lengths.shape[0], dtype=np.int64)
    starts[order] = np.concatenate(([0], np.cumsum(slots[order])[:-1]))
    return starts


def _spans(buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    return [
        buf[o : o + n].tobytes() for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)
    ]


@needs_shm
@pytest.mark.parametrize(
    "nt_from", [-1, 0, 4096], ids=["plain", "all-streaming", "streaming-from-4k"]
)
def test_native_copy_moves_every_span_and_nothing_else(nt_from: int) -> None:
    assert SHM_NATIVE is not None
    rng = np.random.default_rng(nt_from + 7)
    # Odd lengths and offsets: heads and tails around the 16-byte streaming stores.
    lengths = np.concatenate([rng.integers(1, 200, 50), rng.integers(4000, 200_000, 40)])
    lengths = lengths.astype(np.int64)
    src_at, dst_at = _layout(rng, lengths) + 3, _layout(rng, lengths) + 5
    total = int(lengths.sum()) + 64 * lengths.shape[0] + 16
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    SHM_NATIVE.copy(dst.ctypes.data + dst_at, src.ctypes.data + src_at, lengths, nt_from)
    assert _spans(dst, dst_at, lengths) == _spans(src, src_at, lengths)
    written = np.zeros(total, dtype=bool)
    for o, n in zip(dst_at.tolist(), lengths.tolist(), strict=True):
        written[o : o + n] = True
    assert not dst[~written].any(), "bytes outside the spans changed"


@needs_shm
def test_native_copy_takes_lists_and_keeps_memmove_semantics_for_overlap() -> None:
    assert SHM_NATIVE is not None
    buf = np.arange(100_000, dtype=np.uint8)
    want = buf.copy()
    want[10:90_010] = buf[0:90_000]
    base = int(buf.ctypes.data)
    SHM_NATIVE.copy([base + 10], [base], [90_000], 0)  # overlapping: never streamed
    assert np.array_equal(buf, want)


@needs_shm
def test_native_helpers_reject_bad_arrays() -> None:
    assert SHM_NATIVE is not None
    ok = np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError, match="negative"):
        SHM_NATIVE.copy(ok, ok, np.array([1, -1], dtype=np.int64), -1)
    with pytest.raises(ValueError, match="different lengths"):
        SHM_NATIVE.copy(ok, ok, np.zeros(3, dtype=np.int64), -1)
    with pytest.raises(TypeError, match="int64"):
        SHM_NATIVE.cma(os.getpid(), ok.astype(np.int32), ok, ok, False)


@needs_shm
@pytest.mark.parametrize("how", ["copy", "cma"])
def test_a_span_range_moves_those_spans_only(how: str) -> None:
    """A chunk names its spans by index in the plan's arrays; nothing outside moves."""
    assert SHM_NATIVE is not None
    lengths = np.full(10, 1000, dtype=np.int64)
    at = np.arange(10, dtype=np.int64) * 1000
    src = np.random.default_rng(3).integers(1, 256, 10_000, dtype=np.uint8)
    dst = np.zeros(10_000, dtype=np.uint8)
    d, s = dst.ctypes.data + at, src.ctypes.data + at
    if how == "copy":
        SHM_NATIVE.copy(d, s, lengths, -1, 3, 7)
    else:
        assert SHM_NATIVE.cma(os.getpid(), d, s, lengths, False, 3, 7) == 0
    assert np.array_equal(dst[3000:7000], src[3000:7000])
    assert not dst[:3000].any() and not dst[7000:].any()
    for first, last in ((-1, 4), (5, 4), (0, 11)):
        with pytest.raises(ValueError, match="span range"):
            SHM_NATIVE.copy(d, s, lengths, -1, first, last)
        with pytest.raises(ValueError, match="span range"):
            SHM_NATIVE.cma(os.getpid(), d, s, lengths, False, first, last)


@needs_shm
def test_native_cma_batches_past_iov_max_and_reports_errno() -> None:
    rng = np.random.default_rng(11)
    lengths = rng.integers(1, 9000, 3 * IOV_MAX + 5).astype(np.int64)
    src_at, dst_at = _layout(rng, lengths), _layout(rng, lengths)
    total = int(lengths.sum()) + 64 * lengths.shape[0]
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    chunks = _cma.native_chunks(
        os.getpid(), dst.ctypes.data + dst_at, src.ctypes.data + src_at, lengths, write=False
    )
    assert len(chunks) >= 3  # IOV_MAX rows at most per chunk
    for chunk in chunks:
        chunk()
    assert _spans(dst, dst_at, lengths) == _spans(src, src_at, lengths)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process now
    with pytest.raises(CmaError) as info:
        _cma.native_cma(child.pid, [int(dst.ctypes.data)], [int(src.ctypes.data)], [8], write=True)
    assert info.value.errno == errno.ESRCH


@needs_shm
def test_native_memcopy_chunks_stream_large_transfers_and_share_from_share_from() -> None:
    lengths = np.full(_memcopy.SHARE_FROM // (64 << 10), 64 << 10, dtype=np.int64)
    rng = np.random.default_rng(3)
    src_at, dst_at = _layout(rng, lengths), _layout(rng, lengths)
    total = int(lengths.sum()) + 64 * lengths.shape[0]
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    chunks, shared = _memcopy.native_chunks(
        dst.ctypes.data + dst_at, src.ctypes.data + src_at, lengths
    )
    assert shared and len(chunks) >= int(lengths.sum()) // _memcopy.CHUNK_BYTES
    for chunk in chunks[::-1]:  # any order
        chunk()
    assert _spans(dst, dst_at, lengths) == _spans(src, src_at, lengths)


@pytest.mark.slow
def test_the_transports_own_tests_pass_with_the_helpers_off() -> None:
    """The pure paths (ctypes memmove, numpy CMA iovecs, one ctypes call per UCX row) are
    what a machine without a compiler runs: the same tests, in a fresh interpreter."""
    env = dict(os.environ, KVWIRE_NO_NATIVE="1")
    tests = [
        "tests/transport/test_shm_unit.py",
        "tests/transport/test_shm_executor.py",
        "tests/ucx/test_ucx_local.py",
        "tests/transport/test_native_helpers.py::test_the_helpers_are_loaded_wherever_they_can_be_built",
    ]
    code = (
        "import sys, pytest\n"
        "import kvwire_shm.transport, kvwire_ucx.transport\n"
        "sys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', *sys.argv[1:]]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *tests],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    warnings = [line for line in proc.stderr.splitlines() if "native" in line and "off" in line]
    assert sorted(w.split(":")[0] for w in warnings) == ["kvwire_shm", "kvwire_ucx"], (
        f"want one warning line per transport, got {warnings}"
    )
