"""``full``: keep every token (the reference; memory grows with the sequence)."""

from __future__ import annotations

import torch

from armkv.memory.rope import Rotary
from armkv.methods.attention import joint_attention
from armkv.methods.base import CacheLayer, ModelInfo, register_method, reject_options


class FullLayer(CacheLayer):
    """Every key and value seen, concatenated in time order (padding kept, masked, as DynamicCache does)."""

    def __init__(self, layer_idx: int, info: ModelInfo, rotary: Rotary | None, chunk: int):
        super().__init__(layer_idx, info, rotary)
        self.chunk = chunk
        self.keys: torch.Tensor | None = None  # [B, Hkv, N, d]
        self.values: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None  # [B, N] bool

    def attend_chunk(self, query, key, value, valid, positions, scaling):
        out = joint_attention(query, key, value, valid, scaling, self.keys, self.values, self.valid)
        if self.keys is None:
            self.keys, self.values, self.valid = key, value, valid
        else:
            self.keys = torch.cat([self.keys, key], dim=2)
            self.values = torch.cat([self.values, value], dim=2)
            self.valid = torch.cat([self.valid, valid], dim=1)
        return out

    def peek_chunk(self, query, key, value, valid, positions, scaling):
        """:meth:`attend_chunk`'s output without storing the tokens."""
        return joint_attention(query, key, value, valid, scaling, self.keys, self.values, self.valid)

    def state_bytes(self) -> int:
        if self.keys is None:
            return 0
        return 2 * self.keys.numel() * self.keys.element_size()


@register_method("full", "every token kept exactly (reference; grows with the sequence)", bounded=False)
def make_full(layer_idx: int, info: ModelInfo, rotary: Rotary | None, budget: int | None, chunk: int, **options):
    reject_options("full", options)
    return FullLayer(layer_idx, info, rotary, chunk)
