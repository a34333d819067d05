"""The shm transport's CUDA-IPC path: VRAM regions moved between two processes.

Needs a CUDA device; on a host without one the whole module skips with that reason.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from kvwire_shm import ShmTransport, _cuda

from kvwire.transport import MemKind, Region, XferState, wait_for

pytestmark = pytest.mark.gpu

LIB = _cuda.cuda()
if LIB is None:
    pytest.skip("no CUDA driver and device on this host", allow_module_level=True)

NBYTES = 8 << 20

# The peer: VRAM filled with a known pattern, registered, metadata on stdout; after a line
# on stdin it reports a checksum of its first half (which the test WRITEs into).
PEER = """
import sys
import numpy as np
from kvwire_shm import ShmTransport, _cuda
from kvwire.transport import MemKind, Region
lib = _cuda.cuda()
n = int(sys.argv[1])
ptr = _cuda.malloc(lib, n, 0)
host = (np.arange(n, dtype=np.uint64) % 251).astype(np.uint8)
lib.copy(ptr, int(host.ctypes.data), n, 0)
agent = ShmTransport("gpu-peer", cuda=True)
agent.register([Region(ptr, n, 0, MemKind.VRAM)])
print(agent.local_metadata().hex(), ptr, flush=True)
sys.stdin.readline()
back = np.zeros(n, dtype=np.uint8)
lib.copy(int(back.ctypes.data), ptr, n, 0)
print(int(back[: n // 2].astype(np.uint64).sum()), flush=True)
agent.close()
"""


def _pattern(n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) % 251).astype(np.uint8)


def test_vram_read_and_write_across_processes() -> None:
    assert LIB is not None
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, str(NBYTES)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    local_ptr = _cuda.malloc(LIB, NBYTES, 0)
    agent = ShmTransport("gpu-local", cuda=True)
    try:
        assert peer.stdout is not None and peer.stdin is not None
        blob_hex, remote_ptr = peer.stdout.readline().split()
        host = np.zeros(NBYTES, dtype=np.uint8)
        agent.register([Region(local_ptr, NBYTES, 0, MemKind.VRAM)])
        agent.register([Region(int(host.ctypes.data), NBYTES, 0, MemKind.DRAM)])
        name = agent.add_peer(bytes.fromhex(blob_hex))
        whole = np.array([[0, NBYTES, 0]], dtype=np.int64)
        vram, dram, remote = whole.copy(), whole.copy(), whole.copy()
        vram[0, 0], dram[0, 0], remote[0, 0] = local_ptr, host.ctypes.data, int(remote_ptr)

        handle = agent.read(name, vram, remote)  # VRAM <- peer VRAM
        assert wait_for(agent, handle, 60) is XferState.DONE
        agent.release(handle)
        LIB.copy(int(host.ctypes.data), local_ptr, NBYTES, 0)
        assert np.array_equal(host, _pattern(NBYTES))

        host[:] = 0
        handle = agent.read(name, dram, remote)  # host memory <- peer VRAM
        assert wait_for(agent, handle, 60) is XferState.DONE
        agent.release(handle)
        assert np.array_equal(host, _pattern(NBYTES))

        half = np.array([[local_ptr, NBYTES // 2, 0]], dtype=np.int64)
        target = np.array([[int(remote_ptr), NBYTES // 2, 0]], dtype=np.int64)
        ones = np.ones(NBYTES // 2, dtype=np.uint8)
        LIB.copy(local_ptr, int(ones.ctypes.data), NBYTES // 2, 0)
        handle = agent.write(name, half, target)  # VRAM -> peer VRAM
        assert wait_for(agent, handle, 60) is XferState.DONE
        agent.release(handle)
        peer.stdin.write("\n")
        peer.stdin.flush()
        assert int(peer.stdout.readline()) == NBYTES // 2
    finally:
        agent.close()
        _cuda.free(LIB, local_ptr, 0)
        peer.kill()
        peer.wait()
