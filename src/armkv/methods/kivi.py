"""``kivi``: KIVI's asymmetric 2/4-bit KV quantisation with a full-precision residual.

Keys are quantised per channel over groups of ``group`` consecutive tokens (their outlier
channels stay inside one scale); values per token over groups of ``value_group`` channels.
The ``residual`` most recent tokens stay exact, as do the tokens that left the residual but
do not yet fill a group. transformers' ``QuantizedCache`` quantises both per channel, so it
is not KIVI.

Defaults: 2 bits, groups of 32 tokens (keys) and 32 channels (values), a residual of 128
tokens (at most a quarter of the budget).

Under a budget the quantised groups live in a ring of fixed capacity (as many groups as fit
in the budget's bytes, codes, scales and zero-points counted) that overwrites its oldest
group, plus 4 exact attention sinks; without a budget the ring grows.

Quantisation error: a dequantised entry is within half a step of the original, i.e. within
(max - min) / (2 ** bits - 1) / 2 of its group's range (checked in the tests).
"""

from __future__ import annotations

import torch

from armkv.errors import ArmkvError
from armkv.memory.quant import pack_bits as pack
from armkv.memory.quant import unpack_bits as unpack
from armkv.memory.rope import Rotary
from armkv.methods.attention import joint_attention
from armkv.methods.base import CacheLayer, ModelInfo, register_method, reject_options
from armkv.methods.buffers import ExactBuffer, gather_tokens


def quantise(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantisation along ``dim``.

    Returns codes (uint8, same shape as x), scale and zero (x's dtype, size 1 along dim):
    x ~= codes * scale + zero. Computed in float32 whatever x's dtype, the scale and zero
    rounded to x's dtype (what is stored) before the codes are taken against them.
    """
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True).to(x.dtype)
    hi = xf.amax(dim=dim, keepdim=True)
    scale = ((hi - lo.float()) / (2**bits - 1)).clamp(min=torch.finfo(x.dtype).tiny).to(x.dtype)
    codes = ((xf - lo.float()) / scale.float()).round().clamp(0, 2**bits - 1).to(torch.uint8)
    return codes, scale, lo


class KiviLayer(CacheLayer):
    """Exact sinks and residual window, a staging group, and a ring of quantised groups.

    Quantised state (Q groups of G tokens, per batch row and KV head):
    ``key_codes`` [B, H, Q, G, d*bits/8], ``key_scale``/``key_zero`` [B, H, Q, 1, d],
    ``value_codes`` like the keys, ``value_scale``/``value_zero`` [B, H, Q, G, d/value_group, 1].
    """

    def __init__(
        self,
        layer_idx: int,
        info: ModelInfo,
        rotary: Rotary | None,
        chunk: int,
        bits: int,
        group: int,
        value_group: int,
        residual: int,
        sinks: int,
        capacity: int | None,
    ):
        super().__init__(layer_idx, info, rotary)
        self.chunk = chunk
        self.bits, self.group, self.value_group = bits, group, value_group
        self.residual, self.sinks = residual, sinks
        self.capacity = capacity  # Q under a budget; None: the ring grows
        self.exact: ExactBuffer | None = None
        self.stage_k = self.stage_v = None  # [B, H, G, d]: tokens out of the residual, not yet a group
        self.stage_count = None  # [B] long
        self.groups: dict[str, torch.Tensor] = {}
        self.group_valid = None  # [B, Q] bool
        self.write_at = None  # [B] long: next ring entry per row
        # under a budget the ring has a fixed size: the decode step compiles (decode_step)
        self.static_decode = capacity is not None

    # -------------------------------------------------------------- allocation
    def _allocate(self, key: torch.Tensor) -> None:
        b, h, _, d = key.shape
        if d % (8 // self.bits) or d % self.value_group:
            raise ArmkvError(
                f"kivi: head_dim {d} must be a multiple of {8 // self.bits} (bit packing) and of value_group "
                f"{self.value_group}"
            )
        self.exact = ExactBuffer(self.sinks, self.residual, b, h, d, key.dtype, key.device)
        self.stage_k = torch.empty(b, h, self.group, d, dtype=key.dtype, device=key.device)
        self.stage_v = torch.empty_like(self.stage_k)
        self.stage_count = torch.zeros(b, dtype=torch.long, device=key.device)
        self.write_at = torch.zeros(b, dtype=torch.long, device=key.device)
        self.groups = self._empty_groups(b, h, d, self.capacity or 0, key.dtype, key.device)
        self.group_valid = torch.zeros(b, self.capacity or 0, dtype=torch.bool, device=key.device)

    def _empty_groups(self, b, h, d, q, dtype, device) -> dict[str, torch.Tensor]:
        g, packed = self.group, d * self.bits // 8
        return {
            "key_codes": torch.zeros(b, h, q, g, packed, dtype=torch.uint8, device=device),
            "key_scale": torch.empty(b, h, q, 1, d, dtype=dtype, device=device),
            "key_zero": torch.empty(b, h, q, 1, d, dtype=dtype, device=device),
            "value_codes": torch.zeros(b, h, q, g, packed, dtype=torch.uint8, device=device),
            "value_scale": torch.empty(b, h, q, g, d // self.value_group, 1, dtype=dtype, device=device),
            "value_zero": torch.empty(b, h, q, g, d // self.value_group, 1, dtype=dtype, device=device),
        }

    # -------------------------------------------------------------- attention
    def attend_chunk(self, query, key, value, valid, positions, scaling):
        if self.exact is None:
            self._allocate(key)
        ek, ev, evalid, _ = self.exact.kv()
        dk, dv, dvalid = self._dequantised()
        stage_valid = torch.arange(self.group, device=key.device)[None, :] < self.stage_count[:, None]
        state_k = torch.cat([ek, dk, self.stage_k], dim=2)
        state_v = torch.cat([ev, dv, self.stage_v], dim=2)
        state_valid = torch.cat([evalid, dvalid, stage_valid], dim=1)
        out = joint_attention(query, key, value, valid, scaling, state_k, state_v, state_valid)
        lost = self.exact.push(key, value, valid, positions)
        if lost.size:
            self._stage(lost.key, lost.value, lost.valid)
        return out

    def decode_ready(self) -> bool:
        return self.exact is not None

    def decode_step(self, query, key, value, valid, positions, scaling):
        """:meth:`attend_chunk` for one token with static shapes and no host sync (bounded
        ring): every ring entry is read (the unwritten ones masked out), and the token that
        leaves the residual is staged by :meth:`_stage_one`. Equal to the eager step."""
        ek, ev, evalid, _ = self.exact.kv()
        dk, dv, dvalid = self._dequantised(every_group=True)
        stage_valid = torch.arange(self.group, device=key.device)[None, :] < self.stage_count[:, None]
        state_k = torch.cat([ek, dk, self.stage_k], dim=2)
        state_v = torch.cat([ev, dv, self.stage_v], dim=2)
        state_valid = torch.cat([evalid, dvalid, stage_valid], dim=1)
        out = joint_attention(query, key, value, valid, scaling, state_k, state_v, state_valid)
        lost = self.exact.push(key, value, valid, positions)  # one entry a row, valid where a token left
        self._stage_one(lost.key, lost.value, lost.valid[:, 0])
        return out

    def _stage_one(self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor) -> None:
        """:meth:`_stage` of at most one token a row (key, value [B, H, 1, d], valid [B]) with
        static shapes: the token goes to its row's next staging entry; every row's staging
        group is quantised, and written to the ring's next entry where it just filled."""
        b, h = key.shape[:2]
        hot = (torch.arange(self.group, device=key.device)[None, :] == self.stage_count[:, None]) & valid[:, None]
        self.stage_k.copy_(torch.where(hot[:, None, :, None], key, self.stage_k))
        self.stage_v.copy_(torch.where(hot[:, None, :, None], value, self.stage_v))
        count = self.stage_count + valid.long()
        full = count == self.group  # [B]
        new = self._quantised_groups(self.stage_k.unsqueeze(2), self.stage_v.unsqueeze(2))  # one group a row
        slot = self.write_at % self.capacity  # [B]
        for name, tensor in new.items():
            store = self.groups[name]  # [B, H, Q, ...]
            at = slot.view(b, 1, 1, *[1] * (store.ndim - 3)).expand(b, h, 1, *store.shape[3:])
            keep = store.gather(2, at)
            store.scatter_(2, at, torch.where(full.view(b, *[1] * (store.ndim - 1)), tensor, keep))
        self.group_valid.scatter_(1, slot[:, None], self.group_valid.gather(1, slot[:, None]) | full[:, None])
        self.write_at.add_(full.long())
        self.stage_count.copy_(torch.where(full, 0, count))

    def _dequantised(self, every_group: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values [B, H, Q*G, d] and validity [B, Q*G] of the groups written so far (all
        ``Q`` with ``every_group``: a static shape, no host sync)."""
        used = self.group_valid.shape[1] if every_group else min(self.group_valid.shape[1], int(self.write_at.max()))
        g = self.groups
        b, h, _, gsize, _ = g["key_codes"].shape
        d = g["key_scale"].shape[-1]
        key_codes = unpack(g["key_codes"][:, :, :used], self.bits).to(g["key_scale"].dtype)
        keys = key_codes * g["key_scale"][:, :, :used] + g["key_zero"][:, :, :used]
        value_codes = unpack(g["value_codes"][:, :, :used], self.bits).to(g["value_scale"].dtype)
        value_codes = value_codes.reshape(b, h, used, gsize, d // self.value_group, self.value_group)
        values = value_codes * g["value_scale"][:, :, :used] + g["value_zero"][:, :, :used]
        valid = self.group_valid[:, :used].repeat_interleave(gsize, dim=1)
        return keys.reshape(b, h, used * gsize, d), values.reshape(b, h, used * gsize, d), valid

    # -------------------------------------------------------------- commit
    def _stage(self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor) -> None:
        """Add tokens that left the residual to the staging group; quantise every full group."""
        gsize = self.group
        stage_valid = torch.arange(gsize, device=key.device)[None, :] < self.stage_count[:, None]
        cand_k = torch.cat([self.stage_k, key], dim=2)  # [B, H, G + n, d], time order
        cand_v = torch.cat([self.stage_v, value], dim=2)
        cand_valid = torch.cat([stage_valid, valid], dim=1)
        # Valid tokens first, in time order (stable sort), so row b's tokens are 0 .. count_b - 1.
        order = torch.sort((~cand_valid).to(torch.int8), dim=1, stable=True).indices
        count = cand_valid.sum(1)  # [B]
        full = count // gsize  # [B] complete groups per row
        n_new = int(full.max())
        total = cand_valid.shape[1]
        if n_new:
            idx = order[:, : n_new * gsize]
            gk = gather_tokens(cand_k, idx).reshape(*key.shape[:2], n_new, gsize, key.shape[3])
            gv = gather_tokens(cand_v, idx).reshape(*key.shape[:2], n_new, gsize, key.shape[3])
            is_new = torch.arange(n_new, device=key.device)[None, :] < full[:, None]  # [B, n_new]
            self._write_groups(gk, gv, is_new)
        # What is left of each row (fewer than G tokens) is the new staging group.
        rest = full[:, None] * gsize + torch.arange(gsize, device=key.device)[None, :]  # [B, G]
        src = order.gather(1, rest.clamp(max=total - 1))
        self.stage_k.copy_(gather_tokens(cand_k, src))
        self.stage_v.copy_(gather_tokens(cand_v, src))
        self.stage_count.copy_(count - full * gsize)

    def _write_groups(self, gk: torch.Tensor, gv: torch.Tensor, is_new: torch.Tensor) -> None:
        """Quantise groups gk, gv [B, H, n, G, d] and write row b's first is_new[b].sum() of them."""
        b, h, n, gsize, d = gk.shape
        new = self._quantised_groups(gk, gv)
        if self.capacity is not None:
            # More new groups than the ring holds: only the last `capacity` of a row survive.
            is_new = is_new & (
                torch.arange(n, device=gk.device)[None, :] >= is_new.sum(1, keepdim=True) - self.capacity
            )
            first = is_new.long().argmax(1)  # [B] index of the first surviving group
            slot = (
                self.write_at[:, None] + torch.arange(n, device=gk.device)[None, :] - first[:, None]
            ) % self.capacity
        else:
            slot = self.write_at[:, None] + torch.arange(n, device=gk.device)[None, :]
            need = int((self.write_at + is_new.sum(1)).max())
            if need > self.group_valid.shape[1]:
                self._grow(need)
        rows, cols = is_new.nonzero(as_tuple=True)
        dest = slot[rows, cols]
        for name, tensor in new.items():
            self.groups[name][rows, :, dest] = tensor[rows, :, cols]
        self.group_valid[rows, dest] = True
        # Entries ever written form a prefix of the store (every row starts at entry 0), so
        # max(write_at) bounds what is worth dequantising.
        self.write_at.add_(is_new.sum(1))  # (in place: a compiled step keeps its state where it is)

    def _quantised_groups(self, gk: torch.Tensor, gv: torch.Tensor) -> dict[str, torch.Tensor]:
        """Groups gk, gv [B, H, n, G, d] as stored: codes, scales and zero-points (``self.groups``' layout)."""
        b, h, n, gsize, d = gk.shape
        key_codes, key_scale, key_zero = quantise(gk, self.bits, dim=3)  # per channel over the G tokens
        vg = gv.reshape(b, h, n, gsize, d // self.value_group, self.value_group)
        value_codes, value_scale, value_zero = quantise(vg, self.bits, dim=-1)  # per token, channel groups
        return {
            "key_codes": pack(key_codes, self.bits),
            "key_scale": key_scale,
            "key_zero": key_zero,
            "value_codes": pack(value_codes.reshape(b, h, n, gsize, d), self.bits),
            "value_scale": value_scale,
            "value_zero": value_zero,
        }

    def _grow(self, need: int) -> None:
        """Unbudgeted: extend the group store to ``need`` groups (doubling, to amortise the copies)."""
        old = self.group_valid.shape[1]
        size = max(need, 2 * old)
        b, h = self.groups["key_codes"].shape[:2]
        d = self.groups["key_scale"].shape[-1]
        extra = self._empty_groups(b, h, d, size - old, self.groups["key_scale"].dtype, self.group_valid.device)
        self.groups = {k: torch.cat([v, extra[k]], dim=2) for k, v in self.groups.items()}
        self.group_valid = torch.cat(
            [self.group_valid, torch.zeros(b, size - old, dtype=torch.bool, device=self.group_valid.device)], dim=1
        )

    # -------------------------------------------------------------- accounting
    def state_tensors(self) -> dict[str, torch.Tensor]:
        if self.exact is None:
            return {}
        held = {f"exact.{name}": t for name, t in self.exact.tensors().items()}
        held.update({f"groups.{name}": t for name, t in self.groups.items()})
        for name in ("stage_k", "stage_v", "stage_count", "write_at", "group_valid"):
            held[name] = getattr(self, name)
        return held

    def state_bytes(self) -> int:
        if self.exact is None:
            return 0
        allocated = self.group_valid.shape[1]
        per_group = sum(t[:, :, :1].numel() * t.element_size() for t in self.groups.values())
        stage = 2 * self.stage_k.numel() * self.stage_k.element_size()
        return self.exact.state_bytes() + stage + allocated * per_group


def group_bytes(info: ModelInfo, bits: int, group: int, value_group: int) -> int:
    """Bytes of one quantised group of ``group`` tokens, all KV heads: codes, scales and zero-points."""
    d, s = info.head_dim, info.dtype_bytes
    codes = 2 * group * d * bits // 8
    key_meta = 2 * d * s
    value_meta = 2 * group * (d // value_group) * s
    return info.num_kv_heads * (codes + key_meta + value_meta)


@register_method("kivi", "KIVI: 2/4-bit keys per channel, values per token, exact residual (bounded with --budget)")
def make_kivi(
    layer_idx: int,
    info: ModelInfo,
    rotary: Rotary | None,
    budget: int | None,
    chunk: int,
    bits: int = 2,
    group: int = 32,
    value_group: int | None = None,
    residual: int | None = None,
    sinks: int = 4,
    horizon: int | None = None,
    **options,
):
    reject_options("kivi", options)
    # KIVI's residual is 128 tokens; a small budget keeps a quarter of itself exact instead.
    residual = residual if residual is not None else (128 if budget is None else min(128, budget // 4))
    if bits not in (2, 4):
        raise ArmkvError(f"kivi: bits={bits} must be 2 or 4")
    value_group = value_group or min(32, info.head_dim)
    if group < 1 or residual < 0 or info.head_dim % value_group:
        raise ArmkvError(
            f"kivi: group={group} must be >= 1, residual={residual} >= 0 and value_group={value_group} must divide "
            f"head_dim {info.head_dim}"
        )
    capacity = None
    if budget is None:
        sinks = 0  # nothing is ever dropped, so nothing needs to be kept apart
    else:
        exact_tokens = sinks + residual + group  # sinks, residual window, staging group
        free = info.budget_bytes(budget) - exact_tokens * info.token_bytes()
        capacity = free // group_bytes(info, bits, group, value_group)
        if capacity < 1:
            per_group = -(-group_bytes(info, bits, group, value_group) // info.token_bytes())
            raise ArmkvError(
                f"budget {budget} is too small for method 'kivi' ({sinks} sinks + residual {residual} + a staging "
                f"group of {group} exact tokens + one quantised group): raise --budget to at least "
                f"{exact_tokens + per_group}, or lower residual"
            )
    if horizon is not None and capacity is not None:
        # the tokens the cache will see (make_cache's horizon): a residual and a ring that never
        # fill keep the same tokens at any size, so allocate only what they fill
        residual = min(residual, max(0, horizon - sinks))
        capacity = min(capacity, -(-horizon // group) + 1)
    return KiviLayer(layer_idx, info, rotary, chunk, bits, group, value_group, residual, sinks, capacity)
