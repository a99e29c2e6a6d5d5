"""What a sparse read of one decoded token takes from an ARM layer and how many bytes it reads.

Used by ``armkv eval reads`` beside each setting's missed mass.

``tree_taken``: the slots of the M buckets the tree's read routing picks for a decoded token
(``Router.group_topm_buckets`` of its pre-RoPE query, one choice for each KV head's R
query heads), as the cache's ``read_rank="tree"`` picks them.

``bytes_read``: the bytes one layer reads for one decoded token, summed over its KV heads,
counted from the stored state: what ranks the buckets plus the slots it then takes whole.

- ``tree``: the router weights and read biases of the nodes the search scores (all of them
  when the search is exhaustive, else the beam's nodes level by level), in the routers' dtype.
- ``partial``: of every occupied slot, the key-code rows the ranking reads (a row holds
  channels c and c + d/2) and the slot's key scales.
- ``best``: every occupied slot's key codes and scales.

then, for every ranking, the key and value codes and scales of each slot taken (``partial``
and ``best`` read a taken slot's key again whole, as the fused kernels do). The slots' count
bias and positions, and the query, are left out: a few bytes a slot that every ranking reads
alike.
"""

from __future__ import annotations

import torch


def tree_taken(router, query_pre: torch.Tensor, unit: torch.Tensor, m: int) -> torch.Tensor:
    """Slots of each group's tree-routed buckets.

    router : the layer's ``Router``; query_pre : [B, Hq, 1, d] pre-RoPE query of one token;
    unit : [G, S] each slot's bucket (-1 free), G = B * H; m : buckets -> [G, S] bool"""
    B, Hq, T, d = query_pre.shape
    H = router.weight.shape[0]
    x = query_pre.reshape(B, H, Hq // H, T, d).to(router.weight.dtype)
    buckets = router.group_topm_buckets(x, m)[0].reshape(B * H, -1)  # [G, m']
    nb = router.num_buckets
    chosen = torch.zeros(B * H, nb + 1, dtype=torch.bool, device=unit.device).scatter_(1, buckets.long(), True)
    return chosen.gather(1, torch.where(unit < 0, nb, unit.long())) & (unit >= 0)


def _per_slot(t: torch.Tensor | None, groups: int, slots: int) -> float:
    return 0.0 if t is None else t.numel() * t.element_size() / (groups * slots)


def router_bytes(router, m: int) -> int:
    """Bytes of router weights and read biases a top-m read routing of one token touches,
    over all KV heads."""
    H, K, C, d = router.weight.shape
    row = d * router.weight.element_size() + router.read_bias.element_size()
    m = min(m, router.num_buckets)
    if router.exhaustive(m):
        nodes = K
    else:  # the beam scores the children of at most m nodes a level
        nodes = sum(min(C**level, m) for level in range(router.depth))
    return H * nodes * C * row


def bytes_read(state, rank: str, taken: torch.Tensor, head_dim: int, router=None, m: int = 0, rows: int = 0) -> float:
    """Bytes one layer reads for one decoded token (see the module docstring).

    state : the layer's readable ``MemoryState``; rank : "tree", "partial" or "best";
    taken : [G, S] the slots the read takes; head_dim : d (a slot's key codes hold d / 2
    rows); router, m : for "tree"; rows : for "partial", the key-code rows it ranks by"""
    G, S = taken.shape
    key = _per_slot(state.key, G, S)
    key_scale = _per_slot(state.key_scale, G, S)
    value = _per_slot(state.value, G, S) + _per_slot(state.value_scale, G, S)
    occupied = float((state.count.reshape(G, S) > 0).sum())
    slots = float(taken.sum())
    if rank == "tree":
        ranking = float(router_bytes(router, m))
    elif rank == "partial":
        ranking = occupied * (rows * key / max(1, head_dim // 2) + key_scale)
    else:
        ranking = occupied * (key + key_scale)
    return ranking + slots * (key + key_scale + value)
