"""Types of the optional C helper ``_native.c`` (see its header comment for why it exists)."""

from typing import Any

def rma(
    functions: tuple[int, int, int, int],
    worker: int,
    ep: int,
    local: Any,
    length: Any,
    remote: Any,
    rkey: Any,
    param: Any,
    wait_ns: int,
    /,
) -> tuple[int, int, int]: ...
