"""Reads (paper 3.4, DESIGN.md "Reads"): one softmax over the exact sinks and window, the
slots of the query's top-M buckets, and the new chunk (causal)."""

from __future__ import annotations

import math

import torch


def bucket_slot_mask(
    buckets: torch.Tensor, m: torch.Tensor, slot_bucket: torch.Tensor, num_buckets: int
) -> torch.Tensor:
    """Which slots each query reads: those filed under one of its first m buckets.

    buckets : [B, Hq, T, K] bucket ids, best first; m : [B] long, how many to take (<= K)
    slot_bucket : [B, Hq, S] bucket of each slot (-1 = free) -> [B, Hq, T, S] bool

    Costs T * (K + S): a one-hot over buckets, then a gather by slot; nothing scales
    with the sequence.
    """
    B, Hq, T, K = buckets.shape
    take = torch.arange(K, device=buckets.device).view(1, 1, 1, K) < m.view(B, 1, 1, 1)
    chosen = torch.zeros(B, Hq, T, num_buckets + 1, dtype=torch.bool, device=buckets.device)
    chosen.scatter_(-1, torch.where(take, buckets, num_buckets), True)
    chosen[..., num_buckets] = False  # column for free slots and unused picks
    idx = torch.where(slot_bucket < 0, num_buckets, slot_bucket).unsqueeze(2).expand(B, Hq, T, -1)
    return chosen.gather(-1, idx)


def read_attention(
    query: torch.Tensor,
    exact_keys: torch.Tensor,
    exact_values: torch.Tensor,
    exact_valid: torch.Tensor,
    chunk_keys: torch.Tensor,
    chunk_values: torch.Tensor,
    chunk_valid: torch.Tensor,
    scaling: float,
    slot_logits: torch.Tensor | None = None,
    slot_values: torch.Tensor | None = None,
    slot_masks: list[torch.Tensor] | None = None,
    mix: torch.Tensor | None = None,
) -> torch.Tensor:
    """Joint softmax attention over [exact | slots | chunk].

    Parameters
    ----------
    query : [B, Hq, T, d] post-RoPE
    exact_keys, exact_values : [B, Hkv, L, d] sinks and window (post-RoPE); exact_valid : [B, L]
    chunk_keys, chunk_values : [B, Hkv, T, d] the new tokens; chunk_valid : [B, T]; causal
    slot_logits : [B, Hq, T, S] already scaled (and biased) logits of the slots, or None
    slot_values : [B, Hkv, S, d]
    slot_masks : one or two [B, Hq, T, S] bool masks: Top(M), and Top(M+1) for the cascade
    mix : [B] weight g of the second mask's output (soft cascade), with two masks

    Returns
    -------
    [B, T, Hq, d]
    """
    B, Hq, T, d = query.shape
    Hkv = exact_keys.shape[1]
    rep = Hq // Hkv
    q = query.view(B, Hkv, rep * T, d)  # group query heads by KV head: no copy of K/V
    neg = -math.inf
    le = (q @ exact_keys.transpose(-1, -2)).view(B, Hq, T, -1) * scaling
    le = le.masked_fill(~exact_valid.view(B, 1, 1, -1), neg)
    lc = (q @ chunk_keys.transpose(-1, -2)).view(B, Hq, T, T) * scaling
    causal = torch.ones(T, T, dtype=torch.bool, device=query.device).tril()
    lc = lc.masked_fill(~(causal.view(1, 1, T, T) & chunk_valid.view(B, 1, 1, T)), neg)
    values = [exact_values, chunk_values]
    if slot_logits is None:
        outputs = [_softmax_out(torch.cat([le, lc], -1), torch.cat(values, 2), B, Hkv, rep, T, d)]
    else:
        vals = torch.cat([exact_values, slot_values, chunk_values], 2)
        outputs = [
            _softmax_out(torch.cat([le, slot_logits.masked_fill(~mask, neg), lc], -1), vals, B, Hkv, rep, T, d)
            for mask in slot_masks
        ]
    if len(outputs) == 2:
        g = mix.view(B, 1, 1, 1).to(outputs[0].dtype)
        out = g * outputs[1] + (1 - g) * outputs[0]
    else:
        out = outputs[0]
    return out.transpose(1, 2)


def _softmax_out(logits, values, B, Hkv, rep, T, d):
    # a query that sees nothing (all padding) gets zeros instead of NaN
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    p = p.view(B, Hkv, rep * T, -1)
    return (p @ values).view(B, Hkv * rep, T, d)
