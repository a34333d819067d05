"""Block bookkeeping of the reference engine: free list, block tables, prefix reuse.

Pure Python, no torch: the scheduler side of a paged KV cache. A request owns a *block
table* (logical block ids in token order). Full blocks are named by a chained hash of every
token up to their end, so a later request whose prompt starts with the same tokens maps the
same physical blocks instead of recomputing them. Freed blocks stay in the prefix table
until the allocator hands them out again (oldest freed first), exactly the reuse policy a
serving engine's prefix cache follows.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvwire.errors import ConfigError


class OutOfBlocksError(ConfigError):
    """The KV cache has no free block left for a request."""


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of every *full* block of ``tokens``: block i's hash covers tokens
    ``[0, (i + 1) * block_size)``, so equal hashes mean equal prefixes."""
    out: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chunk = ",".join(str(int(t)) for t in tokens[start : start + block_size])
        parent = hashlib.sha256(parent + chunk.encode()).digest()
        out.append(parent)
    return out


@dataclass
class SequenceState:
    """One request's tokens and the blocks holding their KV."""

    request_id: str
    tokens: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose KV is in the cache (computed here or received from a peer)."""
    num_cached: int = 0
    """Leading tokens that were prefix-cache hits when the request was admitted."""
    registered_blocks: int = 0
    """Leading full blocks already published in the prefix table."""


class BlockAllocator:
    """Hands out the ``num_blocks`` physical blocks of one engine's KV cache."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        if not self._free:
            raise OutOfBlocksError(f"KV cache full: all {self.num_blocks} blocks are in use")
        block, _ = self._free.popitem(last=False)
        stale = self._hash_of.pop(block, None)
        if stale is not None and self._by_hash.get(stale) == block:
            del self._by_hash[stale]
        self._refs[block] = 1
        return block

    def _share(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def admit(self, request_id: str, tokens: Sequence[int]) -> SequenceState:
        """Allocate the blocks a prompt needs, reusing cached full blocks of its prefix.

        The last prompt token is never a hit: the engine must compute it to get the logits
        of the first output token (so a block-aligned cached prompt recomputes one block).
        """
        seq = SequenceState(request_id, [int(t) for t in tokens])
        hits: list[int] = []
        if self.prefix_caching:
            for digest in block_hashes(seq.tokens[: len(seq.tokens) - 1], self.block_size):
                block = self._by_hash.get(digest)
                if block is None:
                    break
                hits.append(block)
        needed = self.blocks_for(len(seq.tokens)) - len(hits)
        if needed > self.num_free - sum(1 for b in hits if self._refs[b] == 0):
            raise OutOfBlocksError(
                f"request {request_id!r} needs {needed} blocks, {self.num_free} are free"
            )
        for block in hits:
            self._share(block)
        seq.block_ids = hits + [self._take() for _ in range(needed)]
        seq.num_cached = seq.num_computed = len(hits) * self.block_size
        seq.registered_blocks = len(hits)
        return seq

    def grow(self, seq: SequenceState, num_tokens: int) -> None:
        """Make room for ``num_tokens`` tokens (decode appends a block at each boundary)."""
        while len(seq.block_ids) < self.blocks_for(num_tokens):
            seq.block_ids.append(self._take())

    def publish(self, seq: SequenceState) -> None:
        """Enter the request's newly completed full blocks in the prefix table."""
        if not self.prefix_caching:
            return
        full = min(seq.num_computed, len(seq.tokens)) // self.block_size
        if full <= seq.registered_blocks:
            return
        digests = block_hashes(seq.tokens[: full * self.block_size], self.block_size)
        for index in range(seq.registered_blocks, full):
            digest, block = digests[index], seq.block_ids[index]
            if digest not in self._by_hash:
                self._by_hash[digest] = block
                self._hash_of[block] = digest
        seq.registered_blocks = full

    def release(self, seq: SequenceState) -> None:
        """Drop the request's references; unreferenced blocks return to the free list
        (keeping their prefix entry until they are handed out again)."""
        for block in reversed(seq.block_ids):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
        seq.block_ids = []
