"""Naive references, written for clarity: the tests' oracle for the fast paths.

Every loop here runs over tokens or queries one at a time; nothing is vectorised.
"""

from __future__ import annotations

import torch

from armkv.memory.route import Router
from armkv.memory.state import MemoryState
from armkv.memory.write import WritePlan, WriteParams


def naive_scan(
    state: MemoryState,
    plan: WritePlan,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    params: WriteParams,
    write: str = "gated",
    empty_slot_rule: bool = True,
) -> MemoryState:
    """The recurrence A <- (1 - beta) A + beta a, one write at a time in time order.

    Same inputs as ``scan_writes`` but computes every gate on its own:
    beta = alpha * gamma(cand, k, count), 1 for the first write into an empty slot.
    """
    key, value = list(state.key.unbind(0)), list(state.value.unbind(0))
    pos, count = list(state.pos.unbind(0)), list(state.count.unbind(0))
    G, N, _ = keys.shape
    for g in range(G):
        K, V, P, C = [list(x.unbind(0)) for x in (key[g], value[g], pos[g], count[g])]
        for t in range(N):
            y = int(plan.target[g, t])
            if y < 0:
                continue
            n = plan.count[g, t]
            if write == "fifo":
                beta = torch.ones(1, dtype=keys.dtype)
            elif write == "mean":
                beta = (1.0 / (n + 1.0)).reshape(1)
            else:
                beta = params.gate_values(plan.cand[g, t], keys[g, t], n)
            beta = plan.alpha[g, t] * beta if write == "gated" else beta
            if (empty_slot_rule and float(n) == 0) or write == "fifo":
                beta = torch.ones_like(beta)
            K[y] = (1 - beta) * K[y] + beta * keys[g, t]
            V[y] = (1 - beta) * V[y] + beta * values[g, t]
            bp = beta.mean()
            P[y] = (1 - bp) * P[y] + bp * positions[g, t]
            C[y] = C[y] * (0.0 if float(n) == 0 else 1.0) + 1.0
        key[g], value[g] = torch.stack(K), torch.stack(V)
        pos[g], count[g] = torch.stack(P), torch.stack(C)
    return MemoryState(torch.stack(key), torch.stack(value), torch.stack(pos), torch.stack(count), plan.bucket)


def naive_node_score(router: Router, head: int, x: torch.Tensor, node: int, read: bool = True) -> float:
    """Sum of log-softmax router outputs along the path root -> node (heap numbering), x [d]."""
    C = router.branching
    score = 0.0
    while node > 0:
        parent, child = (node - 1) // C, (node - 1) % C
        logits = router.weight[head, parent] @ x
        logits = logits * router.read_scale + router.read_bias[head, parent] if read else logits + router.bias[head, parent]
        score += float(torch.log_softmax(logits, -1)[child])
        node = parent
    return score


def naive_path_score(router: Router, head: int, x: torch.Tensor, bucket: int, read: bool = True) -> float:
    """The path score of a leaf bucket."""
    return naive_node_score(router, head, x, router.num_nodes + bucket, read)


def naive_route_write(router: Router, head: int, x: torch.Tensor) -> int:
    """Argmax at each level from the root, for one key x [d]."""
    node = 0
    for _ in range(router.depth):
        logits = router.weight[head, node] @ x + router.bias[head, node]
        node = node * router.branching + 1 + int(logits.argmax())
    return node - router.num_nodes


def naive_read(
    query: torch.Tensor,
    exact_keys: torch.Tensor,
    exact_values: torch.Tensor,
    exact_valid: torch.Tensor,
    chunk_keys: torch.Tensor,
    chunk_values: torch.Tensor,
    chunk_valid: torch.Tensor,
    scaling: float,
    slot_keys: torch.Tensor,
    slot_values: torch.Tensor,
    slot_bias: torch.Tensor,
    slot_mask: torch.Tensor,
) -> torch.Tensor:
    """One query at a time: softmax over the keys it may see. Shapes as ``joint_attention``
    with slot_keys/values [B, Hkv, S, d], slot_bias [B, Hkv, S], slot_mask [B, Hq, T, S].
    Returns [B, T, Hq, d]."""
    B, Hq, T, d = query.shape
    Hkv = exact_keys.shape[1]
    rep = Hq // Hkv
    out = torch.zeros(B, T, Hq, d, dtype=query.dtype)
    for b in range(B):
        for h in range(Hq):
            kv = h // rep
            for t in range(T):
                ks, vs, ls = [], [], []
                for j in range(exact_keys.shape[2]):
                    if exact_valid[b, j]:
                        ks.append(exact_keys[b, kv, j]), vs.append(exact_values[b, kv, j]), ls.append(0.0)
                for s in range(slot_keys.shape[2]):
                    if slot_mask[b, h, t, s]:
                        ks.append(slot_keys[b, kv, s]), vs.append(slot_values[b, kv, s]), ls.append(float(slot_bias[b, kv, s]))
                for j in range(t + 1):
                    if chunk_valid[b, j]:
                        ks.append(chunk_keys[b, kv, j]), vs.append(chunk_values[b, kv, j]), ls.append(0.0)
                if not ks:
                    continue
                logits = torch.stack([query[b, h, t] @ k * scaling + bias for k, bias in zip(ks, ls)])
                p = torch.softmax(logits, 0)
                out[b, t, h] = sum(pi * v for pi, v in zip(p, vs))
    return out


def naive_balance_loss(router: Router, x: torch.Tensor) -> float:
    """L1 + L2 per level, summed over levels, averaged over batch and heads (x [B, H, N, d])."""
    B, H, N, _ = x.shape
    total = 0.0
    C = router.branching
    for b in range(B):
        per_head = []
        for h in range(H):
            loss_h = 0.0
            nodes = [0] * N
            for _level in range(router.depth):
                probs = []
                for i in range(N):
                    logits = router.weight[h, nodes[i]] @ x[b, h, i] + router.bias[h, nodes[i]]
                    probs.append(torch.softmax(logits, -1))
                l1 = sum(-float((p * p.clamp_min(1e-12).log()).sum()) for p in probs) / N
                l2 = 0.0
                for node in set(nodes):
                    members = [probs[i] for i in range(N) if nodes[i] == node]
                    pbar = torch.stack(members).mean(0)
                    l2 += float((pbar * pbar.clamp_min(1e-12).log()).sum())
                loss_h += l1 + l2
                nodes = [nodes[i] * C + 1 + int(probs[i].argmax()) for i in range(N)]
            per_head.append(loss_h)
        total += sum(per_head) / H
    return total / B


def exhaustive_topm(router: Router, head: int, x: torch.Tensor, m: int) -> list[int]:
    """The true top-m buckets of one query x [d]: score every leaf by its path, sort."""
    scores = [naive_path_score(router, head, x, j) for j in range(router.num_buckets)]
    return sorted(range(len(scores)), key=lambda j: -scores[j])[:m]


__all__ = [
    "naive_scan",
    "naive_node_score",
    "naive_path_score",
    "naive_route_write",
    "naive_read",
    "naive_balance_loss",
    "exhaustive_topm",
]
