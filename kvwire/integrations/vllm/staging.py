"""A host buffer for a device KV cache (``kv_buffer_device: "cpu"``), with stock's meaning.

Where device memory cannot be registered with the network (no GPUDirect, a platform NIXL
cannot reach), a stock engine keeps a copy of its KV cache in host memory, registers that
copy, and moves blocks between the two around each transfer: P copies a finished prompt's
blocks to the host before a peer may read them, D copies what it received to the device
before vLLM sees the request loaded. On a CPU platform the KV cache already is host memory,
so neither kind of engine stages anything. Peers see host memory either way; nothing on the
wire changes.

The copy has the device cache's layout byte for byte (every allocation mirrored whole), so
the regions, groups and block ids kvwire plans with are the device cache's, and staging a
block is one gather and one scatter per region.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvwire.errors import ConfigError
from kvwire.layout.descs import expand_to_kernel_blocks
from kvwire.layout.geometry import SHARED_GROUP_ID, KVGeometry

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def wants_host_buffer(vllm_config: VllmConfig) -> bool:
    """Stock's rule: a ``cpu`` KV buffer on a platform whose device is not the CPU. A buffer
    on another device than the platform's is refused, by name, as stock refuses it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import _NIXL_SUPPORTED_DEVICE
    from vllm.platforms import current_platform

    transfer = vllm_config.kv_transfer_config
    if transfer is None:
        return False
    device_type, buffer = str(current_platform.device_type), str(transfer.kv_buffer_device)
    allowed = _NIXL_SUPPORTED_DEVICE.get(device_type, ())  # stock's table, platforms' own added
    if buffer not in allowed:
        raise ConfigError(
            f"kv_buffer_device {buffer!r} on a {device_type} platform: KVWireConnector (as "
            f"stock) takes {' or '.join(map(repr, allowed)) or 'none'} there"
        )
    return buffer == "cpu" and device_type != "cpu"


def _flat(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """An allocation as one uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class HostStaging:
    """The host copy of a worker's KV cache and the block copies between the two."""

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        pin = torch.cuda.is_available()
        self._device: dict[int, torch.Tensor] = {}
        self._host: dict[int, torch.Tensor] = {}
        self.views: dict[str, torch.Tensor] = {}
        """Each layer's view, over the host copy: what the worker registers."""
        for name, view in kv_caches.items():
            storage = view.untyped_storage()
            key = int(storage.data_ptr())
            if key not in self._host:
                self._device[key] = _flat(storage, view.device)
                self._host[key] = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host = self._host[key].untyped_storage()
            self.views[name] = torch.empty(0, dtype=view.dtype).set_(
                host, view.storage_offset(), view.size(), view.stride()
            )
        self._regions: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._ratio = 1

    def bind(self, geometry: KVGeometry) -> None:
        """The regions the worker registered (over the host copy): per region, its blocks
        on the device and on the host, and the group whose ids name them."""
        self._ratio = geometry.physical_blocks_per_logical
        self._regions = []
        for region in geometry.regions:
            key = next(k for k, t in self._host.items() if self._owns(t, region.base_addr))
            host, device = self._host[key], self._device[key]
            offset = region.base_addr - int(host.data_ptr())
            shape, strides = (region.num_blocks, region.extent), (region.block_stride, 1)
            self._regions.append(
                (
                    torch.as_strided(device, shape, strides, offset),
                    torch.as_strided(host, shape, strides, offset),
                    region.group_id,
                )
            )

    @staticmethod
    def _owns(flat: torch.Tensor, address: int) -> bool:
        return int(flat.data_ptr()) <= address < int(flat.data_ptr()) + flat.numel()

    def to_host(self, groups: Sequence[Sequence[int]]) -> None:
        """P: a request's blocks (vLLM's ids, per transfer group), device to host."""
        for device, host, ids in self._each(groups):
            host[ids] = device[ids.to(device.device)].to("cpu")

    def to_device(self, groups: Sequence[Sequence[int]]) -> None:
        """D: the blocks a request received, host to device (the caller's stream orders the
        copy before the forward that reads them)."""
        for device, host, ids in self._each(groups):
            device[ids.to(device.device)] = host[ids].to(device.device)

    def _each(self, groups: Sequence[Sequence[int]]) -> Any:
        """Per region, the region blocks of the groups whose ids name its blocks: a shared
        region's (group -1) every group's, any other its own group's."""
        expanded = [expand_to_kernel_blocks(g, self._ratio) for g in groups]
        for device, host, group in self._regions:
            if group == SHARED_GROUP_ID:
                parts = expanded
            elif group < len(expanded):
                parts = [expanded[group]]
            else:
                continue
            ids = np.unique(np.concatenate(parts)) if parts else np.empty(0, np.int64)
            if ids.size:
                yield device, host, torch.from_numpy(ids)
