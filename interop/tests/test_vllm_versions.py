"""KVWireConnector speaks the protocol of the vLLM release it runs in: the connector
version, the messages and the hashed factors (speculative decoding's included) are that
release's, proven against each release's own engine and hash function."""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import ConfigError


def test_the_version_is_the_engines_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, the version is what this vLLM's connector declares; set to another, the
    engine's startup fails naming both (no peer of this release could pair with it)."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata

    from kvwire.integrations.vllm.config import protocol_version

    monkeypatch.delenv("KVWIRE_PROTOCOL_VERSION", raising=False)
    monkeypatch.delenv("KVWIRE_CONFIG", raising=False)
    assert protocol_version({}) == metadata.NIXL_CONNECTOR_VERSION
    other = 15 if metadata.NIXL_CONNECTOR_VERSION != 15 else 14
    monkeypatch.setenv("KVWIRE_PROTOCOL_VERSION", str(other))
    with pytest.raises(ConfigError) as err:
        protocol_version({})
    assert f"version {other} is set" in str(err.value)
    assert f"vLLM {vllm.__version__}" in str(err.value)


@functools.cache
def _vllm_config() -> Any:
    from vllm_engine import build_vllm_config

    start = {
        "connector": "KVWireConnector", "role": "D", "engine_id": "spec", "model": "llama-3-8b",
        "layers": 2, "num_blocks": 16, "tp_size": 1, "block_size": 32, "hma": None,
    }  # fmt: skip
    return build_vllm_config(start)


def _drafter(
    method: str,
    model: str,
    revision: str | None,
    aux: list[int] | None,
    parallel: bool,
    kv_cache_dtype: str | None,
) -> Any:
    """The parts of vLLM's SpeculativeConfig its hash reads (building a real one loads the
    draft model's config from its hub)."""
    hf_config = SimpleNamespace()
    if aux is not None:
        hf_config.eagle_aux_hidden_state_layer_ids = aux
    return SimpleNamespace(
        method=method,
        use_eagle=lambda: method in ("eagle", "eagle3", "mtp"),
        draft_model_config=SimpleNamespace(
            model=model, revision=revision, code_revision=None, hf_config=hf_config
        ),
        parallel_drafting=parallel,
        kv_cache_dtype=kv_cache_dtype,
    )


DRAFTERS = st.builds(
    _drafter,
    method=st.sampled_from(["eagle", "eagle3", "mtp", "ngram", "medusa", "draft_model"]),
    model=st.text(min_size=1, max_size=24),
    revision=st.none() | st.text(max_size=12),
    aux=st.none() | st.lists(st.integers(0, 127), max_size=4),
    parallel=st.booleans(),
    kv_cache_dtype=st.sampled_from([None, "auto", "fp8", "fp8_e5m2", "bfloat16"]),
)


@settings(max_examples=150, deadline=None)
@given(drafter=st.none() | DRAFTERS, mode=st.sampled_from(["pull", "push"]))
def test_speculative_config_hashes_as_vllm(drafter: Any, mode: str) -> None:
    """vLLM's own hash function over the same config, for drafters drawn at random: an
    EAGLE-family drafter's factors, the cache dtype it inherits, and nothing for the
    others."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NIXL_CONNECTOR_VERSION,
        compute_nixl_compatibility_hash,
    )

    from kvwire.integrations.vllm.config import compat_factors

    config = copy.copy(_vllm_config())
    backend = "CPU_ATTN"  # looked up in an engine; here one name for both hashes
    object.__setattr__(config, "speculative_config", drafter)
    stock = compute_nixl_compatibility_hash(config, backend, mode)
    ours = compat_factors(config, mode, NIXL_CONNECTOR_VERSION, backend)
    assert (ours.speculative_config is None) == (drafter is None or not drafter.use_eagle())
    assert ours.hash() == stock


def test_a_vllm_without_the_nixl_connector_fails_startup_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A vLLM whose NIXL connector module is gone (renamed, or an older release)."""
    import importlib
    import sys

    from kvwire.integrations.vllm.config import protocol_version

    package = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
    loaded = importlib.import_module(package)
    monkeypatch.setitem(sys.modules, f"{package}.metadata", None)
    monkeypatch.delattr(loaded, "metadata", raising=False)
    with pytest.raises(ConfigError, match="no NIXL connector metadata module"):
        protocol_version({})


def test_bidirectional_kv_xfer_needs_pull(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-back is a READ of the decode engine's blocks: in push mode the engine's
    startup fails naming the key and the mode, as stock's push connector refuses it
    (``NotImplementedError`` in its scheduler)."""
    from vllm.distributed.kv_transfer.kv_connector import utils
    from vllm_peer import _backend

    from kvwire.integrations.vllm.config import kvwire_config

    # No model runs here: the backend a CPU engine picks, as the harness's engines have it.
    monkeypatch.setattr(utils, "get_current_attn_backends", lambda *_a, **_k: [_backend(False)])

    config = copy.copy(_vllm_config())
    transfer = copy.copy(config.kv_transfer_config)
    extra = {**transfer.kv_connector_extra_config, "bidirectional_kv_xfer": True}
    object.__setattr__(config, "kv_transfer_config", transfer)
    transfer.kv_connector_extra_config = {**extra, "transfer_mode": "push"}
    with pytest.raises(ConfigError, match=r"bidirectional_kv_xfer .* transfer_mode pull"):
        kvwire_config(config)
    transfer.kv_connector_extra_config = extra
    assert kvwire_config(config).mode == "pull"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("decoder_kv_blocks_ttl", "nan"),
        ("decoder_kv_blocks_ttl", float("inf")),
        ("decoder_kv_blocks_ttl", 0),
        ("decoder_kv_blocks_ttl", "soon"),
        ("kv_recompute_threshold", -1),
        ("kv_recompute_threshold", 2.5),
        ("kv_recompute_threshold", float("inf")),
        ("kv_recompute_threshold", True),
    ],
)
def test_read_back_settings_are_checked(key: str, value: Any) -> None:
    """A read-back's hold and threshold that cannot be honoured fail the engine's startup
    with a ``ConfigError`` naming the key, not a request later (a NaN hold would have
    reached the params, an infinite one pinned D's blocks for good)."""
    from kvwire.integrations.vllm.config import readback

    config = copy.copy(_vllm_config())
    transfer = copy.copy(config.kv_transfer_config)
    transfer.kv_connector_extra_config = {
        **transfer.kv_connector_extra_config, "bidirectional_kv_xfer": True, key: value,
    }  # fmt: skip
    object.__setattr__(config, "kv_transfer_config", transfer)
    with pytest.raises(ConfigError, match=key):
        readback(config, kv_cache_config=None)
