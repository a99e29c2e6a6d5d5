"""Where a query's attention lies in the tree: the signal a tree read must deliver.

A tree read (``read_rank="tree"``) routes each pre-RoPE query down its KV head's tree and
reads the slots of the M buckets its beam reaches. What it should reach is measured here,
without any backward through the model: the model's own queries and keys at every layer
(forward hooks, as ``armkv calibrate`` collects keys), the dense causal attention of each
sampled query over every key before it, and, with the keys filed into buckets by a tree's
write routing, the share of the query's full attention that lies on each bucket.

Only the keys the pool would hold count towards a bucket: ARM keeps the first ``sinks``
tokens and the last ``window`` exactly, so their attention is never missed by a sparse read.
A query head's missed mass at M is the share of its full attention on pool keys of the
buckets its KV head's read skips: the same share ``armkv eval reads`` measures on a cache,
here before any merging.

Functions
---------
collect_qk : pre-RoPE queries (a sample of positions) and keys of every layer
bucket_mass : each query head's attention mass on each bucket of the pool
missed_mass : what a tree's top-M read skips of it (and the oracle, the M heaviest buckets)
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from armkv.errors import ArmkvError
from armkv.memory.rope import Rotary
from armkv.memory.route import Router


@dataclass
class QKSample:
    """One sequence's signal: ``q`` [L, Hq, N, d] pre-RoPE queries at positions ``qpos``
    [N] (ascending), ``k`` [L, H, T, d] pre-RoPE keys of every position 0..T-1."""

    q: torch.Tensor
    qpos: torch.Tensor
    k: torch.Tensor


def _projection(attn: torch.nn.Module, which: str) -> torch.nn.Module:
    norm = getattr(attn, f"{which}_norm", None)  # Qwen3 normalises each head before RoPE
    return norm if isinstance(norm, torch.nn.Module) else getattr(attn, f"{which}_proj")


def query_positions(length: int, count: int, first: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct positions in [first, length), ascending, drawn uniformly (all of
    them when there are fewer)."""
    if first >= length:
        raise ArmkvError(f"sequences of {length} tokens leave no query after position {first}: use longer sequences")
    span = length - first
    pick = torch.randperm(span, generator=generator)[: min(count, span)]
    return pick.sort().values + first


@torch.no_grad()
def collect_qk(
    model: torch.nn.Module,
    sequences: Iterable[torch.Tensor],
    queries_per_sequence: int,
    first_query: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float16,
    progress=None,
) -> list[QKSample]:
    """Run each sequence (LongTensor [T]) through ``model`` once and keep every layer's
    pre-RoPE keys and the pre-RoPE queries of ``queries_per_sequence`` positions at or
    after ``first_query`` (seeded), stored as ``dtype``.

    Hooks read ``q_proj`` / ``k_proj`` (``q_norm`` / ``k_norm`` where the layer has them),
    the tensors the model then rotates; nothing of the model is changed."""
    from armkv.train.models import attention_modules, module_head_dim

    layers = attention_modules(model)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    captured: dict[tuple[int, str], torch.Tensor] = {}

    def make_hook(i: int, which: str, head_dim: int):
        def hook(module, inputs, output):
            x = output.detach().float()  # [1, T, heads * d] or [1, T, heads, d]
            captured[(i, which)] = x.reshape(x.shape[1], -1, head_dim).transpose(0, 1)  # [heads, T, d]

        return hook

    handles = []
    was_training = model.training
    out: list[QKSample] = []
    try:
        for i, attn in enumerate(layers):
            d = module_head_dim(attn, model)
            for which in ("q", "k"):
                handles.append(_projection(attn, which).register_forward_hook(make_hook(i, which, d)))
        model.eval()
        extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        for seq in sequences:
            ids = seq.reshape(1, -1)
            model(input_ids=ids.to(device), use_cache=False, **extra)
            qpos = query_positions(ids.shape[1], queries_per_sequence, first_query, generator)
            q = torch.stack([captured[(i, "q")][:, qpos.to(device)] for i in range(len(layers))])
            k = torch.stack([captured[(i, "k")] for i in range(len(layers))])
            out.append(QKSample(q=q.to("cpu", dtype), qpos=qpos, k=k.to("cpu", dtype)))
            captured.clear()
            if progress is not None:
                progress.update(1)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    if not out:
        raise ArmkvError("no sequences: the training text was empty")
    return out


def bucket_mass(
    q: torch.Tensor,
    qpos: torch.Tensor,
    k: torch.Tensor,
    key_bucket: torch.Tensor,
    num_buckets: int,
    rotary: Rotary,
    sinks: int,
    window: int,
    scaling: float | None = None,
    block: int = 64,
) -> torch.Tensor:
    """Each query head's share of its full attention on each bucket's pool keys.

    q : [Hq, N, d] pre-RoPE queries at positions ``qpos`` [N]; k : [H, T, d] pre-RoPE keys
    at positions 0..T-1; key_bucket : [H, T] each key's bucket (a tree's write routing).
    The attention is the model's: RoPE on both, q.k * ``scaling`` (default d ** -0.5),
    causal, one softmax over every key up to the query's position (the query's own key
    included). A key at position p counts for a query at t when ``sinks <= p <= t - window``
    (the others are held exactly). Returns float32 [H, R, N, N_b], R = Hq / H; each row's
    sum is the query head's attention on the pool (at most 1)."""
    Hq, N, d = q.shape
    H, T, _ = k.shape
    if Hq % H:
        raise ArmkvError(f"{Hq} query heads do not group over {H} KV heads")
    R = Hq // H
    scaling = d**-0.5 if scaling is None else scaling
    kr = rotary.rotate(k.float(), torch.arange(T)).repeat_interleave(R, 0)  # [Hq, T, d]
    bucket = key_bucket.long().repeat_interleave(R, 0)  # [Hq, T]
    qr = rotary.rotate(q.float(), qpos)  # [Hq, N, d]
    out = torch.zeros(Hq, N, num_buckets)
    position = torch.arange(T)
    for s in range(0, N, block):
        t = qpos[s : s + block]
        logits = torch.matmul(qr[:, s : s + block], kr.transpose(1, 2)) * scaling  # [Hq, n, T]
        logits = logits.masked_fill(position > t[:, None], float("-inf"))
        p = logits.softmax(-1)
        pool = (position >= sinks) & (position <= (t[:, None] - window))  # [n, T]
        p = p * pool
        out[:, s : s + block] = torch.zeros(Hq, p.shape[1], num_buckets).scatter_add_(
            -1, bucket[:, None].expand_as(p), p
        )
    return out.view(H, R, N, num_buckets)


def grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[Hq, N, d] -> [1, H, R, N, d]: each KV head's R query heads (transformers' repeat_kv order)."""
    Hq, N, d = q.shape
    return q.reshape(1, num_kv_heads, Hq // num_kv_heads, N, d)


@torch.no_grad()
def missed_mass(router: Router, q: torch.Tensor, mass: torch.Tensor, m: int) -> dict[str, torch.Tensor]:
    """What a tree read at M = ``m`` skips: per query head, the attention mass on the pool
    buckets its KV head's read does not take (``Router.group_topm_buckets`` of the pre-RoPE
    queries, one choice for the R heads), and the same for the oracle read that takes the
    ``m`` buckets holding most of the group's mass.

    q : [Hq, N, d]; mass : [H, R, N, N_b] (:func:`bucket_mass`) ->
    {"tree": [H, R, N], "oracle": [H, R, N], "pool": [H, R, N] (the mass on the pool)}"""
    H, R, N, nb = mass.shape
    m = min(m, nb)
    x = grouped(q, H).to(router.weight.dtype)
    buckets = router.group_topm_buckets(x, m)[0][0]  # [H, N, m]
    take = buckets[:, None].expand(H, R, N, m)
    pool = mass.sum(-1)
    tree = pool - mass.gather(-1, take).sum(-1)
    best = mass.sum(1).topk(m, dim=-1).indices[:, None].expand(H, R, N, m)
    oracle = pool - mass.gather(-1, best).sum(-1)
    return {"tree": tree, "oracle": oracle, "pool": pool}
