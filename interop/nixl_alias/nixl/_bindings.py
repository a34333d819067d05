"""Alias of ``nixl_cu12._bindings`` (vLLM loads its telemetry type from ``nixl._bindings``)."""

from nixl_cu12._bindings import *  # noqa: F403
