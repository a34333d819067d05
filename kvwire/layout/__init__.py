"""The KV layout layer: where each block's bytes live and which bytes one transfer moves.

Five modules, each importing only the ones before it (and :mod:`kvwire.errors`, and
:mod:`kvwire.wire` for the transfer mode):
:mod:`~kvwire.layout.topology` (which ranks pair up across TP sizes),
:mod:`~kvwire.layout.geometry` (one rank's registered regions, and a peer's as advertised),
:mod:`~kvwire.layout.alignment` (whether two geometries can exchange blocks, naming every
mismatch), :mod:`~kvwire.layout.descs` (descriptor arrays and coalescing) and
:mod:`~kvwire.layout.plan` (block ids to descriptor arrays). Nothing here does
I/O; the machines and the runtime sit above it.
"""

from __future__ import annotations

from kvwire.layout.alignment import PeerPolicy, check_producer, validate_peer
from kvwire.layout.descs import (
    BlockIds,
    Descs,
    coalesce,
    coalesce_columns,
    coalesce_ranges,
    descriptor_ids,
    empty_descs,
    expand_to_kernel_blocks,
)
from kvwire.layout.geometry import (
    BlockRegion,
    KVGeometry,
    KVLayout,
    RegionKind,
    RemoteGeometry,
    parse_layout,
)
from kvwire.layout.plan import MAX_TABLE_ROWS, PeerLayout, TransferPlan, plan_read, plan_write

__all__ = [
    "BlockIds",
    "BlockRegion",
    "Descs",
    "KVGeometry",
    "KVLayout",
    "MAX_TABLE_ROWS",
    "PeerLayout",
    "PeerPolicy",
    "RegionKind",
    "RemoteGeometry",
    "TransferPlan",
    "coalesce",
    "coalesce_columns",
    "coalesce_ranges",
    "descriptor_ids",
    "empty_descs",
    "expand_to_kernel_blocks",
    "parse_layout",
    "plan_read",
    "plan_write",
    "check_producer",
    "validate_peer",
]
