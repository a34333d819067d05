"""A peer's prepared tables as the NIXL adapter keeps them, and the row indices it takes.

The adapter prepares the two tables a pairing can post (``prep_xfer_dlist``) once per peer
and makes requests from index arrays; these are the pieces that need no agent lock.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from kvwire.errors import DescriptorError


class Prepared:
    """One peer's prepared tables: NIXL's two prepped lists and their lengths.

    Dropped (``stale``) when the peer's agent or a local registration changes; NIXL's lists
    are released once no request made from them is left."""

    __slots__ = ("local_list", "local_rows", "remote_list", "remote_rows", "stale", "users")

    def __init__(self, local_list: Any, local_rows: int, remote_list: Any, remote_rows: int):
        self.local_list = local_list
        self.local_rows = local_rows
        self.remote_list = remote_list
        self.remote_rows = remote_rows
        self.stale = False
        self.users = 0


def rows_of(rows: Any, size: int, side: str) -> np.ndarray[Any, np.dtype[np.int32]]:
    """Row indices as NIXL takes them (int32), each inside its table (DescriptorError)."""
    try:
        array = np.asarray(rows)
    except Exception as exc:
        raise DescriptorError(f"{side} rows must be an integer array: {exc}") from exc
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise DescriptorError(
            f"{side} rows must be a 1-D integer array, got {array.dtype}{array.shape}"
        )
    if array.size and (int(array.min()) < 0 or int(array.max()) >= size):
        raise DescriptorError(
            f"{side} rows must lie in [0, {size}), got [{int(array.min())}, {int(array.max())}]"
        )
    return array.astype(np.int32)


def release_lists(prepared: Prepared) -> None:
    """Give NIXL's prepped lists back (they belong to the agent, not to a lock holder)."""
    for made in (prepared.local_list, prepared.remote_list):
        with contextlib.suppress(Exception):  # nothing to report: the tables are gone
            made.release()
    prepared.local_list = prepared.remote_list = None
