"""``kvwire demo``: real prefill and decode engine processes moving verified KV."""

from __future__ import annotations

from kvwire.demo.run import DemoOptions, drive, run_local
from kvwire.demo.summary import Summary

__all__ = ["DemoOptions", "Summary", "drive", "run_local"]
