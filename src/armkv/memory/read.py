"""Reads (paper 3.4; docs/design.md, "Reads"): which slots a query reads.

The attention itself is one softmax over the exact sinks and window, these slots and the
new chunk (causal): ``armkv.methods.attention.joint_attention``, shared by every method.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from armkv.memory import kernels
from armkv.memory.quant import at_least_float32, mixing_matrix
from armkv.memory.state import MemoryState


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


def bucket_best(scores: torch.Tensor, slot_bucket: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """The best score each bucket holds: the ranking of ``read_rank="best"``.

    scores : [G, T, S] each query's logit of each slot (-inf where a slot is free or not
    readable); slot_bucket : [G, S] (-1 = free) -> [G, T, N_b], -inf for a bucket with no slot.

    Why the best and not a summary: a needle is one key among the few dozen a bucket holds,
    and the query that retrieves it scores that key far above the rest. A bucket's centroid
    (or a box, or the tree's path score) averages it away; its best logit does not.
    """
    G, T, S = scores.shape
    idx = torch.where(slot_bucket < 0, num_buckets, slot_bucket.long()).unsqueeze(1).expand(G, T, S)
    best = torch.full((G, T, num_buckets + 1), -torch.inf, dtype=scores.dtype, device=scores.device)
    return best.scatter_reduce_(-1, idx, scores, "amax")[..., :num_buckets]


def top_unit_slots(scores: torch.Tensor, unit: torch.Tensor, num_units: int, m: int) -> torch.Tensor:
    """The slots of each group's m best units (buckets, or pages), a unit ranked by its best
    slot score, ties to the lower unit id (as the reads break them): scores [G, S] (-inf
    where a slot is not read), unit [G, S] (-1 for a free slot) -> [G, S] bool."""
    G = scores.shape[0]
    best = bucket_best(scores.unsqueeze(1), unit, num_units)[:, 0]  # [G, num_units]
    picked = best.sort(dim=-1, descending=True, stable=True).indices[:, :m]
    chosen = torch.zeros(G, num_units + 1, dtype=torch.bool, device=scores.device).scatter_(1, picked, True)
    return chosen.gather(1, torch.where(unit < 0, num_units, unit.long())) & (unit >= 0)


def partial_rows(query: torch.Tensor, n: int) -> torch.Tensor:
    """The key-code rows ``read_rank="partial"`` ranks a decoded token's buckets by: row c
    holds channels c and c + d/2 (a byte a slot of int4 codes, and under RoPE's rotate-half
    layout one rotating pair in unmixed slots); the n rows where the query is largest, by the
    sum over the R heads of q_c^2 + q_{c + d/2}^2 (SparQ's choice, per KV head), ties to
    the lower row, in increasing order. query [G, R, d] in the slots' basis -> [G, n] long.
    Sums as the fused kernel sums them, so that both pick the same rows."""
    d = query.shape[-1]
    energy = query.float().square().sum(1)
    energy = energy[:, : d // 2] + energy[:, d // 2 :]
    rows = energy.sort(dim=-1, descending=True, stable=True).indices[:, :n]
    return rows.sort(dim=-1).values


def partial_row_count(share: float, head_dim: int) -> int:
    """How many of the head_dim / 2 key-code rows ``partial_share`` names (at least one)."""
    return max(1, min(head_dim // 2, round(share * (head_dim // 2))))


def bucket_best_of_keys(
    query: torch.Tensor,
    keys: torch.Tensor,
    bias: torch.Tensor,
    slot_bucket: torch.Tensor,
    num_buckets: int,
    block: int = 32,
) -> torch.Tensor:
    """:func:`bucket_best` of the largest logit over a group's R query heads, from float keys,
    a block of queries at a time (the R x T x S logits of a prefill chunk are never held at once).

    query : [G, R, T, d] scaled (and mixed, for a mixed state); keys : [G, S, d]; bias : [G, S],
    or [G, T, S] per query (-inf where a slot is free or not read) -> [G, T, N_b]"""
    G, R, T, d = query.shape
    S = keys.shape[1]
    keys_t = keys.transpose(1, 2)
    out = []
    for t0 in range(0, T, block):
        q = query[:, :, t0 : t0 + block]
        # (the bias is the same for the R heads, so it is added after their maximum)
        logits = torch.bmm(q.reshape(G, -1, d), keys_t).view(G, R, -1, S).amax(1)
        logits = logits + (bias.unsqueeze(1) if bias.dim() == 2 else bias[:, t0 : t0 + block])
        out.append(bucket_best(logits, slot_bucket, num_buckets))
    return torch.cat(out, 1)


def unit_summaries(
    slot_k: torch.Tensor, slot_v: torch.Tensor, bias: torch.Tensor, slot_unit: torch.Tensor, num_units: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a read that skips a unit (a bucket, or a page of one) reads of it instead
    (``read_summaries``): one entry whose key and value are the means of the unit's slots'
    keys and values weighted by exp(bias) (a slot's count n under ``log_count_bias``, else 1),
    and whose logit bias is the log of their total weight, so that its share of the softmax
    is exp(q . mean key + log total) where the slots' would be the sum of exp(q . k + log n):
    equal where the unit's logits are equal, less otherwise (Jensen).

    slot_k, slot_v [G, S, d] (any basis: the means are linear); bias [G, S] (-inf: free);
    slot_unit [G, S] (-1: free) -> (keys [G, U, d], values [G, U, d] float32, zero for an
    empty unit; log_weight [G, U] float32, -inf for an empty one; unit [G, S] long, free
    slots at U)."""
    G, S, d = slot_k.shape
    f32 = torch.float32
    weight = torch.exp(bias.to(f32))  # (free slots: exp(-inf) = 0)
    unit = torch.where(slot_unit < 0, num_units, slot_unit).long()
    sums = torch.zeros(G, num_units + 1, 2 * d + 1, dtype=f32, device=slot_k.device)
    w = weight.unsqueeze(-1)
    sums.scatter_add_(
        1, unit.unsqueeze(-1).expand(G, S, 2 * d + 1), torch.cat([slot_k.to(f32) * w, slot_v.to(f32) * w, w], -1)
    )
    total = sums[:, :num_units, -1]
    means = sums[:, :num_units, :-1] / total.clamp_min(torch.finfo(f32).tiny).unsqueeze(-1)
    log_weight = torch.where(total > 0, total.clamp_min(torch.finfo(f32).tiny).log(), float("-inf"))
    return means[..., :d], means[..., d:], log_weight, unit


def index_summaries(
    state, bias: torch.Tensor, index: "BucketIndex", fused: bool = True, kept=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`unit_summaries` of the units ``index`` lists (buckets, or their pages), in the
    basis the slots are stored in (a read scores them with the query in that basis), from
    the ``state``'s codes (:class:`MemoryState`, its first S slots) and their ``bias`` [G, S]
    float32: (keys [G, U, d], values [G, U, d], log_weight [G, U]) float32. With int4 value
    codes on a CPU the kernel (``unit_summaries``) reads the codes once, unit by unit, unless
    ``fused=False``; elsewhere the PyTorch form, its reference.

    ``kept`` = (summaries of an earlier index, its unit of each of these units [G, U] long,
    -1: none): the kernel builds only the units without one and copies the others' entries
    (units whose slots have not changed since, :func:`carried_units`)."""
    kernel = kernels.fused_read(bias, state.value) if fused and state.key_scale is not None else None
    if kernel is not None:
        if kept is None:
            return tuple(
                kernel.unit_summaries(
                    state.key,
                    state.key_scale,
                    state.value,
                    state.value_scale,
                    bias,
                    index.kernel_order(),
                    index.start,
                    index.size,
                )
            )
        (old_k, old_v, old_w), source = kept
        carried = source >= 0
        keys, values, log_weight = kernel.unit_summaries(
            state.key,
            state.key_scale,
            state.value,
            state.value_scale,
            bias,
            index.kernel_order(),
            index.start,
            index.size,
            todo=~carried,
        )
        at = source.clamp_min(0)
        rows = at.unsqueeze(-1).expand_as(keys)
        return (
            torch.where(carried.unsqueeze(-1), old_k.gather(1, rows), keys),
            torch.where(carried.unsqueeze(-1), old_v.gather(1, rows), values),
            torch.where(carried, old_w.gather(1, at), log_weight),
        )
    G, S = bias.shape
    slot_k, slot_v = (t.reshape(G, S, -1) for t in state.kv(torch.float32, unmix=False))
    return unit_summaries(slot_k, slot_v, bias, slot_units(index), index.size.shape[1])[:3]


def carried_units(dirty: torch.Tensor, before: torch.Tensor, after: torch.Tensor, pages: int | None) -> torch.Tensor:
    """For :func:`index_summaries`' ``kept``: each unit of a new index whose slots are the
    same as those of a unit of an earlier one: its bucket has no slot that changed between
    them (``dirty`` [G, N_b] bool), so it lists the same slots in the same order. ``before``,
    ``after`` [G, N_b]: the buckets' sizes in the two indexes; ``pages``: the indexes' units
    are :func:`paged_index`'s pages for that many (whose length must not have changed either),
    None: the buckets themselves -> [G, U] long, the earlier unit's id, -1 where none."""
    clean = ~dirty
    if pages is None:
        return torch.where(clean, torch.arange(clean.shape[1], device=clean.device), -1)
    page_b, _, first_b = page_layout(before, pages)
    page_a, count, first_a = page_layout(after, pages)
    G, nb = after.shape
    U = 2 * pages
    j = torch.arange(U, device=after.device)
    # the bucket of each new page id (ids are handed out bucket by bucket): the last bucket starting at or before it
    bucket = (torch.searchsorted(first_a.contiguous(), j.expand(G, U).contiguous(), right=True) - 1).clamp_min(0)
    within = j - first_a.gather(1, bucket)
    real = within < count.gather(1, bucket)
    same = clean.gather(1, bucket) & real & (page_a == page_b)
    return torch.where(same, first_b.gather(1, bucket) + within, -1)


def units_read(slot_mask: torch.Tensor, unit: torch.Tensor, num_units: int) -> torch.Tensor:
    """Which units a read takes, from the slots it reads: slot_mask [G, T, S] bool, unit
    [G, S] long (free slots at num_units, from :func:`unit_summaries`) -> [G, T, U] bool."""
    G, T, S = slot_mask.shape
    taken = torch.zeros(G, T, num_units + 1, dtype=torch.float32, device=slot_mask.device)
    taken.scatter_reduce_(2, unit.unsqueeze(1).expand(G, T, S), slot_mask.float(), "amax")
    return taken[..., :num_units] > 0


def ranked_chunk_read(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    chunk_ok: torch.Tensor,
    scaling: float,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    exact_ok: torch.Tensor,
    slot_k: torch.Tensor,
    slot_v: torch.Tensor,
    slot_bias: torch.Tensor,
    pick,
    block: int = 32,
    fused=None,
    summaries=None,
) -> torch.Tensor:
    """A chunk's read of the slots its queries' top buckets hold, with every slot's logit
    computed once: the same logits rank the buckets (``pick``) and enter the softmax. The
    masked read (``Reader.masked``) scores every slot twice (once to rank, once in
    SDPA) and builds a float mask of [queries, state + chunk]; this one holds the logits of
    ``block`` queries at a time.

    One joint softmax over [slots | exact entries | the chunk, causally], all in float32:
    query [G, R, T, d]; key, value [G, T, d] the chunk; chunk_ok [G, T] (False: padding);
    exact_k, exact_v [G, L, d], exact_ok [G, L]; slot_k, slot_v [G, S, d], slot_bias [G, S]
    (-inf where a slot is free); pick(logits [G, T', S]: the largest over the R heads,
    biased) -> [G, T', S] bool, the slots each query reads. Entries holding no token must be
    zero (as the layer keeps them). -> [G, R, T, d] float32.

    ``fused`` = (kernel module, the units' :class:`BucketIndex`, m [G] long): ``pick`` ranks
    the units of that index and takes each group's first m, and the kernel's
    ``ranked_slot_read`` does it from the logits in one pass per query (bias, ranking, and the
    softmax over the chosen slots with their values), where the PyTorch ops make a mask the
    size of the logits and read every slot's value; the exact entries and the chunk join its
    softmax here. ``tests/test_sparse_read.py`` checks the two against each other.

    ``summaries`` (``read_summaries``): the units' (keys [G, U, d], values [G, U, d],
    log_weight [G, U]) of :func:`unit_summaries` in the slots' basis, and for the PyTorch ops
    each slot's unit [G, S] (free slots at U; None with ``fused``, whose units are its index's):
    each unit a query leaves out joins its softmax as one entry.
    """
    G, R, T, d = query.shape
    f32 = torch.float32
    q = query.to(f32) * scaling  # (scaled first, as bucket_best_of_keys ranks: the same logits)
    slot_k_t, exact_k_t, key_t = (t.to(f32).transpose(1, 2) for t in (slot_k, exact_k, key))
    slot_v, exact_v = slot_v.to(f32), exact_v.to(f32)
    chunk_v = torch.where(chunk_ok.unsqueeze(-1), value.to(f32), torch.zeros((), dtype=f32, device=value.device))
    causal = torch.ones(T, T, dtype=torch.bool, device=query.device).tril() & chunk_ok.unsqueeze(1)  # [G, T, T]
    exact_blocked = ~exact_ok.view(G, 1, 1, -1)
    S, L = slot_k.shape[1], exact_k.shape[1]
    if fused is not None:
        slot_bias, rest_v = slot_bias.to(f32).contiguous(), torch.cat([exact_v, chunk_v], 1)
    else:
        bias = slot_bias.to(f32).unsqueeze(1).unsqueeze(1)
    out = []
    for t0 in range(0, T, block):
        qb = q[:, :, t0 : t0 + block]
        tb = qb.shape[2]
        flat = qb.reshape(G, R * tb, d)
        slots = torch.bmm(flat, slot_k_t).view(G, R, tb, S)
        exact = torch.bmm(flat, exact_k_t).view(G, R, tb, L).masked_fill_(exact_blocked, float("-inf"))
        chunk = torch.bmm(flat, key_t).view(G, R, tb, T)
        chunk.masked_fill_(~causal[:, None, t0 : t0 + tb], float("-inf"))
        if fused is not None:  # the slots' part of the softmax from the kernel, joined with the rest's
            kernel, index, m = fused
            units = {}
            if summaries is not None:  # each unit's logit (the kernel takes those of the units a query skips)
                unit_k, unit_v, log_weight = summaries[:3]
                U = unit_k.shape[1]
                units = dict(
                    unit_logits=torch.bmm(flat, unit_k.transpose(1, 2)).view(G, R, tb, U) + log_weight.view(G, 1, 1, U),
                    unit_values=unit_v,
                )
            acc, peak, den = kernel.ranked_slot_read(
                slots, slot_bias, slot_v, index.kernel_order(), index.start, index.size, m, **units
            )
            rest = torch.cat([exact, chunk], -1)  # [G, R, tb, L + T]
            top = torch.maximum(peak, rest.amax(-1)).nan_to_num_(0.0, 0.0, 0.0)  # (-inf: the query reads nothing)
            e = torch.exp(rest - top.unsqueeze(-1))
            kept = torch.exp(peak - top)
            total = (den * kept + e.sum(-1)).unsqueeze(-1)
            o = acc * kept.unsqueeze(-1) + torch.bmm(e.view(G, R * tb, -1), rest_v).view(G, R, tb, d)
            out.append(o.div_(total).nan_to_num_(0.0))
            continue
        slots.add_(bias)
        picked = pick(slots.amax(1))
        # (the mask as an additive -inf: a broadcast add is several times cheaper than masked_fill_)
        slots.add_(torch.where(picked, 0.0, float("-inf")).unsqueeze(1))
        parts = [slots, exact, chunk]
        if summaries is not None:  # the units left out, one entry each
            unit_k, unit_v, log_weight, unit = summaries
            U = unit_k.shape[1]
            skipped = torch.bmm(flat, unit_k.transpose(1, 2)).view(G, R, tb, U) + log_weight.view(G, 1, 1, U)
            parts.append(skipped.masked_fill_(units_read(picked, unit, U).unsqueeze(1), float("-inf")))
        w = torch.softmax(torch.cat(parts, -1), dim=-1).nan_to_num_(0.0).view(G, R * tb, -1)
        o = (
            torch.bmm(w[..., :S], slot_v)
            + torch.bmm(w[..., S : S + L], exact_v)
            + torch.bmm(w[..., S + L : S + L + T], chunk_v)
        )
        if summaries is not None:
            o = o + torch.bmm(w[..., S + L + T :], unit_v)
        out.append(o.view(G, R, tb, d))
    return torch.cat(out, 2)


# ---------------------------------------------------------------------- sparse reads
# The gather width (slots gathered per query) is rounded up to a multiple of this, so that it
# takes few distinct values over a generation (a compiled decode step sees few shapes)
WIDTH_STEP = 64


@dataclass
class BucketIndex:
    """The occupied slots of each group listed bucket by bucket: built once per write (slots
    change only then) so that a read gathers the slots of its buckets instead of scanning all.

    order : [G, S] slot ids sorted by bucket (stable), free slots last
    start : [G, N_b] where bucket b's slots begin in ``order``; size : [G, N_b] how many
    (all int32: held beside the state between writes, 4 bytes a slot and 8 a bucket)
    laid : the pool lies bucket by bucket (:func:`sort_by_bucket`): ``order`` is the
    identity, held as a broadcast view, and each bucket's slots are one run of the pool
    """

    order: torch.Tensor
    start: torch.Tensor
    size: torch.Tensor
    laid: bool = False
    breaks: torch.Tensor | None = None  # [G] each group's run breaks (run_breaks), where the build counted them
    _widths: dict = field(default_factory=dict)

    def width(self, m: int) -> int:
        """Slots gathered per query reading m buckets: the most that any m buckets of any
        group hold (the sum of the group's m largest), rounded up to WIDTH_STEP, at most S.
        Fixed between writes, so a read's shapes do not depend on which buckets it picks;
        computed once per write and m (one host sync)."""
        if m not in self._widths:
            S = self.order.shape[1]
            most = int(self.size.topk(min(m, self.size.shape[1]), dim=1).values.sum(1).max()) if S else 0
            self._widths[m] = max(1, min(S, -(-most // WIDTH_STEP) * WIDTH_STEP))
        return self._widths[m]

    def kernel_order(self) -> torch.Tensor:
        """``order`` as the fused kernels take it: of width 0 for a laid pool (the identity)."""
        return self.order[:, :0] if self.laid else self.order

    def nbytes(self) -> int:
        """Bytes held (an ``order`` that is a broadcast view holds none)."""
        held = self.order.untyped_storage().nbytes() if self.order.stride(0) else 0
        return held + self.start.nbytes + self.size.nbytes


def bucket_index(
    slot_bucket: torch.Tensor, occupied: torch.Tensor, num_buckets: int, fused: bool = True
) -> BucketIndex:
    """slot_bucket [G, S] bucket of each slot, occupied [G, S] bool -> :class:`BucketIndex`.
    Free slots (in the paper's pool they keep their bucket) are listed under no bucket. On a
    CPU the kernel's counting sort builds it (``bucket_lists``, which counts the run breaks
    too) unless ``fused=False``; the PyTorch form is a stable sort of the slots by bucket."""
    kernel = kernels.int4_read() if fused and slot_bucket.device.type == "cpu" else None
    if kernel is not None:
        order, start, size, breaks = kernel.bucket_lists(slot_bucket, occupied, num_buckets)
        return BucketIndex(order=order, start=start, size=size, breaks=breaks)
    key = torch.where(occupied, slot_bucket.long(), num_buckets)
    order = torch.sort(key, dim=1, stable=True).indices
    size = torch.zeros(key.shape[0], num_buckets + 1, dtype=torch.long, device=key.device)
    size.scatter_add_(1, key, torch.ones_like(key))
    size = size[:, :num_buckets]
    return BucketIndex(order=order.int(), start=(size.cumsum(1) - size).int(), size=size.int())


def paged_index(index: BucketIndex, num_buckets: int) -> BucketIndex:
    """``index``'s buckets cut into pages, for reads that take pages instead of buckets
    (``ARMConfig.read_pages``): each group's bucket lists, in their order, cut every
    ceil(occupied / num_buckets) slots, so that a read of any m pages touches at most
    m / num_buckets of the occupied slots, however unevenly the tree fills its buckets
    (``num_buckets``: the tree's N_b times ``page_split``, pages of 1 / page_split of the
    mean bucket). A group has at most 2 * num_buckets pages (its buckets' sizes over the
    page's, rounded up, where num_buckets >= the buckets); pages are numbered bucket by
    bucket, the unused ones empty. Returns the pages' index, [G, 2 * num_buckets], like a
    bucket index over the same ``order``."""
    G, S = index.order.shape
    U = 2 * num_buckets
    size, start = index.size.long(), index.start.long()
    page, pages, first = page_layout(size, num_buckets)
    j = torch.arange(max(int(pages.max()), 1) if pages.numel() else 1, device=size.device)
    used = j < pages.unsqueeze(-1)  # [G, N_b, J]
    ids = torch.where(used, first.unsqueeze(-1) + j, U).reshape(G, -1)
    p_start = (start.unsqueeze(-1) + j * page.unsqueeze(-1)).reshape(G, -1)
    p_size = (size.unsqueeze(-1) - j * page.unsqueeze(-1)).clamp(min=0).minimum(page.unsqueeze(-1)).reshape(G, -1)
    out_start = torch.zeros(G, U + 1, dtype=torch.long, device=size.device).scatter_(1, ids, p_start)[:, :U]
    out_size = torch.zeros(G, U + 1, dtype=torch.long, device=size.device).scatter_(1, ids, p_size)[:, :U]
    return BucketIndex(order=index.order, start=out_start.int(), size=out_size.int(), laid=index.laid)


def page_layout(size: torch.Tensor, num_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How :func:`paged_index` cuts buckets of ``size`` [G, N_b] slots into pages of at most
    ceil(occupied / num_pages) slots: (that page length [G, 1], each bucket's pages [G, N_b],
    the id of its first page [G, N_b]; pages are numbered bucket by bucket), all int64."""
    size = size.long()
    page = ((size.sum(1, keepdim=True) + num_pages - 1) // num_pages).clamp_min(1)
    pages = (size + page - 1) // page
    return page, pages, pages.cumsum(1) - pages


def slot_units(index: BucketIndex) -> torch.Tensor:
    """The unit of each slot under ``index`` (a bucket index, or :func:`paged_index`'s pages):
    [G, S] int64, -1 for a free slot. Units lie in id order along ``order``, so each position
    of it belongs to the last unit that began at or before it."""
    G, S = index.order.shape
    size, start = index.size.long(), index.start.long()
    U = size.shape[1]
    ids = torch.arange(U, device=size.device).expand(G, U)
    # each non-empty unit's id where it begins (the empty ones at S, dropped), then the running largest
    marks = torch.full((G, S + 1), -1, dtype=torch.long, device=size.device).scatter_(
        1, torch.where(size > 0, start, S), ids
    )
    at = marks[:, :S].cummax(1).values
    at = torch.where(torch.arange(S, device=size.device) < size.sum(1, keepdim=True), at, -1)
    return torch.full((G, S), -1, dtype=torch.long, device=size.device).scatter_(1, index.order.long().expand(G, S), at)


def slots_of_buckets(
    index: BucketIndex, buckets: torch.Tensor, width: int | None = None, take: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots filed under each query's buckets, packed into one width.

    buckets : [G, Q, M] distinct bucket ids per query; take : [G, Q, M] bool, which of them to
    read (None: all); width : the packed width, at least the slots any M buckets hold
    (:meth:`BucketIndex.width`: fixed between writes, no host sync), or None: the most that
    these queries' buckets hold, rounded up to WIDTH_STEP (one host sync, a tighter gather)
    -> (slot ids [G, Q, width], used [G, Q, width] bool). The buckets' slot lists are laid
    end to end; positions past their total are unused (their ids point at some slot, to be
    given no weight).
    """
    G, Q, M = buckets.shape
    S = index.order.shape[1]
    flat = buckets.reshape(G, Q * M)
    size = index.size.gather(1, flat).view(G, Q, M).long()
    if take is not None:
        size = size * take
    start = index.start.gather(1, flat).view(G, Q, M).long()
    end = size.cumsum(-1)  # where each bucket's run ends in the packed list
    if width is None:
        width = max(1, min(S, -(-int(end[..., -1].max()) // WIDTH_STEP) * WIDTH_STEP))
    j = torch.arange(width, device=buckets.device).expand(G, Q, width).contiguous()
    k = torch.searchsorted(end, j, right=True)  # the bucket whose run holds position j
    used = k < M
    k = k.clamp_max(M - 1)
    pos = start.gather(-1, k) + j - (end.gather(-1, k) - size.gather(-1, k))
    slots = index.order.gather(1, pos.clamp(0, max(S - 1, 0)).view(G, Q * width)).view(G, Q, width).long()
    return slots, used


def gather_slots(state: MemoryState, slots: torch.Tensor, for_reading: bool = False) -> MemoryState:
    """The given slots of each group, as a state of G * Q groups of ``width`` slots (packed
    codes stay packed: a read of it dequantises only what it gathered).

    state : G groups of S slots; slots : [G, Q, width] slot ids -> MemoryState
    for_reading : gather only what a read uses (keys, values, their scales, counts); the
    positions and buckets are then zeros
    """
    G, Q, W = slots.shape
    S = state.slots
    flat = (slots + torch.arange(G, device=slots.device).view(G, 1, 1) * S).reshape(-1)

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:  # [G, S, ...] -> [G * Q, W, ...]
        if t is None:
            return None
        return t.reshape(G * S, *t.shape[2:]).index_select(0, flat).view(G * Q, W, *t.shape[2:])

    key = state.key
    if state.key_scale is not None:  # channel-major codes [G, width, S]
        C = key.shape[1]
        key = key.unsqueeze(1).expand(G, Q, C, S).gather(3, slots.unsqueeze(2).expand(G, Q, C, W)).reshape(G * Q, C, W)
    else:
        key = rows(key)
    count = rows(state.count)
    if for_reading:
        pos, bucket = count.new_zeros(()).expand(G * Q, W), state.bucket.new_zeros(()).expand(G * Q, W)
    else:
        pos, bucket = rows(state.pos), rows(state.bucket)
    return MemoryState(
        key=key,
        value=rows(state.value),
        pos=pos,
        count=count,
        bucket=bucket,
        key_scale=rows(state.key_scale),
        value_scale=rows(state.value_scale),
        mixed=state.mixed,
    )


def run_breaks(index: BucketIndex) -> int:
    """How far the slots are from lying bucket by bucket in the pool: the most, over groups,
    of places where the next slot of the bucket order is not the next slot of the pool (a
    pool sorted by bucket has one per bucket). A gather from channel-major codes costs a
    cache line per channel for each slot that starts a run, so a read of a pool with few
    breaks streams (one host sync)."""
    if index.breaks is not None:  # (counted where the index was built)
        return int(index.breaks.max()) if index.breaks.numel() else 0
    total = index.size.sum(1, keepdim=True, dtype=torch.long)  # [G, 1] occupied slots
    j = torch.arange(index.order.shape[1] - 1, device=index.order.device)
    step = (index.order[:, 1:] - index.order[:, :-1] != 1) & (j < total - 1)
    return int(step.sum(1).max()) if step.numel() else 0


def sort_by_bucket(state: MemoryState, index: BucketIndex) -> MemoryState:
    """The same slots laid bucket by bucket (free slots last): ``index.order`` applied to
    every field. A read gathers each bucket's slots as one contiguous run; the index of the
    result is ``index`` with ``order`` the identity."""
    G, R = index.order.shape  # the index may cover the first R slots only (the rest free)
    rest = torch.arange(R, state.slots, device=index.order.device).expand(G, -1)
    return gather_slots(state, torch.cat([index.order.long(), rest], 1).unsqueeze(1))


def gathered_read(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    exact_valid: torch.Tensor,
    slots: MemoryState,
    slot_bias: torch.Tensor,
    fused: bool = True,
) -> torch.Tensor:
    """One joint softmax over [gathered slots | exact entries | the chunk, causally]: the
    read of ``Reader.masked`` with each query's slots gathered instead of masked.

    query : [B, Hq, T, d] (post-RoPE); key, value : [B, H, T, d] the chunk; valid : [B, T]
    exact_k, exact_v : [B, H, L, d] (entries holding no token zero); exact_valid : [B, L]
    slots : B * H * T groups (row-major over b, h, t) of W slots in the read form (keys
    rotated; codes in the mixed basis where ``slots.mixed``), as :func:`gather_slots` gives
    slot_bias : [B, H, T, W] each gathered slot's logit bias, -inf where it is not read
    -> [B, T, Hq, d]

    The R = Hq / H query heads of a KV head read the same gathered slots (one choice of
    buckets per KV head, ``Reader.group_buckets``). One query (T = 1) with int4 values on a CPU in float32
    goes through the decode step's fused kernel (``armkv.memory.kernels``) unless
    ``fused=False``; the PyTorch ops below are its reference.
    """
    B, Hq, T, d = query.shape
    H = key.shape[1]
    R, W, L = Hq // H, slot_bias.shape[-1], exact_k.shape[2]
    G = B * H
    mix = mixing_matrix(d, query.dtype, query.device) if slots.mixed else None
    kernel = kernels.fused_read(query, slots.value) if fused and T == 1 and slots.key_scale is not None else None
    if kernel is not None:
        return fused_decode_read(
            kernel, query, key, value, valid, exact_k, exact_v, exact_valid, slots, slot_bias, mix, scaling
        )
    q = query.reshape(B, H, R, T, d)
    q_slots = (q if mix is None else q @ mix).transpose(2, 3).reshape(G * T, R, d)
    # logits from products in the model's dtype, biased and softmaxed in float32, as the dense
    # decode read takes them (no-ops for a float32 model)
    slot_scores = at_least_float32(slots.key_scores(q_slots, fused=fused).view(B, H, T, R, W).transpose(2, 3)) * scaling
    slot_scores = slot_scores + slot_bias.unsqueeze(2).to(slot_scores.dtype)
    flat = q.reshape(B, H, R * T, d)
    exact_scores = at_least_float32(torch.matmul(flat, exact_k.transpose(-1, -2))).view(B, H, R, T, L) * scaling
    exact_scores = exact_scores.masked_fill(~exact_valid[:, None, None, None, :], float("-inf"))
    chunk_scores = at_least_float32(torch.matmul(flat, key.transpose(-1, -2))).view(B, H, R, T, T) * scaling
    causal = torch.ones(T, T, dtype=torch.bool, device=query.device).tril()
    chunk_scores = chunk_scores.masked_fill(~(causal & valid[:, None, None, None, :]), float("-inf"))
    w = torch.softmax(torch.cat([slot_scores, exact_scores, chunk_scores], -1), dim=-1).nan_to_num_(0.0).to(query.dtype)
    from_slots = slots.weighted_values(w[..., :W].transpose(2, 3).reshape(G * T, R, W), fused=fused)
    from_slots = from_slots.view(B, H, T, R, d).transpose(2, 3)
    if mix is not None:
        from_slots = from_slots @ mix.T
    chunk_v = torch.where(valid[:, None, :, None], value, torch.zeros((), dtype=value.dtype, device=value.device))
    rest = torch.matmul(w[..., W : W + L].reshape(B, H, R * T, L), exact_v)
    rest = rest + torch.matmul(w[..., W + L :].reshape(B, H, R * T, T), chunk_v)
    out = from_slots + rest.view(B, H, R, T, d)
    return out.reshape(B, Hq, T, d).transpose(1, 2)


def read_slots(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    exact_k: torch.Tensor,
    exact_v: torch.Tensor,
    exact_valid: torch.Tensor,
    state: MemoryState,
    bias: torch.Tensor,
    ids: torch.Tensor,
    used: torch.Tensor,
    fused: bool = True,
) -> torch.Tensor:
    """:func:`gathered_read` of the slots ``ids`` [G = B x H, T, W] of ``state`` (as
    :func:`slots_of_buckets` gives them, ``used`` [G, T, W] marking which count), each with
    its logit bias from ``bias`` (one per slot of the state, G x S values). -> [B, T, Hq, d]"""
    B, H = key.shape[:2]
    G, T, W = ids.shape
    picked = bias.reshape(G, -1).gather(1, ids.reshape(G, T * W)).view(B, H, T, W)
    picked = picked.masked_fill(~used.view(B, H, T, W), -torch.inf)
    return gathered_read(
        query,
        key,
        value,
        valid,
        scaling,
        exact_k,
        exact_v,
        exact_valid,
        gather_slots(state, ids, for_reading=True),
        picked,
        fused=fused,
    )


def fused_decode_read(kernel, query, key, value, valid, exact_k, exact_v, exact_valid, slots, slot_bias, mix, scaling):
    """One query's read through the fused CPU kernel (``armkv.memory.kernels.fused_read``):
    slots [G, ..., W] quantised (their codes and scales as stored), slot_bias [B, H, W] or
    [G, W], the rest as :func:`gathered_read` takes them with T = 1. Returns [B, 1, Hq, d]."""
    return dense_decode_call(kernel, slots, slot_bias, mix)(
        query, key, value, valid, exact_k, exact_v, exact_valid, scaling
    )


def dense_decode_call(kernel, state, bias, mix):
    """:func:`fused_decode_read` with what stays between writes bound (the slots' codes and
    scales, ``bias``, ``mix``): a callable (query, key, value, valid, exact_k, exact_v,
    exact_valid, scaling) -> [B, 1, Hq, d] (:func:`_bound_call`)."""
    return _bound_call(kernel, "dense", state, bias, mix)


_NO_MIX = torch.empty(0)  # (the kernels' "unmixed slots")


def _bound_call(kernel, kind: str, state, bias, mix, index: BucketIndex | None = None, **tail):
    """The fused decode read ``kind`` (the kernel's ``DecodeCall``: "dense", "sparse", "best"
    or "partial") with what stays between writes bound, checked and converted once: the slots'
    codes and scales, their ``bias``, ``mix``, and for the sparse reads ``index`` and ``tail``
    (``m``, ``take``, ``buckets``, ``n``, the units' entries). Returns a callable (query, key,
    value, valid, exact_k, exact_v, exact_valid, scaling) -> what the kernel's function of that
    kind returns, in the model's layout (the kernel reads the token's inputs where they lie: no
    tensor op per argument). A decode step keeps it and makes one kernel call a layer, with no
    other Python work."""
    if index is not None:
        tail.update(order=index.kernel_order(), start=index.start, size=index.size)
    return kernel.DecodeCall(
        kind, state.key, state.key_scale, state.value, state.value_scale, bias, _NO_MIX if mix is None else mix, **tail
    )


def _unit_args(units) -> dict:
    """The fused decode reads' ``read_summaries`` arguments: ``units`` = the index's units'
    (keys, values, log_weight) of :func:`index_summaries`, or None (none)."""
    return {} if units is None else dict(zip(("unit_keys", "unit_values", "unit_log_weight"), units))


def fused_sparse_decode_read(
    kernel,
    query,
    key,
    value,
    valid,
    exact_k,
    exact_v,
    exact_valid,
    state,
    bias,
    mix,
    scaling,
    index: BucketIndex,
    buckets: torch.Tensor,
    take: torch.Tensor,
    units=None,
) -> torch.Tensor:
    """One query's sparse read through the fused CPU kernel: the slots of each group's first
    ``take`` of ``buckets`` ([G, M], [G]) read where they lie in the quantised ``state``
    (bucket by bucket as ``index`` lists them), without gathering them first; ``bias``
    [B, H, S] or [G, S]. The rest as :func:`fused_decode_read`. It equals
    :func:`gathered_read` of :func:`slots_of_buckets`' slots (tests/test_sparse_read.py).
    ``units`` (``read_summaries``): :func:`index_summaries` of ``index``; each unit the read
    skips joins its softmax as one entry."""
    call = _bound_call(kernel, "sparse", state, bias, mix, index, buckets=buckets, take=take, **_unit_args(units))
    return call(query, key, value, valid, exact_k, exact_v, exact_valid, scaling)


def ranked_decode_call(
    kernel,
    state,
    bias,
    mix,
    index: BucketIndex,
    m: int,
    take: torch.Tensor,
    rows: int | None = None,
    units=None,
    max_runs: int = -1,
):
    """The fused ranked decode read with what stays between writes bound (the slots' codes and
    scales, ``bias``, ``mix``, the ``index``, ``m`` and ``take``): ``read_rank="best"``
    (:func:`fused_best_decode_read`), or with ``rows`` ``"partial"``
    (:func:`fused_partial_decode_read`). Returns a callable (query, key, value, valid, exact_k,
    exact_v, exact_valid, scaling) -> (out [B, 1, Hq, d], the m buckets [G, m])
    (:func:`_bound_call`). ``units``
    (``read_summaries``): :func:`index_summaries` of ``index``, bound too. The call keeps each
    unit's runs of consecutive slots (its ``nbytes()``) where no group has more than
    ``max_runs`` (< 0: always), else finds them at each call."""
    kind, n = ("best", 0) if rows is None else ("partial", rows)
    return _bound_call(
        kernel, kind, state, bias, mix, index, m=m, take=take, n=n, max_runs=max_runs, **_unit_args(units)
    )


def fused_partial_decode_read(
    kernel,
    query,
    key,
    value,
    valid,
    exact_k,
    exact_v,
    exact_valid,
    state,
    bias,
    mix,
    scaling,
    index: BucketIndex,
    m: int,
    take: torch.Tensor,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query's read of ``read_rank="partial"`` in one fused kernel call: each group's m
    buckets ranked by their best partial logit (the ``rows`` key-code rows of
    :func:`partial_rows`, :meth:`MemoryState.partial_key_scores`), then the first ``take`` [G]
    of them read as :func:`fused_sparse_decode_read` reads them. Arguments as
    :func:`fused_best_decode_read`'s. Returns ([B, 1, Hq, d], the m buckets [G, m], best first)."""
    call = ranked_decode_call(kernel, state, bias, mix, index, m, take, rows)
    return call(query, key, value, valid, exact_k, exact_v, exact_valid, scaling)


def fused_best_decode_read(
    kernel,
    query,
    key,
    value,
    valid,
    exact_k,
    exact_v,
    exact_valid,
    state,
    bias,
    mix,
    scaling,
    index: BucketIndex,
    m: int,
    take: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query's read of ``read_rank="best"`` in one fused kernel call: every slot scored
    once, each group's m buckets ranked by their best logit (:func:`bucket_best`), and the
    first ``take`` [G] of them read with the logits already computed. Arguments as
    :func:`fused_sparse_decode_read`'s. Returns ([B, 1, Hq, d], the m buckets [G, m], best
    first); it equals :func:`fused_sparse_decode_read` of those buckets."""
    call = ranked_decode_call(kernel, state, bias, mix, index, m, take)
    return call(query, key, value, valid, exact_k, exact_v, exact_valid, scaling)
