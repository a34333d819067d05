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
    ) -> None:
        self.engine = engine
        self.index = index
        self.machine = machine
        self.buf: Buffer = np.zeros((blocks, width), dtype=np.uint8)
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
        "src_ids",
        "stale",
        "stalled",
        "xid",
    )
    cancelled: bool
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
    src_ids: list[int]
    xid: int

    def __init__(self) -> None:
        self.cancelled = False
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
        "d_ids",
        "d_inc",
        "d_results",
        "d_rid",
        "expired",
        "k",
        "n",
        "p",
        "p_freed",
        "p_ids",
        "p_inc",
        "p_rid",
        "read_stale",
        "seed",
        "status",
        "t0",
    )
    aborted: bool
    cluster: ClusterSpec
    d: Engine
    d_ids: list[int]
    d_inc: int
    d_results: dict[int, Action]
    d_rid: str
    expired: bool
    k: int
    n: int
    p: Engine
    p_freed: set[int]
    p_ids: list[int]
    p_inc: int
    p_rid: str
    read_stale: bool
    seed: int
    status: str
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
    lease_queries: int = 0
    """Lease queries a producer answered (every engine here is kvwire: ``lease-query``)."""
    bytes_verified: int = 0
    quarantined_blocks: int = 0
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


def pattern(seed: int, positions: npt.NDArray[np.int64], start: int, width: int) -> Buffer:
    """The KV bytes of a prompt's blocks at ``positions``, bytes ``[start, start+width)``."""
    cols = np.arange(start, start + width, dtype=np.int64)
    return ((seed * 131 + positions[:, None] * 7 + cols[None, :]) % 251).astype(np.uint8)
