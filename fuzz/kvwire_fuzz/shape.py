"""Where the values of a msgpack message start and end, so mutations can aim at them.

Random bytes almost never get past a decoder's first type check; a fuzzer that knows where
a length prefix or a nested value sits reaches the code behind it. This is a tolerant,
read-only walk: it records every value it can parse and stops quietly at the first byte it
cannot, which is what a mutator wants from input that is often already damaged.
"""

from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass
from typing import Literal

Kind = Literal["int", "float", "nil", "bool", "str", "bin", "ext", "array", "map"]

# Kinds whose header states a length (bytes for str/bin/ext, items for array/map): the
# targets of length-prefix inflation.
SIZED: frozenset[str] = frozenset({"str", "bin", "ext", "array", "map"})

_MAX_DEPTH = 64


@dataclass(frozen=True)
class Node:
    """One value: ``data[offset:end]``, whose header is ``header_len`` bytes."""

    offset: int
    end: int
    kind: Kind
    header_len: int
    length: int
    """Bytes of payload (str, bin, ext) or number of items (array) or pairs (map)."""
    ext_type: int = 0


class _Stop(Exception):
    """The walk reached bytes it cannot parse."""


def walk(data: bytes) -> list[Node]:
    """Every value of ``data`` that parses, outermost first (children after their parent)."""
    walker = _Walker(data)
    with contextlib.suppress(_Stop):
        walker.value(0, 0)
    return walker.nodes


class _Walker:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.nodes: list[Node] = []

    def need(self, pos: int, n: int) -> None:
        if pos + n > len(self.data):
            raise _Stop

    def uint(self, pos: int, width: int) -> int:
        self.need(pos, width)
        return int.from_bytes(self.data[pos : pos + width], "big")

    def value(self, pos: int, depth: int) -> int:
        """Parse the value at ``pos``, record it and its children, return where it ends."""
        if depth > _MAX_DEPTH:
            raise _Stop
        self.need(pos, 1)
        b = self.data[pos]
        if b <= 0x7F or b >= 0xE0:
            return self.leaf(pos, 1, "int")
        if b == 0xC0:
            return self.leaf(pos, 1, "nil")
        if b in (0xC2, 0xC3):
            return self.leaf(pos, 1, "bool")
        if 0xCC <= b <= 0xD3:
            return self.leaf(pos, 1 + (1 << ((b - 0xCC) % 4)), "int")
        if b in (0xCA, 0xCB):
            return self.leaf(pos, 5 if b == 0xCA else 9, "float")
        if 0xA0 <= b <= 0xBF:
            return self.blob(pos, 1, b & 0x1F, "str")
        if b in (0xD9, 0xDA, 0xDB):
            width = 1 << (b - 0xD9)
            return self.blob(pos, 1 + width, self.uint(pos + 1, width), "str")
        if b in (0xC4, 0xC5, 0xC6):
            width = 1 << (b - 0xC4)
            return self.blob(pos, 1 + width, self.uint(pos + 1, width), "bin")
        if 0xD4 <= b <= 0xD8:
            return self.blob(pos, 2, 1 << (b - 0xD4), "ext", self.uint(pos + 1, 1))
        if b in (0xC7, 0xC8, 0xC9):
            width = 1 << (b - 0xC7)
            size = self.uint(pos + 1, width)
            return self.blob(pos, 2 + width, size, "ext", self.uint(pos + 1 + width, 1))
        if 0x90 <= b <= 0x9F:
            return self.container(pos, 1, b & 0x0F, "array", depth)
        if b in (0xDC, 0xDD):
            width = 2 if b == 0xDC else 4
            return self.container(pos, 1 + width, self.uint(pos + 1, width), "array", depth)
        if 0x80 <= b <= 0x8F:
            return self.container(pos, 1, b & 0x0F, "map", depth)
        if b in (0xDE, 0xDF):
            width = 2 if b == 0xDE else 4
            return self.container(pos, 1 + width, self.uint(pos + 1, width), "map", depth)
        raise _Stop  # 0xC1: never used

    def leaf(self, pos: int, size: int, kind: Kind) -> int:
        self.need(pos, size)
        self.nodes.append(Node(pos, pos + size, kind, size, 0))
        return pos + size

    def blob(self, pos: int, header: int, size: int, kind: Kind, ext_type: int = 0) -> int:
        self.need(pos + header, size)
        self.nodes.append(Node(pos, pos + header + size, kind, header, size, ext_type))
        return pos + header + size

    def container(self, pos: int, header: int, count: int, kind: Kind, depth: int) -> int:
        self.need(pos, header)
        index = len(self.nodes)
        self.nodes.append(Node(pos, pos + header, kind, header, count))
        end = pos + header
        for _ in range(count * (2 if kind == "map" else 1)):
            end = self.value(end, depth + 1)
        self.nodes[index] = Node(pos, end, kind, header, count)
        return end


def sized_header(node: Node, claim: int) -> bytes:
    """The widest header of ``node``'s kind, claiming ``claim`` bytes or items (< 2**32)."""
    size = struct.pack(">I", claim)
    if node.kind == "str":
        return b"\xdb" + size
    if node.kind == "bin":
        return b"\xc6" + size
    if node.kind == "array":
        return b"\xdd" + size
    if node.kind == "map":
        return b"\xdf" + size
    if node.kind == "ext":
        return b"\xc9" + size + bytes([node.ext_type])
    raise ValueError(f"{node.kind} has no length prefix")
