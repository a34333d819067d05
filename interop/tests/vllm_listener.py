"""A vLLM 0.31.0 side channel, run from vLLM's own code, for kvwire's compatibility tests.

Run with the interop venv's python. It builds a ``VllmConfig`` for a tiny local model (a
``config.json`` written here; no hub, no weights), computes the compatibility hash with
vLLM's ``compute_nixl_compatibility_hash``, wraps vLLM-encoded ``NixlAgentMetadata`` in a
``NixlHandshakePayload`` and serves it with the connector scheduler's own listener thread.
It prints one JSON line (port, hash, the factors' inputs) and serves until stdin closes.

Usage: vllm_listener.py MODEL_DIR [--disable-hma] [--push]
"""

from __future__ import annotations

import json
import os
import sys
import threading

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"

import msgspec
from vllm.config import KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata,
    NixlHandshakePayload,
    compute_nixl_compatibility_hash,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)

from kvwire.testing.ports import free_port

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
    "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16", "head_dim": 32, "rms_norm_eps": 1e-5,
}  # fmt: skip


def main() -> None:
    model_dir = sys.argv[1]
    disable_hma = "--disable-hma" in sys.argv
    mode = "push" if "--push" in sys.argv else "pull"
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    connector = "NixlPushConnector" if mode == "push" else "NixlConnector"
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16"),
        scheduler_config=SchedulerConfig(
            max_model_len=2048,
            is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=True if disable_hma else None,
        ),
        kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role="kv_both"),
    )
    # What the engine core does once before any worker registers its caches.
    layouts = [[x.name for x in get_supported_kv_cache_layouts([CPUAttentionBackend])]]
    config.cache_config.kv_cache_layout = resolve_kv_cache_layout(config, layouts).name
    compat_hash = compute_nixl_compatibility_hash(config, "CPU_ATTN", mode)
    metadata = NixlAgentMetadata(
        engine_id="vllm-prefill", agent_metadata=b"\0" * 16, kv_caches_base_addr=[4096, 8192],
        device_id=0, num_blocks=4, block_lens=[1024, 1024], block_strides=[1024, 1024],
        kv_cache_layout=config.cache_config.get_resolved_kv_cache_layout().name,
        block_size=16, ssm_sizes=(0, 0), attn_backend_name="CPU_ATTN",
        physical_blocks_per_logical_kv_block=1,
    )  # fmt: skip
    encoder = msgspec.msgpack.Encoder()
    payload = NixlHandshakePayload(
        compatibility_hash=compat_hash, agent_metadata_bytes=encoder.encode(metadata)
    )
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=NixlBaseConnectorScheduler._nixl_handshake_listener,
        args=({(0, 0): encoder.encode(payload)}, ready, stop, "127.0.0.1", port),
        daemon=True,
    )
    thread.start()
    ready.wait()
    print(
        json.dumps(
            {
                "port": port,
                "hash": compat_hash,
                "is_hma_enabled": not config.scheduler_config.disable_hybrid_kv_cache_manager,
                "kv_cache_layout": metadata.kv_cache_layout,
                "vllm_version": __import__("vllm").__version__,
            }
        ),
        flush=True,
    )
    sys.stdin.read()
    stop.set()
    thread.join()


if __name__ == "__main__":
    main()
