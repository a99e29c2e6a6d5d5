"""The Triton reads (armkv.memory.triton) in triton's interpreter on this CPU
(TRITON_INTERPRET=1, set by a fixture before the kernels are imported): each kernel against the C++
DecodeCall on the same inputs and against the PyTorch reference (read.gathered_read of the
slots read, fused=False), at odd sizes (37 and 203 slots, buckets of uneven size, three
query heads a KV head, two batch rows, head_dim 64), with float32, float16 and bfloat16
token inputs; the ranked reads choose the same buckets as both.

The C++ call takes float32 inputs: for float16 and bfloat16 it reads the same (rounded)
values in float32, so the two differ by the rounding of the output to the dtype.
Skipped where triton is not installed, unless ARMKV_REQUIRE_TRITON=1 (CI), where that fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from armkv.memory import kernels
from armkv.memory import triton as tk
from armkv.memory.read import (
    _bound_call,
    gather_slots,
    gathered_read,
    index_summaries,
    read_slots,
    slots_of_buckets,
)
from test_kernels import _assert_ranked_read, _random_pool, _ranked_case

if not tk.available():
    if os.environ.get("ARMKV_REQUIRE_TRITON") == "1":
        raise RuntimeError("ARMKV_REQUIRE_TRITON=1 but triton is not installed: pip install 'armkv[gpu]'")
    pytest.skip("triton is not installed (pip install 'armkv[gpu]')", allow_module_level=True)

# the output's rounding to the dtype (eps: float16 9.8e-4, bfloat16 7.8e-3 of values up to about 3)
TOL = {
    torch.float32: dict(rtol=1e-5, atol=2e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """TRITON_INTERPRET=1 while this module's tests run (the kernels' module is imported at
    the first read, under it: its kernels then run on CPU tensors), restored after."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = before


@pytest.fixture(scope="module")
def cpp():
    module = kernels.int4_read()
    if module is None:
        if os.environ.get("ARMKV_REQUIRE_KERNELS") == "1":
            pytest.fail("the fused int4 read kernel did not build (see the warning above)")
        pytest.skip("the C++ kernels could not be built here")
    return module


def _tokens(c: dict, dtype: torch.dtype):
    """A case's token inputs in ``dtype``, and the same values in float32 (what the C++ call reads)."""
    query, key, value, valid, exact_k, exact_v, exact_valid = c["read"][:7]
    low = [t.to(dtype) for t in (query, key, value)], [t.to(dtype) for t in (exact_k, exact_v)]
    ours = (*low[0], valid, *low[1], exact_valid)
    wide = (*(t.float() for t in low[0]), valid, *(t.float() for t in low[1]), exact_valid)
    return ours, wide


def _gathered(c: dict, wide, ids: torch.Tensor, used: torch.Tensor):
    """The PyTorch reference: gathered_read of the slots ids [G, 1, W] (used: which count)."""
    query, key, value, valid, exact_k, exact_v, exact_valid = wide
    return read_slots(
        query, key, value, valid, c["read"][-1], exact_k, exact_v, exact_valid, c["st"], c["bias"], ids, used, False
    )


def _close(got, want, dtype):
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).removeprefix("torch."))
@pytest.mark.parametrize("fmt,mixed,splits", [("k4v4", True, 2), ("k8v4", False, None)])
def test_dense_decode_read_equals_the_cpp_call_and_the_pytorch_read(cpp, dtype, fmt, mixed, splits):
    """Every slot of 37 (a quarter free), the exact entries (some invalid), a padding token,
    and a group with nothing to read at all (zeros); the slots cut into 2 shares or 1."""
    c = _ranked_case(fmt, 64, 37, 3, 5, 3, mixed, False, 23)
    st, bias, mix, scaling = c["st"], c["bias"], c["read"][9], c["read"][10]
    c["bias"] = bias = bias.clone()
    bias[-1] = -torch.inf  # the last group (batch row 1: a padding token) reads no slot
    c["read"][6][1] = False  # nor any exact entry
    ours, wide = _tokens(c, dtype)
    with torch.no_grad():
        got = tk.DecodeCall("dense", st.key, st.key_scale, st.value, st.value_scale, bias, mix, splits=splits)(
            *ours, scaling
        )
        want = _bound_call(cpp, "dense", st, bias, mix)(*wide, scaling)
        G, S = bias.shape
        ref = _gathered(c, wide, torch.arange(S).expand(G, 1, S), torch.ones(G, 1, S, dtype=torch.bool))
    _close(got, want, dtype)
    _close(got, ref, dtype)
    assert (got[1, 0, -3:] == 0).all()


def test_flat_token_inputs_read_as_the_models_layout():
    """The token inputs flat by group ([G, R, d], [G, d], [G], [G, L, d], [G, L]) give the
    same read as the model's layout, in [G, R, d]."""
    c = _ranked_case("k4v4", 64, 37, 3, 5, 3, False, False, 29)
    query, key, value, valid, exact_k, exact_v, exact_valid, st, bias, mix, scaling = c["read"]
    G, H, L, d = c["q"].shape[0], c["H"], exact_k.shape[2], 64
    call = tk.DecodeCall("dense", st.key, st.key_scale, st.value, st.value_scale, bias, torch.empty(0))
    flat = (
        query.reshape(G, -1, d),
        key.reshape(G, d),
        value.reshape(G, d),
        valid[:, 0].repeat_interleave(H),
        exact_k.reshape(G, L, d),
        exact_v.reshape(G, L, d),
        exact_valid.repeat_interleave(H, 0),
    )
    with torch.no_grad():
        model = call(query, key, value, valid, exact_k, exact_v, exact_valid, scaling)
        got = call(*flat, scaling)
    assert got.shape == (G, 3, d)
    torch.testing.assert_close(got.reshape(model.shape), model, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).removeprefix("torch."))
@pytest.mark.parametrize("fmt,mixed,laid,summaries", [("k4v4", False, True, True), ("k8v4", True, False, False)])
def test_sparse_decode_read_equals_the_cpp_call_and_the_gathered_read(cpp, dtype, fmt, mixed, laid, summaries):
    """The slots of each group's first ``take`` of its chosen buckets (9 buckets of uneven
    size over 203 slots; a row reading fewer, a group reading none, a chosen id out of range),
    read where they lie (a pool in any order, or laid bucket by bucket); with ``summaries``
    each skipped bucket one entry (against the C++ call, which test_sparse_read checks)."""
    c = _ranked_case(fmt, 64, 203, 3, 9, 3, mixed, laid, 31)
    st, bias, mix, scaling, index, take = c["st"], c["bias"], c["read"][9], c["read"][10], c["index"], c["take"]
    G = bias.shape[0]
    g = torch.Generator().manual_seed(5)
    picked = torch.stack([torch.randperm(9, generator=g)[:3] for _ in range(G)])
    picked[0, 2] = 11  # (an id outside [0, N_b): skipped)
    tail = dict(buckets=picked, take=take)
    if summaries:
        tail.update(zip(("unit_keys", "unit_values", "unit_log_weight"), index_summaries(st, bias, index)))
    ours, wide = _tokens(c, dtype)
    with torch.no_grad():
        got = _bound_call(tk, "sparse", st, bias, mix, index, **tail)(*ours, scaling)
        want = _bound_call(cpp, "sparse", st, bias, mix, index, **tail)(*wide, scaling)
        _close(got, want, dtype)
        if not summaries:
            reads = (torch.arange(3).view(1, 1, 3) < take.view(G, 1, 1)) & (picked < 9).view(G, 1, 3)
            ids, used = slots_of_buckets(index, picked.clamp_max(8).view(G, 1, 3), None, reads)
            _close(got, _gathered(c, wide, ids, used), dtype)


@pytest.mark.parametrize("rank", ["best", "partial"])
@pytest.mark.parametrize(
    "dtype,fmt,mixed,laid,summaries",
    [
        (torch.float32, "k4v4", True, False, False),
        (torch.float32, "k8v4", False, True, True),
        (torch.bfloat16, "k4v4", False, True, False),
        (torch.float16, "k4v4", True, True, True),
    ],
    ids=["f32-k4v4-mixed", "f32-k8v4-laid-summaries", "bf16-k4v4-laid", "f16-k4v4-mixed-laid-summaries"],
)
def test_ranked_decode_reads_choose_the_cpp_calls_buckets(cpp, rank, dtype, fmt, mixed, laid, summaries):
    """read_rank "best" (every key's logit) and "partial" (the 8 key-code rows where the query
    is largest, the query rounded to int8): each group's m = 3 best of 7 buckets, best first,
    equal to the C++ call's and to the PyTorch ranking (read.bucket_best of
    MemoryState.key_scores / partial_key_scores); the read equal to the C++ call's and to
    the gathered PyTorch read of those buckets."""
    from armkv.memory.read import partial_rows

    c = _ranked_case(fmt, 64, 203, 3, 7, 3, mixed, laid, 37)
    st, bias, mix, scaling, index, take = c["st"], c["bias"], c["read"][9], c["read"][10], c["index"], c["take"]
    tail = dict(m=3, take=take, n=8 if rank == "partial" else 0)
    if summaries:
        tail.update(zip(("unit_keys", "unit_values", "unit_log_weight"), index_summaries(st, bias, index)))
    ours, wide = _tokens(c, dtype)
    with torch.no_grad():
        got, chosen = _bound_call(tk, rank, st, bias, mix, index, **tail)(*ours, scaling)
        want, theirs = _bound_call(cpp, rank, st, bias, mix, index, **tail)(*wide, scaling)
        assert torch.equal(chosen, theirs)
        _close(got, want, dtype)
        if dtype == torch.float32 and not summaries:  # the PyTorch ranking, and the gathered read of its buckets
            q = c["q"]
            scores = st.key_scores(q, fused=False) if rank == "best" else st.partial_key_scores(q, partial_rows(q, 8))
            _assert_ranked_read(c, got, chosen, scores, 3, 7)


@pytest.mark.parametrize("d,fmt,mixed", [(40, "k8v4", True), (48, "k4v4", False)])
@pytest.mark.parametrize("rank", ["dense", "partial"])
def test_odd_head_sizes_read_as_the_cpp_call(cpp, d, fmt, mixed, rank):
    """Head sizes whose halves fill no power of two (20 and 24 channels, one scale group; a
    random orthogonal mixing at 40), five query heads a KV head, 61 slots: the same read, and
    for read_rank="partial" the same buckets, as the C++ call."""
    c = _ranked_case(fmt, d, 61, 5, 6, 2, mixed, False, 53)
    st, bias, mix, scaling = c["st"], c["bias"], c["read"][9], c["read"][10]
    index, tail = (None, {}) if rank == "dense" else (c["index"], dict(m=2, take=c["take"], n=5))
    _, wide = _tokens(c, torch.float32)
    with torch.no_grad():
        got = _bound_call(tk, rank, st, bias, mix, index, **tail)(*wide, scaling)
        want = _bound_call(cpp, rank, st, bias, mix, index, **tail)(*wide, scaling)
    if rank != "dense":
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    _close(got, want, torch.float32)


@pytest.mark.parametrize("rank", ["sparse", "best", "partial"])
def test_reads_of_many_small_pages_equal_the_cpp_call(cpp, rank):
    """read_pages: 9 buckets of 203 slots cut into pages of at most ceil(occupied / 24) slots
    (48 units, most of a few slots), m = 20 of them read with their summaries: the chosen
    pages span two shares of 16 and their slots are packed several pages to a block, the
    skipped units' entries two shares of 32, the ranking 16 units a program; the same pages
    and the same read as the C++ call."""
    from armkv.memory.read import paged_index

    c = _ranked_case("k4v4", 64, 203, 3, 9, 3, False, True, 47)
    st, bias, scaling, take = c["st"], c["bias"], c["read"][10], c["take"]
    pages = paged_index(c["index"], 24)
    G, U = bias.shape[0], pages.size.shape[1]
    assert U == 48 and int(pages.size.max()) < 16
    take = take * 20 // 3  # (20, 13, 20, 0: rows and groups reading fewer)
    tail = dict(
        take=take, **dict(zip(("unit_keys", "unit_values", "unit_log_weight"), index_summaries(st, bias, pages)))
    )
    if rank == "sparse":
        g = torch.Generator().manual_seed(7)
        tail["buckets"] = torch.stack([torch.randperm(U, generator=g)[:20] for _ in range(G)])
    else:
        tail.update(m=20, n=8 if rank == "partial" else 0)
    _, wide = _tokens(c, torch.float32)
    with torch.no_grad():
        got = _bound_call(tk, rank, st, bias, None, pages, **tail)(*wide, scaling)
        want = _bound_call(cpp, rank, st, bias, None, pages, **tail)(*wide, scaling)
    if rank != "sparse":
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    _close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).removeprefix("torch."))
@pytest.mark.parametrize("fmt,mixed", [("k4v4", True), ("k8v4", False)])
def test_dense_chunk_read_equals_the_gathered_read_of_every_slot(dtype, fmt, mixed):
    """A prefill chunk of 5 tokens (some padding) over every slot of a 37-slot pool, the
    exact entries and the chunk causally, three query heads a KV head, in blocks of 16 query
    rows (so that a block ends inside a token's heads): read.gathered_read of every slot."""
    g = torch.Generator().manual_seed(41)
    B, H, R, T, L, S, d = 2, 2, 3, 5, 7, 37, 64
    st, _ = _random_pool(B * H, S, d, 5, fmt, mixed, False, g)
    bias = torch.where(st.count > 0, st.count.clamp_min(1).log(), -torch.inf).view(B, H, S)
    query = torch.randn(B, H * R, T, d, generator=g).to(dtype)
    key, value = (torch.randn(B, H, T, d, generator=g).to(dtype) for _ in range(2))
    valid = torch.rand(B, T, generator=g) > 0.2
    exact_valid = torch.rand(B, L, generator=g) > 0.3
    exact_k, exact_v = (
        (torch.randn(B, H, L, d, generator=g) * exact_valid[:, None, :, None]).to(dtype) for _ in range(2)
    )
    got = tk.dense_chunk_read(query, key, value, valid, 0.3, exact_k, exact_v, exact_valid, st, bias, block=16)
    ids = torch.arange(S).expand(B * H, T, S)
    wide = [t.float() for t in (query, key, value, exact_k, exact_v)]
    ref = gathered_read(
        wide[0],
        wide[1],
        wide[2],
        valid,
        0.3,
        wide[3],
        wide[4],
        exact_valid,
        gather_slots(st, ids, for_reading=True),
        bias.unsqueeze(2).expand(B, H, T, S),
        fused=False,
    )
    _close(got, ref, dtype)


def test_bad_calls_say_what_to_change(monkeypatch):
    c = _ranked_case("k4v4", 64, 37, 3, 5, 3, False, False, 43)
    st, bias, index, take = c["st"], c["bias"], c["index"], c["take"]
    args = (st.key, st.key_scale, st.value, st.value_scale, bias, torch.empty(0))
    with pytest.raises(ValueError, match="kind is dense, sparse, best or partial"):
        tk.DecodeCall("nope", *args)
    with pytest.raises(ValueError, match="the dense read takes no index"):
        tk.DecodeCall("dense", *args, order=index.order)
    with pytest.raises(ValueError, match="1 <= m <= N_b"):
        tk.DecodeCall("best", *args, order=index.order, start=index.start, size=index.size, take=take, m=6)
    with pytest.raises(ValueError, match="1 <= n <= d / 2"):
        tk.DecodeCall("partial", *args, order=index.order, start=index.start, size=index.size, take=take, m=2, n=33)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        tk.DecodeCall("dense", *args)


def test_the_package_imports_without_triton():
    """armkv.memory.triton imports triton only when a kernel runs: without it, the import
    works and available() says so."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import armkv.memory.triton as t\n"
        "assert not t.available() and 'not installed' in t.describe()\n"
        "assert 'triton' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert done.returncode == 0, done.stderr[-2000:]


AOT = r"""
import inspect, json, sys, time
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from armkv.memory.triton import kernels as K

def build(fn, types, consts):
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    t0 = time.time()
    done = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return {"kernel": fn.fn.__name__, "consts": consts, "s": round(time.time() - t0, 1), "shared": done.metadata.shared}

tokens = dict(q="*bf16", kk="*bf16", vv="*bf16", ek="*bf16", ev="*bf16", eok="*u8", kc="*u8", ks="*bf16", vc="*u8",
              vs="*bf16", bias="*fp32", mix="*fp32", scaling="fp32")
part = dict(tokens, own_ok="*u8", part_m="*fp32", part_l="*fp32", part_acc="*fp32", uk="*fp32", uv="*fp32",
            ulw="*fp32", order="*i32", start="*i32", size="*i32", chosen="*i64", take="*i64")
block = dict(BR=16, BH=64, BS=64, BM=64, BC=16)
dense = dict(MIXED=True, KEY_INT8=False, SPARSE=False, HAS_ORDER=False, HAS_UNITS=False, **block)
sparse = dict(MIXED=False, KEY_INT8=True, SPARSE=True, HAS_ORDER=True, HAS_UNITS=True, **block)
parts = dict(part_m="*fp32", part_l="*fp32", part_acc="*fp32", out="*bf16", mix="*fp32")
rank = dict(qm="*fp32", ks="*bf16", bias="*fp32", order="*i32", start="*i32", size="*i32", best="*fp32",
            qi="*fp32", f="*fp32", rows="*i32", scaling="fp32")
ranks = dict(BR=16, BH=64, BS=64, BN=16, BU=16)
out = [
    build(K.decode_partials, part, dense),
    build(K.decode_partials, dict(part, kc="*i8"), sparse),
    build(K.decode_combine, parts, dict(MIXED=True, BR=16, BH=64)),
    build(K.unit_best, dict(rank, kc="*u8"), dict(PARTIAL=True, KEY_INT8=False, HAS_ORDER=True, NGK=4, **ranks)),
    build(K.unit_best, dict(rank, kc="*i8"), dict(PARTIAL=False, KEY_INT8=True, HAS_ORDER=False, NGK=1, **ranks)),
]
if sys.argv[1] == "all":
    chunk = dict(MIXED=True, KEY_INT8=False, BM=64, BH=64, BS=64)
    out.append(build(K.chunk_read, dict(tokens, valid="*u8", out="*bf16"), chunk))
print(json.dumps(out))
"""


def test_the_kernels_compile_for_an_h100(tmp_path):
    """The interpreter runs the kernels' Python; a GPU compiles them, which checks more
    (types across branches, tl.dot's shapes, shared memory). Here the GPU path's kernels are
    compiled for sm_90 (H100, H200) without a GPU, Llama-3.1-8B's head size in bfloat16: each
    must build, within an H100's 227 KB of shared memory a program."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", AOT, "all"], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(built) == 6 and all(k["shared"] <= 227 * 1024 for k in built), built
