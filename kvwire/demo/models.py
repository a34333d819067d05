"""Model presets for the demo: the KV geometry of real models, scaled down by layer count.

Per token and layer a GQA model stores K and V for each KV head (``2 x head_dim`` values);
an MLA model stores one latent vector shared by all heads and replicated on every TP rank.
The demo lays each layer out as one region of HND blocks with K and V side by side, which
is what vLLM's FlashAttention layout advertises per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwire.errors import ConfigError
from kvwire.layout.geometry import BlockRegion, KVGeometry
from kvwire.layout.geometry import heads_per_rank as _heads_per_rank
from kvwire.wire.compat import CompatFactors

BLOCK_TOKENS = 16
DTYPE_BYTES = 2  # bf16


@dataclass(frozen=True)
class ModelPreset:
    name: str
    hf_name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    mla: bool = False
    latent_dim: int = 0
    """MLA: values per token per layer (kv_lora_rank + rope dim)."""

    @property
    def content_bytes(self) -> int:
        """Bytes one head stores for one token in one layer (K|V, or the MLA latent)."""
        if self.mla:
            return self.latent_dim * DTYPE_BYTES
        return 2 * self.head_dim * DTYPE_BYTES

    def kv_bytes_per_token(self, layers: int | None = None) -> int:
        """Whole-model (all heads) KV bytes per token over ``layers`` layers."""
        heads = 1 if self.mla else self.kv_heads
        return (layers or self.num_layers) * heads * self.content_bytes


PRESETS: dict[str, ModelPreset] = {
    "llama-3-8b": ModelPreset("llama-3-8b", "meta-llama/Meta-Llama-3-8B", 32, 8, 128),
    "llama-3-70b": ModelPreset("llama-3-70b", "meta-llama/Meta-Llama-3-70B", 80, 8, 128),
    # A mixture of experts: its experts are in the MLP, so its KV cache is a dense model's.
    "qwen3-30b-a3b": ModelPreset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 48, 4, 128),
    "deepseek-v3": ModelPreset(
        "deepseek-v3", "deepseek-ai/DeepSeek-V3", 61, 1, 128, mla=True, latent_dim=576
    ),
}
ALIASES = {"mla": "deepseek-v3"}


def vllm_layer_name(layer: int) -> str:
    """The attention layer name vLLM gives layer ``layer`` of a Llama-style model.

    vLLM's D requires a peer's region names to equal its own layer names, in order, so an
    engine advertises the names its model really has; the demo uses vLLM's for its presets.
    """
    return f"model.layers.{layer}.self_attn.attn"


def preset(name: str) -> ModelPreset:
    key = ALIASES.get(name, name)
    try:
        return PRESETS[key]
    except KeyError:
        known = ", ".join([*PRESETS, *ALIASES])
        raise ConfigError(f"unknown model {name!r} (known: {known})") from None


@dataclass(frozen=True)
class CacheSpec:
    """One rank's demo KV cache: a model, how many layers, how many blocks, which rank."""

    model: ModelPreset
    layers: int
    num_blocks: int
    tp_rank: int
    tp_size: int
    block_tokens: int = BLOCK_TOKENS
    """Tokens per block (vLLM's CPU attention wants multiples of 32)."""

    def __post_init__(self) -> None:
        if not 1 <= self.layers <= self.model.num_layers:
            raise ConfigError(
                f"--layers must be 1..{self.model.num_layers} for {self.model.name}, "
                f"got {self.layers}"
            )
        heads = 1 if self.model.mla else self.model.kv_heads
        big, small = max(self.tp_size, heads), min(self.tp_size, heads)
        if big % small:
            raise ConfigError(
                f"TP {self.tp_size} does not divide {self.model.name}'s {heads} heads"
            )

    @property
    def heads_here(self) -> int:
        return 1 if self.model.mla else _heads_per_rank(self.tp_size, self.model.kv_heads)

    @property
    def block_len(self) -> int:
        return self.heads_here * self.block_tokens * self.model.content_bytes

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.block_len

    @property
    def total_bytes(self) -> int:
        return self.layers * self.region_bytes

    def geometry(
        self,
        base_addr: int,
        *,
        layout: str = "LBHNC",
        region_names: list[str] | None = None,
        attn_backend_name: str | None = None,
    ) -> KVGeometry:
        """Regions laid out layer after layer from ``base_addr``; an engine that talks to
        a real vLLM passes vLLM's layout name, its layer names and its backend."""
        names = region_names or [vllm_layer_name(layer) for layer in range(self.layers)]
        if len(names) != self.layers:
            raise ConfigError(f"{len(names)} region names for {self.layers} layers")
        regions = [
            BlockRegion(
                base_addr=base_addr + layer * self.region_bytes,
                block_len=self.block_len,
                num_blocks=self.num_blocks,
                mem_kind="DRAM",
                name=names[layer],
            )
            for layer in range(self.layers)
        ]
        return KVGeometry(
            regions=regions,
            kv_cache_layout=layout,
            block_size=self.block_tokens,
            total_kv_heads=1 if self.model.mla else self.model.kv_heads,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            is_mla=self.model.mla,
            attn_backend_name=attn_backend_name or self.default_backend,
        )

    @property
    def default_backend(self) -> str:
        return "FLASHMLA" if self.model.mla else "FLASH_ATTN"

    def compat(self, mode: str) -> CompatFactors:
        """Both sides of the demo hash the same model facts (total layers, not the slice)."""
        return CompatFactors.build(
            vllm_version="0.31.0",
            model=self.model.hf_name,
            dtype="bfloat16",
            num_kv_heads=1 if self.model.mla else self.model.kv_heads,
            head_size=self.model.latent_dim if self.model.mla else self.model.head_dim,
            num_hidden_layers=self.model.num_layers,
            attn_backend_name="FLASHMLA" if self.model.mla else "FLASH_ATTN",
            transfer_mode="push" if mode == "push" else "pull",
        )
