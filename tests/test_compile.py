"""Compiled decoding: the model's whole decode forward with a cache of each bounded method
compiles as one graph (``ArmkvCache.forward``: ``torch.compile(fullgraph=True)``, no graph
break, no host sync), gives the eager logits, and keeps every state tensor where it was
allocated (what a CUDA graph replay needs)."""

import pytest
import torch

from armkv.errors import ArmkvError
from armkv.hf import cache_arg, make_cache
from conftest import DEVICES, TOLERANCE, tiny_model
from test_hf import left_padded

# small budgets, so that the fed tokens evict (sink, swa), fill and overwrite quantised groups
# (kivi), and write and merge slots at several `sync` points (arm, fifo) while compiled
CASES = {
    "sink": dict(budget=10),
    "swa": dict(budget=8),
    "kivi": dict(budget=64, group=4, residual=8),
    "arm": dict(budget=48, arm_overrides={"sync": 4}),
    "arm-routed": dict(budget=48, arm_overrides={"sync": 4, "top_m": "fixed", "m_fixed": 2}),
    "arm-partial": dict(
        budget=48,
        arm_overrides={"sync": 4, "top_m": "fixed", "m_fixed": 2, "read_rank": "partial", "slot_mixing": False},
    ),
    "arm-tree": dict(budget=48, arm_overrides={"sync": 4, "top_m": "fixed", "m_fixed": 2, "read_rank": "tree"}),
    "arm-summaries": dict(budget=48, arm_overrides={"sync": 4, "top_m": "fixed", "m_fixed": 2, "read_summaries": True}),
    "fifo": dict(budget=48),
    # layers of different budget shares (and so of different shapes) in the one graph, as the
    # default model's calibrated adapter gives them
    "arm-shares": dict(budget=48, arm_overrides={"sync": 4, "layer_weights": "0.6,1.4"}),
}


def decode_logits(model, method, options, compile, device, steps=14, watch=None):
    """Prefill a left-padded batch in chunks of 8, then feed the same ``steps`` tokens to every
    row one at a time (``ArmkvCache.forward``: compiled where ``compile`` asks); the logits of
    the prefill's last token and of every fed one [B, 1 + steps, V]. ``watch(cache)`` is called
    after every fed token."""
    ids, mask = (t.to(device) for t in left_padded(batch=2, length=30, seed=1))
    fed = torch.randint(3, 128, (2, steps), generator=torch.Generator().manual_seed(3)).to(device)
    cache = make_cache(model, method.split("-")[0], chunk=8, compile=compile, **options)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = [cache.forward(model, ids, attention_mask=mask, position_ids=positions).logits[:, -1:]]
        for t in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            step = positions[:, -1:] + 1 + t
            out.append(cache.forward(model, fed[:, t : t + 1], attention_mask=mask, position_ids=step).logits)
            if watch is not None:
                watch(cache)
    return torch.cat(out, 1), cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", sorted(CASES))
def test_compiled_decode_step_equals_eager(method, device):
    """fullgraph=True fails on any graph break; aot_eager traces the step as inductor does
    (functionalised, no Python left) without inductor's C++ build, to keep the suite short."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama", device=device)
    eager, _ = decode_logits(model, method, CASES[method], False, device)
    compiled, cache = decode_logits(model, method, CASES[method], {"backend": "aot_eager"}, device)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["calls_captured"] > 0 and not counters["graph_break"]
    # one graph of the whole model for every step (an ARM pool's slot_ladder climb re-packs
    # the pool in a new format: one more)
    rungs = len(cache.layers[0].pool.rungs) if method.startswith(("arm", "fifo")) else 1
    assert 1 <= counters["stats"]["unique_graphs"] <= rungs
    if method.startswith(("arm", "fifo")):
        layer = cache.layers[0]
        assert layer.state.count.sum() > 0 and layer.waiting is not None  # written while compiled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_arm_decode_in_half_precision(dtype):
    """The whole model's compiled decode step with an ARM cache in bfloat16 and float16: one
    graph, no break, the eager logits (within the dtype's tolerance)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama", dtype=dtype)
    eager, _ = decode_logits(model, "arm", CASES["arm"], False, "cpu", steps=10)
    compiled, _ = decode_logits(model, "arm", CASES["arm"], {"backend": "aot_eager"}, "cpu", steps=10)
    torch.testing.assert_close(compiled.float(), eager.float(), **TOLERANCE[dtype])
    assert counters["stats"]["calls_captured"] > 0 and not counters["graph_break"]


@pytest.mark.parametrize("method", ["arm", "arm-ladderless", "arm-routed", "fifo", "sink", "kivi"])
def test_compiled_decoding_keeps_the_state_in_place(method):
    """Over 100 compiled decode steps, ARM's among them 25 writes (sync 4) that merge slots in a
    full pool: every state tensor (exact buffer, waiting tokens, pool codes, scales, counts,
    positions and buckets, M) keeps its address, as a CUDA graph replay needs. Only a
    ``slot_ladder`` climb re-packs the pool (new tensors, once a rung); without a ladder,
    nothing moves at all."""
    options = dict(CASES.get(method, CASES.get(method.split("-")[0], {})))
    if method == "arm-ladderless":
        options = dict(budget=48, arm_overrides={"sync": 4, "slot_ladder": ""})
    seen = []

    def watch(cache):
        layer = cache.layers[1]
        seen.append(
            (
                getattr(getattr(layer, "pool", None), "rung", 0),
                {name: t.data_ptr() for name, t in layer.state_tensors().items()},
                float(layer.state.count.sum()) if hasattr(layer, "pool") else 0.0,
            )
        )

    torch._dynamo.reset()
    model = tiny_model("llama")
    decode_logits(model, method, options, {"backend": "aot_eager"}, "cpu", steps=100, watch=watch)
    first_rung, first_ptrs, _ = seen[0]
    assert len(first_ptrs) >= 5
    for rung, ptrs, _ in seen:
        assert ptrs.keys() == first_ptrs.keys()
        if rung == first_rung:
            assert ptrs == first_ptrs
    if method.startswith(("arm", "fifo")):
        counts = [count for _, _, count in seen]
        assert counts[-1] > counts[0]  # written (and, 100 tokens into a 48-token budget, merged)
    if method == "arm-ladderless":
        assert all(rung == first_rung for rung, _, _ in seen)


def test_inductor_compiles_the_sink_step():
    """The default backend (inductor: generated C++ on a CPU) on one method."""
    torch._dynamo.reset()
    model = tiny_model("llama")
    eager, _ = decode_logits(model, "sink", CASES["sink"], False, "cpu", steps=6)
    compiled, _ = decode_logits(model, "sink", CASES["sink"], True, "cpu", steps=6)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["full", "offload"])
def test_growing_methods_refuse_to_compile(method):
    with pytest.raises(ArmkvError, match="bounded method"):
        make_cache(tiny_model("llama"), method, compile=True)


def test_runner_decodes_through_the_compiled_step():
    """``Runner(compile=...)``, the library's switch (``--compile`` of generate, eval and bench
    decode): the same greedy tokens as without it, through the compiled forward."""
    from armkv.hf.runner import Runner

    class NoTokenizer:
        eos_token_id = 2

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama")
    prompt = [torch.randint(3, 128, (21,), generator=torch.Generator().manual_seed(5)).tolist()]
    want, _, _ = Runner(model, NoTokenizer(), "arm", budget=48, chunk=8).generate_ids(prompt, 12)
    runner = Runner(model, NoTokenizer(), "arm", budget=48, chunk=8, compile={"backend": "aot_eager"})
    got, _, cache = runner.generate_ids(prompt, 12)
    assert got == want and all(layer.compiled for layer in cache.layers)
    assert counters["stats"]["calls_captured"] > 0 and not counters["graph_break"]
    # the next request (a new cache, another prompt length) replays the same graph
    other = [torch.randint(3, 128, (33,), generator=torch.Generator().manual_seed(6)).tolist()]
    want, _, _ = Runner(model, NoTokenizer(), "arm", budget=48, chunk=8).generate_ids(other, 12)
    assert runner.generate_ids(other, 12)[0] == want
    assert counters["stats"]["unique_graphs"] == 1


def test_a_compiled_cache_decoded_through_the_model_says_it_runs_eagerly():
    """A cache made with compile=True but stepped by ``model(...)`` (as ``model.generate``
    does) decodes eagerly: one warning says to call ``cache.forward``; ``cache.forward``
    itself, and the prefill, say nothing."""
    import warnings

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = make_cache(model, "sink", budget=10, chunk=8, compile={"backend": "aot_eager"})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.forward(model, ids[:, :10])
        cache.forward(model, ids[:, 10:11])
    with torch.no_grad(), pytest.warns(UserWarning, match="cache.forward") as caught:
        model(ids[:, 11:12], **cache_arg(cache), use_cache=True)
        model(ids[:, 11:12], **cache_arg(cache), use_cache=True)
    assert len([w for w in caught if "cache.forward" in str(w.message)]) == 1


@pytest.mark.real_model
def test_real_model_generate_compiled_equals_eager(tmp_path, monkeypatch):
    """``armkv generate --compile`` on the default model (its layers hold different budget
    shares, so the graph holds layers of different shapes), for ARM and KIVI (the window methods
    compile on the tiny models above, every method there): the same answers as eager, through
    one graph without a break. A ~300-token needle prompt at budget
    128 (ARM writes every 4 decoded tokens). torch.compile runs with aot_eager in place of
    inductor's C++ build (minutes a method on two cores): the same capture, functionalisation
    and view-input handling, where compiling this model used to fail."""
    import json

    from torch._dynamo.utils import counters

    from armkv.cli import main

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "aot_eager", "mode": None}))
    noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    request = {
        "id": "needle",
        "context": noise * 6 + "The special magic number is: 7305518. " + noise * 6,
        "question": " What is the special magic number mentioned in the text?",
    }
    given = tmp_path / "in.jsonl"
    given.write_text(json.dumps(request) + "\n")
    for method in ("kivi", "arm"):
        answers = {}
        for compiled in (False, True):
            torch._dynamo.reset()
            counters.clear()
            out = tmp_path / f"{method}-{compiled}.jsonl"
            argv = ["generate", "--method", method, "--budget", "128", "--chat", "--max-new-tokens", "6"]
            argv += ["--input", str(given), "--output", str(out)] + (["--compile"] if compiled else [])
            assert main(argv) == 0
            (result,) = [json.loads(line) for line in out.read_text().splitlines()]
            answers[compiled] = result["output"]
            if compiled:
                assert counters["stats"]["calls_captured"] > 0 and not counters["graph_break"], method
        assert answers[True] == answers[False], method
