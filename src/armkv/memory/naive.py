"""Naive references, written for clarity: the tests' oracle for the fast paths.

Every loop here runs over tokens or queries one at a time; nothing is vectorised.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from armkv.memory.route import Router
from armkv.memory.state import MemoryState
from armkv.memory.write import BAND_WIDTH, EXACT_NEIGHBOURS, WriteParams, WritePlan, WriteRule


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


def naive_plan_writes(
    state: MemoryState,
    keys: torch.Tensor,
    bucket: torch.Tensor,
    valid: torch.Tensor,
    params: WriteParams,
    rule: WriteRule = WriteRule(),  # noqa: B008  (frozen)
) -> tuple[WritePlan, MemoryState]:
    """What ``write.plan_writes`` decides at inference, one group and one token at a time.

    Same inputs and outputs (the plan, and the state after the pair merges that made room).
    Scores and cosines are taken per (token, slot) pair in float64
    (``WriteParams.pair_scores_reference``); merges blend in float64. The rules, per group:

    - fifo: the i-th valid token overwrites the i-th oldest slot (free slots first).
    - roomy (``rule.lazy``, the similarity scorer, the shared pool, free slots for every
      valid token): each valid token takes the next free slot.
    - otherwise a token merges into the best-scoring occupied slot of its bucket when that
      score is >= 0 (similarity scorer); else it is novel. A novel token whose score with an
      earlier novel token of its bucket (as a slot) is >= 0 follows the first such token
      (into its root's slot); the others lead and want a free slot.
    - shared pool, more leaders than free slots: the candidates are the mutual-nearest pairs
      of occupied slots (nearest by key cosine among every other occupied slot, or for pools
      of more than EXACT_NEIGHBOURS slots among the BAND_WIDTH slots of its bucket on either
      side in bucket order) and each leader with its most similar occupied slot (of its own
      bucket under demote_scope="bucket"). The most similar candidates merge, as many as
      leaders lack slots (ties: pairs before tokens, lower index first); ``protect_recent``
      keeps the newest slots out and ranks every token below every pair. A merged pair
      becomes one count-weighted slot at the lower index; a demoted leader merges into its
      slot (or the one that absorbed it). Leaders take the free slots in index order (then,
      should the candidates run out, the occupied ones, merging into them).
    - paper pool (Y slots a bucket): a leader takes its bucket's next free slot; past them,
      the best-scoring occupied slot of its bucket, or failing that (a bucket filled in this
      chunk) the slot of the earlier kept token of its bucket it scores highest with.
    - a write's gate compares the token with its slot after the merges, or, in a slot this
      chunk fills, with the slot's first token; its count is the tokens the slot held before.

    Training (the Gumbel-Softmax choice) is not covered: its choice is random.
    """
    G, N, d = keys.shape
    S = state.slots
    Y = rule.slots_per_bucket
    similarity = params.scorer_kind == "similarity"
    key, value = state.key.clone(), state.value.clone()
    pos, count, merged_bucket = state.pos.clone(), state.count.clone(), state.bucket.clone()
    plan_bucket = state.bucket.clone()  # after the merges and this chunk's first fills
    target = torch.full((G, N), -1, dtype=torch.long, device=keys.device)
    plan_count = torch.zeros(G, N, dtype=keys.dtype, device=keys.device)
    cand = torch.zeros_like(keys)
    for g in range(G):
        k = keys[g].double()
        toks = [t for t in range(N) if valid[g, t]]
        tb = [int(b) for b in bucket[g]]
        occupied = [float(c) > 0 for c in state.count[g]]
        if rule.write == "fifo":
            order = sorted(range(S), key=lambda s: (occupied[s], float(state.pos[g, s]) if occupied[s] else 0.0, s))
            for i, t in enumerate(toks):
                target[g, t] = order[i % S]
                plan_bucket[g, order[i % S]] = tb[t]
            continue

        def slot_scores(t: int) -> tuple[list[float], list[float]]:  # token t against every slot: (z, cos)
            z, cos = params.pair_scores_reference(state.key[g].double().unsqueeze(0), k[t].view(1, 1, d))
            return z[0, 0].tolist(), cos[0, 0].tolist()

        def token_score(t: int, u: int) -> float:  # token t against token u as a slot
            return float(params.pair_scores_reference(k[u].view(1, 1, d), k[t].view(1, 1, d))[0][0, 0, 0])

        roomy = rule.lazy and similarity and Y == 0 and occupied.count(False) >= len(toks)
        novel, parent, best_slot, cos = {}, {}, {}, {}
        for t in toks:
            z, cos[t] = slot_scores(t)
            cands = [s for s in range(S) if occupied[s] and int(state.bucket[g, s]) == tb[t]]
            best = None
            for s in cands:
                if best is None or z[s] > z[best]:
                    best = s
            best_slot[t] = best
            novel[t] = roomy or not similarity or best is None or z[best] < 0
            parent[t] = t
            if novel[t] and similarity and not roomy:
                for u in toks:
                    if u < t and novel[u] and tb[u] == tb[t] and token_score(t, u) >= 0:
                        parent[t] = parent[u]  # (u's root: followers are resolved in time order)
                        break
        leaders = [t for t in toks if novel[t] and parent[t] == t]

        src_of, demote_to, via_token, new_slot = {}, {}, {}, {}
        if Y == 0:
            deficit = len(leaders) - occupied.count(False)
            if deficit > 0:
                src_of, demote_to = _naive_make_room(state, g, leaders, cos, tb, deficit, rule)
                for dst, src in src_of.items():
                    n_dst, n_src = float(count[g, dst]), float(count[g, src])
                    w_dst, w_src = n_dst / (n_dst + n_src), n_src / (n_dst + n_src)
                    for x in (key, value):
                        x[g, dst] = (w_dst * x[g, dst].double() + w_src * x[g, src].double()).to(x.dtype)
                        x[g, src] = 0
                    pos[g, dst] = w_dst * float(pos[g, dst]) + w_src * float(pos[g, src])
                    count[g, dst] = n_dst + n_src
                    if n_src > n_dst:
                        merged_bucket[g, dst] = merged_bucket[g, src]
                    pos[g, src], count[g, src], merged_bucket[g, src] = 0, 0, -1
                plan_bucket[g] = merged_bucket[g]
                leaders = [t for t in leaders if t not in demote_to]
            free = [s for s in range(S) if float(count[g, s]) == 0] + [s for s in range(S) if float(count[g, s]) > 0]
            new_slot = {t: free[min(i, S - 1)] for i, t in enumerate(leaders)}
        else:
            taken: dict[int, int] = {}  # leaders kept per bucket so far
            kept = []
            for t in leaders:
                b = tb[t]
                own_free = [s for s in range(b * Y, (b + 1) * Y) if not occupied[s]]
                r = taken.get(b, 0)
                taken[b] = r + 1
                if r < len(own_free):
                    new_slot[t] = own_free[r]
                    kept.append(t)
                elif best_slot[t] is not None:
                    demote_to[t] = best_slot[t]
                else:
                    peers = [u for u in kept if u < t and tb[u] == b]
                    via_token[t] = max(peers, key=lambda u: (token_score(t, u), -u))
            leaders = kept

        redirect = list(range(S))
        for dst, src in src_of.items():
            redirect[src] = dst
        for t in toks:
            if t in new_slot:
                y = new_slot[t]
            elif t in demote_to:
                y = redirect[demote_to[t]]
            elif t in via_token:
                y = int(target[g, via_token[t]])
            elif not novel[t]:
                y = redirect[best_slot[t]]
            else:
                y = int(target[g, parent[t]])
            target[g, t] = y

        first_writer: dict[int, int] = {}
        writes_so_far: dict[int, int] = {}
        for t in toks:
            y = int(target[g, t])
            base, r = float(count[g, y]), writes_so_far.get(y, 0)
            plan_count[g, t] = base + r
            cand[g, t] = keys[g, first_writer[y]] if base == 0 and r > 0 else key[g, y]
            if Y == 0 and base == 0 and r == 0:
                plan_bucket[g, y] = tb[t]
            first_writer.setdefault(y, t)
            writes_so_far[y] = r + 1
    alpha = torch.ones(G, N, dtype=keys.dtype, device=keys.device)
    plan = WritePlan(target=target, alpha=alpha, cand=cand, count=plan_count, bucket=plan_bucket)
    return plan, MemoryState(key=key, value=value, pos=pos, count=count, bucket=merged_bucket)


def _naive_make_room(state, g, leaders, cos, tb, deficit, rule) -> tuple[dict[int, int], dict[int, int]]:
    """The merges that make room in group g (see :func:`naive_plan_writes`): (src_of
    {slot: slot merged into it}, demote_to {leader: slot it merges into})."""
    S = state.slots
    counts = [float(c) for c in state.count[g]]
    eligible = [c > 0 for c in counts]
    if rule.protect_recent > 0:
        by_age = sorted((s for s in range(S) if eligible[s]), key=lambda s: float(state.pos[g, s]))
        keep = math.floor(len(by_age) * (1 - rule.protect_recent))
        eligible = [s in by_age[:keep] for s in range(S)]
    slot_keys = state.key[g].double()

    def slot_cos(a: int, b: int) -> float:
        return float(F.cosine_similarity(slot_keys[a], slot_keys[b], dim=0, eps=1e-12))

    if S <= EXACT_NEIGHBOURS:
        near = {s: [o for o in range(S) if o != s and eligible[o]] for s in range(S) if eligible[s]}
    else:
        order = sorted(range(S), key=lambda s: (int(state.bucket[g, s]) if eligible[s] else -1, s))
        at = {s: i for i, s in enumerate(order)}
        w = min(BAND_WIDTH, S - 1)
        near = {
            s: [
                o
                for o in order[max(0, at[s] - w) : at[s] + w + 1]
                if o != s and eligible[o] and int(state.bucket[g, o]) == int(state.bucket[g, s])
            ]
            for s in range(S)
            if eligible[s]
        }
    nearest = {}
    for s, others in near.items():
        if others:
            nearest[s] = max(others, key=lambda o: (slot_cos(s, o), -o))
    candidates = []  # (similarity, 0 for a slot pair / 1 for a token, index)
    for s, o in nearest.items():
        if nearest.get(o) == s and s < o:
            candidates.append((slot_cos(s, o), 0, s))
    best_of = {}
    for t in leaders:
        slots = [
            s for s in range(S) if eligible[s] and (rule.demote_scope == "any" or int(state.bucket[g, s]) == tb[t])
        ]
        if slots:
            best_of[t] = max(slots, key=lambda s: (cos[t][s], -s))
            candidates.append((cos[t][best_of[t]] - (1e4 if rule.protect_recent > 0 else 0), 1, t))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    src_of, demote_to = {}, {}
    for _, kind, i in candidates[:deficit]:
        if kind == 0:
            src_of[i] = nearest[i]
        else:
            demote_to[i] = best_of[i]
    return src_of, demote_to


def naive_node_score(router: Router, head: int, x: torch.Tensor, node: int, read: bool = True) -> float:
    """Sum of log-softmax router outputs along the path root -> node (heap numbering), x [d]."""
    C = router.branching
    score = 0.0
    while node > 0:
        parent, child = (node - 1) // C, (node - 1) % C
        logits = router.weight[head, parent] @ x
        logits = (
            logits * router.read_scale + router.read_bias[head, parent] if read else logits + router.bias[head, parent]
        )
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
                        (
                            ks.append(slot_keys[b, kv, s]),
                            vs.append(slot_values[b, kv, s]),
                            ls.append(float(slot_bias[b, kv, s])),
                        )
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
    "naive_plan_writes",
    "naive_node_score",
    "naive_path_score",
    "naive_route_write",
    "naive_read",
    "naive_balance_loss",
    "exhaustive_topm",
]
