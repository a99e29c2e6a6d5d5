"""ARM's pool allocated as it fills: a cache whose pool grows gives the same logits and the
same slots as one allocated whole at once (its reference), in every dtype, under left padding,
through prefill, decode and a ladder climb; and a large budget costs nothing until it is used."""

import pytest
import torch

import armkv.memory.pool as pool
from armkv.hf.attach import make_cache
from conftest import tiny_model
from test_hf import padded_prefill_then_decode


def left_padded(batch: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        mask[row, : 3 * row + 4] = 0  # rows hold different numbers of tokens
    return ids.masked_fill(mask == 0, 0), mask


def run(model, ids, mask, prompt: int, **kw):
    """Prefill ``prompt`` tokens in chunks, then decode the rest one by one: (logits, cache)."""
    cache = make_cache(model, "arm", chunk=16, **kw)
    return padded_prefill_then_decode(model, ids, mask, cache, prompt=prompt), cache


def whole_at_once(monkeypatch):
    monkeypatch.setattr(pool.SlotPool, "grows", lambda self: False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("overrides", [{}, {"slot_format": "model", "slot_ladder": ""}, {"slot_ladder": "int8,k8v4"}])
def test_growing_pool_equals_the_whole_pool(monkeypatch, nan_empty, dtype, overrides):
    monkeypatch.setattr(pool, "INITIAL_SLOTS", 5)  # odd, and small enough to grow several times
    model = tiny_model("llama").eval().to(dtype)
    ids, mask = left_padded(batch=2, length=251, seed=3)
    grown_logits, grown = run(model, ids, mask, prompt=233, budget=96, arm_overrides=overrides)
    with monkeypatch.context() as m:
        whole_at_once(m)
        whole_logits, whole = run(model, ids, mask, prompt=233, budget=96, arm_overrides=overrides)
    valid = mask.bool()
    assert not grown_logits[valid].isnan().any()
    torch.testing.assert_close(grown_logits[valid], whole_logits[valid], rtol=0, atol=0)
    for g, w in zip(grown.layers, whole.layers):
        assert g.pool.rung == w.pool.rung and g.slots == w.slots and g.pool.reach == w.pool.reach
        assert g.state.slots <= w.state.slots
        held = w.state.first(g.state.slots)
        for name in ("key", "value", "pos", "count", "bucket", "key_scale", "value_scale"):
            a, b = getattr(g.state, name), getattr(held, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a, b.contiguous()), name
        assert int((w.state.count[:, g.state.slots :] > 0).sum()) == 0  # the whole pool's extra slots are free
        assert g.state_bytes() <= w.state_bytes()


def test_growth_doubles_and_stops_at_the_budget(monkeypatch):
    monkeypatch.setattr(pool, "INITIAL_SLOTS", 4)
    model = tiny_model("llama").eval()
    ids, mask = left_padded(batch=1, length=400, seed=5)
    sizes = []
    real = pool.SlotPool.grow

    def watched(self, packed, valid, dtype):
        out = real(self, packed, valid, dtype)
        if out.slots != packed.slots:
            sizes.append((self, packed.slots, out.slots))
        return out

    monkeypatch.setattr(pool.SlotPool, "grow", watched)
    _, cache = run(model, ids, mask, prompt=400, budget=64, arm_overrides={"slot_ladder": ""})
    layer = cache.layers[0]
    sizes = [(before, after) for pool_, before, after in sizes if pool_ is layer.pool]
    assert sizes and all(after >= min(2 * before, layer.slots) for before, after in sizes)
    assert sizes[-1][1] == layer.slots == layer.state.slots  # full at last, never past the budget


def test_a_large_budget_costs_nothing_until_used():
    """A short prompt holds the same bytes at budget 4096 as at 512: the pool grows as it fills."""
    model = tiny_model("llama").eval()
    ids, mask = left_padded(batch=1, length=40, seed=6)
    sizes = {}
    for budget in (512, 4096):
        _, cache = run(model, ids, mask, prompt=30, budget=budget)
        sizes[budget] = sum(layer.state.nbytes() for layer in cache.layers)
        assert all(layer.state.slots < layer.slots for layer in cache.layers)
    assert sizes[4096] == sizes[512]


def test_training_and_the_paper_pool_allocate_at_once():
    model = tiny_model("llama").eval()
    ids, mask = left_padded(batch=1, length=40, seed=7)
    _, cache = run(model, ids, mask, prompt=30, budget=512, arm_overrides={"pool": "paper"})
    assert all(layer.state.slots == layer.slots for layer in cache.layers)
    _, cache = run(model, ids, mask, prompt=30, budget=512, arm_overrides={"lazy_merge": False})
    assert all(layer.state.slots == layer.slots for layer in cache.layers)
