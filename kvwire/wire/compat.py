"""Compatibility factors, the hash both peers compare, and which factor differs.

Two engines may exchange KV blocks only if they agree on everything that shapes the bytes
of the cache: versions, model, dtypes, attention backend, speculative-decoding state and
the transfer mode. vLLM reduces those factors to one SHA-256 digest of their sorted JSON;
kvwire computes the identical digest and, because it keeps the factors themselves, can also
say *which* of them two peers disagree on.

Tensor-parallel size, block size, layout and block count are deliberately not factors: the
handshake validates them, so heterogeneous deployments still work.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import msgspec

from kvwire.errors import ConfigError
from kvwire.wire.schemas import TransferMode
from kvwire.wire.versions import VLLM_RELEASES


class SpeculativeFactors(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The speculative-decoding factors, hashed only for EAGLE-family drafters.

    ``kv_cache_dtype`` left as ``None`` inherits the target's cache dtype when built through
    :meth:`CompatFactors.build`, so an explicit setting on one side and inheritance on the
    other do not differ.
    """

    method: str
    model: str
    revision: str | None = None
    code_revision: str | None = None
    parallel_drafting: bool = False
    kv_cache_dtype: str | None = None
    auxiliary_layer_ids: tuple[int, ...] | None = None


class CompatFactors(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Every factor of the compatibility hash, in vLLM's order.

    Unknown keys are refused when loading from a dict: a misspelt factor would otherwise
    silently produce a different hash.
    """

    vllm_version: str
    nixl_connector_version: int
    model: str
    dtype: str
    num_kv_heads: int
    head_size: int
    num_hidden_layers: int
    attn_backend_name: str
    cache_dtype: str
    is_hma_enabled: bool
    speculative_config: SpeculativeFactors | None
    transfer_mode: TransferMode

    @classmethod
    def build(
        cls,
        *,
        vllm_version: str,
        model: str,
        dtype: str,
        num_kv_heads: int,
        head_size: int,
        num_hidden_layers: int,
        attn_backend_name: str,
        cache_dtype: str = "auto",
        is_hma_enabled: bool = True,
        transfer_mode: TransferMode | str = TransferMode.PULL,
        speculative: SpeculativeFactors | None = None,
        connector_version: int = 13,
    ) -> CompatFactors:
        """Factors from engine settings, normalised the way vLLM normalises them.

        ``dtype`` may be given as ``"bfloat16"`` or ``"torch.bfloat16"`` (vLLM hashes the
        latter); ``num_kv_heads`` and ``num_hidden_layers`` are model totals, not per rank.
        Pass ``speculative`` only for EAGLE-family drafters (vLLM hashes ``None`` otherwise).
        ``is_hma_enabled`` defaults to what a vLLM engine with the NIXL connector hashes: the
        hybrid KV cache manager resolves *on* (vLLM 0.31.0's CUDA, ROCm, XPU and CPU platforms
        all support it, and the NIXL connectors do).
        """
        if speculative is not None and speculative.kv_cache_dtype is None:
            speculative = msgspec.structs.replace(speculative, kv_cache_dtype=cache_dtype)
        if not dtype.startswith("torch."):
            dtype = f"torch.{dtype}"
        if transfer_mode not in ("pull", "push"):
            raise ConfigError(f"transfer_mode must be 'pull' or 'push', got {transfer_mode!r}")
        return cls(
            vllm_version=vllm_version,
            nixl_connector_version=connector_version,
            model=model,
            dtype=dtype,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            num_hidden_layers=num_hidden_layers,
            attn_backend_name=attn_backend_name,
            cache_dtype=cache_dtype,
            is_hma_enabled=is_hma_enabled,
            speculative_config=speculative,
            transfer_mode=TransferMode(transfer_mode),
        )

    @classmethod
    def from_dict(cls, factors: Mapping[str, Any]) -> CompatFactors:
        """Validate a factors dict (as vLLM builds it); bad input raises :class:`ConfigError`."""
        try:
            return msgspec.convert(dict(factors), cls)
        except (msgspec.ValidationError, TypeError, ValueError) as exc:
            raise ConfigError(f"invalid compatibility factors: {exc}") from None

    @classmethod
    def from_vllm_config(cls, config: Mapping[str, Any]) -> CompatFactors:
        """The factors a vLLM engine with this configuration hashes.

        ``config`` is shaped like vLLM's ``VllmConfig`` (a JSON file of it, say), reading only
        what vLLM's hash reads: ``model_config`` (``model``, ``dtype`` and the model totals
        ``num_kv_heads``, ``head_size``, ``num_hidden_layers``, or an ``hf_config`` holding
        ``num_key_value_heads``, ``head_dim`` and ``num_hidden_layers``), ``cache_config``
        (``cache_dtype``), ``scheduler_config`` (``disable_hybrid_kv_cache_manager``; unset
        resolves as vLLM resolves it for the NIXL connectors: the manager stays on),
        ``speculative_config`` and ``kv_transfer_config`` (``kv_connector``:
        ``NixlPushConnector`` means push). Top-level ``vllm_version`` (default 0.31.0),
        ``attn_backend_name`` (default ``FLASH_ATTN``, ``CPU_ATTN`` on CPU) and ``platform``
        fill what vLLM learns at run time.
        """
        return _from_vllm_config(config)

    def as_dict(self) -> dict[str, Any]:
        """The factors as plain JSON values (tuples become lists), in vLLM's key order."""
        result: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(self))
        return result

    def hash(self) -> str:
        """The compatibility hash of these factors."""
        return compatibility_hash(self)


def compatibility_hash(factors: CompatFactors | Mapping[str, Any]) -> str:
    """SHA-256 hex digest of the factors' JSON with sorted keys, Python's default separators.

    Identical to vLLM's digest for identical factors (tuples hash as lists, non-ASCII is
    escaped). A plain mapping is hashed as given, so unknown future factors still hash.
    """
    data = factors.as_dict() if isinstance(factors, CompatFactors) else dict(factors)
    try:
        text = json.dumps(data, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"compatibility factors are not JSON-serialisable: {exc}") from None
    return hashlib.sha256(text.encode()).hexdigest()


def explain(
    local: CompatFactors | Mapping[str, Any], remote: CompatFactors | Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """The factors that differ, as ``{name: (local value, remote value)}``.

    Nested speculative factors are named ``speculative_config.<field>`` when both sides have
    them; a factor only one side has appears with ``None`` on the other.
    """
    return _diff(_plain(local), _plain(remote), prefix="")


def _plain(factors: CompatFactors | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(factors, CompatFactors):
        return factors.as_dict()
    # Round-trip through JSON so tuples and lists compare equal, exactly as they hash.
    try:
        plain: dict[str, Any] = json.loads(json.dumps(dict(factors)))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"compatibility factors are not JSON-serialisable: {exc}") from None
    return plain


def _diff(local: Mapping[str, Any], remote: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, tuple[Any, Any]] = {}
    for key in sorted(set(local) | set(remote)):
        a, b = local.get(key), remote.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.update(_diff(a, b, prefix=f"{prefix}{key}."))
        elif _canonical(a) != _canonical(b) or (key in local) != (key in remote):
            out[f"{prefix}{key}"] = (a, b)
    return out


def _canonical(value: Any) -> str:
    # Compare as the hash sees values: True and 1 are equal in Python, not in JSON.
    return json.dumps(value, sort_keys=True)


def format_differences(differing: Mapping[str, tuple[Any, Any]]) -> str:
    """One line naming each differing factor with both values: ``model: 'a' != 'b'``."""
    return "; ".join(f"{name}: {a!r} != {b!r}" for name, (a, b) in differing.items())


_VLLM_DEFAULT_RELEASE = "0.31.0"
_EAGLE_METHODS = frozenset({"eagle", "eagle3", "mtp", "dflash"})


def _section(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = config.get(name) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"vLLM config: {name} must be an object, got {type(value).__name__}")
    return value


def _model_total(model: Mapping[str, Any], ours: str, hf_key: str) -> Any:
    if ours in model:
        return model[ours]
    hf = model.get("hf_config") or {}
    if isinstance(hf, Mapping) and hf_key in hf:
        return hf[hf_key]
    raise ConfigError(f"vLLM config: model_config needs {ours} (or hf_config.{hf_key})")


def _from_vllm_config(config: Mapping[str, Any]) -> CompatFactors:
    if not isinstance(config, Mapping):
        raise ConfigError(f"vLLM config must be an object, got {type(config).__name__}")
    model = _section(config, "model_config")
    cache = _section(config, "cache_config")
    scheduler = _section(config, "scheduler_config")
    transfer = _section(config, "kv_transfer_config")
    platform = str(config.get("platform", "cuda")).lower()
    release = str(config.get("vllm_version", _VLLM_DEFAULT_RELEASE))
    disable_hma = bool(scheduler.get("disable_hybrid_kv_cache_manager") or False)
    connector = str(transfer.get("kv_connector", "NixlConnector"))
    mode = TransferMode.PUSH if connector == "NixlPushConnector" else TransferMode.PULL
    cache_dtype = str(cache.get("cache_dtype", "auto"))
    spec = config.get("speculative_config")
    speculative = None
    if isinstance(spec, Mapping) and spec.get("method") in _EAGLE_METHODS:
        draft = spec.get("draft_model_config") or {}
        aux = spec.get("auxiliary_layer_ids")
        speculative = SpeculativeFactors(
            method=str(spec["method"]),
            model=str(draft.get("model", spec.get("model", ""))),
            revision=draft.get("revision"),
            code_revision=draft.get("code_revision"),
            parallel_drafting=bool(spec.get("parallel_drafting", False)),
            kv_cache_dtype=spec.get("kv_cache_dtype"),
            auxiliary_layer_ids=tuple(aux) if aux is not None else None,
        )
    try:
        return CompatFactors.build(
            vllm_version=release,
            connector_version=next(
                (
                    v
                    for v, r in VLLM_RELEASES.items()
                    if release.startswith(r.rsplit(".", 1)[0] + ".")
                ),
                min(VLLM_RELEASES),
            ),
            model=str(model["model"]) if "model" in model else _missing("model_config.model"),
            dtype=str(model.get("dtype", "bfloat16")),
            num_kv_heads=int(_model_total(model, "num_kv_heads", "num_key_value_heads")),
            head_size=int(_model_total(model, "head_size", "head_dim")),
            num_hidden_layers=int(_model_total(model, "num_hidden_layers", "num_hidden_layers")),
            attn_backend_name=str(
                config.get("attn_backend_name", "CPU_ATTN" if platform == "cpu" else "FLASH_ATTN")
            ),
            cache_dtype=cache_dtype,
            is_hma_enabled=not disable_hma,
            transfer_mode=mode,
            speculative=speculative,
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"vLLM config: {exc}") from None


def _connector_version(release: str, releases: Mapping[int, str]) -> int:
    """The NIXL connector version a vLLM release speaks (same minor release)."""
    for version, known in releases.items():
        if release.startswith(known.rsplit(".", 1)[0] + "."):
            return version
    return min(releases)


def _missing(what: str) -> Any:
    raise ConfigError(f"vLLM config: {what} is required")
