"""The top-M policy's targets and fit (armkv.train.policy), ``armkv train --method policy``
and the read-cost curve of ``armkv eval policy --fixed``."""

import json
import math

import pytest
import torch

from armkv.cli import main
from armkv.evals.policy import fixed_at
from armkv.memory.policy import TopMPolicy
from armkv.train.arm import new_arm
from armkv.train.policy import cascade_labels, error_targets, fit_policy, output_error, read_errors
from conftest import tiny_model


def naive_errors(model, arm, ids, sinks, window):
    """read_errors with every input made independently: the attention recomputed from the
    projections and RoPE, each query group's bucket ranking (read_rank "tree": from
    Router.leaf_scores; "best": each bucket's largest logit over the group's heads and the
    bucket's keys in memory, bucket by bucket), then the query-by-query error (naive_output_error)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    captured = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for name in ("q", "k", "v"):
            proj = getattr(attn, f"{name}_proj")
            hooks.append(
                proj.register_forward_hook(
                    lambda m, a, out, i=i, name=name: captured.__setitem__((i, name), out.detach())
                )
            )
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    B, T = ids.shape
    d = model.config.hidden_size // model.config.num_attention_heads
    cos, sin = model.model.rotary_emb(torch.zeros(1, T, d), torch.arange(T)[None])
    t = torch.arange(T)
    in_memory = (t.view(1, T) >= sinks) & (t.view(1, T) < t.view(T, 1) - window)
    causal = t.view(T, 1) >= t.view(1, T)
    result = []
    for i, memory in enumerate(arm.layers):
        q, k, v = (captured[i, n].view(B, T, -1, d).transpose(1, 2) for n in ("q", "k", "v"))
        H, R = k.shape[1], q.shape[1] // k.shape[1]
        qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
        kr = kr.repeat_interleave(R, 1)
        p = torch.softmax((qr @ kr.transpose(-1, -2) / math.sqrt(d)).masked_fill(~causal, -torch.inf), -1).view(
            B, H, R, T, T
        )
        router = memory.router
        bucket = router.route_writes(k)
        ranked = torch.empty(B, H, T, router.num_buckets, dtype=torch.long)
        for b in range(B):
            for h in range(H):
                for j in range(T):
                    if arm.config.read_rank == "tree":
                        # the leaf scores of query head h * R + r under KV head h's tree
                        scores = torch.stack(
                            [router.leaf_scores(q[b : b + 1, r::R, j : j + 1])[0, h, 0] for r in range(R)]
                        )
                        ranked[b, h, j] = (torch.logsumexp(scores, 0) - math.log(R)).argsort(descending=True)
                        continue
                    best = torch.full((router.num_buckets,), -torch.inf)
                    for s in range(T):
                        if in_memory[j, s]:
                            logit = max(float(qr[b, h * R + r, j] @ kr[b, h * R, s]) for r in range(R))
                            best[bucket[b, h, s]] = max(best[bucket[b, h, s]], logit)
                    ranked[b, h, j] = best.argsort(descending=True)
        result.append(naive_output_error(p, in_memory, bucket, ranked, v))
    return torch.stack(result)


@pytest.mark.parametrize("read_rank", ["best", "tree"])
@pytest.mark.parametrize("T, sinks, window", [(23, 2, 5), (17, 0, 3)])
def test_read_errors_match_the_naive_reference(T, sinks, window, read_rank):
    model = tiny_model("llama")
    torch.manual_seed(1)
    arm = new_arm(model, budget=96)
    arm.config.read_rank = read_rank
    ids = torch.randint(3, 120, (2, T))
    error, pooled = read_errors(model, arm, ids, sinks=sinks, window=window)
    L, N_b = model.config.num_hidden_layers, arm.config.num_buckets
    assert error.shape == (L, 2, N_b) and pooled.shape == (L, 2, 2 * 16)
    expect = naive_errors(model, arm, ids, sinks, window)
    torch.testing.assert_close(error.double(), expect, atol=1e-4, rtol=1e-4)
    assert bool((error[..., -1] == 0).all()) and bool((error[..., 0] > 0).all())


def naive_output_error(p, in_memory, bucket, ranked, v):
    """output_error query by query and M by M: the read's keys listed, its softmax renormalised."""
    B, H, R, T, S = p.shape
    N_b = ranked.shape[-1]
    total, count = torch.zeros(B, N_b, dtype=torch.float64), 0
    for b in range(B):
        for h in range(H):
            for r in range(R):
                for t in range(T):
                    if not bool(in_memory[t].any()):
                        continue
                    if b == 0:
                        count += 1
                    w = p[b, h, r, t].double()
                    outputs = []
                    for M in range(1, N_b + 1):
                        read = set(ranked[b, h, t, :M].tolist())
                        keep = torch.tensor(
                            [(not bool(in_memory[t, s])) or int(bucket[b, h, s]) in read for s in range(S)]
                        )
                        ww = w * keep
                        outputs.append((ww @ v[b, h].double()) / ww.sum())
                    full = outputs[-1]
                    for M, o in enumerate(outputs):
                        total[b, M] += float((o - full).norm() / full.norm().clamp_min(1e-6))
    return total / count


def test_output_error_matches_the_naive_reference():
    torch.manual_seed(3)
    B, H, R, T, N_b, d = 2, 2, 2, 11, 8, 5
    logits = torch.randn(B, H, R, T, T)
    causal = torch.ones(T, T).tril().bool()
    p = torch.softmax(logits.masked_fill(~causal, -torch.inf), -1)
    t = torch.arange(T)
    in_memory = (t.view(1, T) >= 1) & (t.view(1, T) < t.view(T, 1) - 3)
    bucket = torch.randint(0, N_b, (B, H, T))
    ranked = torch.rand(B, H, T, N_b).argsort(-1)
    v = torch.randn(B, H, T, d)
    got = output_error(p, in_memory, bucket, ranked, v, block=4)
    torch.testing.assert_close(got.double(), naive_output_error(p, in_memory, bucket, ranked, v), atol=1e-5, rtol=1e-5)
    assert bool((got[:, -1] == 0).all()) and bool((got[:, 0] > 0).all())


def test_read_errors_pool_the_first_keys_as_the_inference_policy_does():
    model = tiny_model("llama")
    arm = new_arm(model, budget=96)
    ids = torch.randint(3, 120, (1, 40))
    _, pooled = read_errors(model, arm, ids)
    keys = {}
    hook = model.model.layers[1].self_attn.k_proj.register_forward_hook(
        lambda m, a, out: keys.__setitem__("k", out.detach())
    )
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()
    first = keys["k"][0, : arm.config.policy_tokens].view(-1, 2, 16).mean(0).flatten()
    torch.testing.assert_close(pooled[1, 0], first)


def test_error_targets_and_labels():
    error = torch.tensor([[0.3, 0.2, 0.04, 0.01, 0.0], [0.5, 0.5, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    assert error_targets(error, 0.05).tolist() == [3, 5, 1]  # nothing in memory: one bucket is enough
    assert error_targets(error, 0.25).tolist() == [2, 5, 1]
    assert cascade_labels(torch.tensor([1, 3]), 1, 4).tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]
    with pytest.raises(Exception, match="error tolerance"):
        error_targets(error, 0.0)


def test_the_target_gives_the_shipped_start_a_gradient_and_the_fit_learns_m_per_input():
    torch.manual_seed(0)
    policy = TopMPolicy(in_dim=6, hidden=16, m_max=16)
    # two kinds of input: one needs 3 buckets, the other 11
    x = torch.cat([torch.randn(40, 6) + 4.0, torch.randn(40, 6) - 4.0]) * 7 + 30
    target = torch.cat([torch.full((40,), 3), torch.full((40,), 11)])
    labels = cascade_labels(target, policy.m_min, policy.m_max - policy.m_min)
    g = policy.continue_probs(x)
    assert bool((policy.decide(x)[0] == 16).all())  # the start reads every bucket
    torch.nn.functional.binary_cross_entropy(g, labels).backward()
    assert float(policy.out.bias.grad.abs()) > 0.1  # a signal, where the language-model loss gives none
    policy.zero_grad()
    report = fit_policy(policy, x, target, steps=200, lr=1e-2)
    assert report["loss_last"] < report["loss_first"] / 5
    m, _, _ = policy.decide(x)
    assert m[:40].tolist() == [3] * 40 and m[40:].tolist() == [11] * 40
    assert report["mean_abs_error"] == 0


def test_fixed_at_interpolates_between_the_nearest_fixed_points():
    points = [{"read_share": 0.25, "ppl": 20.0}, {"read_share": 0.5, "ppl": 19.0}, {"read_share": 1.0, "ppl": 18.0}]
    assert fixed_at(points, 0.375) == pytest.approx(19.5)
    assert fixed_at(points, 0.75) == pytest.approx(18.5)
    assert fixed_at(points, 1.0) == pytest.approx(18.0)
    assert fixed_at(points, 0.1) is None


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "t.txt"
    g = torch.Generator().manual_seed(0)
    words = "the grass is green and the sky is blue while magic numbers hide in long text".split()
    path.write_text(" ".join(words[int(i)] for i in torch.randint(0, len(words), (1200,), generator=g)) + "\n")
    return path


@pytest.fixture(scope="module")
def start_adapter(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("start") / "adapter"
    new_arm(model, budget=96).save(path)
    return path


def test_train_policy_cli_writes_an_adapter_and_reuses_its_targets(
    tiny_model_dir, text, start_adapter, tmp_path, capsys
):
    from armkv.memory.module import ARMModel

    out = tmp_path / "p"

    def args(*target):
        return [
            "train",
            "--method",
            "policy",
            "--model",
            str(tiny_model_dir),
            "--adapter",
            str(start_adapter),
            "--data",
            str(text),
            "--seq-len",
            "96",
            "--sequences",
            "3",
            "--policy-steps",
            "20",
            *target,
            "--out",
            str(out),
            "--no-progress",
        ]

    assert main(args("--error", "0.2")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    fitted = ARMModel.load(out / "adapter")
    start = ARMModel.load(start_adapter)
    assert not torch.equal(fitted.layers[0].policy.out.bias, start.layers[0].policy.out.bias)
    torch.testing.assert_close(fitted.layers[0].router.weight, start.layers[0].router.weight, atol=0, rtol=0)
    assert len(json.loads((out / "policy_fit.json").read_text())["layers"]) == 2
    assert summary["error"] == 0.2 and 1 <= summary["mean_m"] <= summary["num_buckets"]
    # the same data and adapter: the targets are read once, for any tolerance
    assert main(args("--error", "0.05")) == 0
    assert "targets: reusing" in capsys.readouterr().out


@pytest.mark.parametrize("target, message", [(["--error", "0"], "--error 0"), (["--error", "-1"], "--error -1")])
def test_train_policy_bad_target_is_one_line_before_the_model(tmp_path, capsys, target, message):
    assert (
        main(["train", "--method", "policy", "--model", str(tmp_path / "none"), *target, "--out", str(tmp_path)]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_curve_cli_scores_fixed_and_learned_and_resumes(
    tiny_model_dir, text, start_adapter, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "curve"
    args = [
        "eval",
        "policy",
        "--model",
        str(tiny_model_dir),
        "--budget",
        "96",
        "--chunk",
        "16",
        "--input",
        str(text),
        "--inputs",
        "2",
        "--tokens",
        "48",
        "--fixed",
        "1,4",
        "--adapter",
        str(start_adapter),
        "--output",
        str(out),
        "--json",
    ]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["label"]: r for r in summary["rows"]}
    assert set(rows) == {"M=1", "M=4", start_adapter.parent.name}
    assert (
        rows["M=1"]["read_share"] == pytest.approx(1 / 4**3 * 1)
        or rows["M=1"]["read_share"] < rows["M=4"]["read_share"]
    )
    assert all(r["ppl"] > 1 and len(r["ppls"]) == 2 for r in rows.values())
    assert (out / "curve.png").stat().st_size > 0 and "perplexity" in (out / "curve.md").read_text()

    import armkv.evals.policy as policy

    monkeypatch.setattr(policy, "curve_point", lambda *a, **k: pytest.fail("a finished point was scored again"))
    assert main(args) == 0
    capsys.readouterr()
    # other settings in the same folder: refused before the model loads
    assert main([a if a != "48" else "40" for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokens=48" in err[0]


def test_curve_cli_options_reach_every_point_and_are_checked(
    tiny_model_dir, text, start_adapter, tmp_path, capsys, monkeypatch
):
    """--option arm.KEY=VALUE goes to every point of the curve (fixed and learned) and into the
    curve's settings (a resume with other options is refused); an adapter, the top-M keys
    the fixed points set, or another method's option are one-line errors before the model loads."""
    import armkv.evals.policy as policy

    seen = []
    monkeypatch.setattr(
        policy,
        "curve_point",
        lambda model, windows, budget, chunk, options: (
            seen.append(options) or {"ppl": 2.0, "ppls": [2.0], "read_share": 0.5, "cache_bytes": 1}
        ),
    )
    out = tmp_path / "curve"
    base = [
        "eval",
        "policy",
        "--model",
        str(tiny_model_dir),
        "--budget",
        "96",
        "--input",
        str(text),
        "--inputs",
        "2",
        "--tokens",
        "48",
        "--fixed",
        "1,4",
        "--adapter",
        str(start_adapter),
        "--output",
        str(out),
        "--json",
    ]
    assert main(base + ["--option", "arm.read_rank=tree"]) == 0
    capsys.readouterr()
    assert len(seen) == 3 and all(o["read_rank"] == "tree" for o in seen)
    assert json.loads((out / "curve.json").read_text())["settings"]["options"] == {"read_rank": "tree"}
    assert main(base) == 2  # the folder's points were made with other options
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    for option, message in [
        ("arm.adapter=x", "--adapter"),
        ("arm.m_fixed=2", "--fixed"),
        ("kivi.bits=2", "kivi"),
        ("arm.no_such_key=1", "no_such_key"),
    ]:
        assert main(base[:-3] + ["--output", str(tmp_path / "other"), "--json", "--option", option]) == 2
        err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("Loading")]
        assert len(err) == 1 and message in err[0], err
