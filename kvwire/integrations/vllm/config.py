"""One engine's :class:`~kvwire.config.KVWireConfig`, read from vLLM's configuration: the
rank facts, the side channel vLLM's variables name, and the factors a stock NixlConnector
engine hashes (so the two kinds of engine accept each other)."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvwire.config import KVWireConfig, layered
from kvwire.errors import ConfigError
from kvwire.integrations.vllm import staging
from kvwire.integrations.vllm.geometry import attn_backend_name
from kvwire.integrations.vllm.groups import exchanged, prefill_backoff
from kvwire.wire.compat import CompatFactors, SpeculativeFactors
from kvwire.wire.versions import SUPPORTED_VERSIONS, VLLM_RELEASES

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("vllm.kvwire")


def kvwire_config(vllm_config: VllmConfig, *, tp_rank: int = 0) -> KVWireConfig:
    """The one KVWireConfig of this engine: vLLM's kv_transfer_config layer, the rank facts
    and the listener vLLM's side-channel variables name, and the factors vLLM hashes."""
    import vllm.envs as envs

    transfer = vllm_config.kv_transfer_config
    parallel = vllm_config.parallel_config
    as_dict = {
        "kv_connector": transfer.kv_connector,
        "engine_id": transfer.engine_id,
        "kv_connector_extra_config": dict(transfer.kv_connector_extra_config or {}),
    }
    base = KVWireConfig(kv_transfer_config=as_dict)
    if base.mode == "push" and as_dict["kv_connector_extra_config"].get("bidirectional_kv_xfer"):
        raise ConfigError(
            "bidirectional_kv_xfer reads a decode engine's blocks back (a READ), so it needs "
            "transfer_mode pull; in push mode stock's NixlPushConnector refuses it too"
        )
    version = protocol_version(as_dict)
    # With a host buffer (as stock) a prompt reaches the host once computed, so it goes out
    # whole: streamed layers would be read from the host before they were copied there.
    streams = bool(base.stream_layers) and not staging.wants_host_buffer(vllm_config)
    return KVWireConfig(
        kv_transfer_config=as_dict,
        version=version,
        transport_options=stock_transport_options(base, both_ways=_both_ways(vllm_config)),
        tp_rank=tp_rank,
        tp_size=parallel.tensor_parallel_size,
        side_channel_host=envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
        side_channel_port=envs.VLLM_NIXL_SIDE_CHANNEL_PORT
        + getattr(parallel, "data_parallel_index", 0),
        compat=compat_factors(vllm_config, str(base.mode), version),
        stream_layers=streams,
    )


def protocol_version(kv_transfer_config: dict[str, Any]) -> int:
    """The connector version of the vLLM release this engine runs in, which kvwire then
    speaks: a stock engine of that release hashes its version, and one of another release
    is refused by both kinds of engine alike (vLLM hashes its own version too).

    A ``version`` the operator set elsewhere (``KVWIRE_PROTOCOL_VERSION`` or the config
    file) that disagrees fails the engine's startup, naming both: no peer of this engine's
    release could pair with it.
    """
    import vllm

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata
    except ImportError as exc:
        raise ConfigError(
            f"vLLM {vllm.__version__} has no NIXL connector metadata module ({exc}): "
            "KVWireConnector speaks the NIXL connector's protocol and needs its version"
        ) from None
    engine = int(metadata.NIXL_CONNECTOR_VERSION)
    if engine not in SUPPORTED_VERSIONS:
        known = ", ".join(f"{v} (vLLM {r})" for v, r in VLLM_RELEASES.items())
        raise ConfigError(
            f"vLLM {vllm.__version__} speaks NIXL connector version {engine}; kvwire speaks {known}"
        )
    chosen = layered(os.environ, kv_transfer_config=kv_transfer_config).get("version", engine)
    if chosen != engine:
        raise ConfigError(
            f"version {chosen} is set, but this engine runs vLLM {vllm.__version__}, whose "
            f"NIXL connector version is {engine}: leave version unset inside vLLM"
        )
    return engine


def stock_transport_options(base: KVWireConfig, *, both_ways: bool = False) -> dict[str, Any]:
    """The transport's options, with what a stock peer needs filled in where the operator
    left it unset: over NIXL, UCX's peer error handling, which vLLM's agents run with, in
    push mode or when the engine moves KV both ways (``both_ways``: ``kv_both``, a
    read-back). UCX cannot open endpoints both ways between an agent without it and one
    with it, and those need both ways. Pull otherwise keeps kvwire's own default (none),
    which a stock peer accepts and which spares an initiator waiting on an idle target."""
    options = dict(base.transport_options)
    uses_ucx = options.get("backend", "UCX") == "UCX"
    if str(base.transport) == "nixl" and (base.mode == "push" or both_ways) and uses_ucx:
        backend = dict(options.get("backend_options") or {})
        backend.setdefault("ucx_error_handling_mode", "peer")
        options["backend_options"] = backend
    return options


def compat_factors(
    vllm_config: VllmConfig, mode: str, version: int, backend: str | None = None
) -> CompatFactors:
    """The factors a stock NixlConnector engine of this model hashes, so the two kinds of
    engine accept each other (whether the hybrid manager is on is one: vLLM resolves it
    per engine, and both kinds of connector support it). ``backend``: the attention
    backend's name, looked up when not given."""
    import vllm

    model = vllm_config.model_config
    return CompatFactors.build(
        vllm_version=vllm.__version__,
        model=model.model,
        dtype=str(model.dtype).removeprefix("torch."),
        num_kv_heads=model.get_total_num_kv_heads(),
        head_size=model.get_head_size(),
        num_hidden_layers=model.get_total_num_hidden_layers(),
        attn_backend_name=backend or hashed_backend_name(vllm_config, mode, version),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        is_hma_enabled=not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        transfer_mode=mode,
        speculative=speculative_factors(vllm_config),
        connector_version=version,
    )


def hashed_backend_name(vllm_config: VllmConfig, mode: str, version: int) -> str:
    """The attention backend name a stock engine hashes: the engine's first backend's,
    except that a push engine whose cache is block-outermost hashes every backend's name,
    sorted and joined by commas (so pipeline stages that meet a model's backends in
    another order agree); vLLM 0.32 (connector version 14) drops repeated names. Measured
    with DeepSeek-V4 (four backends): the first backend's name alone failed a stock push
    peer's hash check."""
    from vllm.distributed.kv_transfer.kv_connector import utils

    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    if mode != "push" or not layout.is_block_outermost:
        return attn_backend_name(vllm_config)
    names = [str(b.get_name()) for b in utils.get_current_attn_backends(vllm_config)]
    return ",".join(sorted(set(names) if version >= 14 else names))


def speculative_factors(vllm_config: VllmConfig) -> SpeculativeFactors | None:
    """What a stock engine hashes of its speculative decoding: an EAGLE-family drafter
    reads the target's hidden states, so two engines must agree on it (other drafters
    hash nothing)."""
    spec = vllm_config.speculative_config
    if spec is None or not spec.use_eagle():
        return None
    draft = spec.draft_model_config
    if draft is None:
        raise ConfigError("an EAGLE speculative config without its draft model config")
    aux = getattr(draft.hf_config, "eagle_aux_hidden_state_layer_ids", None)
    return SpeculativeFactors(
        method=str(spec.method),
        model=str(draft.model),
        revision=draft.revision,
        code_revision=draft.code_revision,
        parallel_drafting=bool(spec.parallel_drafting),
        kv_cache_dtype=None if spec.kv_cache_dtype is None else str(spec.kv_cache_dtype),
        auxiliary_layer_ids=None if aux is None else tuple(int(i) for i in aux),
    )


def _both_ways(vllm_config: VllmConfig) -> bool:
    """Whether this engine's agents may open endpoints to a peer that opens them to it:
    P for some requests and D for others, or a read-back on."""
    transfer = vllm_config.kv_transfer_config
    extra = transfer.kv_connector_extra_config or {}
    return transfer.kv_role == "kv_both" or bool(extra.get("bidirectional_kv_xfer"))


@dataclass(frozen=True)
class Readback:
    """``bidirectional_kv_xfer`` (pull mode), with stock's meaning: a decode engine keeps a
    finished request's blocks for ``hold_s`` seconds (``decoder_kv_blocks_ttl``, 480 by
    default) and hands back params naming them; a prefill engine given those params with
    the next turn's prompt reads the conversation's KV from them, unless fewer than
    ``threshold`` tokens would cross (``kv_recompute_threshold``, 64 by default): computing
    so few is cheaper than the round trip."""

    hold_s: float
    threshold: int
    moves: bool
    """Whether this model's conversations are kept and read back. Where not, a decode
    engine keeps nothing, and a prefill engine given a stock decode engine's params (which
    keeps them whatever the model) reads nothing but tells it at once that it may free."""


def readback(vllm_config: VllmConfig, kv_cache_config: Any) -> Readback | None:
    """This engine's :class:`Readback`, or None when ``bidirectional_kv_xfer`` is off.
    kvwire moves conversations only for models whose every group's list is the whole
    sequence (no sliding window's tail, no chunks, no R-SWA gaps, no Mamba state or ring) and
    whose prefill computes the whole prompt; for others the engine warns, naming the key,
    and its next turns compute the conversation again (no request gets bytes that are not
    its own)."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    if not extra.get("bidirectional_kv_xfer"):
        return None
    hold = _number(extra, "decoder_kv_blocks_ttl", 480)
    threshold = _number(extra, "kv_recompute_threshold", 64)
    if not 0 < hold < math.inf or not 0 <= threshold < math.inf or threshold != int(threshold):
        raise ConfigError(
            f"bidirectional_kv_xfer needs a finite decoder_kv_blocks_ttl > 0 (got {hold!r}) "
            f"and a whole kv_recompute_threshold >= 0 (got {threshold!r})"
        )
    whole = all(
        not rule.tail and rule.spec_slots is None and not (rule.chunked or rule.gaps or rule.ring)
        for rule in exchanged(kv_cache_config, vllm_config)
    )
    moves = whole and not prefill_backoff(kv_cache_config, vllm_config)
    if not moves:
        log.warning(
            "bidirectional_kv_xfer is on, and KVWireConnector reads a conversation back only "
            "for models whose every KV-cache group keeps the whole sequence (no sliding "
            "window, attention chunks or R-SWA, no state or ring) and whose prefill computes the "
            "whole "
            "prompt: the next turn's prefill computes the conversation again"
        )
    return Readback(hold_s=hold, threshold=int(threshold), moves=moves)


def _number(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{key} must be a number, got {value!r}") from None
    if math.isnan(number):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    return number


def sides(vllm_config: VllmConfig, kv_cache_config: Any) -> tuple[bool, bool]:
    """Whether this engine's workers run a producer and a consumer: one per role, both for
    ``kv_both`` (prefill for some requests, decode for others) and with a read-back on
    (a decode engine's blocks are read, a prefill engine reads)."""
    role = vllm_config.kv_transfer_config.kv_role
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ConfigError(
            f"KVWireConnector needs kv_role kv_producer, kv_consumer or kv_both, got {role!r}"
        )
    # A read-back engine needs both even for a model it reads nothing back for: a stock
    # decode engine may keep a conversation, which a prefill engine must tell it to free.
    both = role == "kv_both" or readback(vllm_config, kv_cache_config) is not None
    return both or role == "kv_producer", both or role == "kv_consumer"


def tp_rank(vllm_config: VllmConfig) -> int:
    """The worker's TP rank; 0 in a process without vLLM's parallel groups (TP 1)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    if vllm_config.parallel_config.tensor_parallel_size != 1:
        raise ConfigError("TP > 1 needs vLLM's parallel groups initialised")
    return 0
