"""Compatibility factors: normalisation, explain, and strict loading."""

from __future__ import annotations

import msgspec
import pytest

import kvwire
from kvwire.wire.compat import CompatFactors, SpeculativeFactors, explain

BASE = CompatFactors.build(
    vllm_version="0.31.0",
    model="m",
    dtype="torch.bfloat16",
    num_kv_heads=8,
    head_size=128,
    num_hidden_layers=32,
    attn_backend_name="FLASH_ATTN",
    cache_dtype="fp8",
)


def test_default_hma_matches_a_vllm_gpu_engine() -> None:
    """vLLM on GPUs with the NIXL connector resolves the hybrid KV cache manager on and
    hashes ``is_hma_enabled: true``; the old default (False) gave a bare hash mismatch."""
    assert CompatFactors.build(**{**_settings(BASE), "is_hma_enabled": True}) == (
        CompatFactors.build(**{k: v for k, v in _settings(BASE).items() if k != "is_hma_enabled"})
    )


VLLM_CONFIG = {
    "model_config": {
        "model": "m",
        "dtype": "bfloat16",
        "hf_config": {"num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 32},
    },
    "cache_config": {"cache_dtype": "fp8"},
}


def test_factors_from_a_vllm_config() -> None:
    assert CompatFactors.from_vllm_config(VLLM_CONFIG) == msgspec.structs.replace(
        BASE, is_hma_enabled=True
    )
    # vLLM 0.31.0's CpuPlatform supports the hybrid manager too: only the backend differs.
    cpu = CompatFactors.from_vllm_config({**VLLM_CONFIG, "platform": "cpu"})
    assert (cpu.is_hma_enabled, cpu.attn_backend_name) == (True, "CPU_ATTN")
    push = CompatFactors.from_vllm_config(
        {**VLLM_CONFIG, "kv_transfer_config": {"kv_connector": "NixlPushConnector"}}
    )
    assert push.transfer_mode == "push"
    v14 = CompatFactors.from_vllm_config({**VLLM_CONFIG, "vllm_version": "0.32.0"})
    assert v14.nixl_connector_version == 14
    off = CompatFactors.from_vllm_config(
        {**VLLM_CONFIG, "scheduler_config": {"disable_hybrid_kv_cache_manager": True}}
    )
    assert off.is_hma_enabled is False


@pytest.mark.parametrize(
    "bad",
    [[], {"model_config": 5}, {"model_config": {"model": "m"}}, {"model_config": {}}],
)
def test_bad_vllm_config_is_a_config_error(bad: object) -> None:
    with pytest.raises(kvwire.ConfigError, match="vLLM config"):
        CompatFactors.from_vllm_config(bad)  # type: ignore[arg-type]


def test_dtype_spellings_hash_alike() -> None:
    short = msgspec.structs.replace(BASE, dtype="torch.bfloat16")
    built = CompatFactors.build(**{**_settings(BASE), "dtype": "bfloat16"})
    assert built.hash() == short.hash() == BASE.hash()


def test_speculative_kv_dtype_inherits_target_cache_dtype() -> None:
    spec = SpeculativeFactors(method="eagle3", model="draft")
    inherited = CompatFactors.build(**_settings(BASE), speculative=spec)
    explicit = CompatFactors.build(
        **_settings(BASE), speculative=SpeculativeFactors("eagle3", "draft", kv_cache_dtype="fp8")
    )
    assert inherited.speculative_config is not None
    assert inherited.speculative_config.kv_cache_dtype == "fp8"
    assert inherited.hash() == explicit.hash()


def test_every_factor_changes_the_hash() -> None:
    changes = {
        "vllm_version": "0.31.1",
        "nixl_connector_version": 14,
        "model": "n",
        "dtype": "torch.float16",
        "num_kv_heads": 4,
        "head_size": 64,
        "num_hidden_layers": 31,
        "attn_backend_name": "FLASHINFER",
        "cache_dtype": "auto",
        "is_hma_enabled": not BASE.is_hma_enabled,
        "speculative_config": SpeculativeFactors("eagle", "d"),
        "transfer_mode": "push",
    }
    assert set(changes) == set(CompatFactors.__struct_fields__)
    for name, value in changes.items():
        other = msgspec.structs.replace(BASE, **{name: value})
        assert other.hash() != BASE.hash(), name
        assert list(explain(BASE, other)) == [name] or name == "speculative_config"


def test_explain_nested_and_json_semantics() -> None:
    a = CompatFactors.build(**_settings(BASE), speculative=SpeculativeFactors("eagle3", "d"))
    b = CompatFactors.build(
        **_settings(BASE),
        speculative=SpeculativeFactors("eagle3", "d", auxiliary_layer_ids=(1, 2)),
    )
    assert explain(a, b) == {"speculative_config.auxiliary_layer_ids": (None, [1, 2])}
    assert explain(a, a) == {}
    # True and 1 are equal in Python but hash differently, so they differ.
    assert explain({"x": True}, {"x": 1}) == {"x": (True, 1)}
    assert explain({"x": 1}, {}) == {"x": (1, None)}
    assert explain({"x": (1, 2)}, {"x": [1, 2]}) == {}


def test_from_dict_refuses_unknown_and_mistyped_factors() -> None:
    good = BASE.as_dict()
    assert CompatFactors.from_dict(good) == BASE
    with pytest.raises(kvwire.ConfigError):
        CompatFactors.from_dict({**good, "modle": "typo"})
    with pytest.raises(kvwire.ConfigError):
        CompatFactors.from_dict({**good, "num_kv_heads": "8"})


def test_mapping_hash_matches_struct_hash_and_accepts_tuples() -> None:
    plain = BASE.as_dict()
    assert kvwire.compatibility_hash(plain) == BASE.hash()
    with pytest.raises(kvwire.ConfigError):
        kvwire.compatibility_hash({"x": object()})


def _settings(factors: CompatFactors) -> dict[str, object]:
    plain = factors.as_dict()
    plain.pop("speculative_config")
    plain["connector_version"] = plain.pop("nixl_connector_version")
    return plain
