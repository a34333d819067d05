"""The compatibility hash and its diagnosis, against vLLM 0.31.0's own code.

A vLLM side channel (``vllm_listener.py``: vLLM's ``VllmConfig``, hash function, payload
classes and listener thread) answers kvwire's client and ``kvwire probe``. Nothing on the
vLLM side is a kvwire copy of vLLM.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvwire.config import RetryPolicy
from kvwire.errors import IncompatiblePeerError
from kvwire.sidechannel import HandshakeClient, fetch_agent_metadata
from kvwire.wire.compat import CompatFactors

LISTENER = Path(__file__).with_name("vllm_listener.py")


class VllmListener:
    """One listener process; started at construction, read (``ready``) when first needed,
    so several vLLM imports overlap."""

    def __init__(self, tmp: Path, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(LISTENER), str(tmp / "model"), *flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.model_dir = str(tmp / "model")
        self._info: dict[str, Any] | None = None

    @property
    def info(self) -> dict[str, Any]:
        if self._info is None:
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(timeout=30)
                raise RuntimeError(f"vLLM listener exited with {self.proc.returncode}")
            self._info = json.loads(line)
        return self._info

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def listeners(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmListener]]:
    started = {
        "default": VllmListener(tmp_path_factory.mktemp("default")),
        "hma_off": VllmListener(tmp_path_factory.mktemp("hma-off"), "--disable-hma"),
    }
    yield started
    for listener in started.values():
        listener.close()


@pytest.fixture
def default_engine(listeners: dict[str, VllmListener]) -> VllmListener:
    return listeners["default"]


@pytest.fixture
def hma_off(listeners: dict[str, VllmListener]) -> VllmListener:
    return listeners["hma_off"]


def our_factors(listener: VllmListener, **scheduler: Any) -> CompatFactors:
    """What kvwire computes for the listener's engine from a VllmConfig-shaped mapping."""
    return CompatFactors.from_vllm_config(
        {
            "vllm_version": listener.info["vllm_version"],
            "platform": "cpu",
            "model_config": {
                "model": listener.model_dir,
                "dtype": "bfloat16",
                "hf_config": {"num_key_value_heads": 4, "head_dim": 32, "num_hidden_layers": 2},
            },
            "scheduler_config": scheduler,
        }
    )


def test_default_factors_hash_like_a_default_vllm_engine(default_engine: VllmListener) -> None:
    """A default vLLM engine with the NIXL connector hashes is_hma_enabled=true (on
    CpuPlatform too); kvwire's default once said false and got a bare mismatch."""
    assert default_engine.info["is_hma_enabled"] is True
    assert our_factors(default_engine).hash() == default_engine.info["hash"]


def test_factors_with_hma_off_hash_like_vllm(hma_off: VllmListener) -> None:
    ours = our_factors(hma_off, disable_hybrid_kv_cache_manager=True)
    assert ours.hash() == hma_off.info["hash"]


def test_layout_name_is_vllms(default_engine: VllmListener) -> None:
    assert default_engine.info["kv_cache_layout"] == "LBHNC"


def test_client_names_the_factor_a_vllm_peer_differs_in(hma_off: VllmListener) -> None:
    ours = our_factors(hma_off)  # HMA on: the only difference
    with (
        HandshakeClient(RetryPolicy(timeout=5.0, retries=0)) as client,
        pytest.raises(IncompatiblePeerError) as info,
    ):
        fetch_agent_metadata(
            client, "127.0.0.1", hma_off.info["port"], [(0, 0)],
            local_hash=ours.hash(), local_factors=ours,
        )  # fmt: skip
    assert info.value.differing == {"is_hma_enabled": (True, False)}


def test_probe_names_is_hma_enabled(hma_off: VllmListener, tmp_path: Path) -> None:
    factors = tmp_path / "factors.json"
    factors.write_text(json.dumps(our_factors(hma_off).as_dict()))
    t0 = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "kvwire", "probe", f"127.0.0.1:{hma_off.info['port']}",
         "--factors", str(factors), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    report = json.loads(run.stdout)
    assert report["compatibility"]["compatible"] is False
    assert report["compatibility"]["differing"] == {"is_hma_enabled": [True, False]}
    assert time.perf_counter() - t0 < 30
