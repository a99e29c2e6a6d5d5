"""The routed memory's state for one layer and one batch: fixed-size, allocated once."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

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
    key_scale, value_scale : [G, S] per-vector scales when key and value are stored as int8
        codes (:meth:`pack`), else None

    Writes and reads work on the unpacked (float) state; between writes a layer may keep
    it packed (``slot_format`` "bfloat16" or "int8"), which is what its bytes count.
    """

    key: torch.Tensor
    value: torch.Tensor
    pos: torch.Tensor
    count: torch.Tensor
    bucket: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

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
            if t is not None:
                total += t.numel() * (4 if f.name == "bucket" else t.element_size())
        return total

    def _map(self, fn) -> "MemoryState":
        return MemoryState(**{f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name)) for f in fields(self)})

    def clone(self) -> "MemoryState":
        return self._map(torch.Tensor.clone)

    def detach(self) -> "MemoryState":
        return self._map(torch.Tensor.detach)

    # ------------------------------------------------------------------ storage format
    def pack(self, slot_format: str) -> "MemoryState":
        """The state as stored between writes: keys and values in the model's dtype
        ("model": unchanged), in bfloat16, or as int8 codes with one fp32 scale per vector
        (absmax / 127, symmetric). Unpacking and packing again gives the same codes."""
        if slot_format == "model":
            return self
        if slot_format == "bfloat16":
            return replace(self, key=self.key.to(torch.bfloat16), value=self.value.to(torch.bfloat16))
        if slot_format != "int8":
            raise ValueError(f"slot_format {slot_format!r} is not one of model, bfloat16, int8")
        key, key_scale = _quantise_int8(self.key)
        value, value_scale = _quantise_int8(self.value)
        return replace(self, key=key, value=value, key_scale=key_scale, value_scale=value_scale)

    def unpack(self, dtype: torch.dtype) -> "MemoryState":
        """The state with float keys and values of ``dtype`` (what writes and reads use)."""
        if self.key_scale is not None:
            key = self.key.to(torch.float32) * self.key_scale.unsqueeze(-1)
            value = self.value.to(torch.float32) * self.value_scale.unsqueeze(-1)
            return replace(self, key=key.to(dtype), value=value.to(dtype), key_scale=None, value_scale=None)
        if self.key.dtype == dtype:
            return self
        return replace(self, key=self.key.to(dtype), value=self.value.to(dtype))


def _quantise_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (codes int8 [..., d], scale fp32 [...]): x ~ codes * scale."""
    x = x.to(torch.float32)
    scale = x.abs().amax(-1) / 127.0
    codes = torch.round(x / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)).clamp(-127, 127)
    return codes.to(torch.int8), scale
