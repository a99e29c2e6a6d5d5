"""The write plan (``write.plan_writes``) against its naive reference (``naive.naive_plan_writes``):
the same targets, gate inputs, counts and buckets, and the same state after the merges that
make room, at odd sizes, with padding, in empty, part-filled and full pools, the shared and
the paper pool, lazy merging on and off, both demotion scopes, fifo, in every dtype."""

from __future__ import annotations

import pytest
import torch

from armkv.errors import ArmkvError
from armkv.memory.naive import naive_plan_writes
from armkv.memory.state import MemoryState
from armkv.memory.write import EXACT_NEIGHBOURS, WriteParams, WriteRule, plan_writes
from conftest import DTYPES, TOLERANCE, dtype_id


def assert_same_plan(state, keys, bucket, valid, params, rule, fused=True):
    """plan_writes and naive_plan_writes agree; returns the naive (plan, state)."""
    with torch.no_grad():
        got, got_state = plan_writes(state, keys, bucket, valid, params, rule, fused=fused)
        want, want_state = naive_plan_writes(state, keys, bucket, valid, params, rule)
    tol = TOLERANCE[keys.dtype]
    assert torch.equal(got.target, want.target), (got.target, want.target)
    for name in ("alpha", "count"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.bucket, want.bucket)
    writes = want.target >= 0  # (a padding token's gate input is arbitrary: it writes nothing)
    torch.testing.assert_close(got.cand[writes], want.cand[writes], **tol)
    for name in ("key", "value"):
        torch.testing.assert_close(getattr(got_state, name), getattr(want_state, name), **tol, msg=name)
    torch.testing.assert_close(got_state.pos, want_state.pos, rtol=1e-6, atol=1e-5)
    assert torch.equal(got_state.count, want_state.count) and torch.equal(got_state.bucket, want_state.bucket)
    assert int((want.target >= 0).sum()) == int(valid.sum())  # every valid token writes, no padding does
    return want, want_state


def random_case(G, N, S, d, occupied, nb, seed, paper_y=0):
    """A float32 state and chunk: random keys, every third token nearly repeating a slot (and
    routed to its bucket), every fourth nearly repeating an earlier token, padding in row 0."""
    g = torch.Generator().manual_seed(seed)
    state = MemoryState.empty(G, S, d, torch.float32, slots_per_bucket=paper_y)
    if paper_y:  # occupy the first slots of each bucket
        fill = torch.arange(S) % paper_y < occupied
    else:
        fill = torch.arange(S) < occupied
    n = int(fill.sum())
    state.key[:, fill] = torch.randn(G, n, d, generator=g)
    state.value[:, fill] = torch.randn(G, n, d, generator=g)
    state.pos[:, fill] = torch.randperm(n, generator=g).float().expand(G, n)
    state.count[:, fill] = torch.randint(1, 4, (G, n), generator=g).float()
    if not paper_y:
        state.bucket[:, fill] = torch.randint(0, nb, (G, n), generator=g)
    keys = torch.randn(G, N, d, generator=g)
    bucket = torch.randint(0, nb, (G, N), generator=g)
    held = fill.nonzero().squeeze(1)
    for t in range(N):
        if t % 3 == 1 and n:
            s = held[torch.randint(0, n, (G,), generator=g)]
            keys[:, t] = state.key[torch.arange(G), s] * 1.001
            bucket[:, t] = state.bucket[torch.arange(G), s]
        elif t % 4 == 3:
            keys[:, t] = keys[:, t // 2] + 1e-3 * torch.randn(G, d, generator=g)
            bucket[:, t] = bucket[:, t // 2]
    valid = torch.ones(G, N, dtype=torch.bool)
    valid[0, :2] = False  # left padding
    valid[-1, -1] = False
    return state, keys, bucket, valid


# (G, N, S, d, occupied, buckets): empty, part-filled, nearly full, full; odd sizes throughout
SHARED = [(2, 7, 9, 5, 0, 3), (3, 11, 13, 5, 9, 3), (2, 13, 17, 7, 14, 4), (2, 9, 17, 7, 17, 2), (1, 15, 5, 3, 5, 2)]
RULES = [WriteRule(lazy=lazy, demote_scope=scope) for lazy in (True, False) for scope in ("any", "bucket")]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case", SHARED, ids=lambda c: "G{}N{}S{}d{}occ{}nb{}".format(*c))
def test_shared_pool_plan_equals_naive(case, fused):
    G, N, S, d, occupied, nb = case
    params = WriteParams(d, "similarity", "scalar", 0.98).requires_grad_(False)
    state, keys, bucket, valid = random_case(G, N, S, d, occupied, nb, seed=S + N)
    merged_any = False
    for rule in RULES + [
        WriteRule(lazy=True, protect_recent=0.3),
        WriteRule(demote_scope="bucket", protect_recent=0.5),
    ]:
        plan, merged = assert_same_plan(state, keys, bucket, valid, params, rule, fused)
        merged_any |= not torch.equal(merged.count, state.count)
        if occupied and not rule.lazy:  # the near-repeats of slots merged into them
            assert (plan.count > 0).any()
    assert merged_any == (occupied + N > S)  # pools short of room made it by merging


def test_large_pool_finds_neighbours_in_the_band():
    """Past EXACT_NEIGHBOURS slots a full pool's pair candidates come from the banded search."""
    G, N, S, d = 1, 9, EXACT_NEIGHBOURS + 61, 6
    params = WriteParams(d, "similarity", "scalar", 0.98).requires_grad_(False)
    state, keys, bucket, valid = random_case(G, N, S, d, S, nb=5, seed=1)
    for rule in (WriteRule(lazy=True), WriteRule(demote_scope="bucket")):
        _, merged = assert_same_plan(state, keys, bucket, valid, params, rule)
        assert not torch.equal(merged.count, state.count)


@pytest.mark.parametrize("occupied", [0, 2, 3])
def test_paper_pool_plan_equals_naive(occupied):
    """Y slots a bucket: leaders fill their bucket's free slots; past them the best slot of
    the bucket, or in a bucket that had none, the earlier kept token they score highest with."""
    G, N, Y, nb, d = 2, 17, 3, 3, 5
    for scorer in ("similarity", "paper"):
        params = WriteParams(d, scorer, "scalar", 0.98).requires_grad_(False)
        state, keys, bucket, valid = random_case(G, N, Y * nb, d, occupied, nb, seed=occupied, paper_y=Y)
        for lazy in (True, False):
            plan, _ = assert_same_plan(state, keys, bucket, valid, params, WriteRule(slots_per_bucket=Y, lazy=lazy))
            assert ((plan.target // Y == bucket) | (plan.target < 0)).all()  # within the token's bucket


def test_fifo_and_the_paper_scorer_plan_equal_naive():
    params = WriteParams(5, "paper", "scalar", 0.98).requires_grad_(False)
    for occupied in (0, 6, 13):
        state, keys, bucket, valid = random_case(2, 9, 13, 5, occupied, 3, seed=occupied)
        assert_same_plan(state, keys, bucket, valid, params, WriteRule(write="fifo"))
        assert_same_plan(state, keys, bucket, valid, params, WriteRule())
    params = WriteParams(5, "similarity", "scalar", 0.98).requires_grad_(False)
    state, keys, bucket, valid = random_case(1, 20, 7, 5, 7, 3, seed=2)  # more tokens than slots
    plan, _ = assert_same_plan(state, keys, bucket, valid, params, WriteRule(write="fifo"))


def structured_case(dtype, full: bool, seed: int):
    """A shared pool and a chunk whose similarities are set apart by at least 0.06, so that a
    bfloat16 plan (cosines good to about 0.01) ranks its candidates as the exact one does:
    slot pairs at cosines 0.92, 0.80, 0.68, 0.56 (each the other's nearest), singleton slots,
    and tokens that nearly repeat a slot or an earlier token, stand at a set cosine (0.86,
    0.74, 0.62) to a singleton slot of their bucket (merge candidates), or point somewhere
    new. Keys on orthogonal directions, of random norms."""
    G, d, pairs, singles = 2, 29, 4, 5
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].T  # rows orthonormal
    S = 2 * pairs + singles + (0 if full else 4)
    n = 2 * pairs + singles
    state = MemoryState.empty(G, S, d, torch.float64)
    slots = []
    for p in range(pairs):
        c = 0.92 - 0.12 * p
        slots += [basis[2 * p], c * basis[2 * p] + (1 - c**2) ** 0.5 * basis[2 * p + 1]]
    slots += [basis[s] for s in range(2 * pairs, n)]  # singleton slot s lies along basis[s]
    state.key[:, :n] = torch.stack(slots) * (torch.rand(G, n, 1, generator=g, dtype=torch.float64) + 0.5)
    state.value[:, :n] = torch.randn(G, n, d, generator=g, dtype=torch.float64)
    state.pos[:, :n] = torch.arange(n, dtype=torch.float32)
    state.count[:, :n] = torch.randint(1, 4, (G, n), generator=g).float()
    pair_bucket = torch.randint(0, 3, (G, pairs), generator=g)
    state.bucket[:, :n] = torch.cat(
        [pair_bucket.repeat_interleave(2, 1), torch.randint(0, 3, (G, singles), generator=g)], 1
    )
    kinds = [
        "new",
        "near",
        "repeat-slot",
        "new",
        "repeat-token",
        "near",
        "new",
        "repeat-slot",
        "near",
        "repeat-token",
        "new",
    ]
    N = len(kinds)
    keys = torch.zeros(G, N, d, dtype=torch.float64)
    bucket = torch.zeros(G, N, dtype=torch.long)
    fresh = iter(range(n, d))  # directions no slot uses
    near = iter(zip(range(2 * pairs, n), (0.86, 0.74, 0.62)))
    for t, kind in enumerate(kinds):
        if kind == "new":
            keys[:, t] = basis[next(fresh)]
            bucket[:, t] = torch.randint(0, 3, (G,), generator=g)
        elif kind == "near":
            s, c = next(near)
            keys[:, t] = c * basis[s] + (1 - c**2) ** 0.5 * basis[next(fresh)]
            bucket[:, t] = state.bucket[:, s]
        elif kind == "repeat-slot":
            s = int(torch.randint(0, n, (1,), generator=g))
            keys[:, t] = state.key[:, s] * 1.0005
            bucket[:, t] = state.bucket[:, s]
        else:
            u = max(i for i in range(t) if kinds[i] == "new")
            keys[:, t] = keys[:, u] * 1.0005
            bucket[:, t] = bucket[:, u]
    keys = keys * (torch.rand(G, N, 1, generator=g, dtype=torch.float64) + 0.5)
    valid = torch.ones(G, N, dtype=torch.bool)
    valid[1, 0] = False
    state = MemoryState(state.key.to(dtype), state.value.to(dtype), state.pos, state.count, state.bucket)
    return state, keys.to(dtype), bucket, valid


def structured_paper_case(dtype, seed: int):
    """A paper pool (3 buckets of 4 slots, 3 held in each, singletons on orthogonal
    directions) and a chunk: into bucket 2 a new token (it takes the bucket's free slot), then
    two at cosines 0.86 and 0.74 to two of its slots (over the bucket's room: each merges into
    the bucket's best slot for it), and a near-repeat of a slot of bucket 0; padding in row 1."""
    G, d, Y = 2, 29, 4
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].T
    state = MemoryState.empty(G, 3 * Y, d, torch.float64, slots_per_bucket=Y)
    held = torch.arange(3 * Y) % Y < 3
    state.key[:, held] = basis[:9] * (torch.rand(G, 9, 1, generator=g, dtype=torch.float64) + 0.5)
    state.value[:, held] = torch.randn(G, 9, d, generator=g, dtype=torch.float64)
    state.pos[:, held] = torch.arange(9, dtype=torch.float32)
    state.count[:, held] = torch.randint(1, 4, (G, 9), generator=g).float()
    keys = torch.stack(
        [basis[20], 0.86 * basis[7] + 0.51 * basis[21], 0.74 * basis[6] + 0.67 * basis[22], basis[1] * 1.0005]
    )
    keys = keys.expand(G, 4, d) * (torch.rand(G, 4, 1, generator=g, dtype=torch.float64) + 0.5)
    bucket = torch.tensor([2, 2, 2, 0]).expand(G, 4)
    valid = torch.ones(G, 4, dtype=torch.bool)
    valid[1, 3] = False
    state = MemoryState(state.key.to(dtype), state.value.to(dtype), state.pos, state.count, state.bucket)
    return state, keys.to(dtype), bucket, valid


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("full", [True, False])
def test_plan_equals_naive_in_every_dtype(dtype, full):
    params = WriteParams(29, "similarity", "scalar", 0.98).requires_grad_(False).to(dtype)
    state, keys, bucket, valid = structured_case(dtype, full, seed=int(full))
    for rule in RULES:
        for fused in (True, False):
            plan, merged = assert_same_plan(state, keys, bucket, valid, params, rule, fused)
        assert (plan.count > 0).any()  # near-repeats merged into stored slots
        assert (merged.count[:, :8] == 0).any()  # slot pairs merged to make room
    state, keys, bucket, valid = structured_paper_case(dtype, seed=int(full))
    for lazy in (True, False):
        plan, _ = assert_same_plan(state, keys, bucket, valid, params, WriteRule(slots_per_bucket=4, lazy=lazy))
        assert torch.equal(plan.target[0], torch.tensor([11, 9, 8, 1]))  # the new token's own slot, then merges


def test_write_rule_validates_its_fields():
    with pytest.raises(ArmkvError, match="WriteRule.demote_scope"):
        WriteRule(demote_scope="nearest")
    with pytest.raises(ArmkvError, match="WriteRule.protect_recent"):
        WriteRule(protect_recent=1.0)
    with pytest.raises(ArmkvError, match="WriteRule.write"):
        WriteRule(write="overwrite")
