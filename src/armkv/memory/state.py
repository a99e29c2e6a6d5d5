"""The routed memory's state for one layer and one batch: fixed-size, allocated once."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from armkv.config import QUANTISED_SLOTS, SLOT_SCALE_BYTES, value_groups
from armkv.memory.kernels import fused_read
from armkv.memory.quant import (
    dequantise_symmetric,
    int4_halves,
    mixing_matrix,
    pack_int4,
    quantise_symmetric,
    unpack_int4,
)

# The slots' quantisation scales: bfloat16 (2 bytes; its 8-bit mantissa adds at most 0.4% to a
# scale whose int4 step is 1/7 of the range) keeps fp32's range, which fp16 would not.
SLOT_SCALE_DTYPE = {2: torch.bfloat16, 4: torch.float32}[SLOT_SCALE_BYTES]


@dataclass
class MemoryState:
    """Slots of one layer. G = batch * KV heads, flattened; S slots; d head size.

    key : [G, S, d] slot keys. The write functions (:mod:`armkv.memory.write`) take and
        return them pre-RoPE; the arm cache layer keeps them between writes rotated to each
        slot's read position (``position_mode``) and un-rotates them for a write
    value : [G, S, d] slot values
    pos : [G, S] count-weighted mean position of what the slot absorbed (float)
    count : [G, S] tokens absorbed (0 = free)
    bucket : [G, S] bucket the slot is filed under (-1 = free in the shared pool;
        the fixed partition s // Y in the paper's pool)
    key_scale, value_scale : [G, S, groups] scales when key and value are stored as int8 or
        int4 codes (:meth:`pack`; int4 codes are uint8 bytes of two codes), else None. Key
        codes are stored channel-major, [G, d or d / 2, S], the layout in which a query's
        scores over every slot are one plain matrix product (:meth:`key_scores`)
    mixed : the codes hold x Q, not x (:func:`armkv.memory.quant.mixing_matrix`); a flag, no bytes

    Writes and reads work on the unpacked (float) state; between writes a layer may keep
    it packed (``slot_format`` "bfloat16", "int8", "k8v4" or "k4v4"), which is what its bytes count.
    """

    key: torch.Tensor
    value: torch.Tensor
    pos: torch.Tensor
    count: torch.Tensor
    bucket: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    mixed: bool = False

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
        return self.count.shape[1]

    def nbytes(self) -> int:
        """Bytes held, as stored (a packed state keeps its bucket ids as int32)."""
        total = 0
        for f in fields(self):
            t = getattr(self, f.name)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
        return total

    def _map(self, fn) -> "MemoryState":
        def apply(x):
            return fn(x) if isinstance(x, torch.Tensor) else x

        return MemoryState(**{f.name: apply(getattr(self, f.name)) for f in fields(self)})

    def first(self, n: int) -> "MemoryState":
        """The first ``n`` slots, as views (the state itself where ``n`` covers them all)."""
        if n >= self.slots:
            return self
        channel_major = self.key_scale is not None  # quantised keys are [G, d or d / 2, S]
        return MemoryState(
            key=self.key[..., :n] if channel_major else self.key[:, :n],
            value=self.value[:, :n],
            pos=self.pos[:, :n],
            count=self.count[:, :n],
            bucket=self.bucket[:, :n],
            key_scale=None if self.key_scale is None else self.key_scale[:, :n],
            value_scale=None if self.value_scale is None else self.value_scale[:, :n],
            mixed=self.mixed,
        )

    def clone(self) -> "MemoryState":
        return self._map(torch.Tensor.clone)

    def detach(self) -> "MemoryState":
        return self._map(torch.Tensor.detach)

    # ------------------------------------------------------------------ storage format
    def pack(self, slot_format: str, mix: bool = False, dtype: torch.dtype | None = None) -> "MemoryState":
        """The state as stored between writes: keys and values in the model's dtype
        ("model": cast to ``dtype``, unchanged where None), in bfloat16, as int8 codes with one fp32 scale per vector
        (absmax / 127, symmetric; "int8"), or with int8 keys and int4 values, two codes a
        byte and one fp32 scale per 32 channels ("k8v4"), or both int4 ("k4v4"). With
        ``mix`` the quantised formats store x Q instead of x (``mixing_matrix``: outlier
        channels spread before the absmax scale is taken). Unpacking and packing again
        gives the same codes."""
        packed = replace(self, bucket=self.bucket.to(torch.int32))
        if slot_format == "model":
            return packed if dtype is None else replace(packed, key=self.key.to(dtype), value=self.value.to(dtype))
        if slot_format == "bfloat16":
            return replace(packed, key=self.key.to(torch.bfloat16), value=self.value.to(torch.bfloat16))
        if slot_format not in QUANTISED_SLOTS:
            raise ValueError(f"slot_format {slot_format!r} is not one of model, bfloat16, {', '.join(QUANTISED_SLOTS)}")
        key_bits, value_bits = QUANTISED_SLOTS[slot_format]
        key, value = self.key, self.value
        if mix:
            q = mixing_matrix(key.shape[-1], key.dtype, key.device)
            key, value = key @ q, value @ q
        key, key_scale = _quantise(key, key_bits)
        key = key.transpose(1, 2).contiguous()  # channel-major (see the class docstring)
        value, value_scale = _quantise(value, value_bits)
        return replace(packed, key=key, value=value, key_scale=key_scale, value_scale=value_scale, mixed=mix)

    def unpack(self, dtype: torch.dtype) -> "MemoryState":
        """The state with float keys and values of ``dtype`` and int64 bucket ids (what writes use)."""
        key, value = self.kv(dtype)
        return replace(
            self, key=key, value=value, bucket=self.bucket.long(), key_scale=None, value_scale=None, mixed=False
        )

    def kv(self, dtype: torch.dtype, unmix: bool = True, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as floats of ``dtype``, dequantised if packed (all a read needs).
        ``unmix=False`` leaves a mixed state's vectors as x Q (a reader that mixes its
        query instead, see ``mixing_matrix``). k4v4 and k8v4 codes read as float32 on a CPU go
        through the fused kernel (one pass; ``armkv.memory.kernels``) unless ``fused=False``;
        the PyTorch ops below are its reference."""
        if self.key_scale is None:
            return self.key.to(dtype), self.value.to(dtype)
        d = self.value.shape[-1] * 2
        unmixing = self.mixed and unmix
        kernel = None
        if (
            fused
            and dtype == torch.float32
            and self.key.dtype in (torch.uint8, torch.int8)
            and (not unmixing or d & (d - 1) == 0)
        ):
            kernel = fused_read(torch.empty(0), self.value)  # (codes and scales carry no gradient)
        if kernel is not None:
            key, value = kernel.int4_dequantise(self.key, self.key_scale, self.value, self.value_scale, unmixing)
            return key, value
        key = _dequantise(self.key.transpose(1, 2), self.key_scale).to(dtype)
        value = _dequantise(self.value, self.value_scale).to(dtype)
        if self.mixed and unmix:
            q = mixing_matrix(key.shape[-1], dtype, key.device)
            key, value = key @ q.T, value @ q.T
        return key, value

    # ------------------------------------------------------------------ reads without dequantising
    def key_scores(self, query: torch.Tensor, fused: bool = True) -> torch.Tensor:
        """query [G, R, d] . every slot key -> [G, R, S], in the stored basis (a mixed state
        wants a mixed query). The scales multiply the R x S scores instead of the S x d keys:
        sum_c q_c s_g(c) k_c = sum_g s_g (q_g . k_g) over each scale's group of channels.
        int4 and int8 codes on a CPU go through the fused kernels (``armkv.memory.kernels``)
        unless ``fused=False``; the PyTorch ops below are their reference."""
        if self.key_scale is None:
            return torch.matmul(query, self.key.to(query.dtype).transpose(1, 2))
        kernel = fused_read(query, self.key, int8=True) if fused else None
        if kernel is not None:
            read = kernel.int4_key_scores if self.key.dtype == torch.uint8 else kernel.int8_key_scores
            return read(query, self.key, self.key_scale)
        G, R, _ = query.shape
        S = self.key.shape[-1]
        total = None
        for h, half, sc in _code_halves(self.key, self.key_scale):  # half [G, width, S] (channel-major)
            sc = sc.to(query.dtype).transpose(1, 2)  # [G, n, S]
            n, width = sc.shape[1], half.shape[1]
            q = query[..., h * width : (h + 1) * width]
            if n == 1:  # one scale over the half: a [R, width] x [width, S] product per group
                part = torch.matmul(q, half.to(query.dtype)) * sc
            else:
                codes = half.to(query.dtype).view(G, n, width // n, S)
                part = (torch.matmul(q.reshape(G, R, n, -1).transpose(1, 2), codes) * sc.unsqueeze(2)).sum(1)
            total = part if total is None else total + part
        return total

    def partial_key_scores(self, query: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The ranking scores of ``read_rank="partial"``: :meth:`key_scores` over the channels of
        ``rows`` only, with the query rounded to int8. query [G, R, d] (stored basis), rows
        [G, n] key-code rows, row c holding channels c and c + d/2 (one byte a slot of int4
        codes) -> [G, R, S] float32: per head, q's 2n channels are rounded at the head's scale
        s = max |q| / 127 (1 where all are 0) to qi = round(q / s); a slot's score is s times
        the sum over its scale groups g of scale_g times the integer sum of qi_c k_c over g's
        channels (exact in float32, in any order). Reads n of the d/2 rows of the
        channel-major codes; the fused CPU read does the same inside ``arm_partial_decode_read``,
        in int16 lanes."""
        G, R, d = query.shape
        n, half = rows.shape[1], d // 2
        channels = torch.cat([rows, rows + half], 1)  # [G, 2n]
        q = query.float().gather(2, channels.unsqueeze(1).expand(G, R, 2 * n))
        peak = q.abs().amax(-1, keepdim=True)
        scale = torch.where(peak > 0, peak / 127, torch.ones_like(peak))  # [G, R, 1]
        qi = torch.round(q / scale).clamp(-127, 127)
        if self.key_scale is None:  # float keys [G, S, d]
            keys = self.key.gather(2, channels.unsqueeze(1).expand(G, self.key.shape[1], 2 * n)).float()
            return torch.matmul(qi, keys.transpose(1, 2)) * scale
        S = self.key.shape[-1]
        if self.key.dtype == torch.uint8:  # int4 bytes [G, d/2, S]: a row's low nibble is channel c, its high c + d/2
            picked = self.key.gather(1, rows.unsqueeze(-1).expand(G, n, S))
            codes = torch.cat(int4_halves(picked), 1)  # [G, 2n, S], in the order of `channels`
        else:  # int8 codes [G, d, S]
            codes = self.key.gather(1, channels.unsqueeze(-1).expand(G, 2 * n, S))
        codes = codes.float()
        ng = self.key_scale.shape[-1]
        of_group = F.one_hot(channels // (d // ng), ng).transpose(1, 2).unsqueeze(1)  # [G, 1, ng, 2n]
        sums = torch.matmul(qi.unsqueeze(2) * of_group, codes.unsqueeze(1))  # [G, R, ng, S]: each group's, integers
        return (sums * self.key_scale.float().transpose(1, 2).unsqueeze(1)).sum(2) * scale

    def weighted_values(self, weights: torch.Tensor, fused: bool = True) -> torch.Tensor:
        """weights [G, R, S] @ the slot values -> [G, R, d], in the stored basis; the scales
        weight the R x S weights instead of the S x d values (int4 codes on a CPU: the fused
        kernel, as :meth:`key_scores`)."""
        if self.value_scale is None:
            return torch.matmul(weights, self.value.to(weights.dtype))
        kernel = fused_read(weights, self.value) if fused else None
        if kernel is not None:
            return kernel.int4_weighted_values(weights, self.value, self.value_scale)
        G, R, S = weights.shape
        parts = []
        for _, half, sc in _code_halves(self.value, self.value_scale):  # half [G, S, width]
            n, width = sc.shape[-1], half.shape[-1]
            codes = half.to(weights.dtype).view(G, S, n, width // n).transpose(1, 2)  # [G, n, S, dg]
            scaled = weights.unsqueeze(1) * sc.to(weights.dtype).transpose(1, 2).unsqueeze(2)  # [G, n, R, S]
            parts.append(torch.matmul(scaled, codes).transpose(1, 2).reshape(G, R, -1))
        return torch.cat(parts, -1) if len(parts) > 1 else parts[0]


def _code_halves(codes: torch.Tensor, scale: torch.Tensor):
    """Packed codes and their scales [G, S, ng], per stored half of the channels, the scales
    not applied. Yields (half index h, its integer codes, its scales [G, S, n]): int8 codes
    are one half; int4 bytes two (low nibbles: the first d / 2 channels, high: the rest),
    each with its share of the groups (or, with one group per vector, the same scale). The
    halves keep the codes' layout (keys channel-major [G, width, S], values [G, S, width])."""
    halves = int4_halves(codes) if codes.dtype == torch.uint8 else (codes,)
    ng = scale.shape[-1]
    per_half = ng // len(halves) if ng % len(halves) == 0 else 0
    for h, half in enumerate(halves):
        yield h, half, scale[..., h * per_half : (h + 1) * per_half] if per_half else scale


def _quantise(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (codes: int8 [..., d], or for 4 bits uint8 [..., d / 2] two a byte;
    SLOT_SCALE_DTYPE scales)."""
    if bits == 8:
        return quantise_symmetric(x, 8, scale_dtype=SLOT_SCALE_DTYPE)
    codes, scale = quantise_symmetric(x, 4, value_groups(x.shape[-1]), scale_dtype=SLOT_SCALE_DTYPE)
    return pack_int4(codes), scale


def _dequantise(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_quantise` (fp32); 4-bit codes are the uint8 ones."""
    return dequantise_symmetric(unpack_int4(codes) if codes.dtype == torch.uint8 else codes, scale)
