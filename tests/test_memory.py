"""The routed memory against its naive references: scan, routing, reads, policy, budget."""

from __future__ import annotations

import math

import pytest
import torch

from armkv.config import ARMConfig
from armkv.errors import ArmkvError
from armkv.memory import naive
from armkv.memory.module import ARMMemory, ARMModel
from armkv.memory.policy import TopMPolicy
from armkv.memory.read import bucket_slot_mask
from armkv.memory.route import Router
from armkv.memory.state import MemoryState
from armkv.memory.write import WriteParams, WriteRule, gate_weights, plan_writes, scan_writes, segmented_suffix_product


def _filled_state(G, S, d, occupied, seed=0, dtype=torch.float64, nb=5):
    g = torch.Generator().manual_seed(seed)
    st = MemoryState.empty(G, S, d, dtype)
    n = occupied
    st.key[:, :n] = torch.randn(G, n, d, generator=g, dtype=dtype)
    st.value[:, :n] = torch.randn(G, n, d, generator=g, dtype=dtype)
    st.pos[:, :n] = torch.arange(n, dtype=torch.float32)
    st.count[:, :n] = torch.randint(1, 4, (G, n), generator=g).float()
    st.bucket[:, :n] = torch.randint(0, nb, (G, n), generator=g)
    return st


def _chunk(G, N, d, seed=1, dup_every=3, dtype=torch.float64, state=None):
    """Random keys where every dup_every-th token repeats an earlier one (or a slot) nearly."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(G, N, d, generator=g, dtype=dtype)
    for t in range(2, N, dup_every):
        keys[:, t] = keys[:, t // 2] + 1e-3 * torch.randn(G, d, generator=g, dtype=dtype)
    if state is not None:
        keys[:, 1] = state.key[:, 0] * 1.0001
    values = torch.randn(G, N, d, generator=g, dtype=dtype)
    positions = torch.arange(100, 100 + N, dtype=torch.float32).expand(G, N).clone()
    return keys, values, positions


@pytest.mark.parametrize("gate", ["scalar", "channel"])
@pytest.mark.parametrize("write", ["gated", "mean"])
@pytest.mark.parametrize("G,N,S,occupied", [(3, 63, 17, 9), (2, 7, 40, 0), (1, 33, 12, 12)])
def test_scan_equals_naive_loop(gate, write, G, N, S, occupied):
    torch.manual_seed(0)
    d = 5
    nb = 5
    params = WriteParams(d, "similarity", gate, 0.9).double()
    with torch.no_grad():  # a gate that is not just the running mean, so every weight matters
        params.gate.weight.add_(0.1 * torch.randn_like(params.gate.weight))
    state = _filled_state(G, S, d, occupied, nb=nb)
    keys, values, positions = _chunk(G, N, d, state=state if occupied else None)
    valid = torch.ones(G, N, dtype=torch.bool)
    valid[0, :3] = False  # left padding in one row
    bucket = torch.randint(0, nb, (G, N), generator=torch.Generator().manual_seed(3))
    keys.requires_grad_(True)
    values.requires_grad_(True)
    plan, merged = plan_writes(
        state,
        keys,
        bucket,
        valid,
        params,
        WriteRule(write=write),
        training=True,
        generator=torch.Generator().manual_seed(5),
    )
    fast = scan_writes(merged, plan, gate_weights(plan, keys, params, write), keys, values, positions)
    slow = naive.naive_scan(merged, plan, keys, values, positions, params, write)
    for name in ("key", "value", "pos", "count"):
        tol = 1e-10 if name in ("key", "value") else 1e-5  # positions and counts are kept in fp32
        # (the reference may widen positions and counts to the keys' dtype)
        torch.testing.assert_close(
            getattr(fast, name), getattr(slow, name), rtol=tol, atol=tol, msg=name, check_dtype=False
        )
    weights = torch.randn_like(fast.key)
    grads = []
    for out in (fast, slow):
        loss = (out.key * weights).sum() + (out.value * weights).sum()  # the fp64 channels
        grads.append(
            torch.autograd.grad(loss, [keys, values, *params.parameters()], allow_unused=True, retain_graph=True)
        )
    inputs = [keys, values, *params.parameters()]
    for a, b, x in zip(*grads, inputs):
        zero = torch.zeros_like(x)  # None: the input did not reach this output at all
        torch.testing.assert_close(zero if a is None else a, zero if b is None else b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("shape", [(3, 17), (2, 4, 9), (1, 1), (2, 2706)])
def test_true_first_equals_a_stable_sort(shape):
    from armkv.memory.write import true_first

    g = torch.Generator().manual_seed(sum(shape))
    for p in (0.0, 0.3, 1.0):
        mask = torch.rand(shape, generator=g) < p
        want = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices
        assert torch.equal(true_first(mask), want)


def test_segmented_suffix_product_matches_loops():
    torch.manual_seed(0)
    M, D = 37, 3
    seg = torch.sort(torch.randint(0, 6, (M,))).values
    decay = torch.rand(M, D, dtype=torch.float64)
    decay[5] = 0.0  # a reset
    got = segmented_suffix_product(decay, seg)
    for i in range(M):
        want = torch.ones(D, dtype=torch.float64)
        for j in range(i + 1, M):
            if seg[j] == seg[i]:
                want = want * decay[j]
        torch.testing.assert_close(got[i], want)


def test_writes_keep_novel_tokens_exact_and_merge_duplicates():
    d, S = 8, 32
    params = WriteParams(d, "similarity", "scalar", 0.98)
    state = MemoryState.empty(1, S, d)
    torch.manual_seed(0)
    base = torch.randn(4, d)
    keys = base.repeat(3, 1).unsqueeze(0)  # 4 distinct keys, each seen 3 times
    values = torch.randn(1, 12, d)
    bucket = torch.zeros(1, 12, dtype=torch.long)
    plan, merged = plan_writes(state, keys, bucket, torch.ones(1, 12, dtype=torch.bool), params)
    out = scan_writes(merged, plan, gate_weights(plan, keys, params), keys, values, torch.arange(12.0).unsqueeze(0))
    assert int((out.count > 0).sum()) == 4
    assert sorted(out.count[out.count > 0].tolist()) == [3.0, 3.0, 3.0, 3.0]
    # the running mean at initialisation: each slot's value is the mean of its 3 values
    for i in range(4):
        slot = int(plan.target[0, i])
        torch.testing.assert_close(out.value[0, slot], values[0, i::4].mean(0), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.pos[0, slot], torch.tensor(float(i + 4)))


def test_full_pool_merges_closest_pair_not_the_novel_token():
    d, S = 6, 4
    params = WriteParams(d, "similarity", "scalar", 0.98)
    state = MemoryState.empty(1, S, d)
    e = torch.eye(d)
    near = e[0] + 0.05 * e[1]  # cos(e0, near) ~ 0.9988 > threshold? no: merges only >= 0.98 in-bucket
    state.key[0] = torch.stack([e[0], near, e[2], e[3]])
    state.count[0] = 1
    state.bucket[0] = torch.tensor([0, 1, 2, 3])  # different buckets: no in-bucket merge
    novel = e[4].view(1, 1, d)
    plan, merged = plan_writes(state, novel, torch.tensor([[2]]), torch.ones(1, 1, dtype=torch.bool), params)
    out = scan_writes(merged, plan, gate_weights(plan, novel, params), novel, novel, torch.zeros(1, 1))
    assert int((out.count > 0).sum()) == 4
    assert float(out.count.max()) == 2.0  # e0 and near were merged
    slot = int(plan.target[0, 0])
    torch.testing.assert_close(out.key[0, slot], e[4])  # the novel token is stored exactly


@pytest.mark.parametrize("fused", [True, False])
def test_demote_scope_bucket_merges_a_token_only_into_its_own_bucket(fused):
    """A full pool, one novel token whose nearest slot lies in another bucket: with
    demote_scope="any" the token is the most redundant candidate and merges into that slot;
    with "bucket" its own bucket holds nothing like it, so the closest slot pair merges
    instead and the token keeps an exact slot of its own."""
    d, S = 6, 4
    params = WriteParams(d, "similarity", "scalar", 0.98).requires_grad_(False)
    state = MemoryState.empty(1, S, d)
    e = torch.eye(d)
    state.key[0] = torch.stack([e[0], e[1], e[1] + e[2], e[3]])  # slots 1 and 2: cosine 0.71
    state.value[0] = state.key[0]
    state.count[0] = 1
    state.bucket[0] = torch.tensor([0, 1, 1, 2])
    token = (e[1] + 0.01 * e[4]).view(1, 1, d)  # nearly slot 1 (bucket 1), routed to bucket 0
    one = torch.ones(1, 1, dtype=torch.bool)
    with torch.no_grad():
        wide, _ = plan_writes(state, token, torch.tensor([[0]]), one, params, WriteRule(lazy=True), fused=fused)
        own, merged = plan_writes(
            state, token, torch.tensor([[0]]), one, params, WriteRule(lazy=True, demote_scope="bucket"), fused=fused
        )
    assert int(wide.target[0, 0]) == 1  # merged into slot 1 of bucket 1
    slot = int(own.target[0, 0])
    assert float(merged.count[0, slot]) == 0  # a slot freed by the pair merge: the token's own
    assert int((merged.count > 0).sum()) == 3 and float(merged.count.max()) == 2.0
    out = scan_writes(merged, own, gate_weights(own, token, params), token, token, torch.zeros(1, 1))
    torch.testing.assert_close(out.key[0, slot], token[0, 0])


def test_paper_pool_and_fifo_stay_within_their_slots():
    for cfg in (
        ARMConfig(depth=2, branching=2, slots=12, pool="paper", scorer="paper"),
        ARMConfig(depth=2, branching=2, slots=12, write="fifo"),
    ):
        mem = ARMMemory(cfg, 2, 8).eval()
        st = mem.init_state(1, torch.float32, "cpu")
        for c in range(5):
            st = mem.write(
                st,
                torch.randn(1, 2, 8, 8),
                torch.randn(1, 2, 8, 8),
                torch.arange(8)[None] + 8 * c,
                torch.ones(1, 8, dtype=torch.bool),
            )
        assert st.count.sum().item() == (2 * 40 if cfg.write != "fifo" else 2 * 12)
        if cfg.pool == "paper":
            assert torch.equal(st.bucket[0], torch.arange(12) // 3)


def test_state_size_is_fixed():
    cfg = ARMConfig(depth=2, branching=4, slots=48, chunk=256)
    mem = ARMMemory(cfg, 2, 8).eval()
    st = mem.init_state(1, torch.float32, "cpu")
    sizes = {}
    written = 0
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        while written < 100_000:
            n = 256
            st = mem.write(
                st,
                torch.randn(1, 2, n, 8, generator=g),
                torch.randn(1, 2, n, 8, generator=g),
                torch.arange(written, written + n)[None],
                torch.ones(1, n, dtype=torch.bool),
            )
            written += n
            if written in (256, 100_096 - 256 * 0):
                sizes[written] = st.pack("model").nbytes()
            sizes["last"] = st.pack("model").nbytes()
    # as stored between writes: fp32 key and value, count, position and an int32 bucket id
    assert sizes[256] == sizes["last"] == cfg.pool_slots * 2 * (2 * 8 * 4 + 12)
    assert float(st.count.sum()) == 2 * written


# ------------------------------------------------------------------ routing
def test_beam_equals_exhaustive_when_m_is_all_buckets():
    torch.manual_seed(0)
    r = Router(2, 6, depth=3, branching=3)
    x = torch.randn(2, 2, 5, 6)
    b_beam, s_beam = r.beam_topm(x, 27)
    s_all = r.leaf_scores(x)
    torch.testing.assert_close(s_beam, s_all.topk(27, -1).values)
    assert torch.equal(torch.sort(b_beam, -1).values, torch.arange(27).expand_as(b_beam))


def test_topm_returns_true_topm_and_matches_naive_paths():
    torch.manual_seed(1)
    r = Router(1, 4, depth=2, branching=3)
    x = torch.randn(1, 1, 6, 4)
    for m in (1, 2, 5):
        buckets, _ = r.topm_buckets(x, m)  # small tree: exhaustive, exact
        for i in range(6):
            assert buckets[0, 0, i].tolist() == naive.exhaustive_topm(r, 0, x[0, 0, i], m)
    # beam search is exact where every top-m leaf's ancestors are in the top-m of their level
    beam, _ = r.beam_topm(x, 3)
    for i in range(6):
        truth = naive.exhaustive_topm(r, 0, x[0, 0, i], 3)
        parents = {b // 3 for b in truth}
        level1 = sorted(range(3), key=lambda c: -naive.naive_node_score(r, 0, x[0, 0, i], 1 + c))[:3]
        if parents <= set(level1):
            assert sorted(beam[0, 0, i].tolist()) == sorted(truth)


@pytest.mark.parametrize("depth,branching,d", [(3, 2, 4), (3, 4, 12), (2, 5, 7), (4, 4, 8)])
@pytest.mark.parametrize("all_at_once", [True, False])
def test_route_writes_matches_naive(monkeypatch, depth, branching, d, all_at_once):
    """Both forms of the write routing (every router's logits in one product, or each
    token's path gathered) against the per-token walk down the tree, with trained-looking
    biases; (4, 4) has more router outputs than ALL_NODES_AT_ONCE by default."""
    import armkv.memory.route as route

    monkeypatch.setattr(route, "ALL_NODES_AT_ONCE", 10**6 if all_at_once else 0)
    torch.manual_seed(depth * 100 + branching * 10 + d)
    r = Router(2, d, depth=depth, branching=branching)
    with torch.no_grad():
        r.bias.normal_()
    x = torch.randn(3, 2, 9, d)
    got = r.route_writes(x)
    for b in range(3):
        for h in range(2):
            for i in range(9):
                assert int(got[b, h, i]) == naive.naive_route_write(r, h, x[b, h, i])


def test_balance_loss_matches_hand_computation():
    r = Router(1, 2, depth=1, branching=2)
    with torch.no_grad():
        r.weight.zero_()
        r.weight[0, 0] = torch.eye(2)
        r.bias.zero_()
    x = torch.tensor([[[[2.0, 0.0], [0.0, 1.0]]]])
    p1 = torch.softmax(torch.tensor([2.0, 0.0]), 0)
    p2 = torch.softmax(torch.tensor([0.0, 1.0]), 0)
    h = lambda p: -(p * p.log()).sum()  # noqa: E731
    pbar = (p1 + p2) / 2
    expected = (h(p1) + h(p2)) / 2 + (pbar * pbar.log()).sum()
    torch.testing.assert_close(r.balance_loss(x), expected)
    torch.manual_seed(3)
    r2 = Router(2, 3, depth=2, branching=3)
    x2 = torch.randn(2, 2, 7, 3)
    assert abs(float(r2.balance_loss(x2)) - naive.naive_balance_loss(r2, x2)) < 1e-5


# ------------------------------------------------------------------ reads
def test_bucket_slot_mask():
    buckets = torch.tensor([[[[2, 0, 1]]]])  # one query, best first
    slot_bucket = torch.tensor([[[0, 1, 2, -1, 2]]])
    m = torch.tensor([2])
    got = bucket_slot_mask(buckets, m, slot_bucket, 3)
    assert got[0, 0, 0].tolist() == [True, False, True, False, True]
    # the one-hot path (many picks) and the comparison path (few picks) agree
    torch.manual_seed(0)
    b = torch.stack([torch.randperm(50)[:12] for _ in range(2 * 3 * 5)]).view(2, 3, 5, 12)
    sb = torch.randint(-1, 50, (2, 3, 7))
    m = torch.tensor([4, 12])
    few = bucket_slot_mask(b, m, sb, 50)  # 12 * 7 <= 57: comparison
    expect = torch.tensor(
        [
            [
                [[bool(((b[i, h, t, : m[i]]) == sb[i, h, s]).any()) for s in range(7)] for t in range(5)]
                for h in range(3)
            ]
            for i in range(2)
        ]
    )
    assert torch.equal(few, expect)
    small = b % 5
    sb5 = torch.where(sb < 0, sb, sb % 5)
    expect5 = torch.tensor(
        [
            [
                [[bool(((small[i, h, t, : m[i]]) == sb5[i, h, s]).any()) for s in range(7)] for t in range(5)]
                for h in range(3)
            ]
            for i in range(2)
        ]
    )
    assert torch.equal(bucket_slot_mask(small, m, sb5, 5), expect5)


def test_arm_read_equals_naive_read():
    from armkv.methods.attention import joint_attention

    torch.manual_seed(0)
    B, Hq, Hkv, T, d, L, S = 2, 4, 2, 5, 6, 3, 7
    q = torch.randn(B, Hq, T, d, dtype=torch.float64)
    ek, ev = torch.randn(B, Hkv, L, d, dtype=torch.float64), torch.randn(B, Hkv, L, d, dtype=torch.float64)
    evalid = torch.rand(B, L) > 0.3
    ck, cv = torch.randn(B, Hkv, T, d, dtype=torch.float64), torch.randn(B, Hkv, T, d, dtype=torch.float64)
    cvalid = torch.ones(B, T, dtype=torch.bool)
    cvalid[1, :2] = False
    sk, sv = torch.randn(B, Hkv, S, d, dtype=torch.float64), torch.randn(B, Hkv, S, d, dtype=torch.float64)
    sbias = torch.rand(B, Hkv, S, dtype=torch.float64)
    smask = torch.rand(B, Hq, T, S) > 0.5
    fast = joint_attention(
        q,
        ck,
        cv,
        cvalid,
        0.4,
        torch.cat([ek, sk], 2),
        torch.cat([ev, sv], 2),
        torch.cat([evalid.unsqueeze(1).expand(B, Hkv, L), torch.ones(B, Hkv, S, dtype=torch.bool)], -1),
        torch.cat([torch.zeros(B, Hkv, L, dtype=torch.float64), sbias], -1),
        torch.cat([torch.ones(B, Hq, T, L, dtype=torch.bool), smask], -1),
    )
    slow = naive.naive_read(q, ek, ev, evalid, ck, cv, cvalid, 0.4, sk, sv, sbias, smask)
    torch.testing.assert_close(fast, slow)


# ------------------------------------------------------------------ policy
def test_policy_m_within_bounds_and_penalty_moves_it():
    torch.manual_seed(0)
    s0 = torch.randn(16, 8)
    results = {}
    for lam in (0.0, 5.0):
        torch.manual_seed(0)
        pol = TopMPolicy(8, 16, m_max=8)
        with torch.no_grad():
            pol.out.bias.fill_(0.0)  # start in the middle
        opt = torch.optim.Adam(pol.parameters(), lr=0.05)
        for _ in range(60):
            m, g, expected = pol.decide(s0, training=True, epsilon=0.1)
            assert int(m.min()) >= 1 and int(m.max()) <= 8
            # the toy task: reading more buckets lowers the task loss a little
            task = (1.0 - expected / 8).mean()
            loss = task + lam * (expected / 8).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        m, _, _ = pol.decide(s0)
        results[lam] = float(m.float().mean())
    assert results[0.0] > results[5.0]
    assert results[0.0] >= 6 and results[5.0] <= 2


# ------------------------------------------------------------------ inputs
def test_bad_inputs_name_the_argument():
    mem = ARMMemory(ARMConfig(depth=1, branching=2, slots=4), 2, 8)
    st = mem.init_state(1, torch.float32, "cpu")
    ok = torch.randn(1, 2, 3, 8)
    with pytest.raises(ArmkvError, match="keys"):
        mem.write(st, torch.randn(1, 2, 3, 7), ok, torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ArmkvError, match="values"):
        mem.write(
            st, ok, torch.zeros(1, 2, 3, 8, dtype=torch.long), torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool)
        )
    with pytest.raises(ArmkvError, match="valid"):
        mem.write(st, ok, ok, torch.zeros(1, 3), torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ArmkvError, match="queries"):
        mem.route_queries(torch.randn(1, 2, 3), 1)
    with pytest.raises(ArmkvError, match="depth"):
        ARMConfig(depth=0)
    with pytest.raises(ArmkvError, match="m_max"):
        ARMConfig(depth=2, branching=2, m_max=5)
    for share in (0.0, 1.5):
        with pytest.raises(ArmkvError, match="partial_share"):
            ARMConfig(read_rank="partial", partial_share=share, slot_mixing=False)
    with pytest.raises(ArmkvError, match="slot_mixing=false"):
        ARMConfig(read_rank="partial")
    with pytest.raises(ArmkvError, match="budget"):
        ARMConfig.for_budget(1, 64)


def test_adapter_roundtrip_and_refusals(tmp_path):
    arm = ARMModel(ARMConfig(depth=2, branching=2, slots=8), 3, 2, 8)
    arm.save(tmp_path / "a")
    back = ARMModel.load(tmp_path / "a")
    for (k, v), (k2, v2) in zip(arm.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    with pytest.raises(ArmkvError, match="3 layers"):
        back.check_fits(30, 3, 64)
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ArmkvError, match="corrupt"):
        ARMModel.load(tmp_path / "a")
    with pytest.raises(ArmkvError, match="not an armkv adapter"):
        ARMModel.load(tmp_path / "missing")


def test_nan_poisoned_free_slots_never_leak():
    cfg = ARMConfig(depth=2, branching=2, slots=16)
    mem = ARMMemory(cfg, 2, 8).eval()
    st = mem.init_state(1, torch.float32, "cpu")
    st.key.fill_(math.nan)
    st.value.fill_(math.nan)
    st = mem.write(
        st, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool)
    )
    occ = st.count > 0
    assert torch.isfinite(st.key[occ]).all() and torch.isfinite(st.value[occ]).all()


# ------------------------------------------------------------------ what merges first
def test_room_similarity_matches_a_pairwise_loop():
    from armkv.memory.write import room_similarity

    g = torch.Generator().manual_seed(3)
    G, S, N, d = 2, 5, 3, 4
    state = MemoryState.empty(G, S, d)
    state.key, state.value = (
        torch.randn(G, S, d, generator=g, dtype=torch.float64),
        torch.randn(G, S, d, generator=g, dtype=torch.float64),
    )
    state.count = torch.tensor([[1.0, 3, 0, 2, 1], [2, 1, 1, 0, 5]], dtype=torch.float64)
    keys = torch.randn(G, N, d, generator=g, dtype=torch.float64)
    cos = torch.nn.functional.cosine_similarity(keys.unsqueeze(2), state.key.unsqueeze(1), dim=-1)
    ss, ts = room_similarity(state, cos)
    assert ts is cos and room_similarity(state, cos, slot_pairs=False)[0] is None
    c = lambda a, b: float(torch.nn.functional.cosine_similarity(a, b, dim=0))  # noqa: E731
    for gi in range(G):
        occ = state.count[gi] > 0
        for a in range(S):
            for b in range(S):
                if occ[a] and occ[b]:
                    assert math.isclose(
                        float(ss[gi, a, b]), c(state.key[gi, a], state.key[gi, b]), rel_tol=1e-6, abs_tol=1e-9
                    )


def test_banded_neighbours_equal_the_exact_ones_within_buckets():
    from armkv.memory.write import _masked_neighbours, banded_neighbours, room_similarity

    g = torch.Generator().manual_seed(7)
    G, S, d = 3, 37, 5
    state = MemoryState.empty(G, S, d, dtype=torch.float64)
    state.key, state.value = (
        torch.randn(G, S, d, generator=g, dtype=torch.float64),
        torch.randn(G, S, d, generator=g, dtype=torch.float64),
    )
    state.count = (torch.rand(G, S, generator=g) * 4).floor().double()  # about a quarter free
    state.bucket = torch.where(state.count > 0, torch.randint(0, 6, (G, S), generator=g), -1)
    keys = torch.randn(G, 2, d, generator=g, dtype=torch.float64)
    cos = torch.nn.functional.normalize(keys, dim=-1) @ torch.nn.functional.normalize(state.key, dim=-1).transpose(1, 2)
    ss, _ = room_similarity(state, cos)
    same = state.bucket.unsqueeze(2) == state.bucket.unsqueeze(1)
    want_sim, want_idx = _masked_neighbours(ss.masked_fill(~same, -math.inf), state)
    # every bucket holds at most 12 slots here: a band of 12 sees the whole bucket
    got_sim, got_idx = banded_neighbours(state, width=12)
    occ = state.count > 0
    has = occ & torch.isfinite(want_sim)
    torch.testing.assert_close(got_sim[has], want_sim[has])
    assert torch.equal(got_idx[has], want_idx[has])
    assert torch.isinf(got_sim[~has]).all()
    # a narrower band only ever finds a pair no better than the exact nearest
    narrow_sim, _ = banded_neighbours(state, width=2)
    assert (narrow_sim[has] <= want_sim[has] + 1e-12).all()


def test_protect_recent_keeps_the_newest_slots_out_of_the_merges():
    cfg = ARMConfig(depth=1, branching=2, slots=8, window=4, sinks=0, sync=1, slot_format="model", protect_recent=0.5)
    mem = ARMMemory(cfg, num_kv_heads=1, head_dim=16).eval()
    state = mem.init_state(1, torch.float32, "cpu", cfg)
    g = torch.Generator().manual_seed(1)
    for step in range(6):  # random 16-d keys are novel: every write past 8 tokens makes room
        keys, values = torch.randn(1, 1, 3, 16, generator=g), torch.randn(1, 1, 3, 16, generator=g)
        positions = torch.arange(step * 3, step * 3 + 3)[None]
        before = state.clone()
        state = mem.write(
            state, keys, values, positions, torch.ones(1, 3, dtype=torch.bool), rule=WriteRule.from_config(cfg)
        )
        if before.count.gt(0).all():
            # the newest half of the slots before the write (4 of 8) are untouched by it
            newest = before.pos[0].argsort()[4:]
            for s in newest:
                same = (state.key[0] == before.key[0, s]).all(-1) & (state.count[0] == before.count[0, s])
                assert same.any(), f"the slot at position {float(before.pos[0, s])} was merged"
        assert float(state.count.sum()) == 3 * (step + 1)


@pytest.mark.parametrize("bits,groups", [(8, 1), (4, 1), (4, 2)])
def test_symmetric_quantiser_is_within_half_a_step_and_stable(bits, groups):
    from armkv.memory.quant import dequantise_symmetric, pack_int4, quantise_symmetric, unpack_int4

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 64, generator=g) * torch.rand(3, 7, 1, generator=g) * 10
    x[0, 0] = 0.0  # a free slot: all zeros stays all zeros
    codes, scale = quantise_symmetric(x, bits, groups)
    q = 2 ** (bits - 1) - 1
    assert scale.shape == (3, 7, groups) and int(codes.abs().max()) <= q
    back = dequantise_symmetric(codes, scale)
    step = scale.repeat_interleave(64 // groups, -1)
    assert bool(((back - x).abs() <= step / 2 + 1e-6).all())
    assert bool((back[0, 0] == 0).all())
    again, scale2 = quantise_symmetric(back, bits, groups)
    assert torch.equal(again, codes) and torch.allclose(scale2, scale)
    if bits == 4:
        packed = pack_int4(codes)
        assert packed.dtype == torch.uint8 and packed.shape[-1] == 32
        assert torch.equal(unpack_int4(packed), codes)
        every = torch.arange(-8, 8, dtype=torch.int8).repeat(4).view(1, 64)  # each code in both nibbles
        assert torch.equal(unpack_int4(pack_int4(every)), every)


def test_k8v4_slots_pack_to_fewer_bytes_than_int8():
    from armkv.config import slot_bytes

    st = MemoryState.empty(2, 5, 64)
    st.key.normal_(), st.value.normal_()
    st.count.fill_(1)
    int8, k8v4 = st.pack("int8"), st.pack("k8v4")
    assert k8v4.nbytes() < int8.nbytes() < st.nbytes()
    meta = 2 * 5 * 12  # count, position, bucket
    assert k8v4.nbytes() - meta == 2 * 5 * (slot_bytes("k8v4", 64, 4) - 12)
    assert int8.nbytes() - meta == 2 * 5 * (slot_bytes("int8", 64, 4) - 12)
    torch.testing.assert_close(k8v4.unpack(torch.float32).key, int8.unpack(torch.float32).key)
    err = (k8v4.unpack(torch.float32).value - st.value).abs().max()
    assert 0 < err <= st.value.abs().max() / 14 + 1e-6


@pytest.mark.parametrize("d", [64, 48])  # a Hadamard order, and one that is not (seeded orthogonal)
def test_mixed_slots_cost_no_bytes_and_hold_outlier_channels_better(d):
    from armkv.memory.quant import mixing_matrix

    q = mixing_matrix(d, torch.float64)
    torch.testing.assert_close(q @ q.T, torch.eye(d, dtype=torch.float64))
    g = torch.Generator().manual_seed(3)
    st = MemoryState.empty(2, 9, d)
    st.key.copy_(torch.randn(2, 9, d, generator=g)), st.value.copy_(torch.randn(2, 9, d, generator=g))
    st.key[..., 3] *= 30  # an outlier channel, as real keys have
    st.value[..., 5] *= 30
    st.count.fill_(1)
    st.key[1, 4], st.value[1, 4], st.count[1, 4] = 0.0, 0.0, 0  # a free slot stays zero
    for fmt in ("int8", "k8v4", "k4v4"):
        plain, mixed = st.pack(fmt), st.pack(fmt, mix=True)
        assert mixed.nbytes() == plain.nbytes() and mixed.mixed and not plain.mixed
        back, back_plain = mixed.unpack(torch.float32), plain.unpack(torch.float32)
        assert not back.mixed and bool((back.key[1, 4] == 0).all())
        for name in ("key", "value"):
            err = (getattr(back, name) - getattr(st, name)).norm()
            assert err < 0.8 * (getattr(back_plain, name) - getattr(st, name)).norm(), (fmt, name)
        # stable: unpacked and packed again, the same codes
        again = back.pack(fmt, mix=True)
        assert torch.equal(again.key, mixed.key) and torch.equal(again.value, mixed.value)
        # a reader that mixes its query instead gets the same dot products
        k_mixed, _ = mixed.kv(torch.float32, unmix=False)
        qv = torch.randn(d, generator=g)
        torch.testing.assert_close(k_mixed @ (mixing_matrix(d).T @ qv), back.key @ qv, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scorer", ["similarity", "paper"])
def test_pair_scores_equal_their_term_by_term_reference(scorer):
    from armkv.memory.write import WriteParams

    torch.manual_seed(4)
    params = WriteParams(24, scorer=scorer).double()
    with torch.no_grad():
        for p in params.parameters():
            p.normal_()
    slots, tokens = torch.randn(3, 11, 24, dtype=torch.float64), torch.randn(3, 7, 24, dtype=torch.float64)
    slots[1, 2] = 0.0  # a free slot (zero key)
    slots.requires_grad_(True)
    z, cos = params.pair_scores(slots, tokens)
    z_ref, cos_ref = params.pair_scores_reference(slots, tokens)
    torch.testing.assert_close(z, z_ref)
    torch.testing.assert_close(cos, cos_ref)
    g = torch.autograd.grad(z.sum(), [slots, *params.score.parameters()])
    g_ref = torch.autograd.grad(z_ref.sum(), [slots, *params.score.parameters()])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


def test_pair_scores_of_a_cosine_only_scorer_take_the_short_path_and_agree():
    """As initialised (and in the shipped adapters) only the cosine's weight is non-zero:
    without gradients pair_scores returns the affine map of cos; it must equal the
    reference, and a weight set afterwards must take the general path again."""
    from armkv.memory.write import WriteParams

    params = WriteParams(24, scorer="similarity").double()
    slots, tokens = torch.randn(3, 11, 24, dtype=torch.float64), torch.randn(3, 7, 24, dtype=torch.float64)
    with torch.no_grad():
        assert params._cosine_only()
        torch.testing.assert_close(params.pair_scores(slots, tokens)[0], params.pair_scores_reference(slots, tokens)[0])
        params.score.weight[0, 5] = 0.7  # an update: the cached check must see it
        assert not params._cosine_only()
        torch.testing.assert_close(params.pair_scores(slots, tokens)[0], params.pair_scores_reference(slots, tokens)[0])
    assert not params._cosine_only()  # gradients wanted: the general path


@pytest.mark.parametrize("S,width", [(37, 5), (130, 32), (3, 2)])
def test_band_similarity_equals_the_pairwise_loop(S, width):
    """The blocked band of slot-slot key cosines against every pair written out."""
    from armkv.memory.write import band_similarity

    g = torch.Generator().manual_seed(S)
    G, d = 2, 6
    key = torch.randn(G, S, d, generator=g, dtype=torch.float64)
    got = band_similarity(key, width)
    assert got.shape == (G, S, width)
    cos = torch.nn.functional.cosine_similarity
    for gi in range(G):
        for i in range(S):
            for o in range(1, width + 1):
                j = i + o
                if j < S:
                    torch.testing.assert_close(got[gi, i, o - 1], cos(key[gi, i], key[gi, j], dim=0))


@pytest.mark.parametrize("fmt", ["model", "bfloat16", "int8", "k8v4", "k4v4"])
@pytest.mark.parametrize("d", [64, 128, 48])  # 2 and 4 value groups, and one (48 does not split by 32)
def test_reads_with_the_scales_folded_equal_dequantised_reads(fmt, d):
    g = torch.Generator().manual_seed(d)
    st = MemoryState.empty(3, 13, d)
    st.key.copy_(torch.randn(3, 13, d, generator=g)), st.value.copy_(torch.randn(3, 13, d, generator=g))
    st.count.fill_(1)
    packed = st.pack(fmt, mix=True)
    query, weights = torch.randn(3, 5, d, generator=g), torch.rand(3, 5, 13, generator=g)
    key, value = packed.kv(torch.float32, unmix=False)
    torch.testing.assert_close(packed.key_scores(query), query @ key.transpose(1, 2), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed.weighted_values(weights), weights @ value, rtol=1e-4, atol=1e-4)


def test_lazy_merging_keeps_near_duplicates_apart_while_the_pool_has_room():
    """lazy: while a chunk's tokens fit in the free slots each takes its own, however close;
    eager (lazy=False): a token above the threshold merges into its slot at once. Once the
    pool is short of room, lazy writes merge as eager ones do."""
    G, N, S, d = 2, 6, 16, 5
    params = WriteParams(d, "similarity", "scalar", 0.98).double()
    state = _filled_state(G, S, d, 4, nb=1)
    keys = state.key[:, :1].repeat(1, N, 1) * 1.001  # every token nearly repeats slot 0
    bucket = torch.zeros(G, N, dtype=torch.long)
    valid = torch.ones(G, N, dtype=torch.bool)
    lazy, _ = plan_writes(state, keys, bucket, valid, params, WriteRule(lazy=True))
    eager, _ = plan_writes(state, keys, bucket, valid, params, WriteRule(lazy=False))
    assert (eager.target == 0).all()  # all merged into the slot they repeat
    for g in range(G):  # each in a slot of its own, none of the occupied ones
        assert sorted(lazy.target[g].tolist()) == list(range(4, 4 + N))
    full = _filled_state(G, S, d, S - 2, nb=1)  # room for 2 of the 6: lazy merges like eager
    keys = full.key[:, :1].repeat(1, N, 1) * 1.001
    lazy, _ = plan_writes(full, keys, bucket, valid, params, WriteRule(lazy=True))
    eager, _ = plan_writes(full, keys, bucket, valid, params, WriteRule(lazy=False))
    assert torch.equal(lazy.target, eager.target)


def test_lazy_plan_with_room_everywhere_equals_the_scored_plan():
    """When every group's chunk fits in its free slots plan_writes skips the token-slot
    scores; each group's plan must be the one the scored path gives it (forced here by a
    second group that is short of room), padding included."""
    G, N, S, d = 1, 7, 24, 5
    params = WriteParams(d, "similarity", "scalar", 0.98).double()
    roomy = _filled_state(G, S, d, 9, nb=4)
    short = _filled_state(G, S, d, S - 3, nb=4)
    keys = torch.randn(2, N, d, dtype=torch.float64)
    keys[:, 3] = keys[:, 1] * 1.001  # a near-repeat inside the chunk
    bucket = torch.randint(0, 4, (2, N))
    valid = torch.ones(2, N, dtype=torch.bool)
    valid[0, 5] = False
    fast, state_fast = plan_writes(roomy, keys[:1], bucket[:1], valid[:1], params, WriteRule(lazy=True))
    both = MemoryState(
        *(
            torch.cat([a, b])
            for a, b in zip(
                (roomy.key, roomy.value, roomy.pos, roomy.count, roomy.bucket),
                (short.key, short.value, short.pos, short.count, short.bucket),
            )
        )
    )
    scored, _ = plan_writes(both, keys, bucket, valid, params, WriteRule(lazy=True))
    for name in ("target", "alpha", "cand", "count", "bucket"):
        torch.testing.assert_close(getattr(fast, name), getattr(scored, name)[:1], rtol=0, atol=0)
    assert torch.equal(state_fast.count, roomy.count)  # nothing merged
    assert (fast.target[0, valid[0]] >= 9).all() and len(set(fast.target[0, valid[0]].tolist())) == N - 1


@pytest.mark.parametrize("G,S,occupied,N", [(3, 37, 30, 11), (2, 700, 690, 33), (1, 9, 0, 5), (2, 20, 20, 20)])
@pytest.mark.parametrize("protect_recent", [0.0, 0.25])
def test_an_inplace_write_equals_the_copying_one(G, S, occupied, N, protect_recent):
    """write_chunk(inplace=True) (what ARMLayer._flush does at inference: no copy of the pool
    per write) gives the state the copying write gives, merges that make room included (pools
    short of room, exact and banded neighbour searches, padding); it refuses to run where a
    gradient is wanted."""
    from armkv.memory.write import write_chunk

    d = 6
    params = WriteParams(d, "similarity", "scalar", 0.98).double().requires_grad_(False)
    base = _filled_state(G, S, d, occupied, seed=S, nb=3)
    keys, values, _ = _chunk(G, N, d, seed=N, state=base if occupied else None)
    bucket = torch.randint(0, 3, (G, N), generator=torch.Generator().manual_seed(N))
    valid = torch.ones(G, N, dtype=torch.bool)
    valid[0, -1] = False
    pos = torch.arange(S, S + N, dtype=torch.float32).expand(G, N)
    rule = WriteRule(lazy=True, protect_recent=protect_recent, demote_scope="bucket")
    with torch.no_grad():
        want = write_chunk(base, keys, values, pos, valid, bucket, params, rule)
        mine = MemoryState(
            base.key.clone(), base.value.clone(), base.pos.clone(), base.count.clone(), base.bucket.clone()
        )
        got = write_chunk(mine, keys, values, pos, valid, bucket, params, rule, inplace=True)
    for name in ("key", "value", "pos", "count", "bucket"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)
    assert got.key.data_ptr() == mine.key.data_ptr() and got.value.data_ptr() == mine.value.data_ptr()
    with pytest.raises(ValueError, match="inference"):
        write_chunk(base, keys.requires_grad_(True), values, pos, valid, bucket, params, rule, inplace=True)


@pytest.mark.parametrize("G,S,pairs", [(3, 37, 5), (1, 9, 0), (2, 64, 30)])
def test_row_wise_merges_equal_the_whole_pool_reference(G, S, pairs):
    """``_merge_pairs`` computes only the merged rows: equal to the reference over every
    slot in keys, values, positions, counts, buckets and gradients (disjoint pairs, some
    slots free, odd sizes)."""
    from armkv.memory.write import _merge_pairs, merge_pairs_reference

    g = torch.Generator().manual_seed(3)
    d = 7
    base = _filled_state(G, S, d, S - 3, seed=5)
    src_of = torch.full((G, S), -1, dtype=torch.long)
    for row in range(G):  # disjoint pairs among the occupied slots: dst < src
        perm = torch.randperm(S - 3, generator=g)[: 2 * pairs].view(-1, 2).sort(-1).values
        src_of[row, perm[:, 0]] = perm[:, 1]
    key = base.key.clone().requires_grad_(True)
    value = base.value.clone().requires_grad_(True)
    outs = []
    for fn in (_merge_pairs, merge_pairs_reference):
        st = MemoryState(key=key, value=value, pos=base.pos, count=base.count, bucket=base.bucket)
        out = fn(st, src_of)
        grads = torch.autograd.grad((out.key * 1.3).sum() + (out.value**2).sum(), (key, value))
        outs.append((out, grads))
    (got, got_g), (want, want_g) = outs
    for name in ("key", "value", "pos", "count", "bucket"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert int((got.count > 0).sum()) == G * (S - 3) - G * pairs


def test_the_mixing_matrix_cached_under_inference_mode_serves_autograd():
    """The cached mixing matrix is shared by reads under torch.inference_mode (generation)
    and by training writes: one first built in inference mode must not be an inference
    tensor, or the training step that packs slots later fails."""
    from armkv.memory.quant import mixing_matrix

    mixing_matrix.cache_clear()
    with torch.inference_mode():
        mixing_matrix(16)
    x = torch.randn(3, 16, requires_grad=True)
    (x @ mixing_matrix(16)).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
