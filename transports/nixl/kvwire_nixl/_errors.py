"""NIXL's exceptions as kvwire errors that keep NIXL's status name.

The binding raises one exception class per ``nixl_status_t`` (``nixlNotFoundError`` ...)
whose message is the status name (``NIXL_ERR_NOT_FOUND``). Which kvwire class a status
becomes depends on the call it came from (NOT_FOUND from a transfer means memory outside
every registration; from ``send_notif`` an unknown agent), so callers pick the class and
this module only recovers the status.
"""

from __future__ import annotations

import re

from kvwire.errors import TransportError

_STATUS = re.compile(r"NIXL_(?:ERR_[A-Z_]+|IN_PROG|SUCCESS)")
_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def status_of(exc: BaseException) -> str | None:
    """NIXL's status name for an exception from the binding, or None for anything else."""
    found = _STATUS.search(str(exc))
    if found:
        return found.group(0)
    cls = type(exc).__name__
    if cls.startswith("nixl") and cls.endswith("Error"):
        # nixlRemoteDisconnectError -> NIXL_ERR_REMOTE_DISCONNECT
        words = _CAMEL.sub("_", cls[len("nixl") : -len("Error")]).upper()
        return f"NIXL_ERR_{words}"
    return None


def translate(exc: BaseException, cls: type[TransportError], what: str) -> TransportError:
    """``cls`` for a failed ``what``, carrying NIXL's status name in ``.status``."""
    status = status_of(exc)
    detail = status or f"{type(exc).__name__}: {exc}"
    return cls(f"{what} failed: {detail}", status=status)


def is_status(exc: BaseException, status: str) -> bool:
    return status_of(exc) == status
