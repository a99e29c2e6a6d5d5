"""The transformers boundary on tiny models: generation equals plain generate, chunked prefill +
decode equals a no-cache forward under left padding, batched equals one by one, attach/detach."""

import pytest
import torch

from armkv.errors import ArmkvError
from armkv.hf import ArmkvCache, attach, attached, detach, is_attached, make_cache
from armkv.hf.compat import cache_arg
from armkv.hf.runner import Runner
from armkv.methods.base import METHODS, _load_builtin_methods
from conftest import ARCHS, DEVICES, TOLERANCE, dtype_id, tiny_model

_load_builtin_methods()
ALL = sorted(METHODS)
BIG = 256  # a budget above every sequence here: nothing evicted, merged or quantised (kivi's residual is 64)
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def left_padded(batch=3, length=20, seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for i in range(1, batch):
        pad = int(torch.randint(1, length // 2, (1,), generator=g))
        mask[i, :pad] = 0
        ids[i, :pad] = 0
    return ids, mask


def padded_prefill_then_decode(model, ids, mask, cache, prompt: int) -> torch.Tensor:
    """Prefill ``prompt`` tokens (the cache chunks them), then feed the rest one by one, with
    positions that skip the left padding: the logits of every position, concatenated."""
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    got = []
    with torch.no_grad():
        for lo, hi in [(0, prompt)] + [(t, t + 1) for t in range(prompt, ids.shape[1])]:
            out = model(
                ids[:, lo:hi],
                attention_mask=mask[:, :hi],
                position_ids=positions[:, lo:hi],
                **cache_arg(cache),
                use_cache=True,
            )
            got.append(out.logits)
    return torch.cat(got, dim=1)


@pytest.fixture(autouse=True)
def _restore_models():
    yield
    # Each test builds its own models; nothing global to undo but the active-layer marker.
    from armkv.hf.attention import ACTIVE

    ACTIVE.set(None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "arch,dtype",
    [(arch, F32) for arch in ARCHS] + [("llama", BF16), ("qwen3", F16)],
    ids=lambda x: dtype_id(x) if isinstance(x, torch.dtype) else x,
)
@pytest.mark.parametrize("method", ALL)
def test_greedy_generation_equals_plain_generate(arch, dtype, method, device):
    """``model.generate`` with the cache gives plain generate's tokens: exactly in float32; in
    bfloat16 and float16, where two logits within a rounding of each other may swap places
    between any two summation orders, every token it picks is the top one of a no-cache
    forward over the sequence so far, within conftest.TOLERANCE."""
    model = tiny_model(arch, dtype=dtype, device=device)
    ids, mask = (t.to(device) for t in left_padded())
    cache = make_cache(model, method, budget=BIG, chunk=7)
    got = model.generate(
        ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, **cache_arg(cache)
    )
    if dtype == torch.float32:
        want = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want)
    else:
        assert_greedy_within_rounding(model, got, mask, ids.shape[1], TOLERANCE[dtype])


def prefill_then_decode(model, cache, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """The last logits of a prefill of ids[:, :prompt], then of each later token decoded one
    at a time through ``cache``: [1 + n, B, vocab]."""
    out = [model(ids[:, :prompt], **cache_arg(cache), use_cache=True).logits[:, -1]]
    for t in range(prompt, ids.shape[1]):
        out.append(model(ids[:, t : t + 1], **cache_arg(cache), use_cache=True).logits[:, -1])
    return torch.stack(out)


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_arm_cache_made_under_inference_mode(kernels, monkeypatch):
    """A cache made and used inside ``torch.inference_mode`` (its parameters are then
    inference tensors) gives the logits of one made outside it, with the fused CPU kernels
    and without them (the path a GPU takes), through prefill chunks, writes and decode."""
    monkeypatch.setenv("ARMKV_KERNELS", kernels)
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 160), generator=torch.Generator().manual_seed(5))

    with torch.inference_mode():  # first, so that no parameter was made outside it
        got = prefill_then_decode(model, make_cache(model, "arm", budget=32, chunk=16), ids, 120)
    model = tiny_model("llama")
    with torch.no_grad():
        want = prefill_then_decode(model, make_cache(model, "arm", budget=32, chunk=16), ids, 120)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_arm_logits_equal_with_and_without_the_fused_kernels(dtype, monkeypatch):
    """The fused CPU kernels change no logit: a whole model's prefill chunks, writes and
    decode steps through ARM give the same logits with them and with their PyTorch forms
    (what a GPU runs), within the dtype's tolerance."""
    ids = torch.randint(3, 128, (2, 170), generator=torch.Generator().manual_seed(7))

    def run(kernels: str) -> torch.Tensor:
        monkeypatch.setenv("ARMKV_KERNELS", kernels)
        model = tiny_model("llama", dtype=dtype)
        with torch.no_grad():
            return prefill_then_decode(model, make_cache(model, "arm", budget=32, chunk=16), ids, 130).float()

    torch.testing.assert_close(run("0"), run("1"), **TOLERANCE[dtype])


def assert_greedy_within_rounding(model, sequences, mask, prompt: int, tolerance: dict, eos: int = 2):
    """Each generated token of ``sequences`` [B, prompt + n] (up to its row's first ``eos``)
    has a no-cache logit within ``tolerance`` of the top logit at its step."""
    full_mask = torch.cat([mask, torch.ones_like(sequences[:, prompt:])], 1)
    with torch.no_grad():
        logits = model(sequences, attention_mask=full_mask, use_cache=False).logits.float()
    for b in range(sequences.shape[0]):
        for t in range(prompt, sequences.shape[1]):
            step = logits[b, t - 1]
            top, picked = step.max(), step[sequences[b, t]]
            assert top - picked <= tolerance["atol"] + tolerance["rtol"] * top.abs(), (
                f"row {b}, step {t - prompt}: picked a logit {float(top - picked):.4f} under the top one"
            )
            if sequences[b, t] == eos:
                break


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "arch,dtype",
    [("llama", F32), ("qwen3", F32), ("llama", BF16), ("qwen3", BF16), ("llama", F16)],
    ids=lambda x: dtype_id(x) if isinstance(x, torch.dtype) else x,
)
@pytest.mark.parametrize("method", ALL)
def test_chunked_prefill_and_decode_equal_no_cache_forward(arch, dtype, method, device, nan_empty):
    """Prefill in chunks of 5 under random left padding, then feed 6 tokens one by one: every
    valid position's logits equal one forward over the whole sequence in the same dtype
    (within conftest.TOLERANCE of that dtype)."""
    model = tiny_model(arch, dtype=dtype, device=device)
    ids, mask = (t.to(device) for t in left_padded(batch=3, length=29, seed=1))
    with torch.no_grad():
        want = model(ids, attention_mask=mask, use_cache=False).logits
    cache = make_cache(model, method, budget=BIG, chunk=5)
    got = padded_prefill_then_decode(model, ids, mask, cache, prompt=23)
    valid = mask.bool()
    assert got.dtype == dtype and got.device.type == device
    torch.testing.assert_close(got[valid], want[valid], **TOLERANCE[dtype])
    assert cache.get_seq_length() == ids.shape[1]


SMALL = {"swa": dict(budget=8), "sink": dict(budget=10), "kivi": dict(budget=64, group=4, residual=8)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ALL)
def test_batched_equals_one_by_one(method, device):
    """Padding is never stored, so a row's cache is the same alone or in a left-padded batch,
    also when a small budget evicts, quantises or merges (prefill in one chunk)."""
    model = tiny_model("llama", device=device)
    kwargs = SMALL.get(method, dict(budget=64 if METHODS[method].bounded else None))
    ids, mask = (t.to(device) for t in left_padded(batch=3, length=24, seed=2))
    cache = make_cache(model, method, chunk=64, **kwargs)
    batched = model.generate(
        ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, **cache_arg(cache)
    )[:, ids.shape[1] :]
    for i in range(ids.shape[0]):
        row = ids[i : i + 1, mask[i].bool()]
        cache = make_cache(model, method, chunk=64, **kwargs)
        alone = model.generate(row, max_new_tokens=20, do_sample=False, pad_token_id=0, **cache_arg(cache))
        alone = alone[0, row.shape[1] :]
        # A row that stopped early is padded in the batch.
        assert torch.equal(alone, batched[i, : len(alone)]) and not batched[i, len(alone) :].any(), f"row {i}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [BF16, F16], ids=dtype_id)
@pytest.mark.parametrize("method", ALL)
def test_batched_logits_equal_one_by_one_in_half_precision(method, dtype, device):
    """:func:`test_batched_equals_one_by_one` in bfloat16 and float16, where the batch's
    shapes round the logits differently (a greedy pick may swap with a rounding-close one):
    the same 12 tokens are fed to every row after the prefill, and each step's logits of a
    row alone are within conftest.TOLERANCE of its logits in the left-padded batch."""
    model = tiny_model("llama", dtype=dtype, device=device)
    kwargs = SMALL.get(method, dict(budget=64 if METHODS[method].bounded else None))
    ids, mask = (t.to(device) for t in left_padded(batch=3, length=24, seed=2))
    fed = torch.randint(3, 128, (3, 12), generator=torch.Generator().manual_seed(3)).to(device)

    def run(ids, mask, fed):
        cache = make_cache(model, method, chunk=64, **kwargs)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = [model(ids, attention_mask=mask, position_ids=positions, **cache_arg(cache)).logits[:, -1:]]
            for t in range(fed.shape[1]):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                step = positions[:, -1:] + 1 + t
                logits.append(
                    model(fed[:, t : t + 1], attention_mask=mask, position_ids=step, **cache_arg(cache)).logits
                )
        return torch.cat(logits, 1)

    batched = run(ids, mask, fed)
    for i in range(ids.shape[0]):
        row = ids[i : i + 1, mask[i].bool()]
        alone = run(row, torch.ones_like(row), fed[i : i + 1])
        torch.testing.assert_close(alone[0], batched[i], **TOLERANCE[dtype], msg=lambda m: f"row {i}: {m}")


def test_kivi_logits_within_quantisation_error():
    """With 4-bit groups of 8 and a residual of 8, most of a 60-token prompt is quantised; the
    logits stay close to the exact ones (the per-entry bound is tested in test_methods)."""
    model = tiny_model("llama")
    ids, mask = left_padded(batch=2, length=60, seed=3)
    with torch.no_grad():
        want = model(ids, attention_mask=mask, use_cache=False).logits[:, -1]
        cache = make_cache(model, "kivi", bits=4, group=8, residual=8, chunk=8)
        got = model(ids, attention_mask=mask, **cache_arg(cache), use_cache=True).logits[:, -1]
    assert cache.layers[0].write_at.min() >= 4, "most tokens went through the quantiser"
    scale = want.abs().max()
    assert (got - want).abs().max() < 0.05 * scale


def test_sampled_runner_equals_generate():
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (1, 17), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(7)
    want = model.generate(
        ids,
        max_new_tokens=12,
        do_sample=True,
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        pad_token_id=0,
        **cache_arg(make_cache(model, "sink", budget=BIG)),
    )[0, 17:]
    runner = Runner(model, _NoTokenizer(), "sink", budget=BIG, chunk=4)
    torch.manual_seed(7)
    got, _, _ = runner.generate_ids(
        [ids[0, :9].tolist(), ids[0, 9:].tolist()], 12, do_sample=True, temperature=0.8, top_k=20, top_p=0.9
    )
    assert got == want[: len(got)].tolist()


@pytest.mark.parametrize("method", ["full", "swa", "kivi"])
def test_greedy_runner_equals_plain_generate(method):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 21), generator=torch.Generator().manual_seed(5))
    want = model.generate(ids, max_new_tokens=15, do_sample=False, pad_token_id=0)[0, 21:]
    got, timing, cache = Runner(model, _NoTokenizer(), method, budget=BIG, chunk=6).generate_ids([ids[0].tolist()], 15)
    assert got == want[: len(got)].tolist()
    assert cache.peak_bytes() >= cache.state_bytes() > 0
    assert timing["prefill_seconds"] > 0


class _NoTokenizer:
    eos_token_id = 2


def test_attach_detach_gives_identical_logits():
    model = tiny_model("qwen2")
    ids, mask = left_padded()
    original = model.config._attn_implementation
    generate = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        plain = model.generate(ids, **generate)
        with attached(model):
            assert model.config._attn_implementation == "armkv"
            during = model(ids, attention_mask=mask, use_cache=False).logits  # sdpa fallback, no ArmkvCache
            assert torch.equal(model.generate(ids, **generate), plain)  # transformers' DynamicCache still works
            cache = make_cache(model, "full")
            with_cache = model(ids, attention_mask=mask, **cache_arg(cache)).logits
        assert not is_attached(model)
        assert model.config._attn_implementation == original
        after = model(ids, attention_mask=mask).logits
    assert torch.equal(before, after)
    assert torch.equal(before, during)
    valid = mask.bool()
    torch.testing.assert_close(with_cache[valid], before[valid], atol=1e-4, rtol=1e-4)


def test_cache_without_attach_is_an_error():
    model = tiny_model("llama")
    cache = make_cache(model, "full")
    detach(model)
    with pytest.raises(ArmkvError, match="attach"):
        model(torch.randint(3, 128, (1, 5)), **cache_arg(cache))


def test_cache_reports_lengths_and_bytes():
    model = tiny_model("llama")
    cache = make_cache(model, "swa", budget=8, chunk=4)
    assert isinstance(cache, ArmkvCache) and cache.get_seq_length() == 0 and cache.get_max_length() == -1
    with torch.no_grad():
        model(torch.randint(3, 128, (2, 13)), **cache_arg(cache))
    assert cache.get_seq_length() == 13
    assert cache.get_mask_sizes(1, 0) == (1, 13)
    bound = 2 * 8 * cache.layers[0].info.token_bytes() * len(cache.layers)
    assert cache.state_bytes() == cache.peak_bytes() == bound
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.state_bytes() == 0


@pytest.mark.parametrize(
    "method,budget,options,message",
    [
        ("nope", None, {}, "unknown method"),
        ("sink", 3, {}, "too small"),
        ("swa", None, {}, "needs a budget"),
        ("full", None, {"chunk": 0}, "chunk"),
    ],
)
def test_make_cache_errors(method, budget, options, message):
    model = tiny_model("llama")
    with pytest.raises(ArmkvError, match=message):
        make_cache(model, method, budget=budget, **options)
    assert attach(model) is model


def test_prompt_longer_than_the_model_allows():
    model = tiny_model("llama")
    runner = Runner(model, _NoTokenizer(), "full")
    with pytest.raises(ArmkvError, match="limit of 512 positions"):
        runner.generate_ids([list(range(3, 103)) * 5], 20)
