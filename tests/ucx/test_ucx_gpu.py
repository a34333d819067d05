"""CUDA memory through the ucx transport; skips cleanly where there is no GPU.

Needs torch with CUDA and a device. UCX (the cu12 wheel) then reports CUDA as a memory
type, the adapter advertises VRAM, and a READ between two agents moves device memory.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvwire.transport import MemKind, XferState, region_of_tensor, wait_for

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def test_read_between_cuda_tensors() -> None:
    from kvwire_ucx import UcxTransport

    a, b = UcxTransport("gpu-a"), UcxTransport("gpu-b")
    try:
        assert MemKind.VRAM in a.capabilities.mem_kinds
        src = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
        dst = torch.zeros_like(src)
        b.register([region_of_tensor(src)])
        a.register([region_of_tensor(dst)])
        a.add_peer(b.local_metadata())
        b.add_peer(a.local_metadata())
        half = src.numel() * src.element_size() // 2
        local = np.array([[dst.data_ptr(), half, 0], [dst.data_ptr() + half, half, 0]])
        remote = np.array([[src.data_ptr() + half, half, 0], [src.data_ptr(), half, 0]])
        handle = a.read("gpu-b", local, remote, notify=b"gpu")
        assert wait_for(a, handle, 60.0) is XferState.DONE
        torch.cuda.synchronize()
        assert torch.equal(dst, torch.cat([src[src.numel() // 2 :], src[: src.numel() // 2]]))
        deadline = time.monotonic() + 30.0
        got: list[tuple[str, bytes]] = []
        while not got and time.monotonic() < deadline:
            b.wait(0.05)
            got = b.drain_notifications()
        assert got == [("gpu-a", b"gpu")]
    finally:
        a.close()
        b.close()
