"""What a READ observes when the producer tries to revoke the consumer's access first.

Issue 18 asks whether P, at a lease expiry, can revoke D's access to the expired blocks
before it reuses them, per transport. This probe measures it with the real libraries: P and
D are two fresh interpreters (this file run with ``--child``), commanded over a socketpair
with JSON lines (stdout stays free for what NIXL and UCX print). Per case:

1. P registers a region filled with pattern A; D adds P and READs it (must be ``done:old``,
   else the case measures nothing);
2. P applies the revocation (the case's ``method``);
3. D posts a READ of the same span ("after revocation", before any reuse);
4. P reuses the memory: writes pattern B over it (skipped where P's memory is gone);
5. D posts a READ again ("after reuse").

Each READ is reported as ``failed``, ``pending`` (still running after the wait: a hang),
``done:old`` (pattern A), ``done:new`` (B: another request's KV), ``done:zeros``,
``done:untouched`` (D's sentinel: reported done, nothing moved) or ``done:other`` (a mix of
A and B: ``--why`` shows the fractions); P's death (a signal) is reported as ``P died:
<signal>``. With ``--in-flight`` (root: two network
namespaces, tests/netns/revocation_in_flight.py) the READ of step 3 is posted before P
revokes and reuses, over a throttled link, and waited for afterwards.

Run ``python tests/transport/revocation_probe.py --why`` for the whole table (about two
minutes), ``--in-flight --why`` for the in-flight one.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

NBYTES = 4 << 20
"""One span of 4 MiB: a few KV blocks, large enough for UCX's zero-copy protocols."""
SEED_OLD, SEED_NEW = 1, 2
SENTINEL = 0xEE
READ_WAIT_S = 5.0
"""How long D waits for a READ before calling it a hang (a healthy one takes milliseconds)."""
STEP_TIMEOUT_S = 60.0
GONE = "n/a (P's memory is gone)"
"""No READ after reuse where the revocation unmapped P's memory: there is nothing to reuse."""

TCP_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
"""The network path, as between two hosts: a GET is then served by P's UCX worker."""
SAME_HOST_ENV = {"UCX_NET_DEVICES": "lo"}
"""UCX's own choice on one host, with the adapters' default error handling (peer error
handling would rule out UCX's shared-memory transports)."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value


def _pattern(seed: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _view(addr: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _raw_mmap(nbytes: int, flags: int, addr: int | None = None) -> int:
    got = _libc.mmap(addr, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if got in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap")
    return int(got)


# -- the child: one agent of a transport, commanded by the parent ------------------------


class _Child:
    def __init__(self) -> None:
        self.t: Any = None
        self.array: Any = None  # keeps numpy / shm memory alive
        self.addr = 0
        self.handle: object = None
        self.peer = ""
        self.xfer: object = None
        self.start = 0.0
        self.protected = False
        self.n = NBYTES

    def handle_cmd(self, cmd: dict[str, Any]) -> Any:
        op = cmd["op"]
        if op == "init":
            self.n = cmd["nbytes"]
            return self._init(cmd["transport"], cmd["options"], cmd["allocator"], cmd["seed"])
        if op == "add_peer":
            self.peer = self.t.add_peer(bytes.fromhex(cmd["blob"]))
            return self.peer
        if op == "read":
            return self._read(cmd["remote"], cmd["wait_s"])
        if op == "post":
            return self._post(cmd["remote"])
        if op == "poll":
            return str(self.t.poll(self.xfer).value.lower())
        if op == "finish":
            return self._finish(cmd["wait_s"])
        if op == "revoke":
            self._revoke(cmd["method"])
            return None
        if op == "fill":
            if self.protected:  # reuse: P writes into its memory again
                rw = mmap.PROT_READ | mmap.PROT_WRITE
                _check(_libc.mprotect(self.addr, self.n, rw), "mprotect")
            _view(self.addr, self.n)[:] = _pattern(cmd["seed"], self.n)
            return None
        if op == "ping":  # P's worker has served (or failed) D's READs and is still here
            return os.getpid()
        if op == "close":
            self.t.close()
            return None
        raise ValueError(op)

    def _init(self, transport: str, options: dict[str, Any], allocator: str, seed: int) -> Any:
        from kvwire.transport import Region, create

        self.t = create(transport, f"revoke-{transport}-{os.getpid()}", **options)
        if allocator == "shm":
            from kvwire_shm import allocate

            self.array = allocate(self.n)
            self.addr = int(self.array.ctypes.data)
        elif allocator == "mmap":
            self.addr = _raw_mmap(self.n, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            self.array = np.zeros(self.n, dtype=np.uint8)
            self.addr = int(self.array.ctypes.data)
        if seed:
            _view(self.addr, self.n)[:] = _pattern(seed, self.n)
        self.handle = self.t.register([Region(self.addr, self.n)])
        return {"blob": self.t.local_metadata().hex(), "addr": self.addr, "pid": os.getpid()}

    def _read(self, remote: int, wait_s: float) -> dict[str, Any]:
        posted = self._post(remote)
        return posted if posted is not None else self._finish(wait_s)

    def _post(self, remote: int) -> dict[str, Any] | None:
        """Post a READ of P's span into ours (filled with the sentinel); a failure to post
        is the READ's outcome."""
        local = _view(self.addr, self.n)
        local[:] = SENTINEL
        descs = (np.array([[self.addr, self.n, 0]]), np.array([[remote, self.n, 0]]))
        self.start = time.monotonic()
        try:
            self.xfer = self.t.read(self.peer, descs[0].astype(np.int64), descs[1].astype(np.int64))
        except Exception as exc:
            return {"state": "failed", "why": f"post: {type(exc).__name__}: {exc}", "took": 0.0}
        return None

    def _finish(self, wait_s: float) -> dict[str, Any]:
        from kvwire.transport import XferState

        deadline = time.monotonic() + wait_s
        state = self.t.poll(self.xfer)
        while state is XferState.PENDING and time.monotonic() < deadline:
            self.t.wait(0.05)
            state = self.t.poll(self.xfer)
        why = ""
        if state is XferState.FAILED and hasattr(self.t, "failure_reason"):
            why = str(self.t.failure_reason(self.xfer))
        try:
            self.t.release(self.xfer)
        except Exception as exc:
            why += f" (release: {type(exc).__name__})"
        took = time.monotonic() - self.start
        got = _view(self.addr, self.n)
        mix = [float((got == _pattern(seed, self.n)).mean()) for seed in (SEED_OLD, SEED_NEW)]
        reply = {"state": state.value.lower(), "why": why, "took": took, "mix": mix}
        return {**reply, "crc": zlib.crc32(got.tobytes())}

    def _revoke(self, method: str) -> None:
        if method == "deregister":
            self.t.deregister(self.handle)
        elif method == "remove_peer":
            self.t.remove_peer(self.peer)
        elif method == "unmap":
            self.t.deregister(self.handle)
            _check(_libc.munmap(self.addr, self.n), "munmap")
        elif method == "punch_hole":
            from kvwire_shm._segments import segment_of

            seg = segment_of(self.addr, self.n)
            assert seg is not None, "punch_hole needs memory from kvwire_shm.allocate"
            flags = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
            _check(_libc.fallocate(seg.fd, flags, self.addr - seg.base, self.n), "fallocate")
        elif method == "remap":
            # P's own range gets fresh private pages; a peer's mapping keeps the old ones.
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10  # MAP_FIXED
            assert _raw_mmap(self.n, flags, self.addr) == self.addr
        elif method == "mprotect":
            _check(_libc.mprotect(self.addr, self.n, 0), "mprotect")
            self.protected = True
        else:
            raise ValueError(method)

    def serve(self, chan: socket.socket) -> None:
        buf = b""
        while True:
            # Between commands the agent is progressed: on UCX's TCP path P's worker serves
            # D's GETs, and an agent nobody calls into might serve nothing.
            ready, _, _ = select.select([chan], [], [], 0 if self.t is None else 0.005)
            if not ready:
                if self.t is not None:
                    self.t.wait(0.01)
                continue
            data = chan.recv(1 << 20)
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd = json.loads(line)
                try:
                    reply = {"ok": self.handle_cmd(cmd)}
                except Exception as exc:
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                chan.sendall(json.dumps(reply).encode() + b"\n")
                if cmd["op"] == "close":
                    return


# -- the parent: one case, both sides ------------------------------------------------------


class _Proc:
    def __init__(self, env: Mapping[str, str], prefix: Sequence[str] = ()) -> None:
        ours, theirs = socket.socketpair()
        self.chan = ours
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, __file__, "--child", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env={**os.environ, **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        theirs.close()
        self.buf = b""

    def call(self, **cmd: Any) -> Any:
        try:
            self.chan.sendall(json.dumps(cmd).encode() + b"\n")
        except OSError:
            raise _Died(self.death()) from None
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while b"\n" not in self.buf:
            self.chan.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.chan.recv(1 << 20)
            except TimeoutError:
                raise _Stuck(cmd["op"]) from None
            if not data:
                raise _Died(self.death())
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{cmd['op']}: {reply['error']}")
        return reply["ok"]

    def death(self) -> str:
        try:
            rc = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "alive"
        return f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"

    def stop(self) -> None:
        self.chan.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Died(Exception):
    pass


class _Stuck(Exception):
    pass


@dataclass(frozen=True)
class Case:
    transport: str
    path: str
    """``tcp`` (UCX's network path, as across hosts), ``same-host`` (UCX's own choice) or,
    for shm, how P's memory is reached: ``mapped`` (memfd) or ``cma`` (process_vm_readv)."""
    method: str
    nbytes: int = NBYTES

    @property
    def label(self) -> str:
        size = "" if self.nbytes == NBYTES else f"/{self.nbytes >> 10}KiB"
        return f"{self.transport}/{self.path}/{self.method}{size}"


@dataclass
class Result:
    case: Case
    after_revoke: str
    after_reuse: str
    p: str

    def row(self) -> str:
        return f"| {self.case.label} | {self.after_revoke} | {self.after_reuse} | {self.p} |"


_PEER_ERRORS: dict[str, dict[str, Any]] = {
    "nixl": {"backend_options": {"ucx_error_handling_mode": "peer"}},
    "ucx": {"error_handling": "peer"},
    "shm": {},
}


def _env(case: Case) -> dict[str, str]:
    if case.transport == "shm":
        return {}
    return TCP_ENV if case.path == "tcp" else SAME_HOST_ENV


def _allocator(case: Case) -> str:
    if case.method in ("unmap", "mprotect"):
        return "mmap"  # whole pages of P's own
    if case.transport == "shm":
        return "shm" if case.path == "mapped" else "numpy"
    return "numpy"


def _classify(reply: dict[str, Any], crcs: dict[int, str], verbose: bool) -> str:
    if reply["state"] == "pending" and verbose:
        return "pending (" + crcs.get(reply["crc"], "other") + " in D's buffer)"
    if reply["state"] == "failed" and verbose:
        return f"failed after {reply['took']:.1f} s ({reply['why'].strip()[:160]})"
    if reply["state"] != "done":
        return str(reply["state"])
    what = crcs.get(reply["crc"], "other")
    if what == "other" and verbose:  # bytes equal to A's, to B's (1/256 agree by chance)
        old, new = reply["mix"]
        what += f" ({old:.0%} old, {new:.0%} new)"
    return "done:" + what


@dataclass(frozen=True)
class InFlight:
    """Where the in-flight variant runs: P and D each behind an argv prefix (``ip netns
    exec``), with their environments, and ``slow(on)`` throttling P's egress so a READ is
    still running when P acts."""

    p_prefix: Sequence[str]
    d_prefix: Sequence[str]
    p_env: Mapping[str, str]
    d_env: Mapping[str, str]
    slow: Callable[[bool], None]


def run_case(
    case: Case,
    wait_s: float = READ_WAIT_S,
    *,
    verbose: bool = False,
    in_flight: InFlight | None = None,
) -> Result:
    """Run one case in two fresh processes; every outcome, a death included, is a result.

    With ``in_flight``, "after revocation" is a READ posted before P revokes and reuses
    (and checked to be still running when P starts), waited for afterwards.
    """
    if in_flight is None:
        env = _env(case)
        p, d = _Proc(env), _Proc(env)
    else:
        p = _Proc(in_flight.p_env, in_flight.p_prefix)
        d = _Proc(in_flight.d_env, in_flight.d_prefix)
    slowed = False
    n = case.nbytes
    crcs = {
        zlib.crc32(_pattern(SEED_OLD, n).tobytes()): "old",
        zlib.crc32(_pattern(SEED_NEW, n).tobytes()): "new",
        zlib.crc32(bytes(n)): "zeros",
        zlib.crc32(bytes([SENTINEL]) * n): "untouched",
    }
    after_revoke = after_reuse = "not run"
    try:
        peer_errors = _PEER_ERRORS[case.transport] if case.path == "tcp" else {}
        init: dict[str, Any] = {"op": "init", "transport": case.transport}
        init["options"] = peer_errors
        init["nbytes"] = case.nbytes
        p_info = p.call(**init, allocator=_allocator(case), seed=SEED_OLD)
        d_info = d.call(**init, allocator="numpy", seed=0)
        d.call(op="add_peer", blob=p_info["blob"])
        if case.method == "remove_peer":
            p.call(op="add_peer", blob=d_info["blob"])

        def read() -> str:
            reply = d.call(op="read", remote=p_info["addr"], wait_s=wait_s)
            return _classify(reply, crcs, verbose)

        baseline = read()
        if baseline != "done:old":
            raise RuntimeError(f"{case.label}: the healthy READ gave {baseline}")
        if in_flight is None:
            p.call(op="revoke", method=case.method)
            after_revoke = read()
            if case.method != "unmap":
                p.call(op="fill", seed=SEED_NEW)
        else:
            in_flight.slow(True)
            slowed = True
            failed_post = d.call(op="post", remote=p_info["addr"])
            if failed_post is not None or d.call(op="poll") != "pending":
                raise RuntimeError(f"{case.label}: the READ was not in flight ({failed_post})")
            p.call(op="revoke", method=case.method)
            if case.method != "unmap":
                p.call(op="fill", seed=SEED_NEW)
            after_revoke = _classify(d.call(op="finish", wait_s=wait_s), crcs, verbose)
        after_reuse = GONE if case.method == "unmap" else read()
        p.call(op="ping")
        p_state = "alive"
    except _Died:
        deaths = ((name, proc.death()) for name, proc in (("P", p), ("D", d)))
        p_state = "; ".join(f"{name} died: {how}" for name, how in deaths if how != "alive")
        if after_revoke == "not run":
            after_revoke = "no answer (a process died)"
        if case.method == "unmap":
            after_reuse = GONE  # never run for unmap, whichever call saw P die first
    except _Stuck as exc:
        p_state = f"stuck in {exc}"
    finally:
        if slowed and in_flight is not None:
            in_flight.slow(False)
        for proc in (p, d):
            if proc.proc.poll() is None:
                try:
                    proc.call(op="close")
                except Exception:
                    proc.proc.kill()
            proc.stop()
    return Result(case, after_revoke, after_reuse, p_state)


CASES: list[Case] = [
    Case("shm", "mapped", "deregister"),
    Case("shm", "mapped", "remove_peer"),
    Case("shm", "mapped", "punch_hole"),
    Case("shm", "mapped", "remap"),
    Case("shm", "cma", "deregister"),
    Case("shm", "cma", "remove_peer"),
    Case("shm", "cma", "mprotect"),
    Case("shm", "cma", "unmap"),
    *(
        Case(t, path, method)
        for t in ("nixl", "ucx")
        for path in ("tcp", "same-host")
        for method in ("deregister", "remove_peer", "unmap")
    ),
    # A small READ takes UCX's copy path, where P's worker itself copies out of its memory:
    *(Case(t, "tcp", "unmap", 4 << 10) for t in ("nixl", "ucx")),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--only", help="run the cases whose label contains this")
    parser.add_argument("--why", action="store_true", help="show each failure's reason")
    parser.add_argument(
        "--in-flight", action="store_true", help="READs in flight, across two namespaces"
    )
    parser.add_argument("--wait", type=float, default=READ_WAIT_S, help="seconds per READ")
    args = parser.parse_args(argv)
    if args.child is not None:
        _Child().serve(socket.socket(fileno=args.child))
        return 0
    if args.in_flight:
        return _main_in_flight(args.only, args.why)
    print("| case | READ after revocation | READ after reuse | P |")
    print("|---|---|---|---|")
    for case in CASES:
        if args.only and args.only not in case.label:
            continue
        print(run_case(case, args.wait, verbose=args.why).row(), flush=True)
    return 0


def _main_in_flight(only: str | None, verbose: bool) -> int:
    """The in-flight cases of tests/netns/revocation_in_flight.py (root, iproute2, tc)."""
    netns = Path(__file__).resolve().parents[1] / "netns"
    sys.path.insert(0, str(netns))
    fixtures = importlib.import_module("netns_fixtures")
    netns_test = importlib.import_module("revocation_in_flight")

    reason = fixtures.unavailable_reason()
    if reason is not None:
        print(f"network namespaces unavailable: {reason}", file=sys.stderr)
        return 2
    print("| case | READ in flight while P revokes and reuses | READ after reuse | P |")
    print("|---|---|---|---|")
    for case in netns_test.CASES:
        if only and only not in case.label:
            continue
        with fixtures.netns_pair_context() as pair:
            result = run_case(case, 30.0, verbose=verbose, in_flight=netns_test.in_flight(pair))
        print(result.row(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
