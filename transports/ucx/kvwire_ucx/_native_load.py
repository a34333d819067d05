"""The optional C helper, or None with one warning line: the ctypes loop stands in.

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
            from kvwire_ucx import _native
        except ImportError as exc:
            why = f"not built: {exc}"
        else:
            return _native
    logging.getLogger("kvwire_ucx").warning(
        "kvwire_ucx: native post loop off (%s); posting through ctypes, one call per row", why
    )
    return None


NATIVE = load()
