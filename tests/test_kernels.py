"""The fused int4 read (armkv.memory.kernels) against its PyTorch reference
(MemoryState.key_scores / weighted_values with fused=False): outputs at odd sizes, with free
slots and zero weights, on the vector and the scalar loops; gradients still flow where
wanted (the kernel stands aside); ARMKV_KERNELS=0 turns it off."""

from __future__ import annotations

import os

import pytest
import torch

from armkv.memory import kernels
from armkv.memory.state import MemoryState
from conftest import Vectorised


@pytest.fixture(scope="module")
def kernel():
    module = kernels.int4_read()
    if module is None:
        if os.environ.get("ARMKV_REQUIRE_KERNELS") == "1":  # CI: the build must work there
            pytest.fail("the fused int4 read kernel did not build (see the warning above)")
        pytest.skip("the fused int4 read kernel could not be built here (no C++ compiler?)")
    return module


def _packed(groups: int, slots: int, d: int, free: int, seed: int) -> MemoryState:
    g = torch.Generator().manual_seed(seed)
    st = MemoryState.empty(groups, slots, d)
    st.key.copy_(torch.randn(groups, slots, d, generator=g) * 3)
    st.value.copy_(torch.randn(groups, slots, d, generator=g))
    st.count.fill_(1)
    if free:  # free slots are stored zero (codes and scales)
        st.key[:, -free:], st.value[:, -free:], st.count[:, -free:] = 0, 0, 0
    return st.pack("k4v4", mix=True)


# d = 64: 2 scale groups (the default model); 128: 4; 48 and 40: one (40's 20 bytes a vector
# do not split into 8-byte blocks, so the scalar loops serve); slot counts around the 8-slot blocks;
# 1-8 query heads a KV head have loops of their own, 9-16 (rep 12) the run-time loop
@pytest.mark.parametrize("d", [64, 128, 48, 40])
@pytest.mark.parametrize(
    "slots,rep,groups", [(1, 1, 1), (7, 3, 2), (8, 5, 1), (37, 3, 4), (301, 2, 3), (45, 4, 2), (29, 12, 2)]
)
def test_fused_int4_read_equals_the_pytorch_read(kernel, d, slots, rep, groups):
    st = _packed(groups, slots, d, free=slots // 5, seed=slots * d + rep)
    g = torch.Generator().manual_seed(rep)
    query = torch.randn(groups, rep, d, generator=g)
    weights = torch.softmax(torch.randn(groups, rep, slots, generator=g), -1)
    weights[:, :, : slots // 3] = 0  # slots no query reads: skipped by nothing, still exact
    torch.testing.assert_close(st.key_scores(query), st.key_scores(query, fused=False), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        st.weighted_values(weights), st.weighted_values(weights, fused=False), rtol=1e-5, atol=1e-5
    )
    # non-contiguous inputs read as their contiguous copies
    q_t = query.transpose(0, 1).contiguous().transpose(0, 1)
    torch.testing.assert_close(st.key_scores(q_t), st.key_scores(query, fused=False), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", ["k8v4", "int8"])
@pytest.mark.parametrize(
    "d,slots,rep,groups",
    [(64, 1, 1, 1), (64, 7, 3, 2), (40, 37, 5, 3), (128, 301, 2, 1), (64, 8, 17, 1), (64, 53, 12, 2)],
)
def test_fused_int8_key_scores_equal_the_pytorch_read(kernel, fmt, d, slots, rep, groups):
    """int8 keys (k8v4 and int8 slots, one scale a slot): the vector loops for whole blocks
    of 8 slots, the scalar loop for the rest and for more than 16 query heads a KV head."""
    g = torch.Generator().manual_seed(slots + d)
    st = MemoryState.empty(groups, slots, d)
    st.key.copy_(torch.randn(groups, slots, d, generator=g) * 3)
    st.value.copy_(torch.randn(groups, slots, d, generator=g))
    st.count.fill_(1)
    st.key[:, slots - slots // 5 :] = 0  # free slots: zero codes and scales
    st = st.pack(fmt, mix=True)
    assert st.key.dtype == torch.int8
    query = torch.randn(groups, rep, d, generator=g)
    torch.testing.assert_close(st.key_scores(query), st.key_scores(query, fused=False), rtol=1e-5, atol=1e-4)
    weights = torch.softmax(torch.randn(groups, rep, slots, generator=g), -1)
    torch.testing.assert_close(
        st.weighted_values(weights), st.weighted_values(weights, fused=False), rtol=1e-5, atol=1e-5
    )


def test_vector_loops_serve_the_default_model_here(kernel):
    """The default model (3 query heads a KV head, d = 64, 2 scale groups) takes the AVX2
    loops on a CPU that has them; the scalar loops serve elsewhere (tested equal above)."""
    import platform

    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    has = platform.machine() in ("x86_64", "AMD64") and " avx2" in flags and " fma" in flags
    assert kernel.int4_vectorised(3, 64, 2) == has
    assert not kernel.int4_vectorised(3, 40, 1)  # 20-byte vectors: scalar


def test_gradients_take_the_pytorch_path(kernel):
    st = _packed(2, 19, 64, free=0, seed=3)
    query = torch.randn(2, 3, 64, requires_grad=True)
    weights = torch.rand(2, 3, 19, requires_grad=True)
    (st.key_scores(query).sum() + st.weighted_values(weights).square().sum()).backward()
    ref_q, ref_w = query.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    (st.key_scores(ref_q, fused=False).sum() + st.weighted_values(ref_w, fused=False).square().sum()).backward()
    torch.testing.assert_close(query.grad, ref_q.grad)
    torch.testing.assert_close(weights.grad, ref_w.grad)


def test_only_int4_float32_cpu_reads_are_fused_and_the_switch_turns_it_off(kernel, monkeypatch):
    codes = torch.zeros(1, 4, 8, dtype=torch.uint8)
    assert kernels.fused_read(torch.zeros(1, 1, 8), codes) is kernel
    assert kernels.fused_read(torch.zeros(1, 1, 8, dtype=torch.float64), codes) is None
    assert kernels.fused_read(torch.zeros(1, 1, 8), codes.to(torch.int8)) is None  # int8 values: no kernel
    assert kernels.fused_read(torch.zeros(1, 1, 8), codes.to(torch.int8), int8=True) is kernel  # int8 keys
    assert kernels.describe() == "fused kernel"  # what `armkv bench` reports
    monkeypatch.setenv("ARMKV_KERNELS", "0")
    assert kernels.fused_read(torch.zeros(1, 1, 8), codes) is None
    assert kernels.describe() == "pytorch (ARMKV_KERNELS=0)"


def test_the_build_is_named_by_its_sources_and_the_torch_it_builds_against(tmp_path):
    """Two environments (armkv's and vLLM's) build into folders of their own: torch rebuilds a
    folder whose include paths change, so one shared folder would be rebuilt by each in turn."""
    (tmp_path / "a.cpp").write_text("int f() { return 1; }")
    (tmp_path / "a.h").write_text("int f();")
    name = kernels.build_name(tmp_path, "2.13.0+cpu", "/env/a/torch")
    assert name == kernels.build_name(tmp_path, "2.13.0+cpu", "/env/a/torch")
    assert name != kernels.build_name(tmp_path, "2.13.0+cpu", "/env/b/torch")
    assert name != kernels.build_name(tmp_path, "2.11.0+cpu", "/env/a/torch")
    (tmp_path / "a.h").write_text("int f(void);")
    assert name != kernels.build_name(tmp_path, "2.13.0+cpu", "/env/a/torch")
    assert kernels._NAME == kernels.build_name(kernels._CSRC, torch.__version__, os.path.dirname(torch.__file__))


def test_a_failed_build_warns_once_and_the_pytorch_path_serves(monkeypatch):
    import torch.utils.cpp_extension as ext

    def broken(**_):
        raise RuntimeError("Error building extension 'armkv_int4_read'\nmore lines")

    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(ext, "load", broken)
    with pytest.warns(RuntimeWarning, match="could not be built .Error building extension 'armkv_int4_read'.; reading"):
        assert kernels.int4_read() is None
    assert kernels.int4_read() is None  # not tried again
    assert kernels.describe() == "pytorch (kernel not built)"
    st = _packed(1, 9, 64, free=2, seed=1)
    q = torch.randn(1, 3, 64)
    torch.testing.assert_close(st.key_scores(q), st.key_scores(q, fused=False))


@pytest.mark.parametrize("slots,d,width", [(1, 64, 32), (2, 64, 32), (37, 64, 12), (301, 40, 32), (300, 64, 2)])
def test_fused_band_neighbours_equal_the_pytorch_band(kernel, slots, d, width):
    """The write's neighbour search (write.banded_neighbours) by the kernel and by PyTorch
    ops: the same partner for every slot that has one, the same similarity, -inf for the
    others; exact duplicates (ties) resolved alike (the nearest in bucket order)."""
    from armkv.memory.write import banded_neighbours

    g = torch.Generator().manual_seed(slots + d + width)
    G = 3
    st = MemoryState.empty(G, slots, d)
    st.key.copy_(torch.randn(G, slots, d, generator=g))
    st.value.copy_(torch.randn(G, slots, d, generator=g))
    if slots > 10:  # duplicated slots: equal similarities on both sides
        st.key[:, 7], st.value[:, 7] = st.key[:, 3], st.value[:, 3]
        st.key[:, 9], st.value[:, 9] = st.key[:, 3], st.value[:, 3]
    st.count = (torch.rand(G, slots, generator=g) * 4).floor()  # about a quarter free
    st.bucket = torch.where(st.count > 0, torch.randint(0, 5, (G, slots), generator=g), -1)
    if slots > 10:
        st.count[:, [3, 7, 9]], st.bucket[:, [3, 7, 9]] = 1.0, 0
    got_sim, got_idx = banded_neighbours(st, width)
    want_sim, want_idx = banded_neighbours(st, width, fused=False)
    has = torch.isfinite(want_sim)
    assert torch.equal(torch.isfinite(got_sim), has)
    torch.testing.assert_close(got_sim[has], want_sim[has], rtol=1e-5, atol=1e-5)
    assert torch.equal(got_idx[has], want_idx[has])
    assert has.any() or slots < 3


@pytest.mark.parametrize("d,groups", [(64, 2), (16, 1), (128, 4)])
@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("fmt", ["k4v4", "k8v4"])
def test_fused_unpack_to_pre_rope_equals_dequantise_then_unrotate(kernel, d, groups, mixed, fmt):
    """int4 values with int4 or int8 keys (k4v4, k8v4: the ladder's rungs) to the floats a
    write uses (SlotPool.write_form): dequantised, unmixed and un-rotated in one pass,
    against the PyTorch dequantise then Rotary.unrotate; free slots (stored zero) stay zero."""
    from armkv.memory.rope import Rotary

    g = torch.Generator().manual_seed(d)
    st = MemoryState.empty(groups, 53, d)
    st.key.copy_(torch.randn(groups, 53, d, generator=g) * 3)
    st.value.copy_(torch.randn(groups, 53, d, generator=g))
    st.count.fill_(1)
    st.key[:, -6:], st.value[:, -6:], st.count[:, -6:] = 0, 0, 0
    st = st.pack(fmt, mix=mixed)
    st.pos = torch.rand(groups, 53) * 5000
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), attention_scaling=1.25)
    cos, sin = (t.expand(groups, 53, -1) for t in rotary.half_cos_sin(st.pos, torch.float32))
    key, value = kernel.int4_unpack_pre_rope(
        st.key, st.key_scale, st.value, st.value_scale, cos, sin, st.mixed, rotary.scaling
    )
    ref_key, ref_value = st.kv(torch.float32, fused=False)
    torch.testing.assert_close(value, ref_value, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(key, rotary.unrotate(ref_key, st.pos), rtol=1e-5, atol=1e-5)
    assert torch.equal(value[:, -6:], torch.zeros(groups, 6, d))


@pytest.mark.parametrize("fmt", ["k4v4", "k8v4"])
@pytest.mark.parametrize(
    "d,slots,rep,exact,mixed",
    [
        (64, 1, 1, 3, True),
        (64, 37, 3, 68, True),
        (40, 301, 5, 9, False),
        (64, 8, 2, 1, False),
        (128, 19, 3, 12, True),
        (64, 45, 4, 7, True),
        (64, 29, 12, 5, True),
    ],
)
@pytest.mark.parametrize("vectorised", [True, False])
def test_fused_decode_read_equals_the_pytorch_ops(kernel, fmt, d, slots, rep, exact, mixed, vectorised):
    """One layer's decode read in one call (Reader.dense's fused path) against the
    PyTorch ops it replaces: free slots, invalid exact entries, a padding token, and a group
    with nothing to read at all (zeros); the AVX2 and the portable loops."""
    from armkv.memory.quant import mixing_matrix
    from armkv.methods.attention import safe_softmax

    groups = 4
    g = torch.Generator().manual_seed(slots * d + rep + exact)
    st = MemoryState.empty(groups, slots, d)
    st.key.copy_(torch.randn(groups, slots, d, generator=g) * 2)
    st.value.copy_(torch.randn(groups, slots, d, generator=g))
    st.count.copy_(torch.randint(1, 4, (groups, slots), generator=g).float())
    free = torch.rand(groups, slots, generator=g) < 0.3
    free[3] = True  # group 3: no slot
    st.key[free], st.value[free], st.count[free] = 0, 0, 0
    st = st.pack(fmt, mix=mixed)
    bias = torch.where(st.count > 0, st.count.clamp_min(1).log(), -torch.inf)
    q = torch.randn(groups, rep, d, generator=g)
    own_k, own_v = torch.randn(groups, d, generator=g), torch.randn(groups, d, generator=g)
    own_ok = torch.tensor([True, False, True, False])  # group 3: a padding token
    exact_k, exact_v = torch.randn(groups, exact, d, generator=g), torch.randn(groups, exact, d, generator=g)
    exact_ok = torch.rand(groups, exact, generator=g) > 0.3
    exact_ok[3] = False
    exact_k[~exact_ok], exact_v[~exact_ok] = 0, 0  # the buffer keeps entries without a token zero
    mix = mixing_matrix(d) if mixed else None
    got = kernel.arm_decode_read(
        q,
        own_k,
        own_v,
        own_ok,
        exact_k,
        exact_v,
        exact_ok,
        st.key,
        st.key_scale,
        st.value,
        st.value_scale,
        bias,
        mix if mixed else torch.empty(0),
        0.3,
        vectorised=vectorised,
    )
    # the reference: the same steps in PyTorch ops
    slot_scores = st.key_scores(q if mix is None else q @ mix, fused=False) * 0.3 + bias.unsqueeze(1)
    exact_scores = (q @ exact_k.transpose(1, 2) * 0.3).masked_fill(~exact_ok[:, None, :], -torch.inf)
    own = ((q * own_k[:, None]).sum(-1, keepdim=True) * 0.3).masked_fill(~own_ok[:, None, None], -torch.inf)
    w = safe_softmax(torch.cat([slot_scores, exact_scores, own], -1))
    from_slots = st.weighted_values(w[..., :slots].contiguous(), fused=False)
    if mix is not None:
        from_slots = from_slots @ mix.T
    want = (
        from_slots
        + w[..., slots : slots + exact] @ exact_v
        + w[..., -1:] * torch.where(own_ok[:, None, None], own_v[:, None], 0)
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[3] == 0).all()


def _random_pool(G, slots, d, buckets, fmt, mixed, laid, g):
    """A packed pool of random slots (a quarter free) filed under random buckets, and its
    bucket index; ``laid``: re-laid bucket by bucket, the index's order the identity."""
    from armkv.memory.read import BucketIndex, bucket_index, sort_by_bucket

    st = MemoryState.empty(G, slots, d)
    st.key.copy_(torch.randn(G, slots, d, generator=g) * 2)
    st.value.copy_(torch.randn(G, slots, d, generator=g))
    st.count.copy_(torch.randint(1, 4, (G, slots), generator=g).float())
    st.bucket.copy_(torch.randint(0, buckets, (G, slots), generator=g))
    free = torch.rand(G, slots, generator=g) < 0.25
    st.key[free], st.value[free], st.count[free], st.bucket[free] = 0, 0, 0, -1
    st = st.pack(fmt, mix=mixed)
    index = bucket_index(st.bucket, st.count > 0, buckets)
    if laid:  # (Reader.bucket_index)
        st = sort_by_bucket(st, index)
        index = BucketIndex(
            order=torch.arange(slots, dtype=torch.int32).expand(G, slots), start=index.start, size=index.size, laid=True
        )
    return st, index


@pytest.mark.parametrize("fmt", ["k4v4", "k8v4"])
@pytest.mark.parametrize(
    "d,slots,rep,buckets,mixed",
    [
        (64, 1, 1, 2, True),
        (64, 37, 3, 5, True),
        (40, 301, 5, 16, False),
        (128, 19, 3, 4, True),
        (64, 203, 12, 9, False),
    ],
)
@pytest.mark.parametrize("laid", [True, False])
@pytest.mark.parametrize("vectorised", [True, False])
def test_fused_sparse_decode_read_equals_the_gathered_pytorch_read(
    kernel, fmt, d, slots, rep, buckets, mixed, laid, vectorised
):
    """The sparse decode read in place (Reader.sparse's fused path: the chosen
    buckets' runs of the pool) against gathering the same slots by index and reading them
    with PyTorch ops (read.slots_of_buckets, gather_slots, gathered_read with fused=False):
    free slots, buckets that hold nothing, rows that read fewer buckets than were routed
    (take), a group that reads none, and pools in any order or laid bucket by bucket."""
    from armkv.memory.quant import mixing_matrix
    from armkv.memory.read import fused_sparse_decode_read, read_slots, slots_of_buckets

    B, H, T, L = 2, 2, 1, 7
    G, M = B * H, min(3, buckets)
    g = torch.Generator().manual_seed(slots * d + rep + buckets)
    st, index = _random_pool(G, slots, d, buckets, fmt, mixed, laid, g)
    bias = torch.where(st.count > 0, st.count.clamp_min(1).log(), -torch.inf).view(B, H, slots)
    picked = torch.stack([torch.randperm(buckets, generator=g)[:M] for _ in range(G)])
    m = torch.tensor([M, max(1, M - 1)])  # the second row reads fewer than were routed
    take = m.repeat_interleave(H)
    take[-1] = 0  # (a group that reads nothing but its exact entries)
    query = torch.randn(B, H * rep, T, d, generator=g)
    key, value = torch.randn(B, H, T, d, generator=g), torch.randn(B, H, T, d, generator=g)
    valid = torch.tensor([[True], [False]])  # the second row's token is padding
    exact_k, exact_v = torch.randn(B, H, L, d, generator=g), torch.randn(B, H, L, d, generator=g)
    exact_valid = torch.rand(B, L, generator=g) > 0.3
    exact_k, exact_v = exact_k * exact_valid[:, None, :, None], exact_v * exact_valid[:, None, :, None]
    mix = mixing_matrix(d) if mixed else None
    with torch.no_grad():
        fast = fused_sparse_decode_read(
            Vectorised(kernel, vectorised),
            query,
            key,
            value,
            valid,
            exact_k,
            exact_v,
            exact_valid,
            st,
            bias,
            mix,
            0.3,
            index,
            picked,
            take,
        )
        used_of = torch.arange(M).view(1, 1, M) < take.view(G, 1, 1)
        ids, used = slots_of_buckets(index, picked.view(G, 1, M), None, used_of)
        ref = read_slots(query, key, value, valid, 0.3, exact_k, exact_v, exact_valid, st, bias, ids, used, False)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def _ranked_case(fmt, d, slots, rep, buckets, m, mixed, laid, seed) -> dict:
    """One decoded token's read of a random pool, for the fused ranked reads: free slots,
    buckets that hold nothing, a padding token, rows reading fewer buckets (take), a group
    reading none. "read": the arguments the fused reads share; "q" the queries [G, R, d] in
    the slots' basis."""
    from armkv.memory.quant import mixing_matrix

    B, H, L = 2, 2, 7
    G = B * H
    g = torch.Generator().manual_seed(seed)
    st, index = _random_pool(G, slots, d, buckets, fmt, mixed, laid, g)
    bias = torch.where(st.count > 0, st.count.clamp_min(1).log(), -torch.inf)
    query = torch.randn(B, H * rep, 1, d, generator=g)
    key, value = torch.randn(B, H, 1, d, generator=g), torch.randn(B, H, 1, d, generator=g)
    valid = torch.tensor([[True], [False]])  # the second row's token is padding
    exact_k, exact_v = torch.randn(B, H, L, d, generator=g), torch.randn(B, H, L, d, generator=g)
    exact_valid = torch.rand(B, L, generator=g) > 0.3
    exact_k, exact_v = exact_k * exact_valid[:, None, :, None], exact_v * exact_valid[:, None, :, None]
    take = torch.tensor([m, max(1, m - 1)]).repeat_interleave(H)
    take[-1] = 0  # (a group that reads nothing but its exact entries)
    mix = mixing_matrix(d) if mixed else None
    q = query.reshape(G, rep, d)
    return {
        "read": (query, key, value, valid, exact_k, exact_v, exact_valid, st, bias, mix, 0.3),
        "index": index,
        "take": take,
        "st": st,
        "bias": bias,
        "q": q @ mix if mixed else q,
        "B": B,
        "H": H,
    }


def _assert_ranked_read(c: dict, out, got, scores, m: int, buckets: int) -> None:
    """A fused ranked read's buckets are the PyTorch ranking of ``scores`` [G, R, S] (times
    the scaling plus the bias, the largest over the R heads, read.bucket_best, a stable sort:
    ties to the lower id), best first; its output is the gathered PyTorch read of them."""
    from armkv.memory.read import bucket_best, read_slots, slots_of_buckets

    query, key, value, valid, exact_k, exact_v, exact_valid, st, bias, _, scaling = c["read"]
    G = c["q"].shape[0]
    logits = (scores * scaling + bias.unsqueeze(1)).amax(1, keepdim=True)  # [G, 1, S]
    want = bucket_best(logits, st.bucket, buckets)[:, 0].sort(dim=-1, descending=True, stable=True).indices[:, :m]
    assert torch.equal(got, want)
    used_of = torch.arange(m).view(1, 1, m) < c["take"].view(G, 1, 1)
    ids, used = slots_of_buckets(c["index"], want.view(G, 1, m), None, used_of)
    ref = read_slots(query, key, value, valid, scaling, exact_k, exact_v, exact_valid, st, bias, ids, used, False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["k4v4", "k8v4"])
@pytest.mark.parametrize(
    "d,slots,rep,buckets,m,mixed",
    [
        (64, 1, 1, 2, 1, True),
        (64, 37, 3, 5, 3, True),
        (40, 301, 5, 16, 2, False),
        (128, 19, 3, 4, 4, True),
        (64, 203, 12, 64, 8, False),
    ],
)
@pytest.mark.parametrize("laid", [True, False])
@pytest.mark.parametrize("vectorised", [True, False])
def test_fused_best_read_ranks_as_pytorch_and_reads_as_the_sparse_read(
    kernel, fmt, d, slots, rep, buckets, m, mixed, laid, vectorised
):
    """read_rank="best" for one decoded token in one kernel call. Its buckets against the
    PyTorch ranking: every slot's logit from the stored codes (MemoryState.key_scores,
    fused=False) times the scaling plus the bias, the largest over the R heads,
    read.bucket_best, a stable sort (ties to the lower id): the same buckets, best first.
    Its output against the gathered PyTorch read of those buckets (gathered_read,
    fused=False). Free slots, buckets that hold nothing, rows reading fewer buckets (take),
    a group reading none, pools in any order or laid bucket by bucket."""
    from armkv.memory.read import fused_best_decode_read

    c = _ranked_case(fmt, d, slots, rep, buckets, m, mixed, laid, slots * d + rep + buckets)
    with torch.no_grad():
        out, got = fused_best_decode_read(Vectorised(kernel, vectorised), *c["read"], c["index"], m, c["take"])
        _assert_ranked_read(c, out, got, c["st"].key_scores(c["q"], fused=False), m, buckets)


@pytest.mark.parametrize("fmt", ["k4v4", "k8v4"])
@pytest.mark.parametrize(
    "d,slots,rep,buckets,m,mixed,rows",
    [
        (64, 1, 1, 2, 1, True, 8),
        (64, 37, 3, 5, 3, True, 8),
        (40, 301, 5, 16, 2, False, 3),
        (128, 19, 3, 4, 4, True, 16),
        (64, 203, 12, 64, 8, False, 1),
        (64, 203, 3, 64, 8, True, 32),
    ],
)
@pytest.mark.parametrize("laid", [True, False])
@pytest.mark.parametrize("vectorised", [True, False])
def test_fused_partial_read_ranks_as_pytorch_and_reads_as_the_sparse_read(
    kernel, fmt, d, slots, rep, buckets, m, mixed, rows, laid, vectorised
):
    """read_rank="partial" for one decoded token in one kernel call. Its buckets against the
    PyTorch ranking: the rows of read.partial_rows of the (mixed) query,
    MemoryState.partial_key_scores times the scaling plus the bias, the largest over the R
    heads, read.bucket_best, a stable sort: the same buckets, best first. Its output against
    the gathered PyTorch read of those buckets. With every row (rows = d/2) the scores are
    the full scores of the query rounded to int8 (each head at max |q| / 127); with one row,
    those of that pair of channels alone."""
    from armkv.memory.read import fused_partial_decode_read, partial_rows

    c = _ranked_case(fmt, d, slots, rep, buckets, m, mixed, laid, slots * d + rep + buckets + rows)
    with torch.no_grad():
        out, got = fused_partial_decode_read(Vectorised(kernel, vectorised), *c["read"], c["index"], m, c["take"], rows)
        scores = c["st"].partial_key_scores(c["q"], partial_rows(c["q"], rows))
        if rows == d // 2:  # every row: the full scores of the rounded query
            step = c["q"].abs().amax(-1, keepdim=True) / 127
            rounded = torch.round(c["q"] / step) * step
            torch.testing.assert_close(scores, c["st"].key_scores(rounded, fused=False), rtol=1e-5, atol=1e-4)
        _assert_ranked_read(c, out, got, scores, m, buckets)


@pytest.mark.parametrize("vectorised", [True, False])
def test_fused_partial_ranking_holds_the_largest_integer_sums(kernel, vectorised):
    """The int16 lanes of the partial ranking at their limit: every key code at a nibble's
    extreme (7 in half the slots, -8 in the rest) and every query channel at 127 after
    rounding, all 32 rows of d = 64 (two chunks of 8 pairs, each summing 8 x 2 x 127 x 15 in
    a lane): the same buckets and read as the PyTorch ranking, whose sums are exact."""
    from armkv.memory.read import fused_partial_decode_read, partial_rows

    c = _ranked_case("k4v4", 64, 203, 3, 64, 8, False, True, 7)
    st = c["st"]
    some = st.key.shape[-1] // 2
    st.key[..., :some] = 0x77  # both nibbles 7
    st.key[..., some:] = 0x88  # both nibbles -8
    c["read"][0].fill_(1.0)
    c["q"].fill_(1.0)
    with torch.no_grad():
        out, got = fused_partial_decode_read(Vectorised(kernel, vectorised), *c["read"], c["index"], 8, c["take"], 32)
        scores = st.partial_key_scores(c["q"], partial_rows(c["q"], 32))
    scale = st.key_scale.float()  # [G, S, 2]: the low 32 channels' group, the high 32's
    torch.testing.assert_close(scores[:, 0, :some], 7 * 32 * scale[:, :some].sum(-1))
    torch.testing.assert_close(scores[:, 0, some:], -8 * 32 * scale[:, some:].sum(-1))
    _assert_ranked_read(c, out, got, scores, 8, 64)


@pytest.mark.parametrize("rank", ["dense", "sparse", "best", "partial"])
def test_fused_reads_take_float32_scales_as_bfloat16_ones(kernel, rank):
    """The pools store their scales in bfloat16 and the kernels read them as they are (each read
    converting the rows it reads); float32 scales of the same values give the same read."""
    from dataclasses import replace

    from armkv.memory.read import fused_best_decode_read, fused_partial_decode_read, fused_sparse_decode_read

    c = _ranked_case("k4v4", 64, 203, 3, 64, 8, False, True, 11)
    query, key, value, valid, exact_k, exact_v, exact_valid, st, bias, mix, scaling = c["read"]
    assert st.key_scale.dtype == torch.bfloat16
    wide = replace(st, key_scale=st.key_scale.float(), value_scale=st.value_scale.float())
    buckets = torch.arange(8).expand(st.key.shape[0], 8)

    def read(state):
        args = (query, key, value, valid, exact_k, exact_v, exact_valid, state, bias, mix, scaling)
        if rank == "dense":
            from armkv.memory.read import fused_decode_read

            return fused_decode_read(kernel, *args)
        if rank == "sparse":
            return fused_sparse_decode_read(kernel, *args, c["index"], buckets, c["take"])
        if rank == "best":
            return fused_best_decode_read(kernel, *args, c["index"], 8, c["take"])[0]
        return fused_partial_decode_read(kernel, *args, c["index"], 8, c["take"], 8)[0]

    with torch.no_grad():
        torch.testing.assert_close(read(wide), read(st), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["k4v4", "k8v4"])
@pytest.mark.parametrize("rank", ["dense", "sparse", "best", "partial"])
@pytest.mark.parametrize("vectorised", [True, False])
def test_fused_reads_take_a_pools_first_slots_in_place(kernel, fmt, rank, vectorised):
    """A pool that is not full is read over its first ``reach`` slots (SlotPool.readable):
    views whose rows lie further apart than their slots. The kernels read them where they
    lie; the read equals the read of a contiguous copy of the same slots, bit for bit."""
    from dataclasses import replace

    from armkv.memory.read import (
        bucket_index,
        fused_best_decode_read,
        fused_decode_read,
        fused_partial_decode_read,
        fused_sparse_decode_read,
    )

    c = _ranked_case(fmt, 64, 203, 3, 64, 8, False, False, 13)
    query, key, value, valid, exact_k, exact_v, exact_valid, big, _, mix, scaling = c["read"]
    S = 157  # of 203
    view = big.first(S)
    assert not view.key.is_contiguous() and not view.value.is_contiguous() and not view.key_scale.is_contiguous()
    copy = replace(
        view,
        key=view.key.contiguous(),
        value=view.value.contiguous(),
        key_scale=view.key_scale.contiguous(),
        value_scale=view.value_scale.contiguous(),
    )
    bias = torch.where(view.count > 0, view.count.clamp_min(1).log(), -torch.inf)
    index = bucket_index(view.bucket, view.count > 0, 64)
    buckets = torch.arange(8).expand(big.key.shape[0], 8)
    k = Vectorised(kernel, vectorised)

    def read(state):
        args = (query, key, value, valid, exact_k, exact_v, exact_valid, state, bias, mix, scaling)
        if rank == "dense":
            return fused_decode_read(k, *args)
        if rank == "sparse":
            return fused_sparse_decode_read(k, *args, index, buckets, c["take"])
        if rank == "best":
            return torch.cat([t.float().flatten() for t in fused_best_decode_read(k, *args, index, 8, c["take"])])
        return torch.cat([t.float().flatten() for t in fused_partial_decode_read(k, *args, index, 8, c["take"], 8)])

    with torch.no_grad():
        torch.testing.assert_close(read(view), read(copy), rtol=0, atol=0)


@pytest.mark.parametrize("rank", ["dense", "sparse", "best", "partial"])
@pytest.mark.parametrize("vectorised", [True, False])
def test_a_bound_decode_call_reads_the_tokens_inputs_where_they_lie(kernel, rank, vectorised):
    """kernel.DecodeCall binds the slots, the index and the entries once; each call takes a
    step's token inputs in the model's layout or flat by group, read in place where a group's
    rows are contiguous and copied where not (views of larger tensors, an expanded mask, a
    non-bool valid). Every form gives the same read, bit for bit, and one bound call gives,
    token after token, what a call bound afresh gives."""
    from armkv.memory.read import _bound_call, index_summaries

    c = _ranked_case("k4v4", 64, 203, 3, 64, 8, False, False, 17)
    query, key, value, valid, exact_k, exact_v, exact_valid, st, bias, _, scaling = c["read"]
    B, H, G = c["B"], c["H"], c["q"].shape[0]
    L, d = exact_k.shape[2], exact_k.shape[3]
    k = Vectorised(kernel, vectorised)
    tail = {
        "dense": {},
        "sparse": {"buckets": torch.arange(8).expand(G, 8), "take": c["take"]},
        "best": {"m": 8, "take": c["take"]},
        "partial": {"m": 8, "take": c["take"], "n": 8},
    }[rank]
    units = index_summaries(st, bias, c["index"])
    if rank != "dense":
        tail.update(zip(("unit_keys", "unit_values", "unit_log_weight"), units))

    def bound():
        return _bound_call(k, rank, st, bias, None, None if rank == "dense" else c["index"], **tail)

    def first(result):
        return result if rank in ("dense", "sparse") else result[0]

    def wide(x, dim):  # the same values in a view whose rows lie further apart
        return torch.cat([x, torch.zeros_like(x)], dim).narrow(dim, 0, x.shape[dim])

    model = (query, key, value, valid, exact_k, exact_v, exact_valid)
    flat = (
        query.reshape(G, -1, d),
        key.reshape(G, d),
        value.reshape(G, d),
        valid[:, 0].repeat_interleave(H),
        exact_k.reshape(G, L, d),
        exact_v.reshape(G, L, d),
        exact_valid.repeat_interleave(H, 0),
    )
    views = (
        wide(query, 3),
        wide(key, 3),
        wide(value, 3),
        valid.long(),
        wide(exact_k, 3),
        wide(exact_v, 3),
        wide(exact_valid, 1),
    )
    assert not views[0].is_contiguous() and not views[4].is_contiguous() and not views[6].is_contiguous()
    with torch.no_grad():
        want = first(bound()(*model, scaling))
        assert want.shape == (B, 1, query.shape[1], d)
        torch.testing.assert_close(first(bound()(*flat, scaling)).reshape(want.shape), want, rtol=0, atol=0)
        torch.testing.assert_close(first(bound()(*views, scaling)), want, rtol=0, atol=0)
        flat_views = (flat[0].transpose(0, 1).contiguous().transpose(0, 1), *flat[1:])  # (a group's heads G d apart)
        assert flat_views[0].stride(0) == d
        torch.testing.assert_close(first(bound()(*flat_views, scaling)).reshape(want.shape), want, rtol=0, atol=0)
        call = bound()
        for step in range(3):
            token = tuple(x + step if x.is_floating_point() else x for x in model)
            torch.testing.assert_close(first(call(*token, scaling)), first(bound()(*token, scaling)), rtol=0, atol=0)


@pytest.mark.parametrize("laid", [True, False])
@pytest.mark.parametrize("rank", ["sparse", "best", "partial"])
def test_a_bound_call_keeps_the_orders_runs_up_to_max_runs(kernel, laid, rank):
    """A sparse read's DecodeCall keeps the runs of consecutive slots of the index's order (a
    laid pool: one a group; else one more than the order's breaks, read.run_breaks), two int32
    a run and one more (nbytes), the bytes adapters.max_runs reserves in the budget; where a
    group has more than max_runs it keeps none and finds them at each call. The read is the
    same either way, bit for bit."""
    from armkv.memory.read import _bound_call

    c = _ranked_case("k4v4", 64, 203, 3, 16, 4, False, laid, 19)
    query, key, value, valid, exact_k, exact_v, exact_valid, st, bias, _, scaling = c["read"]
    G = c["q"].shape[0]
    tail = {"sparse": {"buckets": torch.arange(4).expand(G, 4)}, "best": {"m": 4}, "partial": {"m": 4, "n": 8}}[rank]
    runs = torch.ones(G, dtype=torch.long) if laid else c["index"].breaks.long() + 1  # (each group's)

    def bound(max_runs):
        return _bound_call(kernel, rank, st, bias, None, c["index"], take=c["take"], max_runs=max_runs, **tail)

    kept, capped = bound(int(runs.max())), bound(int(runs.max()) - 1)
    assert kept.nbytes() == int((8 * runs + 4).sum()) and bound(-1).nbytes() == kept.nbytes()
    assert capped.nbytes() == 0
    with torch.no_grad():
        args = (query, key, value, valid, exact_k, exact_v, exact_valid, scaling)
        for a, b in zip(kept(*args), capped(*args)) if rank != "sparse" else [(kept(*args), capped(*args))]:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_partial_rows_are_where_the_query_group_is_largest():
    """read.partial_rows: row c scores q_c^2 + q_{c+d/2}^2 summed over the group's heads; the n
    largest, ties to the lower row, returned in increasing order."""
    from armkv.memory.read import partial_rows

    q = torch.zeros(1, 2, 8)
    q[0, 0, 1], q[0, 1, 5] = 3.0, 2.0  # row 1 scores 9 + 4 (channels 1 and 5 = 1 + 8/2)
    q[0, 0, 2] = 3.5  # row 2: 12.25
    q[0, 1, 7] = 1.0  # row 3: 1; row 0: 0
    assert partial_rows(q, 2).tolist() == [[1, 2]]
    assert partial_rows(q, 3).tolist() == [[1, 2, 3]]
    assert partial_rows(torch.ones(1, 1, 8), 2).tolist() == [[0, 1]]  # ties: the lower rows


@pytest.mark.parametrize(
    "depth,branching,rep,m", [(3, 4, 3, 8), (2, 4, 1, 3), (2, 3, 5, 9), (3, 2, 4, 3), (1, 8, 2, 8)]
)
@pytest.mark.parametrize("scaling", [1.0, 1.25])
def test_fused_group_routing_equals_the_router(kernel, depth, branching, rep, m, scaling):
    """One decoded token's top-m buckets per KV head in one kernel call (Router.fused_group_topm:
    the query un-rotated inside) against Router.group_topm_buckets of the un-rotated query:
    the same buckets, best first, and the same group scores."""
    from armkv.memory.rope import Rotary
    from armkv.memory.route import Router

    B, H, d = 2, 3, 32
    torch.manual_seed(depth * 10 + branching + rep)
    router = Router(H, d, depth, branching)
    with torch.no_grad():
        router.read_bias.normal_()
    assert router.exhaustive(m)
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), attention_scaling=scaling)
    query = torch.randn(B, H * rep, 1, d) * 2
    positions = torch.tensor([[5], [4093]])
    with torch.no_grad():
        got = router.fused_group_topm(kernel, query, positions, rotary, m)
        q_pre = rotary.unrotate(query, positions.unsqueeze(1))
        want, want_scores = router.group_topm_buckets(q_pre.reshape(B, H, rep, 1, d), m)
        _, got_scores = kernel.group_leaf_topm(
            query.reshape(B * H, rep, d),
            positions[:, 0],
            rotary.inv_freq,
            rotary.scaling,
            router.weight.reshape(H, -1, d),
            router.read_bias.reshape(H, -1),
            router.read_scale,
            router._leaf_paths(query.device),
            branching,
            min(m, router.num_buckets),
        )
    assert torch.equal(got, want.reshape(B * H, -1))
    torch.testing.assert_close(got_scores, want_scores.reshape(B * H, -1), rtol=1e-5, atol=1e-5)


def test_fused_group_routing_stands_aside_for_the_beam_and_other_dtypes(kernel):
    """Large trees take the beam search, bfloat16 routers the PyTorch ops: the kernel returns None."""
    from armkv.memory.rope import Rotary
    from armkv.memory.route import Router

    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))
    query, positions = torch.randn(1, 2, 1, 16), torch.tensor([[3]])
    deep = Router(1, 16, 5, 4)
    assert not deep.exhaustive(2) and deep.fused_group_topm(kernel, query, positions, rotary, 2) is None
    half = Router(1, 16, 2, 4).to(torch.bfloat16)
    assert half.fused_group_topm(kernel, query, positions, rotary, 4) is None


@pytest.mark.parametrize(
    "S,occupied,N,d", [(37, 37, 11, 64), (37, 30, 29, 16), (701, 701, 64, 64), (9, 0, 5, 64), (900, 650, 257, 40)]
)
@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("demote_scope", ["any", "bucket"])
def test_fused_write_plan_equals_the_pytorch_plan(kernel, S, occupied, N, d, lazy, demote_scope):
    """plan_writes' choice among the slots by the kernel (write.plan_writes, fused) and by
    PyTorch ops: the same plan (targets, gate inputs, counts, buckets) and the same state
    after the merges that make room, with near-repeats of slots (merges), tokens of buckets
    no slot holds, padding, free slots, a pool short of room, and both neighbour searches
    (S at most EXACT_NEIGHBOURS and above it). With demote_scope="bucket" the kernel scores
    each token against its own bucket's slots only (``bucket_best_slots``) where the ops
    build every cosine and mask the other buckets."""
    from armkv.memory.write import WriteParams, WriteRule, plan_writes

    g = torch.Generator().manual_seed(S + N + d)
    G = 3
    params = WriteParams(d, "similarity", "scalar", 0.98).requires_grad_(False)
    assert params.increasing_in_cosine()
    st = MemoryState.empty(G, S, d)
    st.key[:, :occupied] = torch.randn(G, occupied, d, generator=g)
    st.value[:, :occupied] = torch.randn(G, occupied, d, generator=g)
    st.pos[:, :occupied] = torch.arange(occupied, dtype=torch.float32)
    st.count[:, :occupied] = torch.randint(1, 4, (G, occupied), generator=g).float()
    st.bucket[:, :occupied] = torch.randint(0, 6, (G, occupied), generator=g)
    keys = torch.randn(G, N, d, generator=g)
    if occupied:  # every third token nearly repeats a slot: it merges into it
        src = torch.randint(0, occupied, (G, N), generator=g)
        near = st.key.gather(1, src.unsqueeze(-1).expand(G, N, d)) * 1.001
        keys = torch.where((torch.arange(N) % 3 == 0).view(1, N, 1), near, keys)
    bucket = torch.randint(0, 7, (G, N), generator=g)  # bucket 6: no slot holds it
    if occupied:
        bucket = torch.where(torch.arange(N) % 3 == 0, st.bucket.gather(1, src), bucket)
    valid = torch.rand(G, N, generator=g) > 0.1
    with torch.no_grad():
        rule = WriteRule(lazy=lazy, demote_scope=demote_scope)
        got, got_state = plan_writes(st, keys, bucket, valid, params, rule)
        want, want_state = plan_writes(st, keys, bucket, valid, params, rule, fused=False)
    for name in ("target", "alpha", "cand", "count", "bucket"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)
    for name in ("key", "value", "pos", "count", "bucket"):
        torch.testing.assert_close(getattr(got_state, name), getattr(want_state, name), rtol=0, atol=0)
    assert (got.target >= 0).sum() == valid.sum()


@pytest.mark.parametrize("vectorised", [True, False])
@pytest.mark.parametrize("S,d", [(5, 8), (21, 12), (64, 64), (333, 37)])
def test_bucket_best_slots_equal_the_masked_max_of_all_cosines(kernel, vectorised, S, d):
    """bucket_best_slots (the write plan's fast path under demote_scope="bucket") against the
    masked max over the whole cosine matrix (rows of any length; the kernel normalises them): the same maxima and
    the first of equal cosines
    (slots repeated, so ties fall inside and across buckets), -inf and index 0 for a token
    whose bucket holds no slot, a negative token bucket or one beyond every slot's, and free
    slots (any negative bucket) never chosen; odd head sizes take the vectors' tails."""
    g = torch.Generator().manual_seed(S * d)
    G, N = 2, 9
    slots = torch.randn(G, S, d, generator=g) * torch.rand(G, S, 1, generator=g) * 3
    slots[:, S // 2 :] = slots[:, : S - S // 2].clone()  # every slot of the first half again: ties
    tokens = torch.randn(G, N, d, generator=g) * 2
    tokens[:, 0] = slots[:, 1] * 0.5  # a slot, scaled: cosine 1 (up to rounding)
    slot_bucket = torch.randint(-2, 4, (G, S), generator=g)
    token_bucket = torch.randint(0, 4, (G, N), generator=g)
    token_bucket[0, 1], token_bucket[1, 2], token_bucket[0, 3] = -1, 9, 3
    slot_bucket[0][slot_bucket[0] == 3] = -1  # group 0: bucket 3 holds no slot
    best, idx = kernel.bucket_best_slots(tokens, slots, slot_bucket, token_bucket, vectorised=vectorised)
    cos = torch.nn.functional.normalize(tokens, dim=-1) @ torch.nn.functional.normalize(slots, dim=-1).transpose(1, 2)
    mine = (slot_bucket >= 0).unsqueeze(1) & (slot_bucket.unsqueeze(1) == token_bucket.unsqueeze(2))
    want, want_idx = cos.masked_fill(~mine, -float("inf")).max(-1)
    has = mine.any(-1)
    torch.testing.assert_close(best[has], want[has], rtol=0, atol=1e-6)
    # the first of the best: no earlier slot of the bucket is as good (within rounding)
    chosen = cos.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    earlier = mine & (torch.arange(S) < idx.unsqueeze(-1)) & (cos >= chosen.unsqueeze(-1) - 1e-6)
    assert not earlier[has].any()
    assert (slot_bucket.gather(1, idx)[has] == token_bucket[has]).all()
    assert torch.isinf(best[~has]).all() and (idx[~has] == 0).all()
    assert not has[0, 1] and not has[1, 2] and not has[0, 3]


@pytest.mark.parametrize("vectorised", [True, False])
@pytest.mark.parametrize("S", [5, 8, 21, 64])
def test_fused_best_slots_ties_and_empty_rows(kernel, vectorised, S):
    """The kernel's own contract, on the AVX2 and the portable loops, against torch's masked
    max: the first of equal cosines wins (ties placed across 8-slot blocks), a token with no
    occupied slot of its bucket gets -inf and index 0, any negative slot bucket is free, and
    a negative token bucket matches nothing."""
    g = torch.Generator().manual_seed(S)
    cos = (torch.randint(-4, 5, (2, 6, S), generator=g) / 4).float()  # few distinct values: ties
    slot_bucket = torch.randint(-2, 3, (2, S), generator=g)
    token_bucket = torch.tensor([[0, 1, 2, 7, -1, 0], [2, 2, 1, 0, 5, -1]])
    same, same_idx, best, best_idx = kernel.best_slots(cos, slot_bucket, token_bucket, vectorised=vectorised)
    occ = slot_bucket >= 0
    mine = occ.unsqueeze(1) & (slot_bucket.unsqueeze(1) == token_bucket.unsqueeze(2)) & (token_bucket >= 0).unsqueeze(2)
    want_same, want_same_idx = cos.masked_fill(~mine, -float("inf")).max(-1)
    want_best, want_best_idx = cos.masked_fill(~occ.unsqueeze(1), -float("inf")).max(-1)
    assert torch.equal(same, want_same) and torch.equal(best, want_best)
    assert torch.equal(torch.where(mine.any(-1), same_idx, 0), torch.where(mine.any(-1), want_same_idx, 0))
    assert torch.equal(
        torch.where(occ.any(-1, keepdim=True), best_idx, 0), torch.where(occ.any(-1, keepdim=True), want_best_idx, 0)
    )
    assert (same_idx[~mine.any(-1)] == 0).all() and torch.isinf(same[~mine.any(-1)]).all()
    assert torch.isinf(same[0, 3]) and torch.isinf(same[0, 4]) and torch.isinf(same[1, 5])


@pytest.mark.parametrize("d,slots", [(64, 37), (128, 5), (16, 1), (40, 19)])
@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("unmix", [True, False])
@pytest.mark.parametrize("fmt", ["k4v4", "k8v4"])
def test_fused_dequantise_equals_the_pytorch_ops(kernel, d, slots, mixed, unmix, fmt):
    """MemoryState.kv of k4v4 and k8v4 slots by the kernel and by PyTorch ops: the same float
    keys and values, mixed slots unmixed or left in their basis, free slots zero (odd slot
    counts; d = 40 cannot be mixed and is stored plain)."""
    mixed = mixed and d & (d - 1) == 0
    g = torch.Generator().manual_seed(d + slots)
    st = MemoryState.empty(2, slots, d)
    st.key.copy_(torch.randn(2, slots, d, generator=g) * 3)
    st.value.copy_(torch.randn(2, slots, d, generator=g))
    st.count.fill_(1)
    st.key[:, -1:], st.value[:, -1:], st.count[:, -1:] = 0, 0, 0
    packed = st.pack(fmt, mix=mixed)
    got = packed.kv(torch.float32, unmix=unmix)
    want = packed.kv(torch.float32, unmix=unmix, fused=False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0][:, -1], torch.zeros(2, d)) and torch.equal(got[1][:, -1], torch.zeros(2, d))


@pytest.mark.parametrize(
    "sinks,window,batch,heads,d", [(4, 48, 1, 3, 64), (0, 5, 3, 2, 7), (2, 1, 2, 1, 33), (3, 13, 4, 5, 16)]
)
def test_fused_ring_push_equals_the_pytorch_push(kernel, sinks, window, batch, heads, d):
    """The decode step's window push in one kernel call (ExactBuffer.fused_push) against the
    PyTorch ops: the same entries leave, and every state tensor (window keys, values,
    validity, positions, the ring's head) ends the same, bit for bit, with padding rows,
    a window that is not yet full, and decode steps between chunk pushes."""
    from armkv.methods.buffers import ExactBuffer

    g = torch.Generator().manual_seed(sinks + window + batch + d)
    bufs = [ExactBuffer(sinks, window, batch, heads, d) for _ in range(2)]
    bufs[1].fused_push = False
    start = torch.zeros(batch, dtype=torch.long)
    for t in [5, 1, 1, 1, 1, 1, 1, 1, 7, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]:
        key, value = torch.randn(batch, heads, t, d, generator=g), torch.randn(batch, heads, t, d, generator=g)
        valid = torch.rand(batch, t, generator=g) > 0.25
        positions = start[:, None] + valid.long().cumsum(1) - 1
        start = positions[:, -1] + 1
        got, want = (b.push(key, value, valid, positions) for b in bufs)
        for a, b in zip(
            (got.key, got.value, got.valid, got.positions), (want.key, want.value, want.valid, want.positions)
        ):
            assert torch.equal(a, b)
        for name in ("k", "v", "valid", "pos", "head"):
            assert torch.equal(getattr(bufs[0], name), getattr(bufs[1], name)), name
    assert bufs[0]._ring and bufs[1]._ring


def test_a_stale_build_lock_is_removed_with_a_warning(tmp_path, monkeypatch, capsys):
    """A build lock left by a killed process would make every later load wait forever: a load
    waits while it may be another process's build, and removes it, with a warning that names
    it, once it is older than a build takes; a lock its builder removes ends the wait."""
    import threading
    import time

    from armkv.memory import kernels as k

    lock = tmp_path / "lock"
    k._wait_for_lock(lock)  # no lock: nothing to do
    lock.write_text("")
    threading.Timer(0.3, lock.unlink).start()  # another process's build ends
    start = time.monotonic()
    k._wait_for_lock(lock, poll_s=0.05)
    assert 0.25 < time.monotonic() - start < 10
    assert "waiting for another process's kernel build" in capsys.readouterr().err

    lock.write_text("")  # a killed build's lock: removed once stale
    monkeypatch.setattr(k, "STALE_LOCK_S", 0.3)
    with pytest.warns(RuntimeWarning, match=f"removed {lock}"):
        k._wait_for_lock(lock, poll_s=0.05)
    assert not lock.exists()
