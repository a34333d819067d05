"""The quickstart's two-host recipe, on two "hosts": P listens on the wildcard address in
namespace a, D connects to a's address from namespace b, and every byte arrives.

P must advertise an address D can dial: with ``--listen 0.0.0.0:7600`` it advertises a's
one routable address (192.0.2.1), not ``0.0.0.0`` (which D would take for itself) and not
port 0. The transport is ``ucx`` kept on TCP over the veth link (``Namespace.ucx_env``), so
handshakes, control messages and the KV bytes all cross from one "host" to the other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from netns_fixtures import ADDRESS_A, NetnsPair

KVWIRE = [sys.executable, "-m", "kvwire"]


def test_two_host_demo_recipe_with_a_wildcard_listen_address(netns_pair: NetnsPair) -> None:
    pytest.importorskip("kvwire_ucx", reason="the ucx extra is not installed")
    prefill = subprocess.Popen(
        netns_pair.a.exec_argv(
            [*KVWIRE, "demo", "--role", "prefill", "--listen", "0.0.0.0:7600", "--transport", "ucx"]
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **netns_pair.a.ucx_env()},
    )
    try:
        assert prefill.stderr is not None
        started = prefill.stderr.readline()  # P is serving once it says so
        assert f"side channel {ADDRESS_A}:" in started, started
        assert "listening on 0.0.0.0:7600" in started, started
        decode = netns_pair.b.run(
            [
                *KVWIRE,
                "demo",
                "--role",
                "decode",
                "--connect",
                f"{ADDRESS_A}:7600",
                "--requests",
                "16",
                "--no-progress",
                "--json",
            ],
            timeout=300,
            env=netns_pair.b.ucx_env(),
        )
        assert decode.returncode == 0, decode.stderr + decode.stdout
        summary = json.loads(decode.stdout)
        assert summary["done"] == 16 and summary["failed"] == 0
        assert summary["bytes_moved"] > 0 and summary["bytes_wrong"] == 0 and summary["verified"]
        assert prefill.wait(60) == 0  # D said bye: P ends by itself
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()
