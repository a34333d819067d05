"""The target process of the Mooncake baseline (:mod:`kvwire.bench.mooncake`).

``python -m kvwire.bench.mooncake_peer NBYTES``: start a Mooncake engine on 127.0.0.1 (TCP,
peer-to-peer handshake), register NBYTES of filled memory, print one JSON line
``{"port", "addr"}`` and serve READs until stdin closes.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from kvwire.bench.mooncake import engine_class, start_engine


def main() -> int:
    nbytes = int(sys.argv[1])
    cls = engine_class()
    if cls is None:
        return 1
    engine = start_engine(cls)
    buffer = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    addr = int(buffer.ctypes.data)
    if engine.register_memory(addr, nbytes) != 0:
        return 1
    sys.stdout.write(json.dumps({"port": engine.get_rpc_port(), "addr": addr}) + "\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the bench closes our stdin
    engine.unregister_memory(addr)
    os._exit(0)  # skip Mooncake's static destructors


if __name__ == "__main__":
    raise SystemExit(main())
