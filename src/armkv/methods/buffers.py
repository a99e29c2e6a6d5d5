"""Exact KV buffers of fixed size: attention sinks and a local window.

``ExactBuffer`` is the exact part shared by the bounded methods (``sink``, ``swa``) and by
ARM (whose routed slots receive what falls out of the window). Its tensors are allocated
once and written in place; a push never grows them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from armkv.memory import kernels
from armkv.methods.attention import zero_invalid


@dataclass
class Overflow:
    """Valid tokens pushed out of a window, in time order, left-padded with invalid entries.

    Attributes
    ----------
    key, value : [B, H, n, d]
    valid : [B, n] bool
    positions : [B, n] long (RoPE positions)
    """

    key: torch.Tensor
    value: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor

    @property
    def size(self) -> int:
        """n: the longest row (0 when nothing overflowed)."""
        return self.valid.shape[1]


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, d], index [B, n] -> [B, H, n, d] (the same tokens for every head)."""
    b, h, _, d = x.shape
    return x.gather(2, index[:, None, :, None].expand(b, h, index.shape[1], d))


class ExactBuffer:
    """The first ``sinks`` and the last ``window`` valid tokens of each batch row, exact.

    Padding is never stored. Rows may receive different numbers of valid tokens per push.
    The window is kept right-aligned in time order (its invalid entries, if any, first).

    Parameters
    ----------
    sinks, window : tokens kept (either may be 0)
    batch, num_kv_heads, head_dim : B, H, d
    dtype, device : of the key and value tensors
    tensors : where the buffer lives, {name: tensor} for every name of :meth:`layout` (e.g.
        views of a serving engine's block, ``ARMLayer.place``): zeroed and used in place of
        tensors of its own; None: it allocates them
    """

    def __init__(
        self,
        sinks: int,
        window: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tensors: dict[str, torch.Tensor] | None = None,
    ):
        if sinks < 0 or window < 0:
            raise ValueError(f"ExactBuffer: sinks={sinks} and window={window} must be >= 0")
        self.sinks, self.window = sinks, window
        # One tensor each for keys, values, validity and positions, sinks first: the read takes
        # them as they are (no copy). Entries that hold no valid token are zero, so a reader
        # need not mask them out of its products (state_clean in attention.joint_attention).
        layout = self.layout(sinks, window, batch, num_kv_heads, head_dim, dtype)
        if tensors is None:
            tensors = {name: torch.zeros(shape, dtype=dt, device=device) for name, (shape, dt) in layout.items()}
        else:
            for name, (shape, dt) in layout.items():
                t = tensors[name]
                if tuple(t.shape) != shape or t.dtype != dt:
                    raise ValueError(
                        f"ExactBuffer: {name} must be {dt} of shape {shape}, not {t.dtype} {tuple(t.shape)}"
                    )
                t.zero_()
        self.k, self.v, self.valid, self.pos = tensors["k"], tensors["v"], tensors["valid"], tensors["pos"]
        self.sink_k, self.win_k = self.k[:, :, :sinks], self.k[:, :, sinks:]  # views
        self.sink_v, self.win_v = self.v[:, :, :sinks], self.v[:, :, sinks:]
        self.sink_valid, self.win_valid = self.valid[:, :sinks], self.valid[:, sinks:]
        self.sink_pos, self.win_pos = self.pos[:, :sinks], self.pos[:, sinks:]
        # The window is a ring while decoding: head[b] is the index of row b's oldest entry
        # (the next one replaced). A chunk push puts it back in time order first.
        self.head = tensors["head"]
        self._ring = False  # head may be nonzero
        # every row's sinks hold a token (known after a chunk push, which syncs anyway): a
        # decode push then skips the sink update, a dozen ops that would change nothing
        self._sinks_full = sinks == 0
        # the decode push's window part in one kernel call on a CPU (kernels.ring_push) rather
        # than some twenty small ops; False: the PyTorch ops, its reference
        self.fused_push = True

    @staticmethod
    def layout(
        sinks: int, window: int, batch: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The buffer's tensors, {name: (shape, dtype)}: what :meth:`tensors` returns."""
        L = sinks + window
        return {
            "k": ((batch, num_kv_heads, L, head_dim), dtype),
            "v": ((batch, num_kv_heads, L, head_dim), dtype),
            "valid": ((batch, L), torch.bool),
            "pos": ((batch, L), torch.long),
            "head": ((batch,), torch.long),
        }

    @property
    def capacity(self) -> int:
        """L = sinks + window."""
        return self.sinks + self.window

    def push(self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> Overflow:
        """Append a chunk's valid tokens; return the valid tokens that left the window.

        Parameters
        ----------
        key, value : [B, H, T, d]
        valid : [B, T] bool (False = padding, dropped)
        positions : [B, T] long

        Returns
        -------
        Overflow with n = the largest number of tokens any row lost (sinks never leave); for a
        one-token push (decoding) n is always 1 and its ``valid`` says whether a token left.
        """
        valid = valid.to(torch.bool)
        if key.shape[2] == 1:
            return self._push_one(key, value, valid, positions)
        if self._ring:
            self._unroll()
        to_window = valid
        if self.sinks:
            to_window = self._fill_sinks(key, value, valid, positions)
        # Candidates in time order: the current window, then the chunk's non-sink tokens.
        cand_k = torch.cat([self.win_k, key], dim=2)  # [B, H, W + T, d]
        cand_v = torch.cat([self.win_v, value], dim=2)
        cand_valid = torch.cat([self.win_valid, to_window], dim=1)  # [B, W + T]
        cand_pos = torch.cat([self.win_pos, positions.to(torch.long)], dim=1)
        # A stable sort on validity puts each row's invalid entries first and keeps the valid
        # ones in time order: the last W are the new window, the valid ones before them overflow.
        order = torch.sort(cand_valid.to(torch.int8), dim=1, stable=True).indices  # [B, W + T]
        total = cand_valid.shape[1]
        keep = order[:, total - self.window :]
        kept = cand_valid.gather(1, keep)
        self.win_k.copy_(zero_invalid(gather_tokens(cand_k, keep), kept[:, None]))
        self.win_v.copy_(zero_invalid(gather_tokens(cand_v, keep), kept[:, None]))
        self.win_valid.copy_(kept)
        self.win_pos.copy_(cand_pos.gather(1, keep))

        lost = (cand_valid.sum(1) - self.window).clamp(min=0)  # [B]
        n = int(lost.max()) if lost.numel() else 0
        if not self._sinks_full:
            self._sinks_full = bool(self.sink_valid.all())
        # Valid entries of the sorted order end at `total`; the window took the last W, so a
        # row's lost tokens sit just before it and anything earlier in the slice is invalid.
        out = order[:, total - self.window - n : total - self.window]  # [B, n]
        out_valid = cand_valid.gather(1, out)
        return Overflow(
            key=zero_invalid(gather_tokens(cand_k, out), out_valid[:, None]),
            value=zero_invalid(gather_tokens(cand_v, out), out_valid[:, None]),
            valid=out_valid,
            positions=cand_pos.gather(1, out),
        )

    def _unroll(self) -> None:
        """Put the ring window back in time order (oldest first) and reset its head."""
        order = (self.head[:, None] + torch.arange(self.window, device=self.head.device)) % self.window  # [B, W]
        self.win_k.copy_(gather_tokens(self.win_k, order))
        self.win_v.copy_(gather_tokens(self.win_v, order))
        self.win_valid.copy_(self.win_valid.gather(1, order))
        self.win_pos.copy_(self.win_pos.gather(1, order))
        self.head.zero_()
        self._ring = False

    def _push_one(
        self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor
    ) -> Overflow:
        """:meth:`push` of one token per row (the decode step): a fixed number of small ops
        and no host sync. The token fills the row's next free sink, or else shifts the
        window by one (its oldest entry leaves, invalid if the window was not full); a
        padding token changes nothing."""
        v = valid[:, 0]  # [B]
        pos = positions.to(torch.long)  # [B, 1]
        if not self._sinks_full:
            filled = self.sink_valid.sum(1, keepdim=True)  # [B, 1]
            hot = (torch.arange(self.sinks, device=v.device)[None, :] == filled) & v[:, None]  # [B, S]
            self.sink_k.copy_(torch.where(hot[:, None, :, None], key, self.sink_k))
            self.sink_v.copy_(torch.where(hot[:, None, :, None], value, self.sink_v))
            self.sink_pos.copy_(torch.where(hot, pos, self.sink_pos))
            self.sink_valid |= hot
            v = v & ~hot.any(1)
        if self.window == 0:
            return Overflow(
                key=zero_invalid(key, v[:, None, None]),
                value=zero_invalid(value, v[:, None, None]),
                valid=v[:, None],
                positions=pos,
            )
        # The ring's oldest entry leaves (O(1) in the window: no shift of the other entries).
        kernel = kernels.fused_cpu(key) if self.fused_push else None
        if kernel is not None:
            old_k, old_v, leaves, old_pos = kernel.ring_push(
                self.win_k, self.win_v, self.win_valid, self.win_pos, self.head, key, value, v, pos[:, 0]
            )
            self._ring = True
            return Overflow(key=old_k, value=old_v, valid=leaves, positions=old_pos)
        b, h, _, d = key.shape
        at = self.head[:, None]  # [B, 1]
        at_kv = at[:, None, :, None].expand(b, h, 1, d)
        old_k, old_v = self.win_k.gather(2, at_kv), self.win_v.gather(2, at_kv)
        old_valid, old_pos = self.win_valid.gather(1, at), self.win_pos.gather(1, at)
        leaves = old_valid & v[:, None]
        lost = Overflow(
            key=zero_invalid(old_k, leaves[:, None]),
            value=zero_invalid(old_v, leaves[:, None]),
            valid=leaves,
            positions=old_pos,
        )
        row = v[:, None, None, None]
        self.win_k.scatter_(2, at_kv, torch.where(row, key, old_k))
        self.win_v.scatter_(2, at_kv, torch.where(row, value, old_v))
        self.win_valid.scatter_(1, at, old_valid | v[:, None])
        self.win_pos.scatter_(1, at, torch.where(v[:, None], pos, old_pos))
        self.head.copy_(torch.where(v, (self.head + 1) % self.window, self.head))
        self._ring = True
        return lost

    def _fill_sinks(
        self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Move each row's first valid tokens into its free sink entries; return the rest's validity [B, T]."""
        filled = self.sink_valid.sum(1, keepdim=True)  # [B, 1]
        rank = valid.cumsum(1) - 1  # [B, T]: index of each valid token among the row's valid ones
        to_sink = valid & (filled + rank < self.sinks)
        t = valid.shape[1]
        if t == 0:
            return valid
        # Sink entry j takes the row's valid token of rank j - filled: the (j - filled)-th index
        # of the stable order that puts valid tokens first.
        valid_first = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # [B, T]
        slot = torch.arange(self.sinks, device=valid.device)[None, :]  # [1, S]
        src_rank = slot - filled  # [B, S]
        takes = (src_rank >= 0) & (src_rank < to_sink.sum(1, keepdim=True))  # [B, S]
        src = valid_first.gather(1, src_rank.clamp(0, t - 1))  # [B, S]
        self.sink_k.copy_(torch.where(takes[:, None, :, None], gather_tokens(key, src), self.sink_k))
        self.sink_v.copy_(torch.where(takes[:, None, :, None], gather_tokens(value, src), self.sink_v))
        self.sink_pos.copy_(torch.where(takes, positions.to(torch.long).gather(1, src), self.sink_pos))
        self.sink_valid |= takes
        return valid & ~to_sink

    def kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sinks then window (the buffer's own tensors, not copies: read them before the next push).

        The window is in time order after a chunk push, in ring order after decode steps;
        attention does not depend on the order (``positions`` give it).

        Returns
        -------
        keys, values : [B, H, L, d] with L = sinks + window, zero where not valid
        valid : [B, L] bool
        positions : [B, L] long
        """
        return self.k, self.v, self.valid, self.pos

    def tensors(self) -> dict[str, torch.Tensor]:
        """The buffer's tensors by name (allocated once; every push writes them in place)."""
        return {"k": self.k, "v": self.v, "valid": self.valid, "pos": self.pos, "head": self.head}

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows in place (beam search): index [B] long."""
        for name in ("k", "v", "valid", "pos", "head"):
            t = getattr(self, name)
            t.copy_(t.index_select(0, index.to(t.device)))
        self._sinks_full = self.sinks == 0 or bool(self.sink_valid.all())

    def state_bytes(self) -> int:
        """Bytes of the exact keys and values: (sinks + window) token-equivalents per row.

        This is what ``ARMConfig.state_bytes`` counts for the exact part. The per-row
        validity and positions (:meth:`bookkeeping_bytes`) are not counted against a budget
        by any method (9 bytes per token and row, whatever the heads and head size).
        """
        return self.k.nbytes + self.v.nbytes

    def bookkeeping_bytes(self) -> int:
        """Bytes of the validity mask, positions ([B, L] bool and long) and ring heads ([B] long)."""
        return self.valid.nbytes + self.pos.nbytes + self.head.nbytes
