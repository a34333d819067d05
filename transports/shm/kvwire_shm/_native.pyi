"""Types of the optional C helper ``_native.c`` (see its header comment for why it exists)."""

from typing import Any

HAVE_NT: int

def copy(
    dst: Any, src: Any, length: Any, nt_from: int, first: int = 0, last: int = -1, /
) -> None: ...
def cma(
    pid: int, local: Any, remote: Any, length: Any, write: bool, first: int = 0, last: int = -1, /
) -> int: ...
def plan(
    local: Any,
    remote: Any,
    local_starts: Any,
    local_ends: Any,
    remote_starts: Any,
    remote_ends: Any,
    remote_deltas: Any,
    mapped: bool,
    write: bool,
    chunk: int,
    most: int,
    /,
) -> tuple[bytes, list[int], int, int] | None: ...
