"""NIXL's bundled UCX and kvwire's UCX (the libucx wheel) in one process.

Run as a script by ``test_ucx_with_nixl.py`` so a clash could only kill this process. The
argument says who starts first. Prints one line per check; exits non-zero on any mismatch.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from kvwire_ucx import UcxTransport

from kvwire.transport import XferState, region_of_array, wait_for


def ucx_round(tag: str) -> None:
    a, b = UcxTransport(f"a-{tag}"), UcxTransport(f"b-{tag}")
    try:
        src = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20].copy()
        dst = np.zeros_like(src)
        b.register([region_of_array(src)])
        a.register([region_of_array(dst)])
        a.add_peer(b.local_metadata())
        local = np.array([[dst.ctypes.data, dst.nbytes, 0]], dtype=np.int64)
        remote = np.array([[src.ctypes.data, src.nbytes, 0]], dtype=np.int64)
        state = wait_for(a, a.read(f"b-{tag}", local, remote), 30.0)
        assert state is XferState.DONE and np.array_equal(src, dst), state
        print(f"kvwire-ucx {tag}: ok", flush=True)
    finally:
        a.close()
        b.close()


def nixl_round() -> None:
    # kvwire_nixl's loader, not a bare import: it sets UCX_MODULES as every NIXL process
    # here needs (without it the process crashes at exit, see kvwire_nixl._loader).
    from kvwire_nixl._loader import load_nixl

    api, _ = load_nixl()
    config = api.nixl_agent_config(backends=["UCX"], enable_prog_thread=False)
    na, nb = api.nixl_agent("na", config), api.nixl_agent("nb", config)
    src = np.arange(1 << 20, dtype=np.uint8)[::-1].copy()
    dst = np.zeros_like(src)
    nb.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    na.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    na.add_remote_agent(nb.get_agent_metadata())
    local = na.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
    remote = nb.get_xfer_descs([(src.ctypes.data, src.nbytes, 0)], "DRAM")
    handle = na.initialize_xfer("READ", local, remote, "nb", b"n")
    na.transfer(handle)
    deadline = time.monotonic() + 30.0
    state = na.check_xfer_state(handle)
    while state not in ("DONE", "ERR") and time.monotonic() < deadline:
        nb.get_new_notifs()
        state = na.check_xfer_state(handle)
    assert state == "DONE" and np.array_equal(src, dst), state
    na.release_xfer_handle(handle)
    print("nixl: ok", flush=True)


def main() -> int:
    if sys.argv[1] == "nixl-first":
        nixl_round()
        ucx_round("after-nixl")
    else:
        ucx_round("before-nixl")
        nixl_round()
        ucx_round("after-nixl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
