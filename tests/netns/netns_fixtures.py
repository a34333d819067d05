"""Two hosts on one machine: network namespaces joined by a veth pair, for multi-host tests.

``netns_pair`` (a pytest fixture, re-exported by this directory's conftest) builds two
namespaces, each with one end of a veth pair (192.0.2.1/24 in ``a``, 192.0.2.2/24 in ``b``;
a documentation range with no route out) and ``lo`` up, and deletes them afterwards even
when the test failed. Names are unique per test, so parallel runs do not clash.

Code runs inside a namespace as a subprocess (``ip netns exec``): a command, or a
module-level function of a test file by reference (``Namespace.start(func, *args)``). The
function gets JSON arguments, may :func:`emit` JSON messages while it runs (a listening
port, a metadata blob) and returns a JSON result, so no objects are pickled across.

Namespaces share one kernel, so UCX would pick shared memory or CMA between them and a cut
link would cut nothing: :meth:`Namespace.ucx_env` forces UCX onto TCP over the veth device.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

SUBNET_PREFIX = 24
ADDRESS_A = "192.0.2.1"
ADDRESS_B = "192.0.2.2"
MARK = "@@kvwire-netns@@ "
"""Prefix of the lines a child writes for the parent; everything else is plain output."""


class NetnsError(RuntimeError):
    """An ``ip`` command failed, or a child in a namespace failed or timed out."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here, or ``None`` when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"kvwprobe{secrets.token_hex(4)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


# ------------------------------------------------------------------------------ children


@dataclass
class Child:
    """A process running inside a namespace; its marked stdout lines are messages."""

    proc: subprocess.Popen[str]
    label: str
    output: list[str] = field(default_factory=list)
    """Every unmarked line of stdout and stderr (UCX writes its log here)."""
    _messages: queue.Queue[Any] = field(default_factory=queue.Queue)
    _readers: list[threading.Thread] = field(default_factory=list)

    def __post_init__(self) -> None:
        for stream in (self.proc.stdout, self.proc.stderr):
            reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
            reader.start()
            self._readers.append(reader)

    def _read(self, stream: Any) -> None:
        for line in stream:
            if line.startswith(MARK):
                try:
                    self._messages.put(json.loads(line[len(MARK) :]))
                except ValueError:  # fail the waiting test with the line, not a timeout
                    self._messages.put({"error": f"an unreadable message: {line!r}"})
            else:
                self.output.append(line.rstrip("\n"))
        if stream is self.proc.stdout:
            self._messages.put(None)  # end of the child's messages

    def send(self, value: Any) -> None:
        """Pass ``value`` (JSON) to the child's :func:`receive`."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(value) + "\n")
        self.proc.stdin.flush()

    def message(self, timeout: float) -> Any:
        """The next value the child passed to :func:`emit`."""
        item = self._next(timeout)
        if "emit" not in item:
            raise NetnsError(f"{self.label}: finished without the expected message: {item}")
        return item["emit"]

    def result(self, timeout: float) -> Any:
        """Wait for the child to finish; its function's return value (or raise its error)."""
        deadline = time.monotonic() + timeout
        while True:
            item = self._next(max(0.0, deadline - time.monotonic()))
            if "emit" not in item:
                break
        self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        for reader in self._readers:
            reader.join(timeout=5)
        if "error" in item:
            raise NetnsError(f"{self.label} failed: {item['error']}\n{self.log()}")
        return item["result"]

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            item = self._messages.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise NetnsError(f"{self.label}: nothing within {timeout:.1f}s\n{self.log()}") from None
        if item is None:
            self.proc.wait(timeout=10)
            raise NetnsError(f"{self.label}: exited {self.proc.returncode}\n{self.log()}")
        result: dict[str, Any] = item
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log(self, lines: int = 40) -> str:
        return "\n".join(self.output[-lines:])


def _say(payload: dict[str, Any]) -> None:
    """One marked line to the parent in one ``write(2)``: with ``PYTHONUNBUFFERED``,
    ``print`` writes the text and its newline separately, and a native library writing to
    the same stream between the two (seen once: UCX's log) corrupted the message."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (MARK + json.dumps(payload) + "\n").encode())


def emit(value: Any) -> None:
    """From inside a child: send ``value`` (JSON) to the parent's :meth:`Child.message`."""
    _say({"emit": value})


def receive() -> Any:
    """From inside a child: the next value the parent passed to :meth:`Child.send`."""
    line = sys.stdin.readline()
    if not line:
        raise EOFError("the parent closed the channel")
    return json.loads(line)


def await_reads(
    consumer: Any,
    spec: Any,
    buffer: Any,
    known: dict[str, tuple[int, list[int]]],
    expected: set[str],
    start: float,
    timeout: float,
) -> tuple[dict[str, list[int]], dict[str, dict[str, Any]]]:
    """From inside a D child: wait (bounded) until every id in ``expected`` is done or
    failed. Done requests are checked byte by byte against the content P filled them with
    (``known``: request id -> (content index, D's blocks)); failures keep their reason,
    detail, invalid blocks and when they came."""
    from kvwire.demo.content import count_wrong_bytes

    done: dict[str, list[int]] = {}
    failed: dict[str, dict[str, Any]] = {}
    deadline = start + timeout
    while len(done) + len(failed) < len(expected) and time.monotonic() < deadline:
        consumer.wait_finished(max(0.0, deadline - time.monotonic()))
        fin = consumer.get_finished()
        for rid in fin.done:
            index, blocks = known[rid]
            done[rid] = list(count_wrong_bytes(spec, buffer, index, blocks))
        for rid, why in fin.failed.items():
            failed[rid] = {
                "reason": why.reason,
                "detail": why.detail,
                "invalid": [list(group) for group in why.invalid_block_ids],
                "after_s": time.monotonic() - start,
            }
    return done, failed


def b64(data: bytes) -> str:
    """Bytes as JSON-safe text (for metadata blobs passed between children)."""
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


UCX_LANE = re.compile(r"\b\w+\(([^)]*)\)")
"""A lane of a UCX endpoint configuration, ``am(tcp/veth0 cma/memory)``: its transports."""


def ucx_lanes(log_lines: Sequence[str]) -> set[tuple[str, str]]:
    """Every (transport, device) UCX's info log names in an endpoint configuration.

    UCX (``UCX_LOG_LEVEL=info``) logs one line per endpoint configuration, ``<name>
    inter-node cfg#1 rma_am(tcp/<dev>) am(tcp/<dev>) ...``.
    """
    lanes: set[tuple[str, str]] = set()
    for line in log_lines:
        if re.search(r"-node cfg#\d", line):
            for contents in UCX_LANE.findall(line.split("cfg#", 1)[1]):
                for item in contents.split():
                    transport, _, device = item.partition("/")
                    lanes.add((transport, device))
    return lanes


# ---------------------------------------------------------------------------- namespaces


@dataclass(frozen=True)
class Namespace:
    """One side of the pair: its name, its veth device and its address."""

    name: str
    device: str
    address: str

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside the namespace and wait for it."""
        return subprocess.run(
            self.exec_argv(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_environment(env),
        )

    def start(
        self,
        func: Callable[..., Any],
        *args: Any,
        env: Mapping[str, str] | None = None,
    ) -> Child:
        """Run module-level ``func(*args)`` in a fresh Python inside the namespace."""
        source = Path(func.__code__.co_filename).resolve()
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            str(source),
            func.__qualname__,
            json.dumps(list(args)),
        ]
        proc = subprocess.Popen(
            self.exec_argv(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_environment(env),
        )
        return Child(proc, f"{func.__qualname__} in {self.name}")

    def call(
        self,
        func: Callable[..., Any],
        *args: Any,
        env: Mapping[str, str] | None = None,
        timeout: float = 60,
    ) -> Any:
        """:meth:`start` then wait for the result."""
        child = self.start(func, *args, env=env)
        try:
            return child.result(timeout)
        finally:
            child.kill()

    def ucx_env(self, *, log_level: str | None = None) -> dict[str, str]:
        """Environment that keeps UCX (alone or inside NIXL) on TCP over this veth device.

        Without it UCX reaches the other namespace through shared memory or CMA (one
        kernel), and cutting the link would not cut the transfer.
        """
        # UCX logs to stdout by default; the children's messages to the parent go there.
        env = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": self.device, "UCX_LOG_FILE": "stderr"}
        if log_level is not None:
            env["UCX_LOG_LEVEL"] = log_level
        return env


def _environment(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("UCX_NET_DEVICES", None)  # the Makefile pins it to lo for single-host tests
    env.update(extra or {})
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@dataclass
class NetnsPair:
    """Two namespaces joined by a veth pair; ``a`` and ``b`` are the two hosts."""

    a: Namespace
    b: Namespace

    def cut(self) -> None:
        """Take ``a``'s end of the link down: packets stop both ways."""
        _ip("-n", self.a.name, "link", "set", "dev", self.a.device, "down")

    def restore(self) -> None:
        """Bring ``a``'s end up again and wait until the link carries traffic."""
        _ip("-n", self.a.name, "link", "set", "dev", self.a.device, "up")
        deadline = time.monotonic() + 30
        while not self._link_up():
            if time.monotonic() > deadline:
                raise NetnsError(f"{self.a.device} did not come back up within 30s")
            time.sleep(0.05)

    @contextlib.contextmanager
    def link_cut(self) -> Iterator[None]:
        """The link is down inside the block and restored after it, even on failure."""
        self.cut()
        try:
            yield
        finally:
            self.restore()

    def _link_up(self) -> bool:
        shown = _ip("-n", self.a.name, "-o", "link", "show", "dev", self.a.device, check=False)
        return "LOWER_UP" in shown.stdout and "state UP" in shown.stdout


@contextlib.contextmanager
def netns_pair_context(tag: str | None = None) -> Iterator[NetnsPair]:
    """Build the pair; always delete it (and end the processes left inside it)."""
    tag = tag or secrets.token_hex(3)
    names = (f"kvwire-{tag}-a", f"kvwire-{tag}-b")
    devices = (f"kvw{tag}a", f"kvw{tag}b")
    pair = NetnsPair(
        Namespace(names[0], devices[0], ADDRESS_A), Namespace(names[1], devices[1], ADDRESS_B)
    )
    try:
        for ns in (pair.a, pair.b):
            _ip("netns", "add", ns.name)
        _ip("link", "add", devices[0], "type", "veth", "peer", "name", devices[1])
        for ns in (pair.a, pair.b):
            _ip("link", "set", "dev", ns.device, "netns", ns.name)
            _ip("-n", ns.name, "addr", "add", f"{ns.address}/{SUBNET_PREFIX}", "dev", ns.device)
            _ip("-n", ns.name, "link", "set", "dev", "lo", "up")
            _ip("-n", ns.name, "link", "set", "dev", ns.device, "up")
        pair.restore()  # waits for the carrier on both ends
        yield pair
    finally:
        for ns in (pair.a, pair.b):
            _end_processes_in(ns.name)
            _ip("netns", "del", ns.name, check=False)
        _ip("link", "del", devices[0], check=False)  # only if it never left the root ns


def _end_processes_in(name: str) -> None:
    """Kill what our test left running inside namespace ``name`` (only we use it)."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@pytest.fixture
def netns_pair() -> Iterator[NetnsPair]:
    """Two namespaces joined by a veth pair; skips only where they cannot be created."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with netns_pair_context() as pair:
        yield pair


# ------------------------------------------------------------------------ child entry


def _child_main(source: str, qualname: str, args_json: str) -> int:
    """Inside the namespace: import ``source`` by path, call ``qualname(*args)``, report."""
    try:
        spec = importlib.util.spec_from_file_location(f"_netns_child_{Path(source).stem}", source)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {source}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        func: Any = module
        for part in qualname.split("."):
            func = getattr(func, part)
        result = func(*json.loads(args_json))
        _say({"result": result})
        return 0
    except BaseException as exc:  # reported to the parent, which raises it
        detail = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        _say({"error": detail})
        return 1


if __name__ == "__main__":
    sys.exit(_child_main(*sys.argv[1:4]))
