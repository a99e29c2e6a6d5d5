"""``armkv train --method policy``: teach each layer's top-M policy how many buckets to read.

The policy (paper 3.4) reads the mean of an input's first pre-RoPE keys and picks M, the
buckets each query of that layer reads. Trained through the language-model loss from the
shipped start it gets no signal (the start reads every bucket, and the soft cascade cannot
move M off N_b), so here its target is read off the model itself:

1. :func:`read_errors` runs training text through the model with the full cache, and for
   every layer and query ranks the buckets as ARM's read does (``read_rank``: by each
   bucket's best logit over the query group, ``read.bucket_best_of_keys``, or by the tree's read
   routing, ``Router.group_topm_buckets``). Only the keys ARM keeps in its memory are
   filed in buckets (not the sinks, not the recent window, which every query reads exactly).
   For M = 1 .. N_b it measures, per input, the mean relative error of the attention output
   when each query reads only its top-M buckets (:func:`output_error`).
2. An input's target M is the smallest M whose output error is within a tolerance
   (:func:`error_targets`). (A target from the share of attention mass the buckets hold
   read many buckets where attention is spread thin and few where it is sharp, and lost to
   fixed M: docs/decisions.md.)
3. :func:`fit_policy`: the cascade's decisions are fitted to those targets: at step i
   (from M = m_min + i) "read one more" is right when the target is above m_min + i, a
   binary cross-entropy on each step's probability.

The result is an adapter whose trees, shares and writes are those of ``--adapter`` and
whose policy picks M per layer and input.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from armkv.errors import ArmkvError
from armkv.memory.read import bucket_best_of_keys
from armkv.train.models import attention_modules, module_head_dim


def _projection(attn: torch.nn.Module, name: str) -> torch.nn.Module:
    """The module whose output is the pre-RoPE query or key: ``q_norm``/``k_norm`` where the
    layer normalises heads before RoPE (Qwen3), else ``q_proj``/``k_proj``."""
    norm = getattr(attn, f"{name}_norm", None)
    return norm if isinstance(norm, torch.nn.Module) else getattr(attn, f"{name}_proj")


@torch.no_grad()
def read_errors(
    model: torch.nn.Module, arm, ids: torch.Tensor, sinks: int | None = None, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """How far each layer's attention outputs move when its queries read only their top-M
    buckets, for M = 1 .. N_b (:func:`output_error`), with the policy's input.

    Parameters
    ----------
    model : a transformers causal LM of the Llama family (run once, eager attention)
    arm : its :class:`armkv.memory.module.ARMModel` (the trees that file keys and rank buckets)
    ids : LongTensor [B, T]
    sinks, window : the exact part every query reads (default: the adapter's); a key s counts
        for the query at t when sinks <= s < t - window

    Returns
    -------
    error : [L, B, N_b] float32, 0 at M = N_b (and wherever an input's queries had nothing in memory)
    pooled : [L, B, H * d] the policy's input (mean of the first ``policy_tokens`` pre-RoPE keys)
    """
    from armkv.hf.attach import model_rotary

    config = arm.config
    sinks = config.sinks if sinks is None else sinks
    window = config.window if window is None else window
    layers = attention_modules(model)
    if len(layers) != len(arm.layers):
        raise ArmkvError(f"the adapter has {len(arm.layers)} layers, the model {len(layers)}")
    device = next(model.parameters()).device
    captured: dict[tuple[int, str], torch.Tensor] = {}

    def hook(i: int, name: str, head_dim: int):
        def run(module, inputs, output):
            x = output.detach().float()
            captured[i, name] = x.reshape(x.shape[0], x.shape[1], -1, head_dim).transpose(1, 2)  # [B, heads, T, d]

        return run

    ids = ids.reshape(1, -1) if ids.ndim == 1 else ids
    B, T = ids.shape
    handles = []
    was_training, impl = model.training, model.config._attn_implementation
    try:
        for i, attn in enumerate(layers):
            d = module_head_dim(attn, model)
            handles += [_projection(attn, n).register_forward_hook(hook(i, n, d)) for n in ("q", "k")]
            handles.append(attn.v_proj.register_forward_hook(hook(i, "v", d)))
        model.eval()
        model.set_attn_implementation("eager")  # the fused kernels return no attention weights
        out = model(input_ids=ids.to(device), output_attentions=True, use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(impl)
        model.train(was_training)
        for h in handles:
            h.remove()

    t = torch.arange(T, device=device)
    in_memory = (t.view(1, T) >= sinks) & (t.view(1, T) < t.view(T, 1) - window)  # [query, key]
    # (read_rank="partial" ranks as "best" here: its chunks do, and its decoded tokens approximate it)
    rotary = model_rotary(model) if config.read_rank != "tree" else None
    errors, pooled = [], []
    for i, memory in enumerate(arm.layers):
        router = memory.router.to(device)
        q, k = captured[i, "q"], captured[i, "k"]  # [B, Hq, T, d], [B, H, T, d]
        H, d = k.shape[1], k.shape[-1]
        R = q.shape[1] // H
        p = out.attentions[i].float().view(B, H, R, T, T)
        bucket = router.route_writes(k.to(router.weight.dtype))  # [B, H, T]
        if rotary is None:
            ranked, _ = router.group_topm_buckets(q.view(B, H, R, T, d).to(router.weight.dtype), router.num_buckets)
        else:
            ranked = best_ranking(rotary.rotate(q, t), rotary.rotate(k, t), in_memory, bucket, router.num_buckets)
        errors.append(output_error(p, in_memory, bucket, ranked, captured[i, "v"]).cpu())
        pooled.append(k[:, :, : config.policy_tokens].mean(2).flatten(1).cpu())  # [B, H * d]
    return torch.stack(errors), torch.stack(pooled)


def best_ranking(
    q: torch.Tensor, k: torch.Tensor, in_memory: torch.Tensor, bucket: torch.Tensor, num_buckets: int, block: int = 64
) -> torch.Tensor:
    """The buckets of each query ranked as ``read_rank="best"`` reads them: by the best logit
    a bucket's keys in the query's memory give the query's group (``read.bucket_best_of_keys``;
    every key stands for one token here). q [B, Hq, T, d], k [B, H, S, d] post-RoPE;
    in_memory [T, S]; bucket [B, H, S] -> [B, H, T, N_b], best first."""
    B, Hq, T, d = q.shape
    H, S = k.shape[1], k.shape[2]
    G = B * H
    bias = torch.zeros(T, S, device=q.device).masked_fill(~in_memory, -torch.inf).expand(G, T, S)
    best = bucket_best_of_keys(
        q.reshape(G, Hq // H, T, d), k.reshape(G, S, d), bias, bucket.reshape(G, S), num_buckets, block
    )
    return best.argsort(-1, descending=True).view(B, H, T, num_buckets)


def output_error(
    p: torch.Tensor,
    in_memory: torch.Tensor,
    bucket: torch.Tensor,
    ranked: torch.Tensor,
    v: torch.Tensor,
    block: int = 64,
) -> torch.Tensor:
    """Relative error of each query's attention output when it reads only its top-M buckets
    of the memory (the exact part always read, the softmax renormalised over what is read),
    against reading all of them; mean over the queries that have memory, per input.

    p [B, H, R, T, S] attention; in_memory [T, S]; bucket [B, H, S]; ranked [B, H, T, N_b]
    (best first); v [B, H, S, d] -> [B, N_b]"""
    B, H, R, T, S = p.shape
    N_b, d = ranked.shape[-1], v.shape[-1]
    rank = torch.empty_like(ranked).scatter_(-1, ranked, torch.arange(N_b, device=ranked.device).expand_as(ranked))
    key_rank = rank.gather(-1, bucket.unsqueeze(2).expand(B, H, T, S))  # [B, H, T, S]: rank of each key's bucket
    has_memory = in_memory.any(1)
    total = p.new_zeros(B, N_b)
    for t0 in range(0, T, block):
        sl = slice(t0, min(T, t0 + block))
        pm = p[:, :, :, sl] * in_memory[sl]  # [B, H, R, t, S]
        pe = p[:, :, :, sl] - pm
        idx = key_rank[:, :, sl].unsqueeze(2).expand_as(pm)
        mass = torch.zeros(*pm.shape[:-1], N_b, device=p.device).scatter_add_(-1, idx, pm).cumsum(-1)
        pv = pm.unsqueeze(-1) * v[:, :, None, None]  # [B, H, R, t, S, d]
        num = (
            torch.zeros(*pm.shape[:-1], N_b, d, device=p.device)
            .scatter_add_(-2, idx.unsqueeze(-1).expand_as(pv), pv)
            .cumsum(-2)
        )
        exact_num = torch.einsum("bhrts,bhsd->bhrtd", pe, v).unsqueeze(-2)
        o = (exact_num + num) / (pe.sum(-1, keepdim=True) + mass).unsqueeze(-1)  # [B, H, R, t, N_b, d]
        err = (o - o[..., -1:, :]).norm(dim=-1) / o[..., -1:, :].norm(dim=-1).clamp_min(1e-6)
        total += (err * has_memory[sl].view(1, 1, 1, -1, 1)).sum((1, 2, 3))
    return total / max(int(has_memory.sum()) * H * R, 1)


def error_targets(error: torch.Tensor, tolerance: float) -> torch.Tensor:
    """The smallest M whose read keeps the mean relative output error within ``tolerance``.

    error [..., N_b] (0 at M = N_b) -> [...] long in [1, N_b]."""
    if not tolerance > 0.0:
        raise ArmkvError(f"error tolerance {tolerance}: give a positive relative error, e.g. 0.05")
    reached = error <= tolerance
    reached[..., -1] = True
    return reached.float().argmax(-1) + 1


def cascade_labels(target: torch.Tensor, m_min: int, steps: int) -> torch.Tensor:
    """The right decision at each step of the cascade: [N] targets -> [N, steps] float,
    1 where reading one bucket more (M = m_min + i -> m_min + i + 1) is still short of the target."""
    return (target.view(-1, 1) > m_min + torch.arange(steps, device=target.device)).float()


def fit_policy(
    policy, pooled: torch.Tensor, target: torch.Tensor, steps: int = 100, lr: float = 1e-2, seed: int = 0
) -> dict:
    """Fit one layer's :class:`armkv.memory.policy.TopMPolicy` to its targets in place.

    pooled [N, in_dim]; target [N] long. The input is standardised first (folded into the
    policy's input layer, so inference feeds it raw pooled keys as before). Full-batch AdamW
    on the cascade's binary cross-entropy (:func:`cascade_labels`). Returns the first and last
    loss and the fitted policy's mean |M - target| on these inputs.
    """
    if pooled.shape[0] != target.shape[0] or pooled.shape[0] < 1:
        raise ArmkvError(f"fit_policy: {pooled.shape[0]} inputs for {target.shape[0]} targets")
    torch.manual_seed(seed)
    params = list(policy.parameters())
    device = params[0].device
    x, target = pooled.to(device, torch.float32), target.to(device)
    with torch.no_grad():
        mean, std = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-3) if x.shape[0] > 1 else torch.ones_like(x[0])
        # inp(z) with z = (x - mean) / std  ==  inp'(x) with W' = W / std, b' = b - W' mean
        policy.inp.weight.div_(std)
        policy.inp.bias.sub_(policy.inp.weight @ mean)
        # start from the cascade that reads every bucket at g = sigmoid(2): no information
    K = policy.m_max - policy.m_min
    labels = cascade_labels(target, policy.m_min, K)
    optim = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        g = policy.continue_probs(x)
        loss = torch.nn.functional.binary_cross_entropy(g.clamp(1e-6, 1 - 1e-6), labels)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        m, _, _ = policy.decide(x)
    return {
        "loss_first": losses[0] if losses else math.nan,
        "loss_last": losses[-1] if losses else math.nan,
        "mean_abs_error": float((m - target).abs().float().mean()),
        "mean_m": float(m.float().mean()),
        "mean_target": float(target.float().mean()),
    }


def collect(model, arm, sequences: Iterable[torch.Tensor], progress=None) -> dict[str, torch.Tensor]:
    """:func:`read_errors` over sequences, concatenated: {"error": [L, N, N_b], "pooled": [L, N, H * d]}."""
    pooled, error = [], []
    for seq in sequences:
        e, p = read_errors(model, arm, seq)
        pooled.append(p)
        error.append(e)
        if progress is not None:
            progress.update(1)
    if not error:
        raise ArmkvError("no sequences to read the policy's targets from: the data was empty")
    return {"error": torch.cat(error, 1), "pooled": torch.cat(pooled, 1)}


def train_policy(arm, targets: torch.Tensor, pooled: torch.Tensor, steps: int, lr: float, seed: int) -> list[dict]:
    """Fit every layer's policy of ``arm`` to its targets [L, N]; returns one report a layer.

    An adapter whose policy was absent (top_m "fixed") gets one (top_m becomes "adaptive")."""
    import dataclasses

    from armkv.memory.policy import TopMPolicy

    reports = []
    if arm.config.top_m != "adaptive":
        arm.config = dataclasses.replace(arm.config, top_m="adaptive")
    for i, memory in enumerate(arm.layers):
        memory.config = arm.config
        if memory.policy is None:
            memory.policy = TopMPolicy(pooled.shape[-1], arm.config.policy_hidden, arm.config.max_m)
        report = fit_policy(memory.policy, pooled[i], targets[i], steps=steps, lr=lr, seed=seed + i)
        reports.append({"layer": i, **report})
    return reports


# ---------------------------------------------------------------------------- the command

TARGETS_FILE = "targets.safetensors"


def add_arguments(group) -> None:
    """The flags of ``armkv train --method policy`` (an argument group of ``armkv train``)."""
    group.add_argument(
        "--error",
        type=float,
        default=0.05,
        help="policy: an input's target M keeps its attention outputs within this mean relative error "
        "of reading every bucket",
    )
    group.add_argument(
        "--sequences",
        type=int,
        default=32,
        help="policy: training sequences of --seq-len tokens the targets are read from",
    )
    group.add_argument(
        "--policy-steps", type=int, default=100, help="policy: full-batch optimiser steps of the fit, per layer"
    )
    group.add_argument("--policy-lr", type=float, default=1e-2, help="policy: learning rate of the fit")


def check_error(error: float) -> None:
    if not error > 0.0:
        raise ArmkvError(f"--error {error}: give a positive relative error, e.g. 0.05")


def _adapter_folder(model, adapter: str | None):
    """The adapter folder to start from: a path, or (None / 'calibrated') the one shipped for the model."""
    from pathlib import Path

    from armkv.methods.adapters import shipped_adapter
    from armkv.methods.base import ModelInfo
    from armkv.train.arm import model_shape

    if adapter not in (None, "calibrated"):
        if not Path(adapter).is_dir():
            raise ArmkvError(f"--adapter {adapter}: not a folder (an adapter folder, or omit it for the shipped one)")
        return Path(adapter)
    layers, kv_heads, head_dim = model_shape(model)
    found = shipped_adapter(ModelInfo(layers, model.config.num_attention_heads, kv_heads, head_dim, 0))
    if found is None:
        raise ArmkvError("no adapter ships for this model: make one with armkv calibrate and pass --adapter DIR")
    return found


def main(args, model, tokenizer) -> int:
    """``armkv train --method policy``: read the targets (once; OUT/targets.safetensors is
    reused by a run with the same data and adapter), fit every layer's policy, write
    OUT/adapter and OUT/policy_fit.json."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    from armkv.memory.module import ARMModel, _atomic_write
    from armkv.train.arm import model_shape
    from armkv.train.data import PackedSequences, hf_tokenize, source_from_args

    folder = _adapter_folder(model, args.adapter)
    arm = ARMModel.load(folder)  # a fresh copy: the fit changes it
    arm.check_fits(*model_shape(model), where=str(folder))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = source_from_args(args, args.seed)
    settings = {
        "adapter": str(Path(folder).resolve()),
        "seq_len": args.seq_len,
        "sequences": args.sequences,
        "data": source.describe(),
    }
    path = out / TARGETS_FILE
    tensors = None
    if path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            stored = json.loads(f.metadata().get("settings", "{}"))
        if stored == json.loads(json.dumps(settings)):
            tensors = load_file(str(path))
            if "error" in tensors:
                print(f"targets: reusing {path}")
            else:
                tensors = None
    if tensors is None:
        data = PackedSequences(source, hf_tokenize(tokenizer), tokenizer.eos_token_id, args.seq_len, max_epochs=1)
        sequences = (s.view(1, -1) for _, s in zip(range(args.sequences), data))
        bar = tqdm(total=args.sequences, desc="policy targets", unit="seq", disable=args.no_progress)
        tensors = {k: v.contiguous() for k, v in collect(model, arm, sequences, bar).items()}
        bar.close()
        _atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"settings": json.dumps(settings)}))
    target = {"error": args.error}
    targets = error_targets(tensors["error"], args.error)
    reports = train_policy(arm, targets, tensors["pooled"], args.policy_steps, args.policy_lr, args.seed)
    extra = {
        "policy": {
            **target,
            "sequences": targets.shape[1],
            "seq_len": args.seq_len,
            "steps": args.policy_steps,
            "lr": args.policy_lr,
            "from": str(folder),
        }
    }
    adapter = arm.save(out / "adapter", extra=extra)
    summary = {
        **target,
        "num_buckets": arm.config.num_buckets,
        "mean_target": sum(r["mean_target"] for r in reports) / len(reports),
        "mean_m": sum(r["mean_m"] for r in reports) / len(reports),
        "layers": reports,
        "adapter": str(adapter),
    }
    _atomic_write(out / "policy_fit.json", lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=1)))
    for r in reports:
        print(
            f"layer {r['layer']:2d}: target M {r['mean_target']:5.1f}, picked {r['mean_m']:5.1f} "
            f"(mean |error| {r['mean_abs_error']:.1f}), loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}"
        )
    print(f"ARM adapter: {adapter}")
    print(json.dumps({k: v for k, v in summary.items() if k != "layers"}))
    return 0
