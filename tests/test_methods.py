"""The cache methods: the joint attention kernel, KIVI's quantiser, budgets at every step."""

import pytest
import torch

from armkv.config import ARMConfig
from armkv.errors import ArmkvError
from armkv.hf.attach import make_cache
from armkv.memory.module import ARMModel
from armkv.memory.rope import Rotary
from armkv.methods.attention import joint_attention, joint_attention_reference, safe_softmax, safe_softmax_reference
from armkv.methods.base import METHODS, ModelInfo, _load_builtin_methods, get_method
from armkv.methods.kivi import pack, quantise, unpack
from conftest import DEVICES, DTYPES, dtype_id, tiny_model

_load_builtin_methods()
BOUNDED = sorted(name for name, m in METHODS.items() if m.bounded)


def naive_attention(
    query,
    key,
    value,
    valid,
    scaling,
    state_key=None,
    state_value=None,
    state_valid=None,
    state_bias=None,
    state_mask=None,
):
    """Per (row, head, query) loop: one softmax over the allowed state keys and chunk keys."""
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    out = torch.zeros(b, t, hq, d, dtype=torch.float64)
    for i in range(b):
        for h in range(hq):
            kv = h // (hq // hkv)
            for q in range(t):
                logits, values = [], []
                if state_key is not None:
                    for j in range(state_key.shape[2]):
                        ok = (
                            True
                            if state_valid is None
                            else bool(state_valid[i, j] if state_valid.dim() == 2 else state_valid[i, kv, j])
                        )
                        if state_mask is not None:
                            ok = ok and bool(state_mask[i, h, q, j])
                        if ok:
                            bias = 0.0 if state_bias is None else float(state_bias[i, kv, j])
                            logits.append(float(query[i, h, q] @ state_key[i, kv, j]) * scaling + bias)
                            values.append(state_value[i, kv, j].double())
                for j in range(q + 1):
                    if valid[i, j]:
                        logits.append(float(query[i, h, q] @ key[i, kv, j]) * scaling)
                        values.append(value[i, kv, j].double())
                if logits:
                    w = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                    out[i, q, h] = (w[:, None] * torch.stack(values)).sum(0)
    return out


@pytest.mark.parametrize("with_state", [False, True])
def test_joint_attention_matches_naive(with_state):
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, t, n, d = 2, 4, 2, 5, 7, 8
    q = torch.randn(b, hq, t, d, generator=g)
    k, v = torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g)
    valid = torch.rand(b, t, generator=g) > 0.3
    valid[:, 0] = False  # a padding query that sees no chunk key at all
    kwargs = {}
    if with_state:
        sk = torch.randn(b, hkv, n, d, generator=g)
        sv = torch.randn(b, hkv, n, d, generator=g)
        svalid = torch.rand(b, hkv, n, generator=g) > 0.4
        sk[~svalid] = float("nan")  # unwritten state: must never be read
        sv[~svalid] = float("nan")
        kwargs = dict(
            state_key=sk,
            state_value=sv,
            state_valid=svalid,
            state_bias=torch.rand(b, hkv, n, generator=g),
            state_mask=torch.rand(b, hq, t, n, generator=g) > 0.3,
        )
    got = joint_attention(q, k, v, valid, 0.3, **kwargs)
    want = naive_attention(q, k, v, valid, 0.3, **kwargs)
    assert got.shape == (b, t, hq, d)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["chunk_only", "state_rows", "state_heads", "per_query", "decode", "decode_rows"])
def test_joint_attention_fused_equals_reference_outputs_and_gradients(case):
    """The fused kernel (SDPA over [state | chunk]; for one token, the decode path's two
    matmuls) against the written-out softmax, fp64."""
    g = torch.Generator().manual_seed(1)
    b, hq, hkv, d = 3, 6, 2, 7
    t, n = (1, 13) if case.startswith("decode") else (11, 0 if case == "chunk_only" else 9)
    f64 = dict(dtype=torch.float64)
    q = torch.randn(b, hq, t, d, generator=g, **f64).requires_grad_()
    k = torch.randn(b, hkv, t, d, generator=g, **f64).requires_grad_()
    v = torch.randn(b, hkv, t, d, generator=g, **f64).requires_grad_()
    valid = torch.rand(b, t, generator=g) > 0.3
    valid[0, 0] = False  # a padding query (no key at all when there is no state)
    kwargs = {}
    if n:
        sk = torch.randn(b, hkv, n, d, generator=g, **f64)
        sv = torch.randn(b, hkv, n, d, generator=g, **f64)
        rows = case in ("state_rows", "decode_rows")
        svalid = torch.rand(b, hkv, n, generator=g) > 0.4 if not rows else torch.rand(b, n, generator=g) > 0.4
        mask_kv = svalid if svalid.dim() == 3 else svalid[:, None].expand(b, hkv, n)
        sk[~mask_kv], sv[~mask_kv] = float("nan"), float("nan")  # unwritten state is never read
        kwargs = dict(state_key=sk.requires_grad_(), state_value=sv.requires_grad_(), state_valid=svalid)
        if not rows:
            kwargs["state_bias"] = torch.rand(b, hkv, n, generator=g, **f64).requires_grad_()
        if case in ("per_query", "decode"):
            kwargs["state_mask"] = torch.rand(b, hq, t, n, generator=g) > 0.5
    leaves = [x for x in (q, k, v, *kwargs.values()) if x.dtype == torch.float64]
    grads = {}
    for name, fn in (("fused", joint_attention), ("reference", joint_attention_reference)):
        out = fn(q, k, v, valid, 0.37, **kwargs)
        assert not out.isnan().any()
        grads[name] = (out.detach(), *[x.nan_to_num() for x in torch.autograd.grad((out * out).sum(), leaves)])
    for got, want in zip(grads["fused"], grads["reference"]):
        torch.testing.assert_close(got, want)
    if case == "chunk_only":
        assert (grads["fused"][0][0, 0] == 0).all()  # a padding query that sees no key: zeros


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("t,n", [(11, 9), (3, 40), (17, 1)])
def test_split_attention_equals_the_one_softmax_path(rows, t, n, monkeypatch):
    """A chunk's read without gradients on a CPU (the prefill): two flash attentions, over
    the state with its mask as one broadcast row and over the chunk causally, merged by
    their log-sum-exps, against one softmax over [state | chunk] and the naive loop; with
    padding, unwritten state entries (NaN), per-key biases, a batch row whose state is all
    unwritten and a query that sees no key at all (zeros)."""
    import armkv.methods.attention as attention

    if attention._flash_with_lse() is None:
        pytest.skip("this torch has no CPU flash attention with log-sum-exp")
    g = torch.Generator().manual_seed(t * n)
    b, hq, hkv, d = 3, 6, 2, 7
    q = torch.randn(b, hq, t, d, generator=g)
    k, v = torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g)
    valid = torch.rand(b, t, generator=g) > 0.3
    valid[0, 0] = False  # a padding query: with row 0's state all unwritten it sees no key
    sk, sv = torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    svalid = torch.rand(b, n, generator=g) > 0.4 if rows else torch.rand(b, hkv, n, generator=g) > 0.4
    svalid[0] = False
    mask_kv = svalid if svalid.dim() == 3 else svalid[:, None].expand(b, hkv, n)
    sk[~mask_kv], sv[~mask_kv] = float("nan"), float("nan")
    kwargs = dict(state_key=sk, state_value=sv, state_valid=svalid)
    if not rows:
        kwargs["state_bias"] = torch.rand(b, hkv, n, generator=g)
    with torch.no_grad():
        split = attention.joint_attention(q, k, v, valid, 0.37, **kwargs)
        monkeypatch.setattr(attention, "SPLIT_ATTENTION", False)
        one = attention.joint_attention(q, k, v, valid, 0.37, **kwargs)
    assert not split.isnan().any() and (split[0, 0] == 0).all()
    torch.testing.assert_close(split, one, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(split.double(), naive_attention(q, k, v, valid, 0.37, **kwargs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spread", [1.0, 40.0, 400.0])  # 400: most logits underflow exp
def test_safe_softmax_fast_path_equals_the_written_out_one(spread):
    """torch's fused softmax (no gradient wanted) against the written-out form: the same
    weights, -inf entries 0, a row with every entry excluded all zeros (not NaN), at odd sizes."""
    g = torch.Generator().manual_seed(int(spread))
    scores = torch.randn(2, 3, 5, 37, generator=g) * spread
    scores[..., 30:] = float("-inf")
    scores[0, 1, 2] = float("-inf")  # a row with nothing to read
    fast, ref = safe_softmax(scores), safe_softmax_reference(scores)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-7)
    assert (fast[0, 1, 2] == 0).all() and (fast[..., 30:] == 0).all()
    # with gradients the written-out form serves: finite gradients through the empty row
    leaf = scores.clone().requires_grad_()
    out = safe_softmax(leaf.masked_fill(torch.isinf(scores), float("-inf")))
    out.square().sum().backward()
    assert torch.isfinite(leaf.grad).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_quantiser_error_bound(bits):
    x = torch.randn(3, 2, 32, 16) * 3
    for dim in (2, 3):
        codes, scale, zero = quantise(x, bits, dim)
        assert codes.max() < 2**bits
        assert torch.equal(unpack(pack(codes, bits), bits), codes)
        err = (codes * scale + zero - x).abs()
        assert (err <= scale / 2 + 1e-5).all()


def info(layers=2, heads=4, kv=2, d=16, dtype=torch.float32, device="cpu"):
    return ModelInfo(
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=d,
        max_positions=1 << 16,
        dtype=dtype,
        device=torch.device(device),
    )


def rotary(d=16, device="cpu"):
    return Rotary(1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d)))


def run_layer(layer, steps, batch, info_, generator, chunk_tokens):
    """Feed random chunks (with random left padding in the first), in ``info_``'s dtype and
    on its device; yield after each call."""
    d, hq, hkv = info_.head_dim, info_.num_heads, info_.num_kv_heads
    on = dict(dtype=info_.dtype, device=info_.device)
    pos = torch.zeros(batch, dtype=torch.long)
    for step in range(steps):
        t = chunk_tokens if step == 0 else 1
        valid = torch.ones(batch, t, dtype=torch.bool)
        if step == 0:
            for i in range(batch):
                valid[i, : int(torch.randint(0, t // 2, (1,), generator=generator))] = False
        positions = pos[:, None] + valid.long().cumsum(1) - 1
        pos = positions[:, -1] + 1
        out = layer.attend(
            torch.randn(batch, hq, t, d, generator=generator).to(**on),
            torch.randn(batch, hkv, t, d, generator=generator).to(**on),
            torch.randn(batch, hkv, t, d, generator=generator).to(**on),
            valid.to(info_.device),
            positions.clamp(min=0).to(info_.device),
            d**-0.5,
        )
        assert out.dtype == info_.dtype and out.device.type == info_.device.type
        yield out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("method", BOUNDED)
def test_bounded_methods_stay_within_budget_at_every_step(method, dtype, device, nan_empty):
    """The budget in bytes of the model's dtype (a bfloat16 token-equivalent is half a
    float32 one) holds after every chunk and decode step, in every dtype and device."""
    info_, batch, budget = info(dtype=dtype, device=device), 3, 96
    layer = get_method(method).make_layer(0, info_, rotary(device=device), budget, 16)
    bound = info_.budget_bytes(budget) * batch
    g = torch.Generator().manual_seed(1)
    sizes = []
    for out in run_layer(layer, 120, batch, info_, g, 300):
        assert not out.isnan().any()
        assert layer.state_bytes() <= bound
        sizes.append(layer.state_bytes())
    # attend() records the peak after every chunk of the prefill, so this covers each sync point.
    assert layer.peak_bytes <= bound
    # Sizes may cycle (ARM keeps tokens waiting for their write exact) but must not trend up.
    assert max(sizes[-50:]) <= max(sizes[-100:-50]), "a bounded method must not grow while decoding"


SPARSE_ARM = [
    {"read_rank": "best"},
    {"read_rank": "partial", "slot_mixing": False},
    {"read_rank": "partial", "slot_mixing": False, "read_pages": True},
    {"read_rank": "partial", "slot_mixing": False, "read_pages": True, "page_split": 4},
    {"read_rank": "partial", "slot_mixing": False, "read_pages": True, "read_summaries": True},
    {"read_rank": "tree", "slot_ladder": "int8,k8v4"},
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("options", SPARSE_ARM, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_arm_reading_fewer_buckets_stays_within_budget(dtype, options):
    """At a fixed M < N_b the layer keeps its bucket index (and pages, and with
    ``read_summaries`` their entries) between writes: the slots give way to them, and the
    budget holds at every step."""
    info_, batch, budget = info(dtype=dtype), 3, 96
    given = {}
    if options.get(
        "read_summaries"
    ):  # (2 d + 1 floats a page: 16 buckets at 512, not the budget's tree of ~7 slots a bucket)
        budget = 512
        tree = ARMConfig.for_budget(budget, info_.head_dim, depth=2)
        arm = ARMModel(tree, info_.num_layers, info_.num_kv_heads, info_.head_dim).eval()
        given["arm"] = arm.to(dtype if dtype != torch.float16 else torch.float32)
    layer = get_method("arm").make_layer(
        0, info_, rotary(), budget, 16, top_m="fixed", m_fixed="1/8", **given, **options
    )
    bound = info_.budget_bytes(budget) * batch
    g = torch.Generator().manual_seed(1)
    built = summarised = False
    for _ in run_layer(layer, 120, batch, info_, g, 300):
        assert layer.state_bytes() <= bound
        built |= layer.reader.view().index is not None
        summarised |= layer.reader._carried is not None  # (the last entries made, kept from write to write)
    assert built and layer.peak_bytes <= bound
    assert summarised == bool(options.get("read_summaries"))  # (read_summaries keeps its units' entries, counted)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_arm_inference_keeps_no_autograd_graph_without_kernels(dtype, monkeypatch):
    """With gradients left on (a caller outside torch.no_grad) and the fused CPU kernels off
    (the path a GPU takes), an inference ARM layer writes outside autograd: no slot tensor
    carries a graph from one write to the next (that would grow without bound while decoding)."""
    monkeypatch.setenv("ARMKV_KERNELS", "0")
    info_ = info(dtype=dtype)
    layer = get_method("arm").make_layer(0, info_, rotary(), 96, 16)
    for _ in run_layer(layer, 40, 2, info_, torch.Generator().manual_seed(3), 200):
        pass
    held = held_kv_tensors(layer)
    assert held and not any(t.requires_grad for t in held)


def held_kv_tensors(obj, seen=None):
    """Every tensor of 3 or more dims (keys, values, codes, scales) a layer keeps between
    calls, found by walking its attributes; parameters (nn.Module) and RoPE are not state."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.ndim >= 3 else []
    if isinstance(obj, (torch.nn.Module, Rotary, ModelInfo)):
        return []
    if isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("armkv"):
        items = vars(obj).values()
    else:
        return []
    return [t for item in items for t in held_kv_tensors(item, seen)]


@pytest.mark.parametrize("method", BOUNDED)
def test_state_bytes_count_everything_kept_between_steps(method):
    """No hidden copy (e.g. a dequantised view kept for the next step) beside what is counted."""
    info_, batch, budget = info(), 2, 96
    layer = get_method(method).make_layer(0, info_, rotary(), budget, 16)
    g = torch.Generator().manual_seed(4)
    for step, _ in enumerate(run_layer(layer, 40, batch, info_, g, 300)):
        held = held_kv_tensors(layer)
        assert held, "the walk found no state at all"
        # views of one tensor (the exact buffer's sinks and window) hold its memory once
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
        assert sum(storages.values()) <= layer.state_bytes(), f"step {step}"


@pytest.mark.parametrize("method", BOUNDED)
def test_bounded_bytes_independent_of_length(method):
    info_ = info()
    sizes = []
    for length in (2048, 8192):
        layer = get_method(method).make_layer(0, info_, rotary(), 128, 256)
        g = torch.Generator().manual_seed(2)
        for _ in run_layer(layer, 1, 1, info_, g, length):
            pass
        sizes.append(layer.state_bytes())
    assert sizes[0] == sizes[1]


def test_full_grows():
    info_ = info()
    layer = get_method("full").make_layer(0, info_, rotary(), None, 64)
    g = torch.Generator().manual_seed(3)
    for _ in run_layer(layer, 1, 1, info_, g, 200):
        pass
    assert layer.state_bytes() == 200 * info_.token_bytes()


def test_kivi_budget_holds_more_tokens_than_exact():
    """At one budget KIVI keeps more tokens than a window (2 bits + scales vs fp32)."""
    info_ = info(d=64, kv=3)
    layer = get_method("kivi").make_layer(0, info_, rotary(64), 512, 256)
    stored = layer.sinks + layer.residual + layer.group + layer.capacity * layer.group
    assert stored > 4 * 512


def test_offload_keeps_kv_in_host_memory():
    info_ = info()
    layer = get_method("offload").make_layer(0, info_, rotary(), None, 8)
    g = torch.Generator().manual_seed(4)
    for _ in run_layer(layer, 3, 1, info_, g, 20):
        pass
    assert layer.host_keys.device.type == "cpu"
    assert layer.host_bytes() == 22 * info_.token_bytes()


@pytest.mark.parametrize(
    "method,budget,options,message",
    [
        ("nope", None, {}, "unknown method"),
        ("swa", None, {}, "needs a budget"),
        ("sink", 4, {}, "at least 5"),
        ("kivi", 40, {}, "too small"),
        ("kivi", None, {"bits": 3}, "must be 2 or 4"),
        ("full", None, {"adapter": "x"}, "takes no option adapter"),
    ],
)
def test_bad_method_arguments_are_one_line_errors(method, budget, options, message):
    with pytest.raises(ArmkvError, match=message) as e:
        get_method(method).make_layer(0, info(), rotary(), budget, 16, **options)
    assert "\n" not in str(e.value)


def test_core_import_is_light():
    import subprocess
    import sys

    code = (
        "import sys, armkv, armkv.methods.base, armkv.methods.buffers, armkv.methods.attention, "
        "armkv.methods.full, armkv.methods.window, armkv.methods.kivi, armkv.methods.offload; "
        "bad = [m for m in ('transformers', 'matplotlib', 'datasets') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"the library core imports {out}"


def test_kivi_ring_keeps_the_newest_groups():
    """Keys equal to their token index quantise exactly (4 evenly spaced values, 2 bits), so the
    dequantised store shows which tokens it holds: the newest full groups, oldest overwritten."""
    info_ = info()
    # 11 token-equivalents: residual 4 + staging 4 exact tokens, and room for exactly 2 groups of 4.
    layer = get_method("kivi").make_layer(0, info_, rotary(), 11, 64, group=4, residual=4, sinks=0)
    assert layer.capacity == 2

    def feed(start, n):
        x = torch.arange(start, start + n, dtype=torch.float)[None, None, :, None].expand(1, 2, n, 16)
        q = torch.zeros(1, 4, n, 16)
        layer.attend(
            q,
            x.contiguous(),
            x.contiguous(),
            torch.ones(1, n, dtype=torch.bool),
            torch.arange(start, start + n)[None],
            0.25,
        )

    def stored():
        keys, _, valid = layer._dequantised()
        return sorted(set(keys[0, 0, valid[0], 0].round().long().tolist()))

    feed(0, 30)  # residual 26..29, staging 24..25, groups 0..23 of which the ring keeps the last two
    assert stored() == list(range(16, 24))
    assert int(layer.stage_count[0]) == 2
    for t in range(30, 33):
        feed(t, 1)  # 26, 27, 28 leave the residual: 24..27 becomes a group and overwrites 16..19
    assert stored() == list(range(20, 28))
    assert int(layer.stage_count[0]) == 1


@pytest.mark.parametrize("method", ["sink", "swa", "kivi"])
def test_a_known_horizon_allocates_only_the_window_it_fills(method):
    """make_cache(horizon=N) with N below the budget: the window holds N tokens, not budget,
    and the logits of a chunked prefill and of every decode step up to N tokens are the same
    as with the whole window; a horizon past the budget changes nothing."""
    model = tiny_model("llama").eval()
    ids = torch.randint(0, 100, (2, 37), generator=torch.Generator().manual_seed(5))
    budget, horizon = 4096, ids.shape[1]
    whole = make_cache(model, method, budget=budget, chunk=16)
    held = make_cache(model, method, budget=budget, chunk=16, horizon=horizon)
    with torch.no_grad():
        a = model(ids[:, :30], past_key_values=whole, use_cache=True).logits
        b = model(ids[:, :30], past_key_values=held, use_cache=True).logits
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        for t in range(30, horizon):
            a = model(ids[:, t : t + 1], past_key_values=whole, use_cache=True).logits
            b = model(ids[:, t : t + 1], past_key_values=held, use_cache=True).logits
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert held.state_bytes() * 20 < whole.state_bytes()
    if method != "kivi":
        past = make_cache(model, method, budget=16, chunk=16, horizon=horizon)
        assert past.layers[0].window == make_cache(model, method, budget=16, chunk=16).layers[0].window
