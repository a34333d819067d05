"""Compute a compatibility hash, or compare two engines' factors.

FACTORS.json holds either the factors exactly as vLLM hashes them (it has
"nixl_connector_version"), or engine settings for the builder: vllm_version, model, dtype,
num_kv_heads, head_size, num_hidden_layers, attn_backend_name, cache_dtype, is_hma_enabled,
transfer_mode, speculative (an object or null) and connector_version (default 13). An object
with a "factors" key (as in the golden vectors) is read through that key.

Prints the hash. With --against OTHER.json prints "compatible <hash>" and exits 0 when both
hash alike, or one "factor: ours != theirs" line per differing factor and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvwire.errors import ConfigError

EXIT_DIFFERENT = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factors", metavar="FACTORS.json", help="factors or settings ('-': stdin)")
    parser.add_argument("--against", metavar="OTHER.json", help="compare with these factors")


def run(args: argparse.Namespace) -> int:
    from kvwire.compat import explain

    local = load_factors(args.factors)
    if args.against is None:
        sys.stdout.write(local.hash() + "\n")
        return 0
    remote = load_factors(args.against)
    if local.hash() == remote.hash():
        sys.stdout.write(f"compatible {local.hash()}\n")
        return 0
    for name, (ours, theirs) in explain(local, remote).items():
        sys.stdout.write(f"{name}: {json.dumps(ours)} != {json.dumps(theirs)}\n")
    return EXIT_DIFFERENT


def load_factors(path: str) -> Any:
    """Read a factors or settings file into :class:`kvwire.compat.CompatFactors`."""
    import msgspec

    from kvwire.compat import CompatFactors, SpeculativeFactors

    doc = _read_json(path)
    if "factors" in doc and isinstance(doc["factors"], dict):
        doc = doc["factors"]
    if "nixl_connector_version" in doc:
        return CompatFactors.from_dict(doc)
    settings = dict(doc)
    spec = settings.pop("speculative", None)
    if spec is not None:
        if not isinstance(spec, dict):
            raise ConfigError(f"{path}: 'speculative' must be an object or null")
        spec = dict(spec)
        if "aux" in spec:  # the golden vectors' short name
            spec["auxiliary_layer_ids"] = spec.pop("aux")
        try:
            settings["speculative"] = msgspec.convert(spec, SpeculativeFactors)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{path}: invalid speculative factors: {exc}") from None
    try:
        factors: Any = CompatFactors.build(**settings)
    except (TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}: invalid settings: {exc}".replace("build() ", "")) from None
    # Re-validate types (build() trusts its keyword arguments).
    return CompatFactors.from_dict(factors.as_dict())


def _read_json(path: str) -> dict[str, Any]:
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return doc
