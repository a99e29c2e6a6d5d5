"""Writes (paper 3.2-3.3; docs/design.md, "Writes"): choose a slot, gate, blend, scan.

A chunk of N tokens is written against the state at the sync point t0 in three steps:

1. ``plan_writes`` decides, for every token, the slot it writes to. With the default
   similarity scorer a token either merges into the best-scoring occupied slot of its
   bucket or, when no slot scores above the "new slot" option (logit 0; initialised as
   cosine >= merge_threshold), it is novel and takes a free slot exactly. Novel tokens
   of the chunk that are near-duplicates of an earlier novel token of the same bucket
   join that token's new slot. When the pool has fewer free slots than novel tokens,
   room is made by merging the closest pairs: mutual-nearest pairs of old slots and
   least-novel tokens (merged into their nearest slot) compete on similarity, so a
   novel token keeps an exact slot unless something more redundant can give way.
2. ``gate_weights`` computes every write's blend weight beta = alpha * gamma, where
   gamma = sigmoid(w . [K; k; K*k; cos; log n] + b) is initialised to 1 / (1 + n), the
   running mean; the first write into an empty slot has beta = 1 (the empty-slot rule).
3. ``scan_writes`` applies them: each slot's final state is
   prod(1 - beta) * A0 + sum_i beta_i prod_{j>i}(1 - beta_j) a_i, a segmented affine
   scan over the writes sorted by (slot, time), vectorised (log2 N steps, no loop over
   tokens). ``armkv.memory.naive`` holds the per-token loop it must equal.

Decoding writes the tokens that left the window every ``sync`` tokens through the same
functions; with ``sync=1`` every token is written alone, so its gates see the current state
(the paper's state-dependent form).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from armkv.config import CHOICES, ARMConfig
from armkv.errors import ArmkvError
from armkv.memory import kernels
from armkv.memory.state import MemoryState

SCORE_SHARPNESS = 20.0  # initial weight of cos(slot, token) in the similarity scorer


class WriteParams(nn.Module):
    """Slot scorer and gate of one layer (shared by its KV heads): trainable parameters,
    initialised to a rule (merge at cosine >= merge_threshold; gamma = 1 / (1 + n)) that the
    shipped adapter keeps (docs/design.md)."""

    def __init__(self, head_dim: int, scorer: str = "similarity", gate: str = "scalar", merge_threshold: float = 0.98):
        super().__init__()
        d = head_dim
        self.head_dim, self.scorer_kind = d, scorer
        if scorer == "similarity":
            # features [K~; k; K~ * k; cos(K~, k)]: the product and cosine let it compare them
            self.score = nn.Linear(3 * d + 1, 1)
            with torch.no_grad():
                self.score.weight.zero_()
                self.score.weight[0, 3 * d] = SCORE_SHARPNESS
                self.score.bias.fill_(-SCORE_SHARPNESS * merge_threshold)
        else:
            # the paper's w_s . [K~; k] + b_s: a slot term plus a token term, blind to their match
            self.score = nn.Linear(2 * d, 1)
        # features [K~; k; K~ * k; cos; log max(n, 1)] -> gamma, 1 / (1 + n) at initialisation
        self.gate = nn.Linear(3 * d + 2, 1 if gate == "scalar" else d)
        with torch.no_grad():
            self.gate.weight.zero_()
            self.gate.weight[:, 3 * d + 1] = -1.0
            self.gate.bias.zero_()

    def pair_scores(self, slot_keys: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Score every (token, slot) pair.

        slot_keys : [G, S, d]; tokens : [G, N, d] -> (z [G, N, S], cos [G, N, S])
        """
        d = self.head_dim
        cos = self.cosines(slot_keys, tokens)
        w, b = self.score.weight[0], self.score.bias[0]
        if self._cosine_only():
            return w[3 * d] * cos + b, cos
        # the slot term, the token term and the bias ride in one matmul with the product term:
        # [k, k.w_k, 1] . [K * w_p, 1, K.w_K + b] (the chunk's hot path: N x S scores per group)
        ones_t = torch.ones_like(tokens[..., :1])
        ones_s = torch.ones_like(slot_keys[..., :1])
        prod_w = w[2 * d : 3 * d] if self.scorer_kind == "similarity" else torch.zeros_like(w[:d])
        left = torch.cat([tokens, tokens @ w[d : 2 * d, None], ones_t], -1)
        right = torch.cat([slot_keys * prod_w, ones_s, slot_keys @ w[:d, None] + b], -1)
        z = left @ right.transpose(1, 2)
        if self.scorer_kind == "similarity":
            z = z + w[3 * d] * cos
        return z, cos

    @staticmethod
    def cosines(slot_keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """slot_keys : [G, S, d]; tokens : [G, N, d] -> cos [G, N, S]"""
        return F.normalize(tokens, dim=-1) @ F.normalize(slot_keys, dim=-1).transpose(1, 2)

    def increasing_in_cosine(self) -> bool:
        """True when z is an increasing affine map of the cosine alone (:meth:`_cosine_only`
        with a positive cosine weight): the best slot by z is then the best by cosine."""
        return self._cosine_only() and bool(self.score.weight[0, 3 * self.head_dim] > 0)

    def _cosine_only(self) -> bool:
        """True when the scorer's weights are zero but the cosine's (as initialised, and in
        the shipped adapters) and no gradient is wanted: z is then an affine map of cos, and
        the N x S product of the other terms is skipped. Checked once per weight update, or
        at every call for weights made under ``torch.inference_mode`` (they keep no version)."""
        weight = self.score.weight
        if self.scorer_kind != "similarity" or (torch.is_grad_enabled() and weight.requires_grad):
            return False
        if weight.is_inference():
            return not bool(weight[0, : 3 * self.head_dim].any())
        stamp = (weight._version, weight.data_ptr())
        if getattr(self, "_cosine_stamp", None) != stamp:
            self._cosine_stamp = stamp
            self._cosine_flag = not bool(weight[0, : 3 * self.head_dim].any())
        return self._cosine_flag

    def pair_scores_reference(self, slot_keys: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`pair_scores` term by term, per (token, slot) pair: the tests' oracle."""
        d = self.head_dim
        w, b = self.score.weight[0], self.score.bias[0]
        k, K = tokens.unsqueeze(2), slot_keys.unsqueeze(1)  # [G, N, 1, d], [G, 1, S, d]
        cos = F.cosine_similarity(k, K, dim=-1, eps=1e-12)
        z = (K * w[:d]).sum(-1) + (k * w[d : 2 * d]).sum(-1) + b
        if self.scorer_kind == "similarity":
            z = z + (k * K * w[2 * d : 3 * d]).sum(-1) + w[3 * d] * cos
        return z, cos

    def gate_values(self, cand: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """gamma for each write. cand, tokens : [..., d]; count : [...] -> [..., 1 or d]."""
        cos = F.cosine_similarity(cand, tokens, dim=-1, eps=1e-8).unsqueeze(-1)
        logn = count.clamp_min(1).log().unsqueeze(-1).to(tokens.dtype)
        return torch.sigmoid(self.gate(torch.cat([cand, tokens, cand * tokens, cos, logn], dim=-1)))


@dataclass
class WritePlan:
    """Where each token of a chunk goes. G groups (batch x KV heads), N tokens, S slots.

    target : [G, N] slot written (-1: padding, no write)
    alpha : [G, N] weight of the chosen option (Gumbel-Softmax in training, 1 at inference)
    cand : [G, N, d] what the gate compares the token with: the slot at t0, or for a slot
        filled in this chunk the key of its first token
    count : [G, N] tokens the slot holds before this write (0: fills an empty slot)
    bucket : [G, S] each slot's bucket after the chunk
    """

    target: torch.Tensor
    alpha: torch.Tensor
    cand: torch.Tensor
    count: torch.Tensor
    bucket: torch.Tensor


@dataclass(frozen=True)
class WriteRule:
    """How a layer decides and blends its writes: the write switches of the run-time
    ``ARMConfig``, fixed for a cache (``WriteRule.from_config``; docs/design.md, "Writes")."""

    write: str = (
        "gated"  # "gated" (the learned gate), "mean" (beta = 1 / (n + 1)) or "fifo" (overwrite the oldest slot)
    )
    slots_per_bucket: int = 0  # Y of the paper's fixed partition, 0 for the shared pool
    # (shared pool, similarity scorer) a group whose free slots can hold all of the chunk's
    # valid tokens gives each its own slot, however similar; merging starts when the pool runs short
    lazy: bool = False
    # where a novel token merges when the pool is short of room and it is among the most
    # redundant candidates: "bucket", its most similar slot of its own bucket; "any", of any bucket
    demote_scope: str = "any"
    protect_recent: float = 0.0  # share of the occupied slots, the most recent, kept out of the pair merges
    tau: float = 1.0  # Gumbel-Softmax temperature of the choice in training
    empty_slot_rule: bool = True  # the first write into an empty slot takes beta = 1

    def __post_init__(self) -> None:
        for name in ("write", "demote_scope"):
            if getattr(self, name) not in CHOICES[name]:
                raise ArmkvError(f"WriteRule.{name}={getattr(self, name)!r} is not one of {', '.join(CHOICES[name])}")
        if self.slots_per_bucket < 0:
            raise ArmkvError(f"WriteRule.slots_per_bucket={self.slots_per_bucket} must be >= 0 (0: the shared pool)")
        if not 0.0 <= self.protect_recent < 1.0:
            raise ArmkvError(f"WriteRule.protect_recent={self.protect_recent} must be in [0, 1)")
        if self.tau <= 0:
            raise ArmkvError(f"WriteRule.tau={self.tau} must be > 0")

    @classmethod
    def from_config(cls, config: ARMConfig) -> WriteRule:
        return cls(
            write=config.write,
            slots_per_bucket=config.slots_per_bucket,
            lazy=config.lazy_merge,
            demote_scope=config.demote_scope,
            protect_recent=config.protect_recent,
            tau=config.tau,
            empty_slot_rule=config.empty_slot_rule,
        )


def _gumbel_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return -torch.log(-torch.log(u.clamp(1e-10, 1 - 1e-10)))


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [G, S, ...], index [G, K] -> [G, K, ...]: x[g, index[g, k]], whole rows copied
    (``gather`` with an index expanded over the trailing dims is several times slower)."""
    G, S = x.shape[:2]
    flat = (index + torch.arange(G, device=index.device).unsqueeze(1) * S).reshape(-1)
    return x.reshape(G * S, *x.shape[2:]).index_select(0, flat).view(G, index.shape[1], *x.shape[2:])


def _merge_terms(state: MemoryState, src_of: torch.Tensor):
    """What a merge of slot src_of[g, s] into slot s changes, shared by :func:`_merge_pairs`
    and its reference: (has [G, S]: s absorbs a slot, src [G, S], the count weights w_dst and
    w_src, keep: 0 on the freed source slots, count and bucket after the merges)."""
    has = src_of >= 0
    src = src_of.clamp_min(0)
    n_dst, n_src = state.count, state.count.gather(1, src) * has
    total = (n_dst + n_src).clamp_min(1e-12)
    freed = _scatter_where(torch.zeros_like(has), src, has, has)  # the sources become free
    keep = (~freed).to(state.key.dtype)
    bucket = torch.where(has & (n_src > n_dst), state.bucket.gather(1, src), state.bucket)
    bucket = torch.where(freed, torch.full_like(bucket, -1), bucket)
    return has, src, n_dst / total, n_src / total, keep, (n_dst + n_src) * keep, bucket


def _merge_pairs(state: MemoryState, src_of: torch.Tensor, inplace: bool = False) -> MemoryState:
    """Merge slot src_of[g, s] into slot s (count-weighted), freeing the source slot.

    src_of : [G, S] long, -1 where slot s absorbs nothing. The pairs are disjoint (no slot
    both absorbs and is absorbed, as :func:`_make_room` picks them). Only the rows of the
    merged slots are computed: a full pool merges about ``sync`` pairs per write among
    thousands of slots. Equal to :func:`merge_pairs_reference` (tests/test_memory.py).
    ``inplace``: the merged rows are written into ``state.key`` and ``state.value`` (no
    copy of the pool; the caller holds no other use of them).
    """
    G, S, d = state.key.shape
    has, src, w_dst, w_src, keep, count, bucket = _merge_terms(state, src_of)
    dst_rows = has.view(-1).nonzero().squeeze(1)  # flat g * S + s
    src_rows = (dst_rows // S) * S + src.view(-1).index_select(0, dst_rows)
    wd = w_dst.view(-1).index_select(0, dst_rows).unsqueeze(-1)
    ws = w_src.view(-1).index_select(0, dst_rows).unsqueeze(-1)

    def blend_rows(a: torch.Tensor) -> torch.Tensor:  # [G, S, d]: the merged rows blended, the freed zeroed
        flat = a.reshape(G * S, d)
        mixed = wd.to(a.dtype) * flat.index_select(0, dst_rows) + ws.to(a.dtype) * flat.index_select(0, src_rows)
        out = flat.index_copy_(0, dst_rows, mixed) if inplace else flat.index_copy(0, dst_rows, mixed)
        return out.index_fill_(0, src_rows, 0.0).view(G, S, d)

    pos = torch.where(has, w_dst * state.pos + w_src * state.pos.gather(1, src), state.pos) * keep
    return MemoryState(key=blend_rows(state.key), value=blend_rows(state.value), pos=pos, count=count, bucket=bucket)


def merge_pairs_reference(state: MemoryState, src_of: torch.Tensor) -> MemoryState:
    """:func:`_merge_pairs` computed over every slot (the tests' oracle)."""
    has, src, w_dst, w_src, keep, count, bucket = _merge_terms(state, src_of)

    def blend(a: torch.Tensor) -> torch.Tensor:
        if a.ndim == 3:
            other = gather_rows(a, src)
            mixed = w_dst.unsqueeze(-1).to(a.dtype) * a + w_src.unsqueeze(-1).to(a.dtype) * other
            return torch.where(has.unsqueeze(-1), mixed, a) * keep.unsqueeze(-1)
        return torch.where(has, w_dst * a + w_src * a.gather(1, src), a) * keep

    return MemoryState(key=blend(state.key), value=blend(state.value), pos=blend(state.pos), count=count, bucket=bucket)


def _scatter_where(base: torch.Tensor, index: torch.Tensor, src: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``base.scatter(1, index, src)`` for the entries where mask holds; the others write
    into a spare column that is dropped, so they cannot clobber a real entry."""
    G, S = base.shape
    ext = torch.cat([base, base[:, :1]], 1)
    ext = ext.scatter(1, torch.where(mask, index, S), torch.where(mask, src, ext[:, :1].expand_as(src)))
    return ext[:, :S]


def true_first(mask: torch.Tensor) -> torch.Tensor:
    """Indices along the last dimension with the True entries first, then the False ones,
    each in ascending order: ``torch.sort((~mask).to(torch.int8), stable=True).indices``
    from two running counts and one scatter, without a sort."""
    idx = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    n_true = mask.sum(-1, keepdim=True)
    dest = torch.where(mask, mask.cumsum(-1) - 1, n_true + (~mask).cumsum(-1) - 1)
    return torch.empty_like(idx).scatter_(-1, dest, idx)


def _exclusive_rank(index: torch.Tensor, mask: torch.Tensor, size: int) -> torch.Tensor:
    """For each token, how many earlier tokens of its group share its index (where mask).

    index : [G, N] in [0, size); mask : [G, N] bool -> [G, N] long (0 where not mask).
    One sort by (index, time): a token's rank is its distance from its run's start.
    """
    G, N = index.shape
    t = torch.arange(N, device=index.device)
    key = torch.where(mask, index.clamp(0, size - 1) * N + t, size * N + t)
    sorted_key, order = key.sort(dim=1)
    run = sorted_key // N
    start = torch.ones_like(run, dtype=torch.bool)
    start[:, 1:] = run[:, 1:] != run[:, :-1]
    first = torch.where(start, t.expand(G, N), 0).cummax(1).values
    rank_sorted = t - first
    rank = torch.empty_like(rank_sorted).scatter_(1, order, rank_sorted)
    return rank * mask


def roomy_groups(
    state: MemoryState, valid: torch.Tensor, params: WriteParams, slots_per_bucket: int = 0
) -> torch.Tensor | None:
    """Under lazy merging, which groups' free slots can hold every valid token of the chunk
    ([G, 1] bool): those tokens each take a free slot, whatever their similarity. None where
    lazy merging does not apply (a scorer other than the similarity one, or fixed slots per
    bucket). When every group is roomy at inference, the plan reads no stored slot."""
    if params.scorer_kind != "similarity" or slots_per_bucket != 0:
        return None
    return (state.count == 0).sum(-1, keepdim=True) >= valid.sum(-1, keepdim=True)


def plan_writes(
    state: MemoryState,
    keys: torch.Tensor,
    bucket: torch.Tensor,
    valid: torch.Tensor,
    params: WriteParams,
    rule: WriteRule = WriteRule(),
    training: bool = False,
    generator: torch.Generator | None = None,
    fused: bool = True,
    inplace: bool = False,
) -> tuple[WritePlan, MemoryState]:
    """Decide every write of a chunk against the state at the sync point.

    Parameters
    ----------
    state : the memory at t0
    keys : [G, N, d] pre-RoPE keys of the chunk (what routing and similarity use)
    bucket : [G, N] bucket of each token (``Router.route_writes``)
    valid : [G, N] bool; padding writes nothing
    params : the layer's slot scorer and gate
    rule : the write rule (``WriteRule``: write kind, pool, lazy merging, demotion scope, ...);
        under demote_scope="bucket" the fused path scores each token against its bucket's
        slots only, not all S
    training : choose by Gumbel-Softmax (temperature ``rule.tau``, noise from ``generator``)
    fused : at inference on float32 CPU states with a cosine-only scorer, find each token's
        best slots with the fused kernel (``armkv.memory.kernels``); False: the PyTorch ops,
        its reference
    inplace : merges that make room write into ``state.key`` and ``state.value`` rather than
        copies (inference on a state the caller gives up, as ``SlotPool.write``'s un-packed one)

    Returns
    -------
    (plan, state') where state' is ``state`` after the pair merges that made room.
    ``naive.naive_plan_writes`` decides the same plan one token at a time.
    """
    write, slots_per_bucket, lazy, demote_scope = rule.write, rule.slots_per_bucket, rule.lazy, rule.demote_scope
    protect_recent, tau = rule.protect_recent, rule.tau
    G, N, d = keys.shape
    S = state.slots
    dev = keys.device
    t_idx = torch.arange(N, device=dev).expand(G, N)
    if write == "fifo":
        return _plan_fifo(state, keys, bucket, valid), state

    occ = state.count > 0
    similarity = params.scorer_kind == "similarity"
    roomy = roomy_groups(state, valid, params, slots_per_bucket) if lazy else None  # [G, 1]
    if roomy is not None and not training and bool(roomy.all()):
        # every group's chunk fits in its free slots: each token takes its own, and no
        # token-slot score can change that (the general path below gives the same plan)
        novel = leader = valid
        best_slot = torch.zeros(G, N, dtype=torch.long, device=dev)
        parent = t_idx
        alpha = torch.ones(G, N, dtype=keys.dtype, device=dev)
    else:
        # the fused kernel: one pass over the token-slot cosines finds each token's best slot of
        # its bucket and of any bucket, where the ops below make eight (building and masking z)
        module = kernels.fused_cpu(keys) if fused and not training and params.increasing_in_cosine() else None
        nearest = None
        if module is not None:
            slot_bucket = torch.where(occ, state.bucket, -1)
            if demote_scope == "bucket" and protect_recent == 0:
                # nothing needs a token's cosine with another bucket's slot: score each token
                # against its own bucket's slots (about S / 30 of them in a calibrated tree)
                cos = None
                same_cos, choice = module.bucket_best_slots(keys, state.key, slot_bucket, bucket)
                nearest = (same_cos, choice)
            else:
                cos = params.cosines(state.key, keys)  # [G, N, S]
                same_cos, choice, any_cos, any_idx = module.best_slots(cos, slot_bucket, bucket)
                nearest = (same_cos, choice) if demote_scope == "bucket" else (any_cos, any_idx)
            # z's max is the map of the cosines' max (an increasing map): the same value as the ops'
            best_z = params.score.weight[0, 3 * d] * same_cos + params.score.bias[0]
        else:
            z, cos = params.pair_scores(state.key, keys)  # [G, N, S]
            cand_mask = occ.unsqueeze(1) & (state.bucket.unsqueeze(1) == bucket.unsqueeze(2))
            z = z.masked_fill(~cand_mask, -math.inf)
        if training:
            # options: the candidate slots, then (similarity scorer) "take a new slot" with logit 0
            options = torch.cat([z, torch.zeros(G, N, 1, device=dev, dtype=z.dtype)], -1) if similarity else z
            noisy = options + _gumbel_like(options, generator)
            choice = noisy.argmax(-1)
            probs = torch.softmax(noisy / tau, dim=-1)
            probs = torch.nan_to_num(probs, nan=1.0)  # a token with no option at all: weight 1
            alpha = probs.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
            has_cand = cand_mask.any(-1)
            # the best-scoring slot, also for a token that chose a new one (the paper pool's
            # over-capacity rule merges it there)
            best_slot = torch.where(choice < S, choice, z.argmax(-1))
        else:
            # the argmax over [slots | new (logit 0)] without building it: ties go to the slot
            if module is None:
                best_z, choice = z.max(-1)
            best_slot = choice
            if similarity:
                choice = torch.where(best_z >= 0, choice, S)
            alpha = torch.ones(G, N, dtype=keys.dtype, device=dev)
            has_cand = best_z > -math.inf
        best_slot = best_slot.clamp(0, S - 1)  # (arbitrary where no slot is a candidate)
        if similarity:
            novel = valid & ((choice == S) | ~has_cand)
        else:
            novel = valid.clone()  # the paper's scorer cannot tell novelty: every token wants a free slot
        if roomy is not None:
            novel = torch.where(roomy, valid, novel)

        # novel tokens that repeat an earlier novel token of their bucket join its new slot
        zt, _ = params.pair_scores(keys, keys)  # zt[g, t, u]: token t against token u as a slot
        same = (bucket.unsqueeze(2) == bucket.unsqueeze(1)) & novel.unsqueeze(2) & novel.unsqueeze(1)
        earlier = t_idx.unsqueeze(2) > t_idx.unsqueeze(1)
        parent = t_idx.clone()
        if similarity:
            passes = same & earlier & (zt >= 0)
            if roomy is not None:
                passes = passes & ~roomy.unsqueeze(-1)  # room for every token: repeats keep their own slots
            first = torch.where(passes, t_idx.unsqueeze(1), N).min(-1).values
            parent = torch.where(first < N, first, t_idx)
            for _ in range(max(1, math.ceil(math.log2(max(N, 2))))):
                parent = parent.gather(1, parent)
        leader = novel & (parent == t_idx)

    src_of = torch.full((G, S), -1, dtype=torch.long, device=dev)
    demote_to = torch.full((G, N), -1, dtype=torch.long, device=dev)
    if slots_per_bucket == 0:
        free = (~occ).sum(-1)
        deficit = (leader.sum(-1) - free).clamp_min(0)
        if bool((deficit > 0).any()):
            room = state
            if protect_recent > 0:
                # only the older slots merge; the chunk's tokens give way only when their pairs run out
                older = torch.where(occ, state.pos, math.inf).argsort(1).argsort(1)
                keep = (occ.sum(1, keepdim=True) * (1 - protect_recent)).floor()
                room = replace(state, count=state.count * (older < keep))
            ss, ts = room_similarity(room, cos, slot_pairs=state.slots <= EXACT_NEIGHBOURS)
            neighbours = _masked_neighbours(ss, room) if ss is not None else banded_neighbours(room)
            if protect_recent > 0:
                ts = ts - 1e4
            nearest_token = nearest if protect_recent == 0 else None
            if nearest_token is None and demote_scope == "bucket":
                ts = ts.masked_fill(state.bucket.unsqueeze(1) != bucket.unsqueeze(2), -math.inf)
            src_of, demote_to = _make_room(room, leader, neighbours, ts, deficit, nearest_token)
            leader = leader & (demote_to < 0)
            state = _merge_pairs(state, src_of, inplace)  # (with no deficit nothing merges: src_of is all -1)
        free_mask = state.count == 0
        free_order = true_first(free_mask)  # free slots first
        rank = leader.cumsum(1) - 1
        new_slot = free_order.gather(1, rank.clamp(0, S - 1))
    else:
        Y, NB = slots_per_bucket, S // slots_per_bucket
        free_mask = (~occ).view(G, NB, Y)
        free_count = free_mask.sum(-1)  # [G, NB]
        table = true_first(free_mask) + (torch.arange(NB, device=dev) * Y).view(1, NB, 1)
        rank = _exclusive_rank(bucket, leader, NB)
        fits = rank < free_count.gather(1, bucket.clamp(0, NB - 1))
        new_slot = table[torch.arange(G, device=dev).unsqueeze(1), bucket.clamp(0, NB - 1), rank.clamp(0, Y - 1)]
        over = leader & ~fits
        # over capacity: the best occupied slot of the bucket, or else the best new slot of this chunk
        kept = leader & fits
        zk = zt.masked_fill(~(same & earlier & kept.unsqueeze(1)), -math.inf)
        to_kept = zk.argmax(-1)
        demote_to = torch.where(over & has_cand, best_slot, torch.where(over, -2 - to_kept, demote_to))
        leader = kept

    # the target of every token: a new slot (leaders), its root's target (followers), or its choice
    s_idx = torch.arange(S, device=dev).expand(G, S)
    # a token aimed at a slot that was merged away follows it into the slot that absorbed it
    # (new slots may reuse a freed slot: they are not redirected)
    redirect = _scatter_where(s_idx.clone(), src_of.clamp_min(0), s_idx, src_of >= 0)
    target = torch.where(leader, new_slot, torch.full_like(new_slot, -1))
    target = torch.where(demote_to >= 0, redirect.gather(1, demote_to.clamp_min(0)), target)
    merge_target = redirect.gather(1, best_slot)
    target = torch.where(valid & ~novel, merge_target, target)
    # demoted tokens pointing at a kept token of this chunk (paper pool): take that token's slot
    via_token = demote_to <= -2
    target = torch.where(via_token, target.gather(1, (-2 - demote_to).clamp_min(0)), target)
    target = torch.where(novel & ~leader & ~via_token & (demote_to < 0), target.gather(1, parent), target)
    target = torch.where(valid, target, torch.full_like(target, -1))

    # what each write compares with, and how many tokens its slot holds before it
    writes = target >= 0
    base = state.count.gather(1, target.clamp_min(0)) * writes
    rank_in_slot = _exclusive_rank(target, writes, S)
    opens = writes & (rank_in_slot == 0)
    first_writer = _scatter_where(torch.zeros(G, S, dtype=torch.long, device=dev), target.clamp_min(0), t_idx, opens)
    fresh = base == 0
    slot_key = state.key.gather(1, target.clamp_min(0).unsqueeze(-1).expand(G, N, d))
    first_key = keys.gather(1, first_writer.gather(1, target.clamp_min(0)).unsqueeze(-1).expand(G, N, d))
    cand = torch.where((fresh & (rank_in_slot > 0)).unsqueeze(-1), first_key, slot_key)
    count = base + rank_in_slot

    new_bucket = state.bucket
    if slots_per_bucket == 0:
        fills = writes & fresh & (rank_in_slot == 0)
        new_bucket = _scatter_where(state.bucket, target.clamp_min(0), bucket, fills)
    plan = WritePlan(target=target, alpha=alpha, cand=cand, count=count.to(keys.dtype), bucket=new_bucket)
    return plan, state


def room_similarity(
    state: MemoryState, cos: torch.Tensor, slot_pairs: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """How readily each pair merges when the pool is full (higher first): the cosine of the
    keys (merging by the lower of the key and value cosines, or by Ward's criterion, lost to
    it: docs/decisions.md).

    cos : [G, N, S] key cosines of the chunk's tokens and the slots (``pair_scores``)
    slot_pairs : compute the slot-slot matrix (S x S); False leaves it to
        :func:`banded_neighbours` (large pools)

    Returns (slot-slot [G, S, S] or None, token-slot [G, N, S]); entries for free slots are arbitrary.
    """
    if not slot_pairs:
        return None, cos
    kn = F.normalize(state.key, dim=-1)
    return kn @ kn.transpose(1, 2), cos


# Pools up to this many slots find each slot's nearest neighbour exactly (S x S); larger
# ones among the BAND_WIDTH slots on either side in bucket order (:func:`banded_neighbours`).
EXACT_NEIGHBOURS = 640
BAND_WIDTH = 32


def _masked_neighbours(ss: torch.Tensor, state: MemoryState) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest other occupied slot from the full matrix: (sim [G, S], -inf where none; index [G, S])."""
    occ = state.count > 0
    eye = torch.eye(ss.shape[-1], dtype=torch.bool, device=ss.device)
    return ss.masked_fill(eye | ~occ.unsqueeze(1) | ~occ.unsqueeze(2), -math.inf).max(-1)


def banded_neighbours(
    state: MemoryState, width: int = BAND_WIDTH, fused: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's nearest occupied slot among the ``width`` slots on either side of it in
    bucket order: the same bucket's slots, which the tree filed together because their keys
    are close. Exact within any bucket of at most ``width + 1`` slots; costs S * width, not S^2.
    Float32 CPU states without gradients go through the fused kernel
    (``armkv.memory.kernels``: one pass) unless ``fused=False``; the PyTorch ops below are
    its reference (tests/test_kernels.py).

    Returns (key cosine [G, S], -inf where none; index [G, S]).
    """
    G, S, d = state.key.shape
    occ = state.count > 0
    bucket = torch.where(occ, state.bucket, -1)
    order = torch.sort(bucket, dim=1, stable=True).indices  # [G, S]: free slots first, then by bucket
    w = min(width, S - 1)
    module = kernels.fused_cpu(state.key) if fused and w >= 1 else None
    if module is not None:
        nn_sim, nn_idx = module.band_neighbours(state.key, order, bucket, w)
        return nn_sim, nn_idx
    pos = torch.arange(S, device=order.device)
    if w < 1:
        return torch.full((G, S), -math.inf, device=state.key.device), torch.zeros(
            G, S, dtype=torch.long, device=state.key.device
        )

    def sort(x: torch.Tensor) -> torch.Tensor:  # rows of x [G, S, ...] in bucket order
        return gather_rows(x, order)

    occ_s, bucket_s = sort(occ), sort(bucket)
    sim = band_similarity(sort(state.key), w)
    ok = occ_s.unsqueeze(-1) & _band(occ_s, w, False) & (bucket_s.unsqueeze(-1) == _band(bucket_s, w, -2))
    sim = sim.masked_fill(~ok, -math.inf)
    # best partner after each place, and (the same pairs seen from the other end) before it
    fwd_sim, fwd_o = sim.max(-1)
    # back[:, i, o - 1] = sim[:, i - o, o - 1]: place i seen from i - o
    offsets = torch.arange(1, w + 1, device=sim.device)
    src = pos.unsqueeze(1) - offsets  # [S, w]
    back = sim.gather(1, src.clamp_min(0).expand(G, S, w)).masked_fill((src < 0).expand(G, S, w), -math.inf)
    back_sim, back_o = back.max(-1)
    use_back = back_sim > fwd_sim
    place = torch.where(use_back, pos - (back_o + 1), pos + (fwd_o + 1)).clamp(0, S - 1)
    best = torch.where(use_back, back_sim, fwd_sim)
    # back to slot indexing
    nn_sim = torch.empty_like(best).scatter_(1, order, best)
    nn_idx = torch.empty_like(order).scatter_(1, order, order.gather(1, place))
    return nn_sim, nn_idx


def _band(x: torch.Tensor, width: int, fill) -> torch.Tensor:
    """x [G, S, ...] -> [G, S, width, ...] with out[:, i, o - 1] = x[:, i + o] (``fill`` past the end)."""
    pad = x.new_full((x.shape[0], width, *x.shape[2:]), fill)
    win = torch.cat([x, pad], 1).unfold(1, width + 1, 1)  # [G, S, ..., width + 1], a view
    return win[..., 1:].movedim(-1, 2)


BAND_BLOCK = 64  # rows per block of the banded dot products (a [BLOCK, BLOCK + width] matmul each)


def _band_dots(f: torch.Tensor, width: int) -> torch.Tensor:
    """f [G, S, d] -> [G, S, width]: out[:, i, o - 1] = f[:, i] . f[:, i + o] (0 past the end).

    Blocks of BAND_BLOCK rows against the BAND_BLOCK + width rows they reach, one batched
    matmul (S x (BLOCK + width) x d work, nothing of size S x width x d materialised)."""
    G, S, d = f.shape
    nb = -(-S // BAND_BLOCK)
    fp = torch.cat([f, f.new_zeros(G, nb * BAND_BLOCK + width - S, d)], 1)
    rows = fp[:, : nb * BAND_BLOCK].reshape(G, nb, BAND_BLOCK, d)
    reach = fp.unfold(1, BAND_BLOCK + width, BAND_BLOCK)  # [G, nb, d, BLOCK + width]
    dots = torch.matmul(rows, reach)  # [G, nb, BLOCK, BLOCK + width]
    col = torch.arange(BAND_BLOCK, device=f.device).unsqueeze(1) + torch.arange(1, width + 1, device=f.device)
    band = dots.gather(-1, col.expand(G, nb, BAND_BLOCK, width))
    return band.reshape(G, nb * BAND_BLOCK, width)[:, :S]


def band_similarity(key: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`room_similarity`'s slot-slot measure (key cosine) between each slot and the
    ``width`` slots after it (in the given order): key [G, S, d] -> [G, S, width], arbitrary
    where a pair is not valid."""
    return _band_dots(F.normalize(key, dim=-1), width)


def _make_room(
    state: MemoryState,
    leader: torch.Tensor,
    neighbours: tuple[torch.Tensor, torch.Tensor],
    token_sims: torch.Tensor,
    deficit: torch.Tensor,
    nearest_token: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``deficit`` merges per group among the most similar candidates.

    Candidates: mutual-nearest pairs of occupied slots (disjoint by construction), and
    each novel leader merged into its nearest occupied slot (any bucket).
    neighbours : (sim, index) [G, S] of each slot's nearest occupied slot
    token_sims : [G, N, S] token-slot similarities (:func:`room_similarity`)
    nearest_token : (sim, index) [G, N] of each token's most similar occupied slot under
        ``token_sims``, where already found (the fused kernel of :func:`plan_writes`)

    Returns (src_of [G, S]: slot merged into slot s, or -1; demote_to [G, N]: slot a
    demoted leader merges into, or -1).
    """
    G, S = state.count.shape
    N = leader.shape[1]
    occ = state.count > 0
    nn_sim, nn_idx = neighbours
    s_idx = torch.arange(S, device=nn_sim.device).expand(G, S)
    mutual = occ & torch.isfinite(nn_sim) & (nn_idx.gather(1, nn_idx) == s_idx) & (s_idx < nn_idx)
    if nearest_token is None:
        nearest_token = token_sims.masked_fill(~occ.unsqueeze(1), -math.inf).max(-1)
    a_sim, a_idx = nearest_token
    a_ok = leader & torch.isfinite(a_sim)
    cand = torch.cat([torch.where(mutual, nn_sim, -math.inf), torch.where(a_ok, a_sim, -math.inf)], 1)
    order = cand.argsort(dim=1, descending=True, stable=True)
    pick_sorted = torch.arange(S + N, device=nn_sim.device).expand(G, S + N) < deficit.unsqueeze(1)
    picked = torch.zeros_like(pick_sorted).scatter(1, order, pick_sorted) & torch.isfinite(cand)
    src_of = torch.where(picked[:, :S], nn_idx, torch.full_like(nn_idx, -1))
    demote_to = torch.where(picked[:, S:], a_idx, torch.full_like(a_idx, -1))
    return src_of, demote_to


def _plan_fifo(state: MemoryState, keys: torch.Tensor, bucket: torch.Tensor, valid: torch.Tensor) -> WritePlan:
    """The FIFO ablation: every token overwrites the oldest slot (free slots first)."""
    G, N, d = keys.shape
    S = state.slots
    age = torch.where(state.count > 0, state.pos, torch.full_like(state.pos, -math.inf))
    order = age.argsort(dim=1, stable=True)
    rank = (valid.cumsum(1) - 1).clamp_min(0) % S
    target = torch.where(valid, order.gather(1, rank), torch.full_like(rank, -1))
    new_bucket = _scatter_where(state.bucket, target.clamp_min(0), bucket, valid)
    zeros = torch.zeros(G, N, dtype=keys.dtype, device=keys.device)
    return WritePlan(
        target=target, alpha=torch.ones_like(zeros), cand=torch.zeros_like(keys), count=zeros, bucket=new_bucket
    )


def gate_weights(
    plan: WritePlan, keys: torch.Tensor, params: WriteParams, write: str = "gated", empty_slot_rule: bool = True
) -> torch.Tensor:
    """beta = alpha * gamma for every write; 1 for the first write into an empty slot.

    keys : [G, N, d] -> beta [G, N, 1 or d]
    """
    if write == "fifo":
        return torch.ones_like(plan.alpha).unsqueeze(-1)
    if write == "mean":
        beta = (1.0 / (plan.count + 1.0)).unsqueeze(-1)  # a fixed rule: no learned weight enters
    else:
        beta = plan.alpha.unsqueeze(-1) * params.gate_values(plan.cand, keys, plan.count)
    if empty_slot_rule:
        beta = torch.where((plan.count == 0).unsqueeze(-1), torch.ones_like(beta), beta)
    return beta


def segmented_suffix_product(decay: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """Exclusive suffix products within segments: out_i = prod of decay_j for the later j of
    i's segment (1 for a segment's last element). Hillis-Steele, log2(M) steps.

    decay : [M, D] in segment order; segment : [M] non-decreasing ids -> [M, D]
    """
    M = decay.shape[0]
    # shift by one inside each segment: element i starts from its successor's decay
    same_next = torch.zeros(M, 1, dtype=torch.bool, device=decay.device)
    same_next[:-1, 0] = segment[1:] == segment[:-1]
    prod = torch.where(same_next, torch.cat([decay[1:], decay[-1:]], 0), torch.ones_like(decay))
    # reach: how far right element i's product already extends within its segment
    step = 1
    while step < M:
        ahead = torch.zeros(M, 1, dtype=torch.bool, device=decay.device)
        ahead[: M - step, 0] = segment[step:] == segment[: M - step]
        # prod_i covers (i, i + step]; the next block starts at i + step
        later = torch.cat([prod[step:], torch.ones_like(prod[:step])], 0)
        prod = torch.where(ahead, prod * later, prod)
        step *= 2
    return prod


def scan_writes(
    state: MemoryState,
    plan: WritePlan,
    beta: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    inplace: bool = False,
) -> MemoryState:
    """Apply a chunk's writes, all slots at once.

    Unrolled, slot y's recurrence over its writes i (in time order) is
    A_final = (prod_i d_i) A_0 + sum_i beta_i (prod_{j>i} d_j) a_i with d = 1 - beta:
    the suffix products come from one segmented scan over the writes sorted by
    (slot, time) (log2 M steps on the gates only, [M, 1] for scalar gates), and the sums
    from one index_add. Counts ride along with decay 0 at a slot's first fill.

    keys, values : [G, N, d] (pre-RoPE keys); positions : [G, N]; beta : [G, N, 1 or d]
    inplace : the written rows go into ``state.key`` and ``state.value`` themselves, not into
        copies of the pool (positions and counts are new tensors either way)
    """
    G, N, d = keys.shape
    S = state.slots
    writes = plan.target >= 0
    g_idx, t_idx = writes.nonzero(as_tuple=True)
    if g_idx.numel() == 0:
        return MemoryState(state.key, state.value, state.pos, state.count, plan.bucket)
    seg = g_idx * S + plan.target[g_idx, t_idx]
    order = torch.argsort(seg * N + t_idx)
    seg, g_s, t_s = seg[order], g_idx[order], t_idx[order]
    b = beta[g_s, t_s]  # [M, Dg], Dg = 1 or d
    bp = b.mean(-1, keepdim=True)  # positions blend with the mean gate
    fresh = (plan.count[g_s, t_s] == 0).unsqueeze(-1)
    dc = torch.where(fresh, 0.0, 1.0).to(b.dtype)  # counts restart at a slot's first fill
    Dg = b.shape[-1]
    after = segmented_suffix_product(torch.cat([1 - b, 1 - bp, dc], -1), seg)  # [M, Dg + 2]
    w_kv, w_p, w_c = b * after[:, :Dg], bp * after[:, Dg : Dg + 1], after[:, Dg + 1 :]
    first = torch.ones_like(seg, dtype=torch.bool)
    first[1:] = seg[1:] != seg[:-1]
    total = (1 - torch.cat([b, bp, 1 - dc], -1)[first]) * after[first]  # prod of every d in the segment
    seg_ids = seg[first]
    slot_of = torch.cumsum(first.long(), 0) - 1  # each write's segment, 0..K-1
    K = seg_ids.numel()

    def gather_sum(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(K, x.shape[-1], dtype=x.dtype, device=x.device).index_add(0, slot_of, weights * x)

    u_key = gather_sum(w_kv, keys[g_s, t_s])
    u_value = gather_sum(w_kv, values[g_s, t_s])
    u_pos = gather_sum(w_p.to(positions.dtype), positions[g_s, t_s].unsqueeze(-1)).squeeze(-1)
    u_count = gather_sum(w_c, torch.ones_like(w_c)).squeeze(-1)
    a_kv, a_p, a_c = total[:, :Dg], total[:, Dg], total[:, Dg + 1]

    def update(x0: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        # a slot's first fill (a = 0) ignores what it held: free slots may hold anything
        return torch.where(a == 0, u, a * x0 + u)

    flat_k, flat_v = state.key.reshape(G * S, d), state.value.reshape(G * S, d)
    put = torch.Tensor.index_copy_ if inplace else torch.Tensor.index_copy
    key = put(flat_k, 0, seg_ids, update(flat_k[seg_ids], a_kv, u_key)).view(G, S, d)
    value = put(flat_v, 0, seg_ids, update(flat_v[seg_ids], a_kv, u_value)).view(G, S, d)
    flat_p, flat_c = state.pos.reshape(G * S), state.count.reshape(G * S)
    pos = flat_p.index_copy(0, seg_ids, update(flat_p[seg_ids], a_p.to(flat_p.dtype), u_pos.to(flat_p.dtype))).view(
        G, S
    )
    count = flat_c.index_copy(
        0, seg_ids, update(flat_c[seg_ids], a_c.to(flat_c.dtype), u_count.to(flat_c.dtype)).detach()
    ).view(G, S)
    return MemoryState(key=key, value=value, pos=pos, count=count, bucket=plan.bucket)


def write_chunk(
    state: MemoryState,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    bucket: torch.Tensor,
    params: WriteParams,
    rule: WriteRule = WriteRule(),
    training: bool = False,
    generator: torch.Generator | None = None,
    inplace: bool = False,
) -> MemoryState:
    """Plan, gate and scan one chunk (see the module docstring). Shapes as in plan_writes;
    ``inplace``: the state's key and value tensors are written in place (inference only, on a
    state the caller gives up: no copy of the pool per write)."""
    if inplace and (training or (torch.is_grad_enabled() and (state.key.requires_grad or keys.requires_grad))):
        raise ValueError("write_chunk(inplace=True) is for inference: gradients need the state before the write")
    plan, state = plan_writes(state, keys, bucket, valid, params, rule, training, generator, inplace=inplace)
    beta = gate_weights(plan, keys, params, rule.write, rule.empty_slot_rule)
    return scan_writes(state, plan, beta, keys, values, positions, inplace)
