"""Reads (paper 3.4; docs/design.md, "Reads"): which slots a query reads.

The attention itself is one softmax over the exact sinks and window, these slots and the
new chunk (causal): ``armkv.methods.attention.joint_attention``, shared by every method.
"""

from __future__ import annotations

import torch


def bucket_slot_mask(
    buckets: torch.Tensor, m: torch.Tensor, slot_bucket: torch.Tensor, num_buckets: int
) -> torch.Tensor:
    """Which slots each query reads: those filed under one of its first m buckets.

    buckets : [B, Hq, T, K] bucket ids, best first; m : [B] long, how many to take (<= K)
    slot_bucket : [B, Hq, S] bucket of each slot (-1 = free) -> [B, Hq, T, S] bool

    Costs T * min(S * K, N_b + S): nothing scales with the sequence, and with few picks
    nothing scales with the number of buckets.
    """
    B, Hq, T, K = buckets.shape
    S = slot_bucket.shape[-1]
    take = torch.arange(K, device=buckets.device).view(1, 1, 1, K) < m.view(B, 1, 1, 1)
    picked = torch.where(take, buckets, -2)  # -2 matches no slot (free slots hold -1)
    if K * S <= num_buckets + S:
        # few picks: compare each slot's bucket with the picks, T * S * K, nothing scales with N_b
        return (slot_bucket.unsqueeze(2).unsqueeze(-1) == picked.unsqueeze(3)).any(-1)
    # many picks: a one-hot over buckets, then a gather by slot, T * (N_b + S)
    chosen = torch.zeros(B, Hq, T, num_buckets + 1, dtype=torch.bool, device=buckets.device)
    chosen.scatter_(-1, torch.where(take, buckets, num_buckets), True)
    chosen[..., num_buckets] = False  # column for free slots and unused picks
    idx = torch.where(slot_bucket < 0, num_buckets, slot_bucket).unsqueeze(2).expand(B, Hq, T, -1)
    return chosen.gather(-1, idx)
