"""Move one request's KV between two in-process engines with kvwire's plans and numpy.

No transport, no runtime: for every (consumer rank, producer rank) pair that
:mod:`kvwire.layout.topology` pairs, :class:`kvwire.layout.PeerLayout` plans the descriptors
(as the consumer in pull mode, as the producer in push mode), and the rows are copied with
numpy slices of the ranks' tensors. Zero ranges are cleared. If the generation that follows
matches a monolithic engine's, kvwire's layout, head slicing and block ids mean the same
thing to both engines, which is the whole point of the library.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt
import torch

from kvwire.errors import ConfigError, DescriptorError
from kvwire.examples.engine.engine import Engine, LocalRanks
from kvwire.layout import Descs, PeerLayout, TransferPlan, topology
from kvwire.layout.geometry import RemoteGeometry


class HostMemory:
    """Byte views of registered tensors, addressed by their process addresses.

    Every descriptor row is bounds-checked against the tensor it falls in, so a wrong
    descriptor is an error here rather than a stray write.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        spans = []
        for t in tensors:
            view: npt.NDArray[np.uint8] = t.detach().numpy().reshape(-1).view(np.uint8)
            spans.append((t.data_ptr(), view))
        spans.sort(key=lambda span: span[0])
        self._bases = np.array([base for base, _ in spans], dtype=np.int64)
        self._views = [view for _, view in spans]

    def span(self, addr: int, length: int) -> npt.NDArray[np.uint8]:
        index = int(np.searchsorted(self._bases, addr, side="right")) - 1
        if index >= 0:
            offset = addr - int(self._bases[index])
            view = self._views[index]
            if offset >= 0 and offset + length <= view.size:
                return view[offset : offset + length]
        raise DescriptorError(f"descriptor {addr:#x}+{length} is outside every registered tensor")


def copy_rows(src_mem: HostMemory, src: Descs, dst_mem: HostMemory, dst: Descs) -> int:
    """Copy descriptor row ``i`` of ``src`` to row ``i`` of ``dst``; returns bytes moved."""
    if src.shape != dst.shape or not np.array_equal(src[:, 1], dst[:, 1]):
        raise DescriptorError("source and destination descriptors do not pair row by row")
    for (s_addr, length, _), (d_addr, _, _) in zip(src.tolist(), dst.tolist(), strict=True):
        dst_mem.span(d_addr, length)[:] = src_mem.span(s_addr, length)
    return int(src[:, 1].sum()) if src.size else 0


def zero_rows(mem: HostMemory, ranges: Descs) -> None:
    for addr, length, _ in ranges.tolist():
        mem.span(addr, length)[:] = 0


def _rank_memory(engine: Engine) -> list[HostMemory]:
    ranks = engine.ranks
    if not isinstance(ranks, LocalRanks):
        raise ConfigError("hand copying needs an engine whose ranks run in this process")
    return [HostMemory(w.kv.tensors) for w in ranks.workers]


def hand_transfer(
    producer: Engine,
    producer_request: str,
    consumer: Engine,
    consumer_request: str,
    *,
    mode: str = "pull",
) -> int:
    """Fill the consumer request's uncomputed blocks from the producer's; returns bytes.

    The producer request must be prefilled; the consumer request admitted with the same
    prompt. Marks the consumer request received, ready for :meth:`Engine.step`.
    """
    p_seq = producer.requests[producer_request]
    c_seq = consumer.requests[consumer_request]
    if p_seq.tokens[: len(c_seq.tokens)] != c_seq.tokens:
        raise ConfigError("producer and consumer requests do not hold the same prompt")
    num_tokens = len(c_seq.tokens)
    p_ids = [p_seq.block_ids[: -(-num_tokens // producer.cache.block_size)]]
    c_ids = [consumer.blocks_to_receive(consumer_request)]
    p_geo, c_geo = producer.geometries(), consumer.geometries()
    p_mem, c_mem = _rank_memory(producer), _rank_memory(consumer)
    moved = 0
    for c_rank, c_geometry in enumerate(c_geo):
        for p_rank in topology.remote_tp_ranks(c_rank, len(c_geo), len(p_geo)):
            plan: TransferPlan
            if mode == "pull":
                layout = PeerLayout(c_geometry, RemoteGeometry.from_local(p_geo[p_rank]))
                plan = layout.plan(c_ids, p_ids, num_tokens=num_tokens)
                moved += copy_rows(
                    p_mem[p_rank], plan.remote_descs, c_mem[c_rank], plan.local_descs
                )
                zero_rows(c_mem[c_rank], plan.local_zero)
            elif mode == "push":
                remote = RemoteGeometry.from_local(c_geometry)
                layout = PeerLayout(p_geo[p_rank], remote, mode="push")
                plan = layout.plan(p_ids, c_ids, num_tokens=num_tokens)
                moved += copy_rows(
                    p_mem[p_rank], plan.local_descs, c_mem[c_rank], plan.remote_descs
                )
                zero_rows(c_mem[c_rank], plan.remote_zero)
            else:
                raise ConfigError(f"mode must be 'pull' or 'push', got {mode!r}")
    consumer.mark_received(consumer_request)
    return moved
