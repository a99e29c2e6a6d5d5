"""The router's training signal (armkv.train.router_signal) and ``armkv train --method router``
(armkv.train.router), on tiny models."""

import json
import math

import pytest
import torch

from armkv.cli import main
from armkv.hf.attach import model_rotary
from armkv.memory.kmeans import init_router_from_keys
from armkv.memory.route import Router
from armkv.train.arm import new_arm
from armkv.train.router import RouterTrainConfig, evaluate, pool_fill, read_cost_loss, read_loss, train_layer
from armkv.train.router_signal import bucket_mass, collect_qk, grouped, missed_mass
from conftest import tiny_model


def _signal(model, T=96, n=24, sequences=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, model.config.vocab_size, (T,), generator=g) for _ in range(sequences)]
    return collect_qk(model, ids, n, 20, seed=seed, dtype=torch.float32), ids


def _naive_mass(model, ids, layer, qpos, key_bucket, num_buckets, sinks, window):
    """The attention of each query, recomputed from the projections with transformers' own RoPE,
    summed bucket by bucket and key by key."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = model.model.layers[layer].self_attn
    got = {}
    hooks = [
        getattr(attn, f"{n}_proj").register_forward_hook(
            lambda m, a, out, n=n: got.__setitem__(n, out.detach()), always_call=True
        )
        for n in ("q", "k")
    ]
    with torch.no_grad():
        model(input_ids=ids[None])
    for h in hooks:
        h.remove()
    T = ids.numel()
    d = model.config.hidden_size // model.config.num_attention_heads
    q, k = (got[n].view(1, T, -1, d).transpose(1, 2) for n in ("q", "k"))
    cos, sin = model.model.rotary_emb(torch.zeros(1, T, d), torch.arange(T)[None])
    qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
    H, R = k.shape[1], q.shape[1] // k.shape[1]
    out = torch.zeros(H, R, len(qpos), num_buckets)
    for h in range(H):
        for r in range(R):
            for n, t in enumerate(qpos.tolist()):
                logits = qr[0, h * R + r, t] @ kr[0, h, : t + 1].T / math.sqrt(d)
                p = logits.softmax(-1)
                for j in range(t + 1):
                    if sinks <= j <= t - window:
                        out[h, r, n, key_bucket[h, j]] += p[j]
    return out


def test_bucket_mass_is_the_dense_attention_on_each_buckets_pool_keys():
    model = tiny_model("llama")
    samples, ids = _signal(model, sequences=1)
    s, layer = samples[0], 1
    router = Router(2, 16, depth=2, branching=2)
    buckets = router.route_writes(s.k[layer][None])[0]
    got = bucket_mass(s.q[layer], s.qpos, s.k[layer], buckets, 4, model_rotary(model), sinks=3, window=5, block=7)
    want = _naive_mass(model, ids[0], layer, s.qpos, buckets, 4, 3, 5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert float(got.sum(-1).max()) <= 1 + 1e-6 and float(got.sum(-1).min()) > 0


def test_missed_mass_of_a_tree_read_and_of_the_oracle():
    model = tiny_model("llama")
    samples, _ = _signal(model, sequences=1)
    s = samples[0]
    router = Router(2, 16, depth=2, branching=4)
    init_router_from_keys(router, s.k[0])
    mass = bucket_mass(s.q[0], s.qpos, s.k[0], router.route_writes(s.k[0][None])[0], 16, model_rotary(model), 2, 4)
    # the reference: each group's buckets from the exhaustive leaf scores, by hand
    x = grouped(s.q[0], 2)
    for m in (4, 16):  # (where the search is exhaustive: the beam of m = 1 may miss the best leaf)
        got = missed_mass(router, s.q[0], mass, m)
        scores = router.leaf_scores(x[0].flatten(1, 2)[None]).view(2, 2, -1, 16)
        group = torch.logsumexp(scores, 1)  # [H, N, N_b]
        top = group.topk(m, -1).indices
        want = mass.sum(-1) - mass.gather(-1, top[:, None].expand(2, 2, -1, m)).sum(-1)
        torch.testing.assert_close(got["tree"], want)
        assert bool((got["oracle"] <= got["tree"] + 1e-6).all())
    assert float(missed_mass(router, s.q[0], mass, 16)["tree"].abs().max()) < 1e-6
    beam = missed_mass(router, s.q[0], mass, 1)
    assert bool((beam["oracle"] <= beam["tree"] + 1e-6).all()) and bool((beam["tree"] <= beam["pool"] + 1e-6).all())


def test_read_loss_is_the_cross_entropy_of_the_group_read_against_the_mass():
    g = torch.Generator().manual_seed(0)
    router = Router(2, 8, depth=2, branching=3)
    x = torch.randn(1, 2, 3, 5, 8, generator=g)
    mass = torch.rand(2, 3, 5, 9, generator=g) / 9
    want = 0.0
    for h in range(2):
        for n in range(5):
            for b in range(9):  # a leaf's probability: the product of its path's softmaxes, by hand
                p = 0.0
                for r in range(3):
                    node, prob = 0, 1.0
                    path = [b // 3, b % 3]
                    for child in path:
                        logits = router.weight[h, node] @ x[0, h, r, n] * router.read_scale + router.read_bias[h, node]
                        prob = prob * logits.softmax(-1)[child]
                        node = node * 3 + 1 + child
                    p += prob / 3
                want = want - mass[h, :, n, b].sum() * torch.log(p)
    torch.testing.assert_close(read_loss(router, x, mass), want / mass.sum(), rtol=1e-5, atol=1e-6)


def test_training_a_layer_lowers_what_its_tree_read_misses_and_is_seeded():
    model = tiny_model("llama")
    train, _ = _signal(model, T=128, n=48, sequences=3)
    held, _ = _signal(model, T=128, n=48, sequences=1, seed=1)
    rotary = model_rotary(model)
    cfg = RouterTrainConfig(steps=40, batch_queries=64, batch_keys=128, refile_every=20, fraction=4, window=8)

    def trained():
        router = Router(2, 16, depth=2, branching=4)
        init_router_from_keys(router, torch.cat([s.k[1] for s in train], 1))
        before = evaluate(router, router, train, 1, rotary, cfg)
        log = train_layer(router, train, 1, rotary, cfg)
        return router, before, evaluate(router, router, train, 1, rotary, cfg), log

    router, before, after, log = trained()
    assert after["ce"] < before["ce"]
    assert log["ce"][-1] < log["ce"][0] and len(log["balance"]) == 40
    assert not any(p.requires_grad for p in router.parameters())
    again = trained()[0]
    for a, b in zip(router.parameters(), again.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert evaluate(router, router, held, 1, rotary, cfg)["missed"] >= 0


def test_pool_fill_counts_each_buckets_pool_keys_at_each_query():
    model = tiny_model("llama")
    train, _ = _signal(model, T=96, n=12, sequences=2)
    cfg = RouterTrainConfig(sinks=3, window=8)
    router = Router(2, 16, depth=2, branching=3)
    init_router_from_keys(router, torch.cat([s.k[1] for s in train], 1))
    got = pool_fill(router, train, 1, cfg)
    want = []
    for s in train:  # by hand: each query's pool keys, counted bucket by bucket
        buckets = router.route_writes(s.k[1][None])[0]
        for t in s.qpos.tolist():
            row = torch.zeros(2, 9)
            for h in range(2):
                for j in range(cfg.sinks, t - cfg.window + 1):
                    row[h, buckets[h, j]] += 1
            want.append(row / row.sum(-1, keepdim=True))
    torch.testing.assert_close(got, torch.stack(want, 1))
    # the cost term: 1 for a uniform read, the fill of the chosen bucket for a certain one
    x = torch.randn(1, 2, 3, got.shape[1], 16)
    with torch.no_grad():
        router.weight.zero_()
        router.read_bias.zero_()
    torch.testing.assert_close(read_cost_loss(router, x, got), torch.tensor(1.0))


def test_the_read_cost_term_moves_the_read_off_the_full_buckets():
    model = tiny_model("llama")
    train, _ = _signal(model, T=128, n=48, sequences=3)
    rotary = model_rotary(model)
    costs = []
    for weight in (0.0, 4.0):  # (no re-filing: the fill the term sees stays the same)
        cfg = RouterTrainConfig(
            steps=30, batch_queries=64, batch_keys=128, refile_every=100, fraction=4, window=8, read_cost=weight
        )
        router = Router(2, 16, depth=2, branching=4)
        init_router_from_keys(router, torch.cat([s.k[1] for s in train], 1))
        fill = pool_fill(router, train, 1, cfg)
        x = grouped(torch.cat([s.q[1] for s in train], 1), 2)
        with torch.no_grad():
            before = float(read_cost_loss(router, x, fill))
        log = train_layer(router, train, 1, rotary, cfg)
        assert len(log["read_cost"]) == (30 if weight else 0)
        with torch.no_grad():
            costs.append(float(read_cost_loss(router, x, fill)))
    assert costs[1] < before and costs[1] < costs[0]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "t.txt"
    g = torch.Generator().manual_seed(0)
    words = "the grass is green and the sky is blue while magic numbers hide in long text".split()
    path.write_text(" ".join(words[int(i)] for i in torch.randint(0, len(words), (1500,), generator=g)) + "\n")
    return path


def test_train_router_cli_writes_an_adapter_and_resumes_exactly(tiny_model_dir, text, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from armkv.memory.module import ARMModel

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    start = tmp_path / "start"
    new_arm(model, budget=96).save(start)
    out = tmp_path / "r"
    args = [
        "train",
        "--method",
        "router",
        "--model",
        str(tiny_model_dir),
        "--adapter",
        str(start),
        "--data",
        str(text),
        "--seq-len",
        "128",
        "--router-sequences",
        "2",
        "--heldout-sequences",
        "1",
        "--queries-per-sequence",
        "16",
        "--router-steps",
        "6",
        "--refile-every",
        "3",
        "--out",
        str(out),
        "--no-progress",
        "--no-plot",
    ]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    trained = ARMModel.load(out / "adapter")
    begun = ARMModel.load(start)
    assert not torch.equal(trained.layers[0].router.weight, begun.layers[0].router.weight)
    for name, value in begun.state_dict().items():  # only the trees train (the adapter is saved in bf16)
        if ".router." not in name:
            torch.testing.assert_close(trained.state_dict()[name], value.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert trained.config.meta["router"] == "trained"
    assert len(json.loads((out / "router_fit.json").read_text())["layers"]) == 2
    assert 0 <= summary["missed_trained"] <= summary["pool"] <= 1
    # a second run without --resume refuses; one stopped after its first layer and resumed equals the whole run
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err
    import shutil

    shutil.rmtree(out / "checkpoints" / "step_00000002")
    (out / "adapter" / "adapter_model.safetensors").unlink()
    assert main([*args, "--resume"]) == 0
    assert "signal: reusing" in capsys.readouterr().out
    resumed = ARMModel.load(out / "adapter")
    for a, b in zip(trained.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--router-steps", "-1"], "--router-steps"),
        (["--fraction", "0"], "--fraction"),
        (["--seq-len", "50"], "--seq-len 50"),
        (["--adapter", "/nonexistent"], "--adapter /nonexistent"),
    ],
)
def test_train_router_bad_settings_are_one_line_before_the_model(tmp_path, capsys, bad, message):
    args = ["train", "--method", "router", "--model", str(tmp_path / "none"), "--out", str(tmp_path), *bad]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
