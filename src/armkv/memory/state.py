"""The routed memory's state for one layer and one batch: fixed-size, allocated once."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class MemoryState:
    """Slots of one layer. G = batch * KV heads, flattened; S slots; d head size.

    key : [G, S, d] pre-RoPE slot keys (rotated only when read)
    value : [G, S, d] slot values
    pos : [G, S] count-weighted mean position of what the slot absorbed (float)
    count : [G, S] tokens absorbed (0 = free)
    bucket : [G, S] bucket the slot is filed under (-1 = free in the shared pool;
        the fixed partition s // Y in the paper's pool)
    """

    key: torch.Tensor
    value: torch.Tensor
    pos: torch.Tensor
    count: torch.Tensor
    bucket: torch.Tensor

    @classmethod
    def empty(
        cls,
        groups: int,
        slots: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        slots_per_bucket: int = 0,
    ) -> "MemoryState":
        if slots_per_bucket:
            bucket = (torch.arange(slots, device=device) // slots_per_bucket).expand(groups, slots).clone()
        else:
            bucket = torch.full((groups, slots), -1, dtype=torch.long, device=device)
        return cls(
            key=torch.zeros(groups, slots, head_dim, dtype=dtype, device=device),
            value=torch.zeros(groups, slots, head_dim, dtype=dtype, device=device),
            pos=torch.zeros(groups, slots, dtype=torch.float32, device=device),
            count=torch.zeros(groups, slots, dtype=torch.float32, device=device),
            bucket=bucket,
        )

    @property
    def groups(self) -> int:
        return self.key.shape[0]

    @property
    def slots(self) -> int:
        return self.key.shape[1]

    def nbytes(self) -> int:
        """Bytes held; the bucket ids are counted as int32 (they fit in one)."""
        total = 0
        for f in fields(self):
            t = getattr(self, f.name)
            total += t.numel() * (4 if f.name == "bucket" else t.element_size())
        return total

    def clone(self) -> "MemoryState":
        return MemoryState(**{f.name: getattr(self, f.name).clone() for f in fields(self)})

    def detach(self) -> "MemoryState":
        return MemoryState(**{f.name: getattr(self, f.name).detach() for f in fields(self)})
