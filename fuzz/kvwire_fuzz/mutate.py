"""Structure-aware mutations of valid messages.

Each mutation takes its decisions from a :class:`Chooser`, so the same operators run under
Hypothesis (which records and shrinks the choices), under :mod:`random` (the harness's own
engine) and under atheris (which seeds the choices from its input). The operators aim at
what breaks decoders: length prefixes claiming far more than is there, values of the wrong
type, nesting deeper than any schema, fields dropped or repeated, and the separators and
prefixes of the text notifications.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import msgspec

from kvwire_fuzz.shape import SIZED, Node, sized_header, walk

T = TypeVar("T")

GIB = 1 << 30
CLAIMS = (GIB, (1 << 32) - 1, 1 << 31, 0xFFFF, 0x10000)
"""Lengths a hostile header claims; 1 GiB is the headline case."""

_WRONG_OBJECTS: tuple[object, ...] = (
    None,
    True,
    -1,
    -(2**63),
    2**64 - 1,
    0,
    1.5,
    float("nan"),
    float("inf"),
    "",
    "x" * 40,
    "\u00e9\U0001f600",
    b"",
    b"\x00" * 17,
    [],
    [[]],
    [-1],
    {},
    {"a": 1},
    {"": None},
    msgspec.msgpack.Ext(1, b"\x00"),
)
WRONG_VALUES: tuple[bytes, ...] = (
    *(msgspec.msgpack.encode(v) for v in _WRONG_OBJECTS),
    b"\xca\x7f\xc0\x00\x00",  # float32 NaN
    b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",  # int64 minimum
    b"\xc1",  # the one byte msgpack never uses
)
"""Encodings of values that are the wrong type for almost every field."""

INTERESTING_BYTES = (0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xC6, 0xDB, 0xDD, 0xDF, 0xFF)

TEXT_TOKENS: tuple[bytes, ...] = (
    b":",
    b",",
    b"HB:",
    b"PUSH_REG:",
    b"0",
    b"-1",
    b"+1",
    b"1_0",
    b"999999999",
    b"9999999999999999999999",
    b"\xd9\xa3",  # Arabic-Indic digit three: int() takes it, the wire must not
    b" ",
    b"\x00",
    b"\xff",
    b"\xed\xa0\x80",  # an encoded lone surrogate: invalid UTF-8
    b"{",
    b"}",
    b"[",
    b"]",
    b'"',
    b"NaN",
    b"Infinity",
    b"1e999",
    b"null",
    b"true",
    b'"\\ud800"',
    b'"remote_port": 70000',
    b'"tp_size": 0',
    b'"remote_block_ids": [[-1]]',
    b"\xef\xbb\xbf",  # UTF-8 byte-order mark
)


class Chooser(Protocol):
    """Where a mutation's decisions come from."""

    def integer(self, low: int, high: int) -> int:
        """An int in ``[low, high]``, both ends included."""
        ...


class RandomChooser:
    """A :class:`Chooser` over :mod:`random` (the atheris harness's own mutations)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def integer(self, low: int, high: int) -> int:
        return self._rng.randint(low, high)


def pick(ch: Chooser, items: Sequence[T]) -> T:
    return items[ch.integer(0, len(items) - 1)]


def _pos(ch: Chooser, data: bytes) -> int:
    return ch.integer(0, len(data))


def _node(ch: Chooser, data: bytes, kinds: frozenset[str] | None = None) -> Node | None:
    nodes = [n for n in walk(data) if kinds is None or n.kind in kinds]
    return pick(ch, nodes) if nodes else None


def _replace(data: bytes, node: Node, value: bytes) -> bytes:
    return data[: node.offset] + value + data[node.end :]


# ------------------------------------------------------------------------ byte level


def flip_bits(data: bytes, ch: Chooser) -> bytes:
    if not data:
        return b"\x00"
    out = bytearray(data)
    for _ in range(ch.integer(1, 8)):
        i = ch.integer(0, len(out) - 1)
        out[i] ^= 1 << ch.integer(0, 7)
    return bytes(out)


def set_byte(data: bytes, ch: Chooser) -> bytes:
    if not data:
        return bytes([pick(ch, INTERESTING_BYTES)])
    i = ch.integer(0, len(data) - 1)
    return data[:i] + bytes([pick(ch, INTERESTING_BYTES)]) + data[i + 1 :]


def truncate(data: bytes, ch: Chooser) -> bytes:
    return data[: _pos(ch, data)]


def delete_span(data: bytes, ch: Chooser) -> bytes:
    i = _pos(ch, data)
    return data[:i] + data[i + ch.integer(1, 16) :]


def insert_bytes(data: bytes, ch: Chooser) -> bytes:
    i = _pos(ch, data)
    junk = bytes(ch.integer(0, 255) for _ in range(ch.integer(1, 8)))
    return data[:i] + junk + data[i:]


def duplicate_span(data: bytes, ch: Chooser) -> bytes:
    i, j = sorted((_pos(ch, data), _pos(ch, data)))
    k = _pos(ch, data)
    return data[:k] + data[i:j] + data[k:]


# ------------------------------------------------------------------- msgpack aware


def inflate_length(data: bytes, ch: Chooser) -> bytes:
    """Rewrite one length prefix to claim up to 4 GiB that the input does not hold."""
    node = _node(ch, data, SIZED)
    if node is None:
        return data
    claim = pick(ch, (*CLAIMS, node.length + 1, node.length * 2 + 1))
    header = sized_header(node, min(claim, (1 << 32) - 1))
    return data[: node.offset] + header + data[node.offset + node.header_len :]


def retype(data: bytes, ch: Chooser) -> bytes:
    """Replace one value with a value of another type."""
    node = _node(ch, data)
    if node is None:
        return data
    return _replace(data, node, pick(ch, WRONG_VALUES))


def nest(data: bytes, ch: Chooser) -> bytes:
    """Bury one value under thousands of one-element arrays or maps."""
    node = _node(ch, data)
    depth = pick(ch, (2, 64, 1_000, 100_000))
    wrapper = pick(ch, (b"\x91", b"\x81\xa1k", b"\xdc\x00\x01"))
    if node is None:
        return wrapper * depth + data
    return _replace(data, node, wrapper * depth + data[node.offset : node.end])


def drop_entry(data: bytes, ch: Chooser) -> bytes:
    """Remove one key/value pair of a map (a required field goes missing)."""
    entry = _map_entry(data, ch)
    if entry is None:
        return data
    node, key, value = entry
    head = b"\xdf" + struct.pack(">I", node.length - 1)
    body = data[node.offset + node.header_len : key.offset] + data[value.end : node.end]
    return data[: node.offset] + head + body + data[node.end :]


def repeat_entry(data: bytes, ch: Chooser) -> bytes:
    """Repeat one key/value pair of a map, with the count raised to match."""
    entry = _map_entry(data, ch)
    if entry is None:
        return data
    node, key, value = entry
    head = b"\xdf" + struct.pack(">I", node.length + 1)
    body = data[node.offset + node.header_len : node.end]
    return data[: node.offset] + head + data[key.offset : value.end] + body + data[node.end :]


def _map_entry(data: bytes, ch: Chooser) -> tuple[Node, Node, Node] | None:
    """A chosen non-empty map and one of its (key, value) pairs; ``None`` if there is none."""
    node = _node(ch, data, frozenset({"map"}))
    if node is None or node.length == 0:
        return None
    pairs = _pairs(data, node)
    if not pairs:
        return None
    return (node, *pick(ch, pairs))


def _pairs(data: bytes, node: Node) -> list[tuple[Node, Node]]:
    """The (key, value) nodes of a parsed map: its direct children, two by two."""
    by_offset = {n.offset: n for n in walk(data) if n.offset > node.offset}
    children: list[Node] = []
    pos = node.offset + node.header_len
    while pos < node.end and pos in by_offset:
        children.append(by_offset[pos])
        pos = by_offset[pos].end
    return list(zip(children[::2], children[1::2], strict=False))


# ------------------------------------------------------------------------ text level


def insert_token(data: bytes, ch: Chooser) -> bytes:
    """Insert a separator, prefix, odd number or JSON token (notifications, JSON params)."""
    i = _pos(ch, data)
    return data[:i] + pick(ch, TEXT_TOKENS) + data[i:]


def replace_tail(data: bytes, ch: Chooser) -> bytes:
    """Replace everything after the last ':' (a completion's count) with a token."""
    i = data.rfind(b":")
    return data[: i + 1] + pick(ch, TEXT_TOKENS) if i >= 0 else data


def repeat_separator(data: bytes, ch: Chooser) -> bytes:
    """Many separators or empty ids (heartbeats), many brackets (JSON)."""
    token = pick(ch, (b",", b":", b"[", b"{", b",a"))
    i = _pos(ch, data)
    return data[:i] + token * pick(ch, (2, 100, 10_000)) + data[i:]


Mutation = Callable[[bytes, Chooser], bytes]

MUTATIONS: tuple[Mutation, ...] = (
    flip_bits,
    set_byte,
    truncate,
    delete_span,
    insert_bytes,
    duplicate_span,
    inflate_length,
    inflate_length,
    retype,
    retype,
    nest,
    drop_entry,
    repeat_entry,
    insert_token,
    replace_tail,
    repeat_separator,
)
"""Every operator; the msgpack-aware ones that matter most appear twice."""


def splice(data: bytes, other: bytes, ch: Chooser) -> bytes:
    """The head of one message joined to the tail of another."""
    return data[: _pos(ch, data)] + other[_pos(ch, other) :]


def mutate(data: bytes, pool: Sequence[bytes], ch: Chooser, rounds: int = 0) -> bytes:
    """Apply 1-4 operators (or ``rounds``), sometimes splicing in another seed from ``pool``."""
    for _ in range(rounds or ch.integer(1, 4)):
        if pool and ch.integer(0, 9) == 0:
            data = splice(data, pick(ch, pool), ch)
        else:
            data = pick(ch, MUTATIONS)(data, ch)
    return data
