"""Commands sent to a peer agent process.

They travel as :mod:`kvwire.framing` frames over a socketpair inherited by the child;
stdout and stderr stay free for whatever the transport's libraries print.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Hello(msgspec.Struct, tag=True):
    pass


class Alloc(msgspec.Struct, tag=True):
    """Allocate ``nbytes`` and register them, or only the first ``register`` bytes when it
    is set: the rest stays mapped, so a descriptor past the region's end reaches memory
    (an adapter that skips its bound check then moves bytes instead of faulting)."""

    nbytes: int
    allocator: str = "numpy"
    register: int = 0


class Deregister(msgspec.Struct, tag=True):
    region: int


class Fill(msgspec.Struct, tag=True):
    """Oracle write of ``pattern(seed)`` over ``[addr, addr + nbytes)``."""

    addr: int
    nbytes: int
    seed: int


class ReadDescs(msgspec.Struct, tag=True):
    """Oracle read of the spans of an (N, 3) int64 descriptor array (raw bytes), or with
    ``digest`` only their CRC-32, which spares the channel large reads."""

    descs: bytes
    digest: bool = False


class Metadata(msgspec.Struct, tag=True):
    pass


class AddPeer(msgspec.Struct, tag=True):
    blob: bytes


class Post(msgspec.Struct, tag=True):
    op: str
    peer: str
    local: bytes
    remote: bytes
    notify: bytes | None = None


class WaitXfer(msgspec.Struct, tag=True):
    xfer: int
    timeout: float


class Release(msgspec.Struct, tag=True):
    xfer: int


class Notify(msgspec.Struct, tag=True):
    peer: str
    message: bytes


class Drain(msgspec.Struct, tag=True):
    """Notifications received so far; waits until ``at_least`` are in hand or timeout."""

    at_least: int = 0
    timeout: float = 0.0


class AwaitThenRead(msgspec.Struct, tag=True):
    """Wait for ``message``, then at once oracle-read ``descs``: was the data there first?"""

    message: bytes
    descs: bytes
    timeout: float


class AwaitThenFill(msgspec.Struct, tag=True):
    """Wait for ``message``, then at once overwrite ``[addr, addr + nbytes)``."""

    message: bytes
    addr: int
    nbytes: int
    seed: int
    timeout: float


class GateOpen(msgspec.Struct, tag=True):
    """Make a :class:`~kvwire.peer.gate.Gate` of ``nbytes`` and register it: answers its
    ``addr`` and ``nbytes``, or ``unavailable`` (why this host has none)."""

    nbytes: int


class GateArm(msgspec.Struct, tag=True):
    """Zero the gate and hold the first write into every page of these spans (int64
    arrays); ``note``: the notification whose arrival is checked against them."""

    offsets: bytes
    lengths: bytes
    note: bytes | None = None
    through: int = 0
    """A thread id never held (the commander's test thread, which may write into the gate
    from inside its own calls)."""


class GateStep(msgspec.Struct, tag=True):
    """Release the faults recorded before mark ``release`` (-1: none), wait up to ``wait``
    seconds for a fault, look for the armed note; answers the new ``mark`` and, from the
    moment the note was first seen, ``noticed`` (held faults and the spans' bytes then)."""

    release: int
    wait: float


class GateLook(msgspec.Struct, tag=True):
    """The held faults and the armed spans' bytes now, without releasing anything."""


class GateShut(msgspec.Struct, tag=True):
    """Hold nothing any more: every waiting writer goes on."""


class Close(msgspec.Struct, tag=True):
    pass


class Die(msgspec.Struct, tag=True):
    """Exit at once with SIGKILL, mid-whatever, without closing anything."""


Request = (
    Hello
    | Alloc
    | Deregister
    | Fill
    | ReadDescs
    | Metadata
    | AddPeer
    | Post
    | WaitXfer
    | Release
    | Notify
    | Drain
    | AwaitThenRead
    | AwaitThenFill
    | GateOpen
    | GateArm
    | GateStep
    | GateLook
    | GateShut
    | Close
    | Die
)

request_encoder = msgspec.msgpack.Encoder()
request_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Request)
reply_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder()
