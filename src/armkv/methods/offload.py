"""``offload``: the full cache, each layer's keys and values kept in host memory.

A layer's KV is copied to the compute device for its own attention only, so the device
holds one layer's KV at a time (transiently). On CUDA the host copy is pinned so the
transfers can overlap; on a CPU-only machine the host is the device and the method still
runs, copying, which keeps its code path tested everywhere. (transformers'
``DynamicCache(offloading=True)`` asserts CUDA instead.)
"""

from __future__ import annotations

import torch

from armkv.memory.rope import Rotary
from armkv.methods.attention import joint_attention
from armkv.methods.base import CacheLayer, ModelInfo, register_method, reject_options


class OffloadLayer(CacheLayer):
    """Every token kept, in host memory; ``state_bytes`` counts what stays on the compute device."""

    def __init__(self, layer_idx: int, info: ModelInfo, rotary: Rotary | None, chunk: int):
        super().__init__(layer_idx, info, rotary)
        self.chunk = chunk
        self.host_keys: torch.Tensor | None = None  # [B, Hkv, N, d] on the CPU
        self.host_values: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None  # [B, N] bool, on the compute device (bookkeeping)
        self.device: torch.device | None = None

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        host = x.to("cpu", copy=True)
        return host.pin_memory() if torch.cuda.is_available() else host

    def attend_chunk(self, query, key, value, valid, positions, scaling):
        self.device = key.device
        state_k = state_v = None
        if self.host_keys is not None:
            # copy=True: on a CPU-only machine this is the same transfer the GPU path makes.
            state_k = self.host_keys.to(self.device, non_blocking=True, copy=True)
            state_v = self.host_values.to(self.device, non_blocking=True, copy=True)
            fetched = 2 * state_k.numel() * state_k.element_size()
            self.peak_bytes = max(self.peak_bytes, self.state_bytes() + fetched)
        out = joint_attention(query, key, value, valid, scaling, state_k, state_v, self.valid)
        new_k, new_v = self._to_host(key), self._to_host(value)
        if self.host_keys is None:
            self.host_keys, self.host_values, self.valid = new_k, new_v, valid
        else:
            self.host_keys = torch.cat([self.host_keys, new_k], dim=2)
            self.host_values = torch.cat([self.host_values, new_v], dim=2)
            self.valid = torch.cat([self.valid, valid], dim=1)
        if torch.cuda.is_available() and self.host_keys.device.type == "cpu":
            self.host_keys, self.host_values = self.host_keys.pin_memory(), self.host_values.pin_memory()
        return out

    def host_bytes(self) -> int:
        """Bytes of keys and values in host memory."""
        if self.host_keys is None:
            return 0
        return 2 * self.host_keys.numel() * self.host_keys.element_size()

    def state_bytes(self) -> int:
        """Bytes resident on the compute device between attentions: 0 on an accelerator; on a
        CPU-only machine the host is the device, so all of :meth:`host_bytes`."""
        if self.device is None or self.device.type != "cpu":
            return 0
        return self.host_bytes()


@register_method("offload", "full cache in host memory; one layer's KV on the device at a time", bounded=False)
def make_offload(layer_idx: int, info: ModelInfo, rotary: Rotary | None, budget: int | None, chunk: int, **options):
    reject_options("offload", options)
    return OffloadLayer(layer_idx, info, rotary, chunk)
