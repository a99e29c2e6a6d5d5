"""The sparse read (each query gathers the slots of its top-M buckets) against the masked
read of the whole pool, its reference: bucket lists, the two bucket rankings (each bucket's
best logit, the tree's routing per KV head), and the layer's outputs at decode (T = 1) and
in short chunks, fp32 and bf16, every slot format."""

import copy
import warnings

import pytest
import torch

import armkv.memory.reader as reader_module
from armkv.config import ARMConfig
from armkv.errors import ArmkvError
from armkv.hf.attach import make_cache
from armkv.memory import kernels
from armkv.memory.module import ARMModel
from armkv.memory.read import (
    bucket_best,
    bucket_index,
    gather_slots,
    paged_index,
    run_breaks,
    slot_units,
    slots_of_buckets,
    sort_by_bucket,
)
from armkv.memory.route import Router
from armkv.memory.state import MemoryState
from armkv.methods.arm import resolve_arm
from armkv.methods.base import ModelInfo
from conftest import DEVICES, Vectorised, tiny_model


@pytest.mark.parametrize("G,S,nb,M,Q", [(3, 37, 5, 2, 4), (2, 101, 16, 3, 7), (1, 1, 4, 1, 1), (2, 64, 64, 9, 3)])
def test_slots_of_buckets_lists_exactly_the_occupied_slots_of_the_picked_buckets(G, S, nb, M, Q):
    g = torch.Generator().manual_seed(S)
    slot_bucket = torch.randint(0, nb, (G, S), generator=g)
    occupied = torch.rand(G, S, generator=g) < 0.7
    slot_bucket = torch.where(
        occupied | (torch.rand(G, S, generator=g) < 0.5), slot_bucket, -1
    )  # some free slots keep a bucket
    buckets = torch.stack([torch.stack([torch.randperm(nb, generator=g)[:M] for _ in range(Q)]) for _ in range(G)])
    take = torch.rand(G, Q, M, generator=g) < 0.8
    index = bucket_index(slot_bucket, occupied, nb)
    width = index.width(M)
    assert width % 64 == 0 or width == S
    ids, used = slots_of_buckets(index, buckets, width, take)
    for gi in range(G):
        for qi in range(Q):
            picked = [b for b, t in zip(buckets[gi, qi].tolist(), take[gi, qi].tolist()) if t]
            want = sorted(s for s in range(S) if occupied[gi, s] and int(slot_bucket[gi, s]) in picked)
            got = ids[gi, qi][used[gi, qi]].tolist()
            assert sorted(got) == want and len(set(got)) == len(got)
    # the width holds any M buckets of any group
    sizes = torch.stack([torch.bincount(slot_bucket[gi][occupied[gi]], minlength=nb) for gi in range(G)])
    assert width >= int(sizes.sort(1, descending=True).values[:, :M].sum(1).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("G,T,S,nb", [(3, 5, 37, 7), (1, 1, 1, 4), (2, 3, 64, 64)])
def test_bucket_best_is_each_buckets_largest_score(G, T, S, nb, dtype):
    g = torch.Generator().manual_seed(S)
    scores = torch.randn(G, T, S, generator=g).to(dtype)
    slot_bucket = torch.randint(-1, nb, (G, S), generator=g)  # -1: free
    scores = scores.masked_fill((slot_bucket < 0).unsqueeze(1) | (torch.rand(G, T, S, generator=g) < 0.2), -torch.inf)
    got = bucket_best(scores, slot_bucket, nb)
    assert got.shape == (G, T, nb) and got.dtype == dtype
    for gi in range(G):
        for t in range(T):
            for b in range(nb):
                mine = [float(scores[gi, t, s]) for s in range(S) if int(slot_bucket[gi, s]) == b]
                assert float(got[gi, t, b]) == max(mine, default=-float("inf"))


@pytest.mark.parametrize("read_rank,finds", [("best", True), ("partial", True), ("tree", False)])
def test_a_needle_is_read_from_one_bucket_when_the_ranking_is_the_best_logit(read_rank, finds):
    """A slot's key direction as the query of its KV head (a needle the query retrieves): at
    M = 1, the "best" ranking reads the bucket of the slot with the largest logit (computed
    here from the dequantised keys, + log n); so does "partial" for a query whose energy lies
    in as many key-code rows as it reads (the needle's largest, in the slots' basis), whose
    partial logits are then its logits; the tree's routing of a random tree, which never sees
    the slots, misses some."""
    _, layer = _layer_with_memory(torch.float32, {"slot_format": "k4v4", **_rank(read_rank)})
    st = layer.reader.readable()
    B, H = layer.buffer.sink_k.shape[:2]
    Hq, d = layer.info.num_heads, layer.info.head_dim
    keys, _ = st.kv(torch.float32, unmix=True)
    bias = torch.where(st.count > 0, st.count.clamp_min(1).log(), -torch.inf)
    layer.reader.m, layer.reader.route_k = torch.tensor([1, 1]), 1
    needles = misses = 0
    for needle in range(st.slots):
        if not st.count[0, needle] > 0:
            continue
        direction = keys[0, needle]
        if read_rank == "partial":  # the needle's key on its layer.reader.partial_rows largest rows only
            stored = st.kv(torch.float32, unmix=False)[0][0, needle]
            energy = stored[: d // 2].square() + stored[d // 2 :].square()
            rows = energy.topk(layer.reader.partial_rows).indices
            kept = torch.zeros(d, dtype=torch.bool)
            kept[rows], kept[rows + d // 2] = True, True
            direction = torch.where(kept, stored, 0.0)
            direction = direction @ layer.reader.mixing.T if st.mixed else direction
        query = torch.zeros(B, Hq, 1, d)
        query[0, : Hq // H] = 40 * direction / direction.norm()  # KV head 0 of row 0
        logits = keys[0] @ query[0, 0, 0] * d**-0.5 + bias[0]
        best = int(logits.argmax())
        picked = layer.reader.group_buckets(1, query, layer.reader.bucket_scores(query, d**-0.5))[0, 0, 0, 0]
        needles += 1
        misses += int(picked != st.bucket[0, best])
    assert needles > 20 and (misses == 0) == finds


def test_gather_slots_takes_every_field_of_the_listed_slots():
    g = torch.Generator().manual_seed(0)
    G, S, d = 2, 29, 64
    st = MemoryState.empty(G, S, d)
    st.key.copy_(torch.randn(G, S, d, generator=g))
    st.value.copy_(torch.randn(G, S, d, generator=g))
    st.count.copy_(torch.randint(0, 3, (G, S), generator=g).float())
    st.pos.copy_(torch.rand(G, S, generator=g) * 100)
    st.bucket.copy_(torch.randint(0, 7, (G, S), generator=g))
    ids = torch.randint(0, S, (G, 3, 11), generator=g)
    for fmt in ("model", "bfloat16", "int8", "k8v4", "k4v4"):
        packed = st.pack(fmt, mix=fmt in ("k8v4", "k4v4"))
        got = gather_slots(packed, ids).unpack(torch.float32)
        full = packed.unpack(torch.float32)
        for name in ("key", "value", "pos", "count", "bucket"):
            want = torch.stack([getattr(full, name)[gi][ids[gi, q]] for gi in range(G) for q in range(3)])
            torch.testing.assert_close(getattr(got, name), want, rtol=0, atol=0, msg=f"{fmt} {name}")


@pytest.mark.parametrize("depth,m", [(3, 16), (2, 3), (3, 5)])
def test_group_routing_is_the_mean_path_probability_of_the_group(depth, m):
    torch.manual_seed(0)
    router = Router(2, 16, depth, 4)
    x = torch.randn(2, 2, 3, 7, 16)  # [B, H, R, N, d]
    buckets, scores = router.group_topm_buckets(x, m)
    leaf = router.leaf_scores(x.reshape(2, 2, 21, 16)).view(2, 2, 3, 7, -1)
    group = torch.logsumexp(leaf, 2) - torch.log(torch.tensor(3.0))
    want_scores, want = group.topk(m, -1)
    if (
        m >= router.num_buckets // 4 or router.num_nodes * 4 <= depth * m * 4
    ):  # exhaustive, or a beam wide enough to be exact
        assert torch.equal(buckets, want)
    else:  # the beam: picks the best surviving leaves, never better than the exhaustive top-m
        assert (scores <= want_scores + 1e-5).all()
    torch.testing.assert_close(scores, group.gather(-1, buckets))
    # the one-product scoring of a small tree, against the level-by-level reference
    for read in (True, False):
        torch.testing.assert_close(router._all_leaf_scores(x[:, :, 0], read), router.leaf_scores(x[:, :, 0], read))
    # one query per group: the per-query routing
    one, _ = router.group_topm_buckets(x[:, :, :1], m)
    assert torch.equal(one, router.topm_buckets(x[:, :, 0], m)[0])


def _rank(read_rank: str) -> dict:
    """The overrides that select a ranking ("partial" needs unmixed slots; "-pages" reads pages)."""
    rank, _, pages = read_rank.partition("-")
    return {
        "read_rank": rank,
        **({"slot_mixing": False} if rank == "partial" else {}),
        **({"read_pages": True} if pages else {}),
    }


def _layer_with_memory(dtype, overrides, seed=1, device="cpu", with_cache=False):
    """Layer 1 of a tiny model's arm cache after a prompt and a few decode steps: merged
    slots, tokens waiting, a left-padded row. Returns (model, layer), or with ``with_cache``
    (model, layer, the cache)."""
    model = tiny_model("llama").to(device, dtype).eval()
    torch.manual_seed(seed)
    ids = torch.randint(0, 100, (2, 301)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :120] = 0
    overrides = {"sync": 5, "lazy_merge": False, "top_m": "fixed", "m_fixed": 3, **overrides}
    info = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_positions=512)
    if overrides.get(
        "read_summaries"
    ):  # (2 d + 1 floats a unit: a tree of 16 buckets, not the budget's ~7 slots a bucket)
        torch.manual_seed(0)
        arm = ARMModel(
            ARMConfig.for_budget(96, info.head_dim, depth=2, top_m="fixed", m_fixed=3), 2, 2, info.head_dim
        ).eval()
        torch.manual_seed(seed)
    else:
        arm, _ = resolve_arm(info, 96, "random", overrides=overrides)
    # the ARM parameters in the model's dtype for bf16 (a memory computing in bf16); fp16 keeps
    # them in float32, as the library does (computing in fp16, the merges overflow to NaN)
    arm = copy.deepcopy(arm).to(device, dtype if dtype != torch.float16 else torch.float32)
    cache = make_cache(model, "arm", budget=96, chunk=32, arm=arm, arm_overrides=overrides)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for _ in range(3):
            model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    layer = cache.layers[1]
    assert layer.pending is not None and layer.state.count.max() > 1
    assert layer.memory.router.num_buckets >= 8 and 0 < layer.reader.route_k < layer.memory.router.num_buckets
    return (model, layer, cache) if with_cache else (model, layer)


def _chunk(model, layer, dtype, T: int, padded: int):
    """A random chunk of T tokens for the layer's two rows (queries, keys, values, valid,
    positions), the second row's first ``padded`` tokens padding."""
    B, H = layer.buffer.sink_k.shape[:2]
    Hq, d = model.config.num_attention_heads, layer.buffer.sink_k.shape[-1]
    g = torch.Generator().manual_seed(T)
    device = layer.buffer.sink_k.device
    query = torch.randn(B, Hq, T, d, generator=g).to(device, dtype)
    key, value = (torch.randn(B, H, T, d, generator=g).to(device, dtype) for _ in range(2))
    valid = torch.ones(B, T, dtype=torch.bool, device=device)
    valid[1, :padded] = False
    return query, key, value, valid, torch.arange(400, 400 + T, device=device).expand(B, T)


FORMATS = [
    {"slot_format": "k4v4"},
    {"slot_format": "k8v4", "slot_mixing": False},
    {"slot_format": "int8"},
    {"slot_format": "bfloat16"},
    {"slot_format": "model"},
    {"slot_ladder": "int8,k8v4"},
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("overrides", FORMATS)
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("read_rank", ["best", "partial", "tree"])
@pytest.mark.parametrize("device", DEVICES)
def test_sparse_read_equals_the_masked_read_of_the_whole_pool(dtype, tol, overrides, T, read_rank, device, monkeypatch):
    """Tolerances: fp32 2e-5 (the two reads sum the same terms in another order, slots
    dequantised alike); bf16 2e-2 and fp16 2e-3 (products and softmax in the model's dtype,
    rounded at other points). Every ranking picks the same buckets in both reads ("partial"
    one decoded token's from a quarter of the key-code rows, a chunk's as "best")."""
    model, layer = _layer_with_memory(dtype, {**overrides, **_rank(read_rank)}, device=device)
    query, key, value, valid, positions = _chunk(model, layer, dtype, T, padded=1)
    exact = layer.exact()
    for m in (
        torch.tensor([3, 3], device=device),
        torch.tensor([1, 2], device=device),
    ):  # rows may read fewer buckets than the widest
        layer.reader.m, layer.reader.route_k = m, int(m.max())  # as ARMLayer._decide_m sets them
        assert (layer.reader.path(T, every=False) == "sparse") == (
            T == 1 or read_rank == "tree"
        )  # (best, partial chunks: the ranked read)
        with torch.no_grad():
            ref = layer.reader.masked(query, key, value, valid, positions, 0.3, *exact, reads_all=False)
            fast = layer.reader.sparse(query, key, value, valid, positions, 0.3, *exact)
            eager = layer.reader.sparse(query, key, value, valid, positions, 0.3, *exact, fused=False)
            every = layer.reader.masked(query, key, value, valid, positions, 0.3, *exact, reads_all=True)
        torch.testing.assert_close(fast, ref, rtol=tol, atol=tol)
        torch.testing.assert_close(eager, ref, rtol=tol, atol=tol)
        with monkeypatch.context() as patch:  # compiled: the fixed width of any M buckets, no host sync
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
            with torch.no_grad():
                fixed = layer.reader.sparse(query, key, value, valid, positions, 0.3, *exact)
        torch.testing.assert_close(fixed, ref, rtol=tol, atol=tol)
        # the masks mattered (not every slot was read): reading all differs far more than the two reads
        assert (every.float() - ref.float()).abs().max() > 4 * (fast.float() - ref.float()).abs().max()
    # the gather reads a fraction of the pool
    index = layer.reader.bucket_index()
    assert index.width(3) <= layer.reader.readable().slots


@pytest.mark.parametrize("read_rank", ["best", "partial", "tree"])
def test_read_tally_counts_the_slots_a_decode_read_touches(read_rank):
    """The fused read counts its buckets' sizes, the eager one the slots it gathers: the same
    count, part of the occupied slots; the dense read counts them all."""
    model, layer = _layer_with_memory(torch.float32, _rank(read_rank))
    query, key, value, valid, positions = _chunk(model, layer, torch.float32, 1, padded=0)
    exact = layer.exact()
    layer.reader.m, layer.reader.route_k = torch.tensor([3, 2]), 3
    tallies = []
    for fused in (True, False):
        layer.read_tally = [0, 0]
        with torch.no_grad():
            layer.reader.sparse(query, key, value, valid, positions, 0.3, *exact, fused=fused)
        tallies.append(layer.read_tally)
    occupied = int((layer.reader.readable().count > 0).sum())
    assert tallies[0] == tallies[1]
    assert tallies[0][1] == occupied and 0 < tallies[0][0] < occupied
    layer.read_tally = [0, 0]
    with torch.no_grad():
        layer.reader.dense(query, key, value, valid, 0.3, *exact)
    assert layer.read_tally == [occupied, occupied]


@pytest.mark.parametrize("read_rank", ["best", "partial", "partial-pages"])
def test_generation_with_sparse_reads_equals_the_masked_reads(monkeypatch, read_rank):
    """Whole model, prefill in chunks then decoding (writes between the reads): the logits
    with the gathered reads equal those with every read masked over the whole pool."""
    model = tiny_model("llama").eval()
    ids = torch.randint(0, 100, (2, 260), generator=torch.Generator().manual_seed(3))

    def run():
        cache = make_cache(
            model,
            "arm",
            budget=96,
            chunk=16,
            adapter="random",
            arm_overrides={"sync": 3, "top_m": "fixed", "m_fixed": 2, **_rank(read_rank)},
        )
        outs = []
        with torch.no_grad():
            logits = model(ids[:, :200], past_key_values=cache, use_cache=True).logits
            outs.append(logits)
            for t in range(200, 260):
                outs.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
        return torch.cat(outs, 1), cache

    calls = []
    gathered = reader_module.Reader.sparse
    monkeypatch.setattr(
        reader_module.Reader,
        "sparse",
        lambda self, *a, **k: calls.append(a[0].shape[2]) or gathered(self, *a, **k),
    )
    monkeypatch.setattr(
        reader_module, "relay_breaks", lambda slots, num_buckets: 0
    )  # re-lay the pool at every write that breaks its order
    sorts = []
    relay = reader_module.sort_by_bucket
    monkeypatch.setattr(reader_module, "sort_by_bucket", lambda st, index: sorts.append(1) or relay(st, index))
    builds, bound_calls = [], []
    bind = reader_module.ranked_decode_call

    class Counted:  # the bound fused call, counting its calls
        def __init__(self, call):
            self.call, self.nbytes = call, call.nbytes

        def __call__(self, *x):
            bound_calls.append(1)
            return self.call(*x)

    def counted(*a, **k):
        builds.append(1)
        return Counted(bind(*a, **k))

    monkeypatch.setattr(reader_module, "ranked_decode_call", counted)
    sparse, cache = run()
    assert len(sorts) > 10
    assert cache.layers[0].reader.route_k < cache.layers[0].memory.router.num_buckets
    # every decode step of both layers gathered: through _sparse_read, or (best / partial,
    # between writes) straight to the call it bound, once a build in _sparse_read
    assert calls.count(1) + len(bound_calls) - len(builds) == 2 * 60
    # the fused call is bound again after each write (every 3 steps), and kept between them
    assert 2 * 60 // 3 <= len(builds) < 2 * 60

    # the reference: every read masked over the whole pool, the pool re-laid by bucket as the
    # sparse run lays it (where slots lie changes no read, but a write's ties may fall otherwise)
    def masked(self, query, key, value, valid, positions, scaling, *exact, fused=True):
        self.bucket_index()
        return self.masked(query, key, value, valid, positions, scaling, *exact, reads_all=False)

    monkeypatch.setattr(reader_module.Reader, "sparse", masked)
    dense, _ = run()
    torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("G,S,nb,laid", [(3, 50, 8, False), (2, 97, 16, True), (1, 5, 4, False), (2, 64, 4, True)])
def test_paged_index_cuts_each_bucket_into_pages_of_the_mean_size(G, S, nb, laid, split):
    """Every occupied slot is in exactly one page, a page lies within one bucket and holds at
    most ceil(occupied / (N_b page_split)) slots, and slot_units names the page that lists
    each slot."""
    g = torch.Generator().manual_seed(S)
    slot_bucket = torch.randint(0, nb, (G, S), generator=g)
    slot_bucket[0, : S // 2] = 1  # one crowded bucket
    occupied = torch.rand(G, S, generator=g) > 0.2
    index = bucket_index(slot_bucket, occupied, nb)
    if laid:  # the pool laid bucket by bucket: order is the identity
        order = torch.sort(torch.where(occupied, slot_bucket, nb), dim=1, stable=True).indices
        slot_bucket, occupied = slot_bucket.gather(1, order), occupied.gather(1, order)
        index = bucket_index(slot_bucket, occupied, nb)
        index = type(index)(
            order=torch.arange(S, dtype=torch.int32).expand(G, S), start=index.start, size=index.size, laid=True
        )
    units = nb * split
    pages = paged_index(index, units)
    page_of = slot_units(pages)
    assert pages.size.shape == (G, 2 * units) and pages.laid == laid
    for row in range(G):
        occ = int(occupied[row].sum())
        assert int(pages.size[row].sum()) == occ and int(pages.size[row].max()) <= -(-occ // units)
        assert torch.equal(page_of[row] >= 0, occupied[row])
        for u in range(2 * units):
            listed = pages.order[row, pages.start[row, u] : pages.start[row, u] + pages.size[row, u]].long()
            assert (page_of[row, listed] == u).all()
            assert slot_bucket[row, listed].unique().numel() <= 1


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("read_rank", ["best", "partial"])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("device", DEVICES)
def test_paged_reads_equal_the_masked_read_and_touch_at_most_m_pages(
    dtype, tol, T, read_rank, split, device, monkeypatch
):
    """read_pages: every read path ranks and takes the same pages (the fused and the eager
    decode reads, the compiled one's fixed width, the ranked chunk read, all against the
    masked read of the whole pool), and a decode read of M buckets' worth of pages (M *
    page_split of them) touches at most M / N_b of the occupied slots."""
    model, layer = _layer_with_memory(
        dtype, {**_rank(read_rank), "read_pages": True, "page_split": split}, device=device
    )
    query, key, value, valid, positions = _chunk(model, layer, dtype, T, padded=1)
    layer.reader.page_index()  # (the first paged index may re-lay the pool)
    exact = layer.exact()
    nb = layer.memory.router.num_buckets
    for m in (torch.tensor([3, 3], device=device), torch.tensor([1, 2], device=device)):
        layer.reader.m, layer.reader.route_k = m, int(m.max())
        with torch.no_grad():
            ref = layer.reader.masked(query, key, value, valid, positions, 0.3, *exact, reads_all=False)
            fast = layer.reader.read(query, key, value, valid, positions, 0.3, *exact, reads_all=False)
            outs = [fast]
            if T == 1:
                outs.append(layer.reader.sparse(query, key, value, valid, positions, 0.3, *exact, fused=False))
                with monkeypatch.context() as patch:
                    patch.setattr(torch.compiler, "is_compiling", lambda: True)
                    outs.append(layer.reader.sparse(query, key, value, valid, positions, 0.3, *exact))
        for out in outs:
            torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        if T == 1:
            layer.read_tally = [0, 0]
            with torch.no_grad():
                layer.reader.sparse(query, key, value, valid, positions, 0.3, *exact)
            read, occupied = layer.read_tally
            per_group = (layer.reader.readable().count > 0).sum(1)
            units = nb * split  # pages of at most ceil(n / units) slots, M * split of them read
            assert (
                0
                < read
                <= int(sum(int(k) * split * -(-int(n) // units) for k, n in zip(m.repeat_interleave(2), per_group)))
            )
            layer.read_tally = None


def test_paged_reads_need_a_logit_ranking():
    with pytest.raises(ArmkvError, match="read_pages=true ranks pages"):
        ARMConfig(read_pages=True, read_rank="tree")


@pytest.mark.parametrize(
    "G,S,nb,share", [(1, 1, 1, 1.0), (2, 53, 6, 0.8), (3, 700, 64, 0.5), (2, 37, 8, 0.0), (1, 300, 5, 1.0)]
)
def test_the_kernels_bucket_lists_equal_the_stable_sort(G, S, nb, share):
    """``bucket_index`` on a CPU (the kernel's counting sort) lists the same slots in the same
    order as the stable sort by bucket, and counts the same run breaks; empty pools, free
    slots scattered, a pool laid bucket by bucket."""
    if kernels.int4_read() is None:
        pytest.skip("no kernel")
    g = torch.Generator().manual_seed(S)
    occupied = torch.rand(G, S, generator=g) < share
    bucket = torch.where(occupied, torch.randint(0, nb, (G, S), generator=g), -1)
    for slot_bucket in (bucket, bucket.sort(1).values.where(occupied.sort(1, descending=True).values, -1)):
        occ = slot_bucket >= 0
        fast, ref = bucket_index(slot_bucket.int(), occ, nb), bucket_index(slot_bucket, occ, nb, fused=False)
        assert fast.breaks is not None and ref.breaks is None
        for a, b in ((fast.order, ref.order), (fast.start, ref.start), (fast.size, ref.size)):
            assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b)
        assert run_breaks(fast) == run_breaks(ref)
    with pytest.raises(RuntimeError, match="outside"):
        kernels.int4_read().bucket_lists(torch.full((1, 3), nb), torch.ones(1, 3, dtype=torch.bool), nb)


def test_sort_by_bucket_lays_the_same_slots_bucket_by_bucket():
    g = torch.Generator().manual_seed(5)
    G, S, d, nb, reach = 2, 53, 32, 6, 41
    st = MemoryState.empty(G, S, d)
    used = torch.rand(G, reach, generator=g) < 0.8
    st.count[:, :reach] = torch.where(used, torch.randint(1, 4, (G, reach), generator=g).float(), 0.0)
    st.bucket[:, :reach] = torch.where(used, torch.randint(0, nb, (G, reach), generator=g), -1)
    st.key[:, :reach] = torch.randn(G, reach, d, generator=g) * used.unsqueeze(-1)
    st.value[:, :reach] = torch.randn(G, reach, d, generator=g) * used.unsqueeze(-1)
    st.pos[:, :reach] = torch.rand(G, reach, generator=g) * 100 * used
    packed = st.pack("k4v4", mix=True)
    index = bucket_index(packed.bucket[:, :reach], packed.count[:, :reach] > 0, nb)
    assert run_breaks(index) > nb
    laid = sort_by_bucket(packed, index)
    after = bucket_index(laid.bucket[:, :reach], laid.count[:, :reach] > 0, nb)
    assert run_breaks(after) < nb and torch.equal(after.size, index.size)
    assert torch.equal(
        after.order[:, : int(index.size.sum(1).min())], torch.arange(int(index.size.sum(1).min())).expand(G, -1)
    )
    a, b = packed.unpack(torch.float32), laid.unpack(torch.float32)
    for gi in range(G):  # the same slots: every row of (key, value, pos, count, bucket) once
        rows = lambda s: sorted(
            map(
                tuple,
                torch.cat(
                    [s.key[gi], s.value[gi], s.pos[gi, :, None], s.count[gi, :, None], s.bucket[gi, :, None].float()], 1
                ).tolist(),
            )
        )  # noqa: E731
        assert rows(a) == rows(b)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("overrides", FORMATS)
@pytest.mark.parametrize("T", [1, 37, 70])
@pytest.mark.parametrize("pages", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_ranked_chunk_read_equals_the_masked_read(dtype, tol, overrides, T, pages, device, monkeypatch):
    """A chunk's read with each logit computed once (ranking and softmax) reads the same
    slots as the masked read of the whole pool, in blocks of queries that do not divide T:
    its PyTorch ops, and on a CPU the kernel (``ranked_slot_read``, its vector and portable
    loops), ranking buckets or their pages. Tolerances as for the gathered read: the ranked
    read works in float32, the masked one's products and softmax in the model's dtype."""
    model, layer = _layer_with_memory(dtype, {**overrides, "read_rank": "best", "read_pages": pages}, device=device)
    query, key, value, valid, positions = _chunk(model, layer, dtype, T, padded=max(1, T // 3))
    exact = layer.exact()
    module = kernels.int4_read() if device == "cpu" else None  # (the kernels serve CPU tensors)
    for m in (torch.tensor([3, 3], device=device), torch.tensor([1, 2], device=device)):
        layer.reader.m, layer.reader.route_k = m, int(m.max())
        assert layer.reader.path(T, every=False) == (
            "sparse" if T == 1 else "ranked"
        )  # (one token: ranked in one call)
        with torch.no_grad():
            ref = layer.reader.masked(query, key, value, valid, positions, 0.3, *exact, reads_all=False)
            every = layer.reader.masked(query, key, value, valid, positions, 0.3, *exact, reads_all=True)
            reads = [layer.reader.ranked(query, key, value, valid, 0.3, *exact, fused=False)]
            for vectorised in [True, False] if module is not None else []:
                monkeypatch.setattr(kernels, "fused_cpu", lambda x, v=vectorised: Vectorised(module, v))
                reads.append(layer.reader.ranked(query, key, value, valid, 0.3, *exact))
        for ranked in reads:
            assert ranked.dtype == ref.dtype and ranked.shape == ref.shape
            torch.testing.assert_close(ranked, ref, rtol=tol, atol=tol)
            assert (every.float() - ref.float()).abs().max() > 4 * (ranked.float() - ref.float()).abs().max()
        close = 2e-5 if dtype == torch.float32 else tol / 4  # (both read in float32; then rounded to the model's dtype)
        for ranked in reads[1:]:
            torch.testing.assert_close(ranked, reads[0], rtol=close, atol=close)


def test_prefill_with_ranked_chunk_reads_equals_the_masked_reads(monkeypatch):
    """Whole model, prefill in chunks (the ranked read, at lengths above and below what a
    gather serves), then decoding: the logits equal those with every chunk read masked over
    the whole pool."""
    model = tiny_model("llama").eval()
    ids = torch.randint(0, 100, (2, 330), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :50] = 0

    def run():
        cache = make_cache(
            model,
            "arm",
            budget=96,
            chunk=80,
            adapter="random",
            arm_overrides={"sync": 3, "top_m": "fixed", "m_fixed": 2, "read_rank": "best"},
        )
        with torch.no_grad():
            out = model(ids[:, :300], attention_mask=mask[:, :300], past_key_values=cache, use_cache=True).logits
            outs = [out]
            for t in range(300, 330):
                outs.append(
                    model(
                        ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache, use_cache=True
                    ).logits
                )
        return torch.cat(outs, 1)

    calls = []
    ranked = reader_module.Reader.ranked
    monkeypatch.setattr(
        reader_module.Reader,
        "ranked",
        lambda self, *a, **k: calls.append(a[0].shape[2]) or ranked(self, *a, **k),
    )
    fast = run()
    assert calls and min(calls) > 1 and max(calls) > reader_module.SPARSE_MAX_QUERIES
    monkeypatch.setattr(reader_module, "PATHS", tuple(row for row in reader_module.PATHS if row[0] != "ranked"))
    masked = run()
    torch.testing.assert_close(fast, masked, rtol=1e-4, atol=1e-4)


def test_sparse_reads_off_the_cpu_warn_once(monkeypatch):
    """Reading M < N_b buckets at inference on an accelerator (PyTorch ops, slower there than
    reading every bucket) warns once a process, where no fused backend serves there (triton not
    installed); the CPU, training and reading every bucket do not."""
    monkeypatch.setattr(reader_module, "_warned_slow_sparse", False)
    monkeypatch.setattr(reader_module, "_triton", False)  # (triton's kernels did not import)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reader_module.warn_slow_sparse_reads(8, 64, cpu, False)
        reader_module.warn_slow_sparse_reads(64, 64, cuda, False)
        reader_module.warn_slow_sparse_reads(8, 64, cuda, True)
    with pytest.warns(RuntimeWarning, match="reads 8 of 64 buckets on cuda"):
        reader_module.warn_slow_sparse_reads(8, 64, cuda, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reader_module.warn_slow_sparse_reads(8, 64, cuda, False)


def _naive_summarised_read(layer, query, key, value, valid, scaling, exact_k, exact_v, exact_valid, mask):
    """``read_summaries`` written out query by query: one softmax over the slots the read takes
    (``mask`` [B, Hq, T, S]), each unit it skips as the weighted mean of its slots' keys and
    values (weights exp(bias)) with the log of the weights' sum as bias, the exact entries and
    the chunk up to the query. In float64 -> [B, T, Hq, d]."""
    slot_k, slot_v, occupied, bias = (t.double() for t in layer.reader.slots())
    slot_unit, num_units = layer.reader.read_units()
    B, Hq, T, d = query.shape
    H = key.shape[1]
    slot_unit = slot_unit.reshape(B, H, -1)
    q, k, v, ek, ev = (t.double() for t in (query, key, value, exact_k, exact_v))
    out = torch.zeros(B, T, Hq, d, dtype=torch.float64)
    for b in range(B):
        for hq in range(Hq):
            h = hq // (Hq // H)
            members = (slot_unit[b, h][None, :] == torch.arange(num_units)[:, None]) & (occupied[b, h] > 0)  # [U, S]
            w = bias[b, h].exp().nan_to_num(0.0)  # [S]
            for t in range(T):
                x = q[b, hq, t]
                taken = mask[b, hq, t]
                skipped = members.any(1) & ~(members & taken).any(1)
                unit_w = members[skipped].double() * w  # [U', S]
                mean_k = unit_w @ slot_k[b, h] / unit_w.sum(1, keepdim=True)
                mean_v = unit_w @ slot_v[b, h] / unit_w.sum(1, keepdim=True)
                keep = valid[b, : t + 1]
                logits = torch.cat(
                    [
                        slot_k[b, h][taken] @ x * scaling + bias[b, h][taken],
                        mean_k @ x * scaling + unit_w.sum(1).log(),
                        ek[b, h][exact_valid[b]] @ x * scaling,
                        k[b, h, : t + 1][keep] @ x * scaling,
                    ]
                )
                values = torch.cat([slot_v[b, h][taken], mean_v, ev[b, h][exact_valid[b]], v[b, h, : t + 1][keep]])
                if len(logits):
                    out[b, t, hq] = torch.softmax(logits, 0) @ values
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("T", [1, 5, 37])
@pytest.mark.parametrize("read_rank", ["best", "partial-pages", "tree"])
def test_read_summaries_equal_a_softmax_over_the_read_slots_and_each_skipped_units_mean(
    dtype, tol, T, read_rank, monkeypatch
):
    """``read_summaries``: a read at M < N_b (the masked read; in float32 on a CPU a decoded
    token's fused sparse read and a chunk's fused ranked read, else the ranked read's PyTorch
    ops for a chunk ranked by its logits) equals the softmax written out query by query over
    the slots it takes, one entry for each unit it skips and the rest; it reads far closer to
    reading every bucket than the same read without them (these random keys spread attention
    thin)."""
    model, layer = _layer_with_memory(dtype, {**_rank(read_rank), "read_summaries": True})
    query, key, value, valid, positions = _chunk(model, layer, dtype, T, padded=1)
    exact = layer.exact()
    fused = []  # (which fused reads ran, with the units' entries)
    for name in ("ranked_decode_call", "fused_sparse_decode_read"):
        real = getattr(reader_module, name)
        monkeypatch.setattr(
            reader_module,
            name,
            lambda *a, _real=real, _name=name: fused.append((_name, a[-1] is not None)) or _real(*a),
        )
    real_ranked = reader_module.ranked_chunk_read
    monkeypatch.setattr(
        reader_module,
        "ranked_chunk_read",
        lambda *a, **k: fused.append(("ranked", k["fused"] is not None)) or real_ranked(*a, **k),
    )
    for m in (torch.tensor([3, 3]), torch.tensor([1, 2])):
        layer.reader.m, layer.reader.route_k = m, int(m.max())
        layer.reader.view().ranked = None
        with torch.no_grad():
            fused.clear()
            read = layer.reader.read(query, key, value, valid, positions, 0.3, *exact, reads_all=False)
            if dtype == torch.float32 and kernels.int4_read() is not None and (T == 1 or read_rank != "tree"):
                assert fused and all(used for _, used in fused), fused
            masked = layer.reader.masked(query, key, value, valid, positions, 0.3, *exact, reads_all=False)
            q_pre = layer.rotary.unrotate(query, positions.unsqueeze(1))
            occupied = layer.reader.slots()[2]
            mask = layer.reader._masks_for(
                q_pre, layer.reader.bucket_scores(query, 0.3), occupied, query.shape[1] // key.shape[1]
            )[0]
            every = layer.reader.masked(query, key, value, valid, positions, 0.3, *exact, reads_all=True)
            layer.config.read_summaries = False
            plain = layer.reader.masked(query, key, value, valid, positions, 0.3, *exact, reads_all=False)
            layer.config.read_summaries = True
        naive = _naive_summarised_read(layer, query, key, value, valid, 0.3, *exact, mask)
        assert read.dtype == dtype and read.shape == naive.shape
        torch.testing.assert_close(masked.double(), naive, rtol=tol, atol=tol)
        torch.testing.assert_close(read.double(), naive, rtol=tol, atol=tol)
        gap = lambda x: (x.double() - every.double()).abs().mean()  # noqa: E731
        assert gap(read) < gap(plain) / 4


@pytest.mark.parametrize(
    "overrides",
    [
        {"slot_format": "k4v4"},
        {"slot_format": "k8v4", "slot_mixing": False},
        {"slot_format": "k4v4", "read_pages": True},
    ],
)
@pytest.mark.parametrize("laid", [False, True])
def test_index_summaries_kernel_equals_the_pytorch_form(overrides, laid):
    """read.index_summaries: the kernel's unit_summaries (AVX2 and portable loops) against its
    PyTorch form, for buckets and pages, int4 and int8 keys, a pool listed by index or laid
    bucket by bucket; the entries the layer keeps are counted in its state bytes."""
    from armkv.memory.read import BucketIndex, index_summaries

    kernel = kernels.int4_read()
    if kernel is None:
        pytest.skip("the fused kernel is not built here")
    model, layer = _layer_with_memory(torch.float32, {**overrides, "read_summaries": True, "slot_ladder": ""})
    if laid:  # (as Reader.bucket_index re-lays a pool whose list has drifted from its order)
        listed = layer.reader.bucket_index()
        layer.state = sort_by_bucket(layer.state, listed)
        order = torch.arange(listed.order.shape[1], dtype=torch.int32).expand_as(listed.order)
        view = layer.reader.view()  # (the re-laid state's)
        view.index = BucketIndex(order=order, start=listed.start, size=listed.size, laid=True)
    index = layer.reader.page_index() or layer.reader.bucket_index()
    assert index.laid == laid
    st = layer.reader.readable()
    bias = layer.reader.bias().reshape(-1, st.slots)
    ref = index_summaries(st, bias, index, fused=False)
    for vectorised in (True, False):
        got = kernel.unit_summaries(
            st.key,
            st.key_scale,
            st.value,
            st.value_scale,
            bias,
            index.kernel_order(),
            index.start,
            index.size,
            vectorised,
        )
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(ref[2]).any() and (
        torch.isinf(ref[2]).any() or not overrides.get("read_pages")
    )  # (pages: some empty)
    layer.reader._carried = layer.reader.view().summaries = None  # (the decode steps kept those of an earlier index)
    before = layer.state_bytes()
    kept = layer.reader.summaries(index)
    assert layer.state_bytes() == before + sum(t.nbytes for t in kept)


@pytest.mark.parametrize(
    "overrides",
    [
        {"read_rank": "partial", "slot_mixing": False, "read_pages": True},
        {"read_rank": "best"},
        {"read_rank": "tree", "slot_format": "k8v4"},
    ],
)
def test_summaries_carried_over_writes_equal_a_fresh_build(overrides, monkeypatch):
    """``read_summaries`` carries the entries of units whose buckets no write changed
    (``SlotPool.take_dirty``, ``read.carried_units``): after every decode step (writes every
    4 tokens into a pool of merged slots, still filling, with pages re-laid where the list
    drifts) the kept entries equal those built afresh from the codes, and at some writes most
    units were carried, not rebuilt."""
    from armkv.memory.read import index_summaries

    if kernels.int4_read() is None:
        pytest.skip("the fused kernel is not built here")
    carried = []
    real = reader_module.carried_units
    monkeypatch.setattr(reader_module, "carried_units", lambda *a: carried.append(r := real(*a)) or r)
    model, layer, cache = _layer_with_memory(
        torch.float32, {**overrides, "read_summaries": True, "sync": 4}, with_cache=True
    )
    ids = torch.randint(0, 100, (2, 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for _ in range(40):
            out = model(ids, past_key_values=cache, use_cache=True)
            ids = out.logits[:, -1:].argmax(-1)
            index = layer.reader.page_index() or layer.reader.bucket_index()
            view = layer.reader.view()
            if view.summaries is None:
                continue
            st = layer.reader.readable()
            fresh = index_summaries(st, layer.reader.bias().reshape(-1, st.slots), index)
            for a, b in zip(view.summaries, fresh):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    shares = [float((c >= 0).float().mean()) for c in carried]
    assert len(shares) > 5 and max(shares) > 0.5, shares


def test_unit_summaries_are_weighted_means_and_log_totals():
    """read.unit_summaries against a loop over units: free slots and empty units left out."""
    from armkv.memory.read import unit_summaries, units_read

    g = torch.Generator().manual_seed(5)
    G, S, d, U = 2, 23, 4, 5
    k, v = torch.randn(G, S, d, generator=g), torch.randn(G, S, d, generator=g)
    count = torch.randint(0, 4, (G, S), generator=g).float()
    bias = torch.where(count > 0, count.clamp_min(1).log(), float("-inf"))
    unit = torch.randint(0, U - 1, (G, S), generator=g).masked_fill(count == 0, -1)  # unit U - 1 stays empty
    keys, values, log_weight, at = unit_summaries(k, v, bias, unit, U)
    for gi in range(G):
        for u in range(U):
            members = (unit[gi] == u).nonzero().flatten()
            if not len(members):
                assert log_weight[gi, u] == float("-inf") and not keys[gi, u].any() and not values[gi, u].any()
                continue
            w = count[gi, members]
            torch.testing.assert_close(keys[gi, u], (w[:, None] * k[gi, members]).sum(0) / w.sum())
            torch.testing.assert_close(values[gi, u], (w[:, None] * v[gi, members]).sum(0) / w.sum())
            torch.testing.assert_close(log_weight[gi, u], w.sum().log())
    mask = torch.rand(G, 3, S, generator=g) > 0.7
    taken = units_read(mask, at, U)
    for gi in range(G):
        for t in range(3):
            expect = {int(unit[gi, s]) for s in range(S) if mask[gi, t, s] and unit[gi, s] >= 0}
            assert set(taken[gi, t].nonzero().flatten().tolist()) == expect
