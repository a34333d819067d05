"""The simulated deployment's parts: engine and cluster specs, block allocators, ranks,
in-flight transfers, requests and the run's result; :mod:`kvwire.sim.world` moves them.

Kept apart from the world's event loop so the loop reads as what happens, and this module
as what exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvwire.machine import (
    Action,
    ConsumerMachine,
    ProducerMachine,
    TransferMode,
)

HEADS = 4
UNIT = 16
FULL = HEADS * UNIT
"""Bytes of one logical block over all heads; a rank holds its heads' slice (MLA: all)."""
POISON = 255
"""Freshly allocated consumer blocks hold this; the KV pattern never does (values < 251)."""
SCRIBBLE = 253
"""A streamed prompt's blocks hold this until a layer of a chunk is computed into them (and
again once the engine takes them back): a byte written before it was computed, or from
blocks given to another prompt, never matches the KV."""
LAYERS = 4
"""Streaming (``--stream``): layers of the push cluster's KV, one stream unit (region) each."""
BLOCK_TOKENS = 4
"""Streaming: tokens per block (prompts end mid-block; chunks are cut at any token)."""
STREAM_UNITS = LAYERS - 1
"""Units written before the prompt ends: every layer but the last (it carries the
completion)."""
P_BLOCKS = 16384
D_BLOCKS = 32768
ARRIVALS_PER_S = 400.0

Buffer = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class EngineSpec:
    name: str
    role: str  # "P" or "D"
    cluster: str
    tp: int
    lease_s: float = 30.0


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    mode: TransferMode
    mla: bool
    weight: float


CLUSTERS = (
    ClusterSpec("pull", TransferMode.PULL, False, 0.5),
    ClusterSpec("mla", TransferMode.PULL, True, 0.2),
    ClusterSpec("push", TransferMode.PUSH, False, 0.3),
)

ENGINES = (
    EngineSpec("pA0", "P", "pull", 2),
    EngineSpec("pA1", "P", "pull", 1),
    EngineSpec("dA0", "D", "pull", 1),
    EngineSpec("dA1", "D", "pull", 4),
    EngineSpec("pM0", "P", "mla", 2),
    EngineSpec("dM0", "D", "mla", 1),
    EngineSpec("dM1", "D", "mla", 4),
    EngineSpec("pW0", "P", "push", 2),
    EngineSpec("dW0", "D", "push", 1),
    EngineSpec("dW1", "D", "push", 4),
)
SHORT_LEASE = EngineSpec("pS0", "P", "pull", 1, lease_s=5.5)


class Allocator:
    """An engine's block manager: a free list plus an ownership map for leak checks."""

    def __init__(self, n: int) -> None:
        self.free_list = list(range(n - 1, -1, -1))
        self.owned = np.zeros(n, dtype=bool)
        self.gens = np.zeros(n, dtype=np.int64)
        """Bumped when a block is freed: a read that saw another generation read reused KV."""
        self.allocated = 0

    def alloc(self, k: int) -> list[int] | None:
        if k > len(self.free_list):
            return None
        ids = [self.free_list.pop() for _ in range(k)]
        self.owned[ids] = True
        self.allocated += k
        return ids

    def free(self, ids: list[int]) -> int:
        """Return the ids to the pool; the number that were not allocated (double frees)."""
        arr = np.asarray(ids, dtype=np.int64)
        owned = self.owned[arr]
        good = arr[owned]
        self.owned[good] = False
        self.gens[good] += 1
        self.free_list.extend(good.tolist())
        self.allocated -= len(good)
        return len(ids) - len(good)


class Rank:
    __slots__ = (
        "agent",
        "alive",
        "buf",
        "engine",
        "index",
        "last_now",
        "machine",
        "peers",
        "timer_at",
        "xfers",
    )

    def __init__(
        self,
        engine: Engine,
        index: int,
        machine: ConsumerMachine | ProducerMachine,
        width: int,
        blocks: int,
        layered: bool = False,
    ) -> None:
        self.engine = engine
        self.index = index
        self.machine = machine
        shape = (blocks, LAYERS, BLOCK_TOKENS, width) if layered else (blocks, width)
        self.buf: Buffer = np.zeros(shape, dtype=np.uint8)
        """Per block: its bytes; streaming: ``[layer, token in block, byte]``."""
        self.agent = f"{engine.spec.name}#{engine.inc}:{index}"
        self.alive = True
        self.last_now = -math.inf
        self.timer_at = math.inf
        self.peers: dict[str, int] = {}
        """engine name -> the incarnation our handshake added (the transport's peer)."""
        self.xfers: dict[int, Xfer] = {}


class Engine:
    def __init__(self, spec: EngineSpec, cluster: ClusterSpec, skew: float, sched_skew: float):
        self.spec = spec
        self.cluster = cluster
        self.skew = skew
        self.sched_skew = sched_skew
        self.inc = 0
        self.up = True
        self.ranks: list[Rank] = []
        self.blocks = P_BLOCKS if spec.role == "P" else D_BLOCKS
        self.alloc = Allocator(self.blocks)

    @property
    def engine_id(self) -> str:
        """A restarted engine is a new engine: vLLM gives every process its own id, and the
        handshake's id check is what stops a consumer reading a dead process's block ids."""
        return f"{self.spec.name}.{self.inc}"

    def slice_of(self, rank: int) -> tuple[int, int]:
        """(first byte, length) of a logical block this rank stores."""
        if self.cluster.mla:
            return 0, FULL
        width = FULL // self.spec.tp
        return rank * width, width


class Xfer:
    """One transfer in flight on the fabric."""

    __slots__ = (
        "cancelled",
        "data",
        "dst_gens",
        "dst_ids",
        "gens",
        "notif",
        "outcome",
        "peer",
        "peer_inc",
        "peer_rank",
        "rank",
        "read",
        "rid",
        "rows",
        "src_ids",
        "stale",
        "stalled",
        "xid",
    )
    cancelled: bool
    data: Buffer | None
    dst_gens: npt.NDArray[np.int64] | None
    """A WRITE: the generations of its consumer blocks when the consumer allocated them for
    this request (a landing that finds others wrote into blocks D since reused)."""
    dst_ids: list[int]
    gens: npt.NDArray[np.int64] | None
    notif: bytes
    outcome: str
    peer: Engine
    peer_inc: int
    peer_rank: int
    rank: Rank
    read: bool
    rid: str
    rows: Rows | None
    """A streaming round's rectangles as (src index, dst index) into the ranks' buffers."""
    src_ids: list[int]
    xid: int

    def __init__(self) -> None:
        self.cancelled = False
        self.rows = None
        self.data = None
        """The source bytes, when the DMA read them as it was posted."""
        self.dst_gens = None
        self.outcome = ""
        self.stalled = False
        """Held up by a partition: completes after the heal with whatever is there then."""
        self.stale = False
        """A stalled READ whose source blocks were freed by the producer before it ended."""


class Request:
    """One prompt's journey through the proxy, a producer and a consumer."""

    __slots__ = (
        "aborted",
        "cluster",
        "d",
        "d_gens",
        "d_ids",
        "d_inc",
        "d_results",
        "d_rid",
        "expired",
        "k",
        "n",
        "nt",
        "p",
        "p_aborted",
        "p_done",
        "p_freed",
        "p_ids",
        "p_inc",
        "p_rid",
        "preemptions",
        "read_stale",
        "seed",
        "status",
        "stream",
        "streamed",
        "t0",
    )
    aborted: bool
    cluster: ClusterSpec
    d: Engine
    d_ids: list[int]
    d_inc: int
    d_gens: npt.NDArray[np.int64] | None
    d_results: dict[int, Action]
    d_rid: str
    expired: bool
    k: int
    n: int
    nt: int
    """Streaming: the prompt's tokens (``n`` blocks of BLOCK_TOKENS, the last maybe part)."""
    p: Engine
    p_aborted: bool
    p_done: bool
    """The producer engine handed the prompt's blocks over (PrefillFinished)."""
    p_freed: set[int]
    p_ids: list[int]
    p_inc: int
    p_rid: str
    preemptions: int
    read_stale: bool
    seed: int
    status: str
    stream: Stream | None
    streamed: bool
    """A round of its KV was written before its prompt ended."""
    t0: float

    def __init__(self) -> None:
        self.status = "pending"
        self.p_freed = set()
        self.d_results = {}
        self.p_ids = []
        self.d_ids = []
        self.expired = False
        self.aborted = False
        self.read_stale = False
        self.d_gens = None
        self.nt = 0
        self.p_aborted = False
        self.p_done = False
        self.preemptions = 0
        self.stream = None
        self.streamed = False


class Stream:
    """A prompt the producer engine computes chunk by chunk, layer by layer."""

    __slots__ = ("bounds", "chunk", "ids", "layer", "version")

    def __init__(self, bounds: list[int]) -> None:
        self.bounds = bounds
        """Token boundaries of its chunks: ``[0, ..., nt]``."""
        self.chunk = 0
        self.layer = -1
        """The next layer to compute in the chunk; -1: the chunk is not scheduled yet."""
        self.ids: list[int] = []
        """The blocks the engine holds for it so far (its own until PrefillFinished)."""
        self.version = 0
        """Bumped at each preemption: the KV computed again is told apart from the old."""


@dataclass
class SimResult:
    seed: int
    requests: int = 0
    done: int = 0
    failed: int = 0
    expired: int = 0
    aborted: int = 0
    leaked_blocks: int = 0
    double_frees: int = 0
    stuck: int = 0
    invariant_violations: int = 0
    corrupt: int = 0
    stale_done: int = 0
    """Requests reported done whose bytes were not the producer's for that request (a READ
    that outlived the lease and read blocks the producer had given to another prompt)."""
    partitions: int = 0
    streamed: int = 0
    """Streaming: requests that had KV written before their prompt ended."""
    stream_rounds: int = 0
    preemptions: int = 0
    stalls: int = 0
    vanished: int = 0
    """Consumer engines killed while a prompt streamed to them (``vanish``)."""
    late_writes: int = 0
    """WRITEs that landed in consumer blocks after the consumer freed them (counted in
    ``corrupt`` too)."""
    lease_queries: int = 0
    """Lease queries a producer answered (every engine here is kvwire: ``lease-query``)."""
    bytes_verified: int = 0
    quarantined_blocks: int = 0
    """Consumer blocks of failed push requests held until the producer's writes into them
    are bounded to have ended (``writes_until``), then freed."""
    machine_events: int = 0
    notifications_dropped: int = 0
    crashes: int = 0
    sim_time_s: float = 0.0
    wall_s: float = 0.0
    faults: list[str] = field(default_factory=list)
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.invariant_violations == 0
            and self.leaked_blocks == 0
            and self.double_frees == 0
            and self.stuck == 0
            and self.corrupt == 0
            and self.stale_done == 0
        )


Cells = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]
Rows = tuple[Cells, Cells]
"""Source and destination index arrays ``(block, layer, token in block)`` of a round."""


def kv(
    seed: int,
    version: int,
    layers: npt.NDArray[np.int64],
    tokens: npt.NDArray[np.int64],
    start: int,
    width: int,
) -> Buffer:
    """Streaming: the KV bytes ``[start, start+width)`` of ``(layer, token)`` pairs of a
    prompt computed the ``version``-th time; one row per pair. Every input changes every
    byte (a mixed hash), so a byte of another layer, token, prompt or computation is wrong.
    """
    cols = np.arange(start, start + width, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = (
            np.uint64(seed * 1_000_003 + version * 7919)
            + layers.astype(np.uint64)[:, None] * np.uint64(104_729)
            + tokens.astype(np.uint64)[:, None] * np.uint64(1_299_709)
            + cols[None, :] * np.uint64(15_485_863)
        )
        h ^= h >> np.uint64(29)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(32)
    out: Buffer = (h % np.uint64(251)).astype(np.uint8)
    return out


def piece_rows(
    pieces: tuple[tuple[int, int, int, int], ...],
    nt: int,
    src_ids: list[int],
    dst_ids: list[int],
) -> Rows | None:
    """The (block, layer, token) cells a streaming round's rectangles name, on both sides:
    the producer's list is the prompt's first blocks, the consumer's its last (a prefix
    hit needs no more). None if a rectangle names a token past the producer's blocks."""
    layers_l: list[npt.NDArray[np.int64]] = []
    tokens_l: list[npt.NDArray[np.int64]] = []
    for u0, u1, t0, t1 in pieces:
        ls = np.arange(u0, LAYERS if u1 < 0 else u1, dtype=np.int64)
        ts = np.arange(t0, nt if t1 < 0 else t1, dtype=np.int64)
        layers_l.append(np.repeat(ls, len(ts)))
        tokens_l.append(np.tile(ts, len(ls)))
    layers = np.concatenate(layers_l) if layers_l else np.zeros(0, dtype=np.int64)
    tokens = np.concatenate(tokens_l) if tokens_l else np.zeros(0, dtype=np.int64)
    blocks = tokens // BLOCK_TOKENS
    if len(blocks) and int(blocks.max()) >= len(src_ids):
        return None
    skip = -(-nt // BLOCK_TOKENS) - len(dst_ids)
    keep = blocks >= skip
    layers, tokens, blocks = layers[keep], tokens[keep], blocks[keep]
    src = np.asarray(src_ids, dtype=np.int64)[blocks]
    dst = np.asarray(dst_ids, dtype=np.int64)[blocks - skip]
    within = tokens % BLOCK_TOKENS
    return (src, layers, within), (dst, layers, within)


def pattern(seed: int, positions: npt.NDArray[np.int64], start: int, width: int) -> Buffer:
    """The KV bytes of a prompt's blocks at ``positions``, bytes ``[start, start+width)``."""
    cols = np.arange(start, start + width, dtype=np.int64)
    return ((seed * 131 + positions[:, None] * 7 + cols[None, :]) % 251).astype(np.uint8)
