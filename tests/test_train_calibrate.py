"""train/calibrate.py: pre-RoPE keys collected by hooks, subsampled without replacement."""

import pytest
import torch

from armkv.errors import ArmkvError
from armkv.train.calibrate import collect_keys
from conftest import tiny_model


def reference_keys(model, seqs):
    """Per layer [Hkv, N, d]: k_proj (then k_norm, for Qwen3) of each layer's normed input."""
    per_layer = None
    for ids in seqs:
        hidden = model(input_ids=ids[None], output_hidden_states=True).hidden_states
        keys = []
        for layer, h in zip(model.model.layers, hidden):
            attn = layer.self_attn
            k = attn.k_proj(layer.input_layernorm(h)).view(h.shape[1], -1, attn.head_dim)  # [T, Hkv, d]
            if hasattr(attn, "k_norm"):
                k = attn.k_norm(k)
            keys.append(k.transpose(0, 1))
        per_layer = keys if per_layer is None else [torch.cat([a, b], 1) for a, b in zip(per_layer, keys)]
    return per_layer


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.no_grad()
def test_all_keys_when_the_cap_is_large(arch):
    model = tiny_model(arch)
    seqs = [torch.randint(3, 128, (13,)), torch.randint(3, 128, (9,))]
    got = collect_keys(model, seqs, max_keys_per_head=1000)
    want = reference_keys(model, seqs)
    assert len(got) == len(model.model.layers)
    for g, w in zip(got, want):
        assert g.shape == (2, 22, model.model.layers[0].self_attn.head_dim)
        torch.testing.assert_close(g, w)


@torch.no_grad()
def test_subsample_is_capped_shared_across_layers_and_seeded(llama):
    seqs = [torch.randint(3, 128, (2, 20)) for _ in range(3)]  # [B, T] chunks: 120 tokens
    llama.train()
    sample = collect_keys(llama, seqs, max_keys_per_head=17, seed=1)
    assert llama.training and not any(m._forward_hooks for m in llama.modules())
    full = reference_keys(llama, [s for chunk in seqs for s in chunk])
    # Find the sampled tokens by the last layer's keys (layer 0's depend on the token id
    # alone and repeat); every layer and head must hold the keys of those same tokens.
    match = (sample[-1][0][:, None] - full[-1][0][None]).abs().amax(-1) < 1e-5  # [17, 120]
    assert (match.sum(1) == 1).all()
    picked = match.float().argmax(1)  # [17]
    assert len(set(picked.tolist())) == 17
    for got, every in zip(sample, full):
        assert got.shape == (2, 17, every.shape[-1])
        torch.testing.assert_close(got, every[:, picked])
    again = collect_keys(llama, seqs, max_keys_per_head=17, seed=1)
    other = collect_keys(llama, seqs, max_keys_per_head=17, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(sample, again))
    assert not torch.equal(sample[0], other[0])


def test_bad_input(llama):
    with pytest.raises(ArmkvError, match="no calibration"):
        collect_keys(llama, [], 8)
    with pytest.raises(ArmkvError, match="at least 1"):
        collect_keys(llama, [torch.arange(4)], 0)
    with pytest.raises(ArmkvError, match="k_proj"):
        collect_keys(torch.nn.Linear(2, 2), [torch.arange(4)], 8)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_retrieval_scores_equal_a_per_head_loop_and_restore_the_model(arch):
    """Each layer's score is the largest over heads of the mean weight a second-copy query puts
    on the token after its first occurrence; written out here query by query."""
    from armkv.train.calibrate import retrieval_scores

    model = tiny_model(arch)
    impl, was_training = model.config._attn_implementation, model.train().training
    g = torch.Generator().manual_seed(3)
    passages = [torch.randint(0, 100, (13,), generator=g), torch.randint(0, 100, (9,), generator=g)]
    scores = retrieval_scores(model, passages)
    assert model.training == was_training and model.config._attn_implementation == impl
    model.eval().set_attn_implementation("eager")
    expected = torch.zeros(model.config.num_hidden_layers)
    with torch.no_grad():
        for p in passages:
            T = len(p)
            att = model(input_ids=torch.cat([p, p])[None], output_attentions=True).attentions
            for layer, a in enumerate(att):
                per_head = [sum(float(a[0, h, T + i, i + 1]) for i in range(1, T)) / (T - 1) for h in range(a.shape[1])]
                expected[layer] += max(per_head) / len(passages)
    torch.testing.assert_close(torch.tensor(scores), expected, rtol=1e-5, atol=1e-6)
    assert all(0 <= s <= 1 for s in scores)


def _sqrt_shares(scores, floor=0.5, spread=2.0):
    """The unlifted shares: floor + spread * sqrt(score / top), scaled to mean 1."""
    raw = [floor + spread * (max(x, 0.0) / max(scores)) ** 0.5 for x in scores]
    return [r * len(raw) / sum(raw) for r in raw]


def test_retrieval_layer_weights_favour_copying_layers_and_average_one():
    from armkv.train.calibrate import retrieval_layer_weights

    w = retrieval_layer_weights([0.0, 0.01, 0.64, 0.16])  # 0.16 = 0.64 / 4: lifted; nothing above layer 3
    assert abs(sum(w) / len(w) - 1) < 1e-3
    assert w[0] < w[1] < w[2] == w[3]
    assert w[2] / w[0] == pytest.approx(2.5 / 0.5, rel=1e-3)  # (floor + spread) / floor at the top
    assert retrieval_layer_weights([0.0, 0.0]) == [1.0, 1.0]
    with pytest.raises(ArmkvError, match="rule"):
        retrieval_layer_weights([0.1, 0.2], "sqrt")  # a rule that lost: docs/decisions.md


def test_lift_late_layer_weights_take_the_lift_from_the_layers_above_the_last_lifted_one():
    from armkv.train.calibrate import retrieval_layer_weights

    scores = [0.0, 0.01, 0.64, 0.2, 0.15, 0.05, 0.02]  # layers 2 and 3 are lifted (>= 0.16); 4-6 lie above them
    w, sq = retrieval_layer_weights(scores), _sqrt_shares(scores)
    assert sum(w) / len(w) == pytest.approx(1, abs=1e-3)
    # the layers below the last lifted one keep the unlifted shares; the lifted ones get the top's
    assert w[:2] == pytest.approx(sq[:2], abs=1e-4) and w[2] == w[3] == pytest.approx(sq[2], abs=1e-4)
    # the late layers pay the lift (sq[2] - sq[3]) in proportion to their shares
    keep = 1 - (sq[2] - sq[3]) / sum(sq[4:])
    assert w[4:] == pytest.approx([x * keep for x in sq[4:]], abs=1e-3)
    # the threshold: a lower lift takes in 0.15 as well
    low = retrieval_layer_weights(scores, lift=0.2)
    assert low[4] == low[3] == low[2]
    # the late layers give at most half their shares; the rest is taken from every layer evenly
    thin = [0.0, 0.64, 0.2, 0.2, 0.2, 0.0]  # three layers lifted, one layer above them
    t, tsq = retrieval_layer_weights(thin), _sqrt_shares(thin)
    assert t[5] / t[0] == pytest.approx(tsq[5] / tsq[0] / 2, rel=1e-3)
    assert t[1] == t[2] == t[3] == t[4] and sum(t) / len(t) == pytest.approx(1, abs=1e-3)


def test_adapter_layer_weights_set_each_layers_budget_and_even_overrides(tmp_path):
    """An adapter's layer_weights are the default shares of make_cache; layer_weights='even' undoes them."""
    import dataclasses

    from armkv.hf.attach import make_cache
    from armkv.train.arm import new_arm

    model = tiny_model("llama").eval()
    L = model.config.num_hidden_layers
    arm = new_arm(model, 96, None)
    arm.config = dataclasses.replace(arm.config, layer_weights=[0.5] + [1.5] * (L - 1))
    path = arm.save(tmp_path / "a")
    ids = torch.randint(0, 100, (1, 150))

    def slots(**options):
        cache = make_cache(model, "arm", 96, 16, adapter=str(path), **options)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        return [layer.slots for layer in cache.layers]

    weighted, even = slots(), slots(layer_weights="even")
    assert len(set(even)) == 1 and weighted[0] < even[0] < weighted[1]


def test_named_share_rules_follow_the_adapters_retrieval_scores(tmp_path):
    """layer_weights='lift-late' applies the rule to the scores stored in the adapter; an
    adapter without them is a one-line error that says what to do."""
    import dataclasses

    from armkv.hf.attach import make_cache
    from armkv.train.arm import new_arm
    from armkv.train.calibrate import retrieval_layer_weights

    model = tiny_model("llama").eval()
    L = model.config.num_hidden_layers
    scores = [0.0] * (L - 1) + [0.5]
    arm = new_arm(model, 96, None)
    plain = arm.save(tmp_path / "plain")
    arm.config = dataclasses.replace(arm.config, meta={**arm.config.meta, "retrieval_scores": scores})
    path = arm.save(tmp_path / "a")
    ids = torch.randint(0, 100, (1, 150))

    def slots(adapter, **options):
        cache = make_cache(model, "arm", 96, 16, adapter=str(adapter), **options)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        return [layer.slots for layer in cache.layers]

    named = slots(path, layer_weights="lift-late")
    explicit = slots(path, layer_weights=",".join(str(w) for w in retrieval_layer_weights(scores)))
    assert named == explicit and named[-1] > named[0]
    with pytest.raises(ArmkvError, match="retrieval scores"):
        slots(plain, layer_weights="lift-late")


def test_retrieval_passages_are_cut_from_the_documents_in_order():
    from armkv.train.calibrate import retrieval_passages

    docs = ["a b c", "d e", "f g h i j k"]
    tokenize = lambda text: [ord(c) for c in text.split()[0]] * len(text.split())  # noqa: E731
    passages = retrieval_passages(docs, tokenize, 4, 2)
    assert [p.tolist() for p in passages] == [[97, 97, 97, 100], [100, 102, 102, 102]]
    short = retrieval_passages(["a b"], tokenize, 4, 2)  # the data runs out: one shorter passage
    assert [p.tolist() for p in short] == [[97, 97]]
