"""Alias: vLLM imports ``nixl``; the nixl-cu12 wheel's module is ``nixl_cu12``."""

from nixl_cu12 import *  # noqa: F403
