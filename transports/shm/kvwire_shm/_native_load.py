"""The optional C helper, or None with one warning line: the pure-Python copies stand in.

``KVWIRE_NO_NATIVE=1`` turns the helper off on purpose (the tests run both paths).
"""

from __future__ import annotations

from kvwire.transport import load_native_helper

NATIVE = load_native_helper("kvwire_shm._native", "using the slower pure-Python copies")
