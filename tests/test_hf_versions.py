"""The installed transformers, whichever of the supported versions it is (5.20 - 5.24): a tiny
model generates through every cache method, with ``generate`` and with armkv's Runner, and
transformers warns about nothing (5.24 renamed ``past_key_values`` to ``cache``; armkv passes
the name of the installed version)."""

import re
import warnings
from pathlib import Path

import pytest
import torch

from armkv.hf import make_cache
from armkv.hf.attach import model_info
from armkv.hf.compat import CACHE_ARG, SUPPORTED, VERSION, cache_arg, transformers
from armkv.hf.runner import Runner
from armkv.methods.base import METHODS, _load_builtin_methods
from conftest import ARCHS, tiny_model

_load_builtin_methods()
BIG = 256  # above every sequence here: the bounded methods keep every token, so they equal plain generate
SMALL = 64  # below the sequences here: the bounded methods evict, merge or quantise


class _NoTokenizer:
    eos_token_id = 2


def test_the_installed_version_is_supported_and_the_range_is_pyprojects():
    assert SUPPORTED[0] <= VERSION < SUPPORTED[1], transformers.__version__
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    low, high = re.search(r'"transformers>=([\d.]+),<([\d.]+)"', pyproject).groups()
    assert SUPPORTED == (tuple(map(int, low.split("."))), tuple(map(int, high.split("."))))
    assert CACHE_ARG == ("cache" if VERSION >= (5, 24) else "past_key_values")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_generates_without_a_warning(arch, method):
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (2, 96), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    short, short_mask = ids[:, :20], mask[:, :20]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning / DeprecationWarning from transformers fails here
        # 20 + 8 tokens under budget 256: no method evicts, merges or quantises, so each equals plain generate
        want = model.generate(short, attention_mask=short_mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = model.generate(
            short,
            attention_mask=short_mask,
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            **cache_arg(make_cache(model, method, budget=BIG, chunk=16)),
        )
        assert torch.equal(got, want)
        tokens, _, _ = Runner(model, _NoTokenizer(), method, budget=BIG, chunk=16).generate_ids(
            [short[0, :12].tolist(), short[0, 12:].tolist()], 8
        )
        assert tokens == want[0, 20 : 20 + len(tokens)].tolist()
        # 96 + 8 tokens under budget 64: the bounded methods drop, merge or quantise, within their budget
        budget = SMALL if METHODS[method].bounded else None
        cache = make_cache(model, method, budget=budget, chunk=16)
        bounded = model.generate(
            ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, **cache_arg(cache)
        )
        assert bounded.shape == (2, 104)
        _, _, ran = Runner(model, _NoTokenizer(), method, budget=budget, chunk=16).generate_ids(
            [ids[0, :60].tolist(), ids[0, 60:].tolist()], 8
        )
    if budget is not None:
        info = model_info(model)
        # the budget is per layer and sequence; ARM shares the layers' total among them
        per_sequence = info.num_layers * budget * 2 * info.num_kv_heads * info.head_dim * 4  # float32
        assert 0 < cache.peak_bytes() <= 2 * per_sequence and 0 < ran.peak_bytes() <= per_sequence


def test_update_takes_both_call_forms():
    """Up to 5.23 a layer calls ``update(key, value, layer_idx)``; from 5.24 ``update(key,
    value, layer_idx, kwargs=...)``: both mark the layer for the attention and return the
    key and value as given."""
    from armkv.hf.attention import ACTIVE

    model = tiny_model("llama")
    cache = make_cache(model, "full")
    k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    for call in (lambda: cache.update(k, v, 1), lambda: cache.update(k, v, 1, kwargs={"position_ids": None})):
        got = call()
        assert got[0] is k and got[1] is v and ACTIVE.get() == (cache, 1)
        ACTIVE.set(None)
