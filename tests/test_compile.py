"""Compiled decoding: the decode step of each bounded method compiles whole
(``torch.compile(fullgraph=True)``: no graph break, no host sync) and gives the eager logits."""

import pytest
import torch

from armkv.errors import ArmkvError
from armkv.hf import make_cache
from conftest import DEVICES, tiny_model
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
}


def decode_logits(model, method, options, compile, device, steps=14):
    """Prefill a left-padded batch in chunks of 8, then feed the same ``steps`` tokens to every
    row one at a time; the logits of the prefill's last token and of every fed one [B, 1 + steps, V]."""
    ids, mask = (t.to(device) for t in left_padded(batch=2, length=30, seed=1))
    fed = torch.randint(3, 128, (2, steps), generator=torch.Generator().manual_seed(3)).to(device)
    cache = make_cache(model, method.split("-")[0], chunk=8, compile=compile, **options)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = [model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1:]]
        for t in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            step = positions[:, -1:] + 1 + t
            out.append(model(fed[:, t : t + 1], attention_mask=mask, position_ids=step, past_key_values=cache).logits)
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
    # one graph for every layer and step (the layers have one shape)
    assert counters["stats"]["unique_graphs"] == 1
    if method.startswith(("arm", "fifo")):
        layer = cache.layers[0]
        assert layer.state.count.sum() > 0 and layer.waiting is not None  # written while compiled


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
    decode): the same greedy tokens as without it, through a compiled step."""
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
    assert got == want and all(layer._step is not None for layer in cache.layers)
    assert counters["stats"]["calls_captured"] > 0 and not counters["graph_break"]
