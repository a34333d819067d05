"""The NIXL transport passes the whole conformance suite (DRAM), the two agents in
separate processes, over UCX on loopback."""

from __future__ import annotations

import os
from typing import ClassVar

from kvwire_conformance import TransportSuite

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # this process's agent; the peer inherits it


class TestNixlConformance(TransportSuite):
    transport = "nixl"
    peer_env: ClassVar[dict[str, str]] = {"UCX_NET_DEVICES": os.environ["UCX_NET_DEVICES"]}
