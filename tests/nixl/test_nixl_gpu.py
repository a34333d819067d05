"""VRAM through the NIXL transport: CUDA tensors registered and moved between two agents,
and between host and device memory.

Needs a CUDA device, a CUDA build of torch and NIXL's UCX built with CUDA (nixl-cu12);
on a host without them the whole module skips with the reason. On a GPU host:
``UCX_NET_DEVICES=lo .venv/bin/pytest -q -m gpu tests/nixl/test_nixl_gpu.py``
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from kvwire_nixl import NixlTransport
from kvwire_nixl.transport import cuda_device_present

from kvwire.transport import MemKind, XferState, region_of_tensor, wait_for

pytestmark = pytest.mark.gpu

if not cuda_device_present():
    pytest.skip("no CUDA driver and device on this host", allow_module_level=True)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch here is not a CUDA build", allow_module_level=True)

TIMEOUT = 30.0
NBYTES = 8 << 20


@pytest.fixture
def agents() -> Iterator[tuple[NixlTransport, NixlTransport]]:
    a = NixlTransport(f"kvwire-gpu-a-{uuid.uuid4().hex[:6]}")
    b = NixlTransport(f"kvwire-gpu-b-{uuid.uuid4().hex[:6]}")
    yield a, b
    a.close()
    b.close()


def _descs(tensor: object, offsets: list[int], length: int) -> np.ndarray:
    region = region_of_tensor(tensor)
    out = np.zeros((len(offsets), 3), dtype=np.int64)
    out[:, 0] = region.addr + np.asarray(offsets)
    out[:, 1] = length
    out[:, 2] = region.device_id
    return out


def test_capabilities_claim_vram(agents: tuple[NixlTransport, NixlTransport]) -> None:
    a, _ = agents
    assert MemKind.VRAM in a.capabilities.mem_kinds


@pytest.mark.parametrize(
    ("src_device", "dst_device"), [("cuda", "cuda"), ("cpu", "cuda"), ("cuda", "cpu")]
)
def test_read_between_memory_kinds(
    agents: tuple[NixlTransport, NixlTransport], src_device: str, dst_device: str
) -> None:
    a, b = agents
    src = (torch.arange(NBYTES, dtype=torch.int64) % 251).to(torch.uint8).to(src_device)
    dst = torch.zeros(NBYTES, dtype=torch.uint8, device=dst_device)
    a.register([dst])
    b.register([src])
    peer = a.add_peer(b.local_metadata())
    offsets = list(range(0, NBYTES, 1 << 20))[::-1]
    handle = a.read(
        peer,
        _descs(dst, list(range(0, NBYTES, 1 << 20)), 1 << 20),
        _descs(src, offsets, 1 << 20),
        b"vram",
    )
    assert wait_for(a, handle, TIMEOUT) is XferState.DONE
    a.release(handle)
    expected = src.cpu().view(len(offsets), -1).flip(0).reshape(-1)
    assert torch.equal(dst.cpu(), expected)
    got: list[tuple[str, bytes]] = []
    while not got:
        got = b.drain_notifications()
        b.wait(0.01)
    assert got == [(a.name, b"vram")]


def test_write_from_a_cuda_tensor(agents: tuple[NixlTransport, NixlTransport]) -> None:
    a, b = agents
    src = torch.full((NBYTES,), 9, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
    a.register([src])
    b.register([dst])
    peer = a.add_peer(b.local_metadata())
    handle = a.write(peer, _descs(src, [0], NBYTES), _descs(dst, [0], NBYTES))
    assert wait_for(a, handle, TIMEOUT) is XferState.DONE
    a.release(handle)
    torch.cuda.synchronize()
    assert bool((dst == 9).all())
