"""Alias of ``nixl_cu12._api`` (vLLM loads ``nixl._api``)."""

from nixl_cu12._api import *  # noqa: F403
