"""The transfer state machines, sans-IO: no sockets, threads or clock reads inside.

A driver (the runtime, the simulator, a test) feeds events with the current time and
executes the actions that come back::

    machine = ConsumerMachine(KVWireConfig(engine_id="decode-0", tp_size=2, tp_rank=1))
    actions = machine.handle(RequestAdded("req-1", remote=RemotePrefill(...)), now)
    ...
    deadline = machine.next_deadline()      # call handle(Timer(), now) once now >= deadline

Every legal transition is listed in :mod:`kvwire.machine.table`. The machines take the one
configuration, :class:`~kvwire.config.KVWireConfig` (pass ``environ={}`` for a machine that
must not see ``KVWIRE_*`` variables, as the simulator does).
"""

from __future__ import annotations

from kvwire.machine._core import InvariantViolation, MachineStats, rebase_deadline
from kvwire.machine.actions import (
    ACTION_TYPES,
    Action,
    ArmTimer,
    CancelTransfer,
    EvictEngine,
    FailReason,
    FreeBlocks,
    FreeReason,
    PeerMisbehaved,
    PostRead,
    PostWrite,
    QueryLeases,
    ReleaseTransfer,
    RemoteRank,
    RequestDone,
    RequestFailed,
    SendNotification,
    StartHandshake,
)
from kvwire.machine.consumer import ConsumerMachine
from kvwire.machine.events import (
    EVENT_TYPES,
    Abort,
    AllocationDone,
    BlockIds,
    ChunkScheduled,
    Event,
    HandshakeDone,
    HandshakeFailed,
    LayersComputed,
    LeaseConfirmed,
    NotificationReceived,
    PeerLost,
    Preempted,
    PrefillFinished,
    ReleaseFailed,
    RemotePrefill,
    RequestAdded,
    Timer,
    TransferDone,
    TransferFailed,
    TransferPosted,
)
from kvwire.machine.producer import ProducerMachine, base_request_id
from kvwire.machine.table import ConsumerState, EngineState, ProducerState, TransferState
from kvwire.wire.schemas import FEATURES, TransferMode

__all__ = [
    "ACTION_TYPES",
    "EVENT_TYPES",
    "FEATURES",
    "Abort",
    "Action",
    "AllocationDone",
    "ArmTimer",
    "BlockIds",
    "CancelTransfer",
    "ChunkScheduled",
    "ConsumerMachine",
    "ConsumerState",
    "EngineState",
    "Event",
    "EvictEngine",
    "FailReason",
    "FreeBlocks",
    "FreeReason",
    "HandshakeDone",
    "HandshakeFailed",
    "InvariantViolation",
    "LayersComputed",
    "LeaseConfirmed",
    "MachineStats",
    "NotificationReceived",
    "PeerLost",
    "PeerMisbehaved",
    "PostRead",
    "PostWrite",
    "Preempted",
    "PrefillFinished",
    "QueryLeases",
    "ProducerMachine",
    "ProducerState",
    "ReleaseFailed",
    "ReleaseTransfer",
    "RemotePrefill",
    "RemoteRank",
    "RequestAdded",
    "RequestDone",
    "RequestFailed",
    "SendNotification",
    "StartHandshake",
    "Timer",
    "TransferDone",
    "TransferFailed",
    "TransferMode",
    "TransferPosted",
    "TransferState",
    "base_request_id",
    "rebase_deadline",
]
