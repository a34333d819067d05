"""The optional C helper, or None with one warning line: the pure-Python copies stand in.

``KVWIRE_NO_NATIVE=1`` turns the helper off on purpose (the tests run both paths).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType


def load() -> ModuleType | None:
    if os.environ.get("KVWIRE_NO_NATIVE", "") not in ("", "0"):
        why = "KVWIRE_NO_NATIVE is set"
    else:
        try:
            from kvwire_shm import _native
        except ImportError as exc:
            why = f"not built: {exc}"
        else:
            return _native
    logging.getLogger("kvwire_shm").warning(
        "kvwire_shm: native copy helper off (%s); using the slower pure-Python copies", why
    )
    return None


NATIVE = load()
