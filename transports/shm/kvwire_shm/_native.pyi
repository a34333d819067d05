"""Types of the optional C helper ``_native.c`` (see its header comment for why it exists)."""

from typing import Any

HAVE_NT: int

def copy(dst: Any, src: Any, length: Any, nt_from: int, /) -> None: ...
def cma(pid: int, local: Any, remote: Any, length: Any, write: bool, /) -> int: ...
