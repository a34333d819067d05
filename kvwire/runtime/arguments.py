"""What the engine passes to a runtime, checked at the call that receives it.

A wrong argument must fail where it was passed, naming the argument, and never turn into a
request that reports done with bytes that are not its own: a flat list read as one group per
id, a float id truncated to a neighbouring block, a numeric string parsed as an id, an id
past the registered pool. The machines check their events' shapes too, but in protocol
words and only after the conversion that hid the mistake; these checks come first.

Every check here is per call and vectorised (one ``numpy.asarray`` per group), never per
block in Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvwire.errors import ConfigError, LocalProtocolError
from kvwire.layout.geometry import KVGeometry

BlockIds = tuple[tuple[int, ...], ...]

_ID_KINDS = ("i", "u")
"""numpy dtype kinds of integer ids; bool (``b``), float, string and object are refused."""


def _is_sequence(value: object) -> bool:
    return isinstance(value, (Sequence, np.ndarray)) and not isinstance(
        value, (str, bytes, bytearray, memoryview)
    )


def block_ids_arg(
    value: object, geometry: KVGeometry | None, *, name: str = "block_ids"
) -> BlockIds:
    """``value`` as per-group tuples of Python ints, or a :class:`LocalProtocolError`.

    One list per KV-cache group the geometry has (``[[0, 1, 2]]`` for one group, not
    ``[0, 1, 2]``), integer ids only, each inside the registered pool. An empty sequence
    means nothing to move, as vLLM says it for a full prefix-cache hit.
    """
    if geometry is None:
        raise LocalProtocolError(f"register_kv_caches before passing {name}")
    if not _is_sequence(value):
        raise LocalProtocolError(
            f"{name}: expected one list of block ids per KV-cache group, got {type(value).__name__}"
        )
    assert isinstance(value, (Sequence, np.ndarray))
    groups: list[tuple[int, ...]] = []
    pool = geometry.advertised_num_blocks() // geometry.physical_blocks_per_logical
    for index, group in enumerate(value):
        if not _is_sequence(group):
            raise LocalProtocolError(
                f"{name}[{index}]: expected a list of block ids, got {type(group).__name__} "
                f"({group!r}); pass one list per KV-cache group, e.g. [[0, 1, 2]]"
            )
        ids = np.asarray(group)
        if ids.size == 0:
            groups.append(())
            continue
        if ids.ndim != 1 or ids.dtype.kind not in _ID_KINDS:
            raise LocalProtocolError(
                f"{name}[{index}]: block ids must be ints, got {ids.dtype.name} "
                f"values such as {ids.reshape(-1)[0]!r}"
            )
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= pool:
            bad = high if high >= pool else low
            raise LocalProtocolError(
                f"{name}[{index}]: block id {bad} is outside the registered pool of {pool} blocks"
            )
        groups.append(tuple(ids.astype(np.int64, copy=False).tolist()))
    expected = geometry_groups(geometry)
    if groups and expected is not None and len(groups) != expected:
        raise LocalProtocolError(
            f"{name}: {len(groups)} lists, but the registered KV cache has {expected} "
            f"KV-cache group{'s' if expected != 1 else ''} (one list per group)"
        )
    return tuple(groups)


def geometry_groups(geometry: KVGeometry) -> int | None:
    """How many KV-cache groups index the geometry's blocks: the groups it declares, else
    those its regions name; None when every region is shared and no group is declared."""
    if geometry.group_kinds or geometry.group_block_sizes:
        return max(len(geometry.group_kinds), len(geometry.group_block_sizes))
    ids = [r.group_id for r in geometry.regions if r.group_id >= 0]
    return max(ids) + 1 if ids else None


def num_tokens_arg(value: object, held: int = 0) -> int | None:
    """A prompt length the blocks passed can hold, or None when not given. ``held``: the
    tokens those blocks reach (:meth:`KVGeometry.tokens_held`); 0: no blocks to fit."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise LocalProtocolError(f"num_tokens must be an int, got {type(value).__name__}")
    tokens = int(value)
    if tokens < 0 or (held and not 0 < tokens <= held):
        raise LocalProtocolError(
            f"num_tokens {tokens} does not fit the blocks passed: they hold 1 to {held} tokens"
        )
    return tokens


def request_id_arg(value: object, *, name: str = "request_id") -> str:
    """A request id the protocol's notifications can carry: heartbeats join ids with ','."""
    if not isinstance(value, str) or not value:
        raise LocalProtocolError(f"{name} must be a non-empty str, got {value!r}")
    if "," in value:
        raise LocalProtocolError(
            f"{name} {value!r} contains ',': heartbeats list request ids separated by ','"
        )
    try:
        value.encode()
    except UnicodeEncodeError:
        raise LocalProtocolError(f"{name} {value!r} is not valid Unicode text") from None
    return value


def params_arg(value: object) -> Mapping[str, Any] | bytes | bytearray | memoryview | str:
    """``kv_transfer_params`` of a type the decoder reads (a dict, JSON text, msgpack)."""
    if not isinstance(value, (Mapping, bytes, bytearray, memoryview, str)):
        raise LocalProtocolError(
            "kv_transfer_params must be a dict, JSON text or msgpack bytes, got "
            f"{type(value).__name__}"
        )
    return value


def geometry_arg(value: object) -> KVGeometry:
    if not isinstance(value, KVGeometry):
        raise ConfigError(
            f"register_kv_caches needs a kvwire.KVGeometry, got {type(value).__name__}"
        )
    return value
