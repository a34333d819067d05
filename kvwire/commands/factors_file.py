"""Compatibility factors from a file, and the one comparison of two engines' factors.

``kvwire compat-hash`` and ``kvwire probe --factors`` read the same files and must agree:
a file whose ``compat-hash`` equals a peer's hash is compatible with that peer in ``probe``
too. Both therefore load through :func:`load_factors` (which normalises engine settings
exactly as :meth:`~kvwire.wire.compat.CompatFactors.build` does) and compare through
:func:`compare`.

A file holds either the factors exactly as vLLM hashes them (it has
``nixl_connector_version``), or engine settings for the builder (``vllm_version``,
``model``, ``dtype``, ...; ``speculative`` an object or null; ``connector_version``,
default 13). An object with a ``factors`` key (as in the golden vectors) is read through it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvwire.errors import ConfigError
from kvwire.wire.compat import CompatFactors, SpeculativeFactors, explain


def load_factors(path: str) -> CompatFactors:
    """Read a factors or settings file (``-``: stdin); any problem is a ConfigError."""
    doc = _read_json(path)
    if "factors" in doc and isinstance(doc["factors"], dict):
        doc = doc["factors"]
    if "nixl_connector_version" in doc:
        return _named(path, CompatFactors.from_dict, doc)
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
        built = CompatFactors.build(**settings)
    except (TypeError, AttributeError) as exc:
        why = str(exc).replace("CompatFactors.build() ", "").replace("build() ", "")
        raise ConfigError(f"{path}: invalid settings: {why}") from None
    # build() trusts its keyword arguments: validate the types it was given.
    return _named(path, CompatFactors.from_dict, built.as_dict())


@dataclass(frozen=True)
class Comparison:
    """Whether a peer hashing ``remote_hash`` is compatible with ``local``, and why not."""

    local_hash: str
    remote_hash: str
    compatible: bool
    differing: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    how: str = ""
    """Where ``differing`` comes from (the peer's stated factors, or a guess)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "local_hash": self.local_hash,
            "remote_hash": self.remote_hash,
            "compatible": self.compatible,
            "differing": {k: [a, b] for k, (a, b) in self.differing.items()},
            "how": self.how,
        }


def compare(
    local: CompatFactors,
    remote_hash: str,
    remote_factors: Mapping[str, Any] | CompatFactors | None = None,
) -> Comparison:
    """Compatible exactly when the hashes are equal; otherwise the factors that differ,
    from the peer's own factors when it states them."""
    local_hash = local.hash()
    if local_hash == remote_hash:
        return Comparison(local_hash, remote_hash, True, how="equal hashes")
    if remote_factors is None:
        return Comparison(
            local_hash, remote_hash, False, how="unknown (peer did not state its factors)"
        )
    return Comparison(
        local_hash,
        remote_hash,
        False,
        explain(local, remote_factors),
        how="from the factors the peer states",
    )


def _named(path: str, convert: Any, doc: Mapping[str, Any]) -> CompatFactors:
    try:
        factors: CompatFactors = convert(doc)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return factors


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
