"""Descriptor arrays as NIXL wants them: validated once, adjacent spans merged.

NIXL's plain (``initialize_xfer``) path does not merge adjacent descriptors, while its
prepped path does; measured here, a READ of 256 adjacent 64 KiB blocks took 2.2 ms
unmerged and 1.3 ms merged. Merging in numpy before ``initialize_xfer`` gives the plain
path the merged speed without the cost of preparing lists per transfer.
"""

from __future__ import annotations

import numpy as np

from kvwire.transport import Descs, as_descs, check_pair

_INT64 = np.dtype(np.int64)
_NDARRAY = np.ndarray

CACHEABLE_ROWS = 1024
"""Transfers of at most this many descriptors keep their NIXL request for reuse; above
it the transfer itself dwarfs creating a request, and hashing the key would not pay."""


def prepare(local: object, remote: object) -> tuple[Descs, Descs]:
    """Validated ``(N, 3)`` int64 arrays that pair up row by row (DescriptorError if not)."""
    loc = as_descs(local)  # type: ignore[arg-type]
    rem = as_descs(remote)  # type: ignore[arg-type]
    check_pair(loc, rem)
    return loc, rem


def fast_key(local: object, remote: object) -> tuple[bytes, bytes] | None:
    """The exact bytes of a small ``(N, 3)`` int64 descriptor pair, or None.

    The bytes only serve to find a request made earlier from arrays with the very same
    content, which were validated then (``tobytes`` copies in C order, so views and
    copies of one array give one key); anything else returns None and takes the
    validating path. Kept to a handful of attribute reads: this is the 4 KiB hot path
    (the dtype test is by identity: numpy's native int64 dtype is one object, and any
    other spelling of it merely takes the validating path).
    """
    if type(local) is not _NDARRAY or type(remote) is not _NDARRAY:
        return None
    shape = local.shape
    if (
        local.dtype is not _INT64
        or remote.dtype is not _INT64
        or shape != remote.shape
        or len(shape) != 2
        or shape[1] != 3
        or shape[0] > CACHEABLE_ROWS
    ):
        return None
    return local.tobytes(), remote.tobytes()
