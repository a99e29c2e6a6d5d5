"""``armkv train --method router``: train each layer's tree so that a query's top-M read
reaches the buckets that hold its attention.

The signal (:mod:`armkv.train.router_signal`) is the model's own: every layer's pre-RoPE
queries and keys on training text, the dense causal attention of sampled queries, and the
share of each query head's attention on the pool keys of each bucket, the keys filed by the
tree's write routing. No gradient goes through the model.

The loss over a layer's queries is the cross-entropy of the tree's read distribution
against that mass, level by level: a leaf's read log-probability is the sum of the
log-softmax of the router outputs along its path (``Router.leaf_scores``), so

    CE = - sum_b mass_b * log P(b | q) = sum over levels of each node's children's
         cross-entropy, weighted by the mass that reaches the node,

and a query's beam is pushed down the children that hold its mass. The R query heads of a
KV head share one read (``Router.group_topm_buckets`` ranks by log of the mean of their path
probabilities), so the loss is on that group distribution against the group's mass; queries
with little attention on the pool weigh little (the mass is not renormalised).

The tree is trained as one tree for keys and queries: its node weights are the centroids
that file keys (write routing, ``W_p k + b_p``) and that route queries (read routing,
``W_p q / sqrt(d) + r_p``); the balance loss of the paper (``alpha * L_bal`` on the keys) keeps
the write routing spread, and every ``refile_every`` steps the keys are filed again under
the tree as it now stands and the targets recomputed (what a bucket holds changes with the
tree). The alternative it was measured against, key and query maps of one tree, is in
docs/decisions.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from armkv.errors import ArmkvError
from armkv.memory.rope import Rotary
from armkv.memory.route import Router
from armkv.train.router_signal import QKSample, bucket_mass, grouped, missed_mass

WARMUP = 10  # steps of linear warm-up of the step size


@dataclass(frozen=True)
class RouterTrainConfig:
    """What a router run does to each layer (every field is in the checkpoints' config)."""

    steps: int = 100  # Adam steps per layer
    lr: float = 0.02  # Adam step size, relative to the layer's mean key norm (warm-up, cosine to 1/10)
    batch_queries: int = 512  # queries per KV head and step (each with its R query heads)
    batch_keys: int = 2048  # keys per KV head and step in the balance loss
    alpha: float = 0.01  # weight of the balance loss
    refile_every: int = 25  # steps between re-filings of the keys under the tree being trained
    read_cost: float = 0.0  # weight of the read's expected share of the pool (N_b sum_b P(b | q) fill_b; 1: balanced)
    fraction: int = 8  # the held-out read's M = N_b / fraction
    sinks: int = 4  # the keys ARM holds exactly (never in the pool, never missed)
    window: int = 48
    seed: int = 0


def layer_keys(samples: list[QKSample], layer: int) -> list[torch.Tensor]:
    return [s.k[layer].float() for s in samples]


def layer_masses(
    router: Router, samples: list[QKSample], layer: int, rotary: Rotary, cfg: RouterTrainConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's queries grouped by KV head [1, H, R, N, d] and their bucket mass
    [H, R, N, N_b], the keys filed by ``router``'s write routing, over all samples."""
    qs, masses = [], []
    with torch.no_grad():
        for s in samples:
            k = s.k[layer].float()
            buckets = router.route_writes(k[None].to(router.weight.dtype))[0]
            masses.append(
                bucket_mass(s.q[layer].float(), s.qpos, k, buckets, router.num_buckets, rotary, cfg.sinks, cfg.window)
            )
            qs.append(s.q[layer].float())
    H = router.weight.shape[0]
    return grouped(torch.cat(qs, 1), H), torch.cat(masses, 2)


def pool_fill(router: Router, samples: list[QKSample], layer: int, cfg: RouterTrainConfig) -> torch.Tensor:
    """The share of the pool's keys in each bucket when each query reads, [H, N, N_b] over all
    samples (the pool at a query at t: the keys at sinks..t - window, filed by ``router``'s
    write routing): what a read of bucket b takes of the pool, before any merging."""
    out = []
    with torch.no_grad():
        for s in samples:
            k = s.k[layer].float()
            buckets = router.route_writes(k[None].to(router.weight.dtype))[0].long()  # [H, T]
            H, T = buckets.shape
            onehot = torch.zeros(H, T, router.num_buckets).scatter_(-1, buckets[..., None], 1.0)
            onehot[:, : cfg.sinks] = 0
            upto = onehot.cumsum(1)  # [H, T, N_b]: keys at positions <= p
            last = (s.qpos - cfg.window).clamp_min(0)
            counts = upto[:, last]  # [H, N, N_b]
            out.append(counts / counts.sum(-1, keepdim=True).clamp_min(1))
    return torch.cat(out, 1)


def group_log_probs(router: Router, x: torch.Tensor) -> torch.Tensor:
    """The group read distribution over buckets, log P(b | q) [H, N, N_b]: the mean of the R
    query heads' path probabilities (the ranking of ``Router.group_topm_buckets``).
    x : [1, H, R, N, d] pre-RoPE queries."""
    _, H, R, N, d = x.shape
    logp = router.leaf_scores(x.reshape(1, H, R * N, d), read=True).view(H, R, N, -1)
    return torch.logsumexp(logp, 1) - math.log(R)


def read_loss(router: Router, x: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the group read distribution against the group's bucket mass.

    x : [1, H, R, N, d] pre-RoPE queries; mass : [H, R, N, N_b] -> scalar (per unit of mass)"""
    target = mass.sum(1)  # [H, N, N_b]
    return -(target * group_log_probs(router, x)).sum() / target.sum().clamp_min(1e-12)


def read_cost_loss(router: Router, x: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """The read's expected share of the pool, N_b * E_q[sum_b P(b | q) fill_b] (1 for a
    read that does not prefer full buckets over a balanced tree): what a top-M read costs
    grows with the fill of the buckets it ranks first, and the mass loss alone is lowest
    on the fullest buckets (they hold the most attention). fill : [H, N, N_b] (:func:`pool_fill`)."""
    p = group_log_probs(router, x).exp()
    return (p * fill).sum(-1).mean() * fill.shape[-1]


@torch.no_grad()
def evaluate(
    write_router: Router, read_router: Router, samples: list[QKSample], layer: int, rotary: Rotary, cfg
) -> dict:
    """Held-out missed mass at M = N_b / fraction: keys filed by ``write_router``, queries
    routed by ``read_router`` (mean over queries, query heads and KV heads)."""
    x, mass = layer_masses(write_router, samples, layer, rotary, cfg)
    H = x.shape[1]
    q = x[0].reshape(-1, x.shape[3], x.shape[4])  # [Hq, N, d]
    m = max(1, write_router.num_buckets // cfg.fraction)
    got = missed_mass(read_router, q, mass, m)
    got_loss = float(read_loss(read_router, x, mass))
    fill = pool_fill(write_router, samples, layer, cfg)  # [H, N, N_b]
    chosen = read_router.group_topm_buckets(x.to(read_router.weight.dtype), m)[0][0]  # [H, N, m]
    return {
        "missed": float(got["tree"].mean()),
        "read_share": float(fill.gather(-1, chosen.long()).sum(-1).mean()),
        "oracle": float(got["oracle"].mean()),
        "pool": float(got["pool"].mean()),
        "ce": got_loss,
        "m": m,
        "kv_heads": H,
    }


def train_layer(router: Router, samples: list[QKSample], layer: int, rotary: Rotary, cfg: RouterTrainConfig) -> dict:
    """Train one layer's tree in place (weights, write and read biases) on ``samples``;
    deterministic given ``cfg.seed`` and ``layer``. Returns the layer's training log."""
    g = torch.Generator().manual_seed(cfg.seed * 1009 + layer)
    keys = torch.cat(layer_keys(samples, layer), 1)  # [H, sum T, d]
    scale = float(keys.norm(dim=-1).mean())
    params = [router.weight, router.bias, router.read_bias]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(params, lr=cfg.lr * scale)
    base = [cfg.lr * scale, cfg.lr * scale * 0.1]
    x = mass = fill = None
    log = {"ce": [], "balance": [], "read_cost": []}
    for step in range(cfg.steps):
        if step % cfg.refile_every == 0:
            x, mass = layer_masses(router, samples, layer, rotary, cfg)
            fill = pool_fill(router, samples, layer, cfg) if cfg.read_cost else None
        lr = base[1] + 0.5 * (base[0] - base[1]) * (1 + math.cos(math.pi * step / max(1, cfg.steps)))
        lr *= min(1.0, (step + 1) / WARMUP)
        for group in optimizer.param_groups:
            group["lr"] = lr
        N = x.shape[3]
        pick = torch.randperm(N, generator=g)[: cfg.batch_queries]
        ce = read_loss(router, x[:, :, :, pick], mass[:, :, pick])
        loss = ce
        if cfg.read_cost:
            cost = read_cost_loss(router, x[:, :, :, pick], fill[:, pick])
            loss = loss + cfg.read_cost * cost
            log["read_cost"].append(float(cost.detach()))
        if cfg.alpha:
            kpick = torch.randperm(keys.shape[1], generator=g)[: cfg.batch_keys]
            balance = router.balance_loss(keys[None, :, kpick])
            loss = loss + cfg.alpha * balance
            log["balance"].append(float(balance.detach()))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        log["ce"].append(float(ce.detach()))
    for p in params:
        p.requires_grad_(False)
    return log


def config_dict(cfg: RouterTrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def write_json(path: Path, data) -> None:
    from armkv.train.checkpoint import write_atomic

    write_atomic(path, (json.dumps(data, indent=1) + "\n").encode())


def check_config(cfg: RouterTrainConfig) -> None:
    """A bad setting is a one-line error before any slow work."""
    if cfg.steps < 0 or cfg.batch_queries < 1 or cfg.batch_keys < 1 or cfg.refile_every < 1:
        raise ArmkvError(
            "--router-steps must be >= 0, --batch-queries, --batch-keys and --refile-every >= 1 "
            f"(got {cfg.steps}, {cfg.batch_queries}, {cfg.batch_keys}, {cfg.refile_every})"
        )
    if cfg.fraction < 1 or cfg.lr <= 0 or cfg.alpha < 0 or cfg.read_cost < 0:
        raise ArmkvError("--fraction must be >= 1, --router-lr > 0, --alpha >= 0 and --read-cost >= 0")


SIGNAL_FILE = "signal.safetensors"


def add_arguments(group) -> None:
    """The flags of ``armkv train --method router`` (an argument group of ``armkv train``;
    ``--alpha``, ``--seed``, ``--seq-len``, ``--adapter``, ``--out`` and ``--resume`` are shared)."""
    d = RouterTrainConfig()
    group.add_argument("--router-sequences", type=int, default=8, help="router: training sequences of --seq-len tokens")
    group.add_argument(
        "--heldout-sequences",
        type=int,
        default=2,
        help="router: held-out sequences the missed mass is reported on (the default corpus's held-out split)",
    )
    group.add_argument(
        "--queries-per-sequence", type=int, default=256, help="router: query positions sampled per sequence"
    )
    group.add_argument("--router-steps", type=int, default=d.steps, help="router: Adam steps per layer")
    group.add_argument(
        "--router-lr", type=float, default=d.lr, help="router: step size, relative to the layer's mean key norm"
    )
    group.add_argument(
        "--refile-every", type=int, default=d.refile_every, help="router: steps between re-filings of the keys"
    )
    group.add_argument("--fraction", type=int, default=d.fraction, help="router: the held-out read's M = N_b / this")
    group.add_argument(
        "--read-cost",
        type=float,
        default=d.read_cost,
        help="router: weight of the read's expected share of the pool in the loss (0: off)",
    )


def config_from_args(args) -> RouterTrainConfig:
    cfg = RouterTrainConfig(
        steps=args.router_steps,
        lr=args.router_lr,
        alpha=args.alpha,
        refile_every=args.refile_every,
        fraction=args.fraction,
        read_cost=args.read_cost,
        seed=args.seed,
    )
    check_config(cfg)
    if args.router_sequences < 1 or args.heldout_sequences < 1 or args.queries_per_sequence < 1:
        raise ArmkvError("--router-sequences, --heldout-sequences and --queries-per-sequence must be at least 1")
    if args.seq_len < 2 * (cfg.sinks + cfg.window):
        raise ArmkvError(f"--seq-len {args.seq_len}: give at least {2 * (cfg.sinks + cfg.window)} tokens")
    return cfg


def _signal(model, tokenizer, args, cfg, out: Path) -> tuple[list[QKSample], list[QKSample]]:
    """The training and held-out signal, read from OUT/signal.safetensors when a run with the
    same data settings wrote it, else collected (one forward pass a sequence) and written."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    from armkv.memory.module import _atomic_write
    from armkv.train.data import DocumentSource, PackedSequences, default_corpus, hf_tokenize, source_from_args
    from armkv.train.router_signal import collect_qk

    source = source_from_args(args, args.seed)
    own_heldout = bool(args.data or args.dataset)
    settings = {
        "seq_len": args.seq_len,
        "sequences": args.router_sequences,
        "heldout": args.heldout_sequences,
        "queries": args.queries_per_sequence,
        "first_query": cfg.sinks + cfg.window,
        "seed": args.seed,
        "data": source.describe(),
    }
    path = out / SIGNAL_FILE
    if path.is_file():
        with safe_open(str(path), "pt") as f:
            stored = json.loads(f.metadata().get("settings", "{}"))
        if stored == json.loads(json.dumps(settings, default=str)):
            t = load_file(str(path))
            print(f"signal: reusing {path}")
            split = lambda name, n: [  # noqa: E731
                QKSample(q=t[f"{name}.{i}.q"], qpos=t[f"{name}.{i}.qpos"], k=t[f"{name}.{i}.k"]) for i in range(n)
            ]
            return split("train", args.router_sequences), split("heldout", args.heldout_sequences)
    tokenize = hf_tokenize(tokenizer)
    stream = iter(PackedSequences(source, tokenize, tokenizer.eos_token_id, args.seq_len, max_epochs=1))
    train_ids = [s for _, s in zip(range(args.router_sequences), stream)]
    if own_heldout:  # the sequences after the training ones
        held_ids = [s for _, s in zip(range(args.heldout_sequences), stream)]
    else:
        held = DocumentSource(default_corpus("heldout"), seed=args.seed)
        held_ids = [
            s
            for _, s in zip(
                range(args.heldout_sequences),
                PackedSequences(held, tokenize, tokenizer.eos_token_id, args.seq_len, max_epochs=1),
            )
        ]
    if len(train_ids) < args.router_sequences or len(held_ids) < args.heldout_sequences:
        raise ArmkvError("the data ran out: give more text, fewer --router-sequences or a shorter --seq-len")
    bar = tqdm(total=len(train_ids) + len(held_ids), desc="router signal", unit="seq", disable=args.no_progress)
    first = cfg.sinks + cfg.window
    train = collect_qk(model, train_ids, args.queries_per_sequence, first, seed=args.seed, progress=bar)
    heldout = collect_qk(model, held_ids, args.queries_per_sequence, first, seed=args.seed + 1, progress=bar)
    bar.close()
    tensors = {}
    for name, samples in (("train", train), ("heldout", heldout)):
        for i, s in enumerate(samples):
            tensors.update({f"{name}.{i}.q": s.q, f"{name}.{i}.qpos": s.qpos, f"{name}.{i}.k": s.k})
    meta = {"settings": json.dumps(settings, default=str)}
    _atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
    return train, heldout


def _router_params(arm) -> dict[str, torch.Tensor]:
    return {k: v for k, v in arm.state_dict().items() if ".router." in k}


def plot(reports: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    layers = [r["layer"] for r in reports]
    for key, label in (("before", "k-means tree"), ("after", "trained tree")):
        ax.plot(layers, [100 * r[key]["missed"] for r in reports], marker="o", markersize=3, label=label)
    ax.plot(layers, [100 * r["after"]["oracle"] for r in reports], ls=":", label="the M heaviest buckets")
    ax.set_xlabel("layer")
    ax.set_ylabel("held-out attention missed (%)")
    ax.set_title(f"tree read at M = {reports[0]['after']['m']} buckets, before any merge")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args, model, tokenizer) -> int:
    """``armkv train --method router``: collect the signal (once; OUT/signal.safetensors is
    reused), train every layer's tree in turn (a checkpoint after each; ``--resume`` goes on
    from the last), write OUT/adapter (bf16), OUT/router_fit.json and OUT/router.png."""
    from tqdm.auto import tqdm

    from armkv.hf.attach import model_rotary
    from armkv.memory.module import ARMModel
    from armkv.train.arm import model_shape
    from armkv.train.checkpoint import (
        capture_rng,
        latest_checkpoint,
        load_checkpoint,
        model_fingerprint,
        save_checkpoint,
    )
    from armkv.train.policy import _adapter_folder

    cfg = config_from_args(args)
    folder = _adapter_folder(model, args.adapter)
    arm = ARMModel.load(folder)
    arm.check_fits(*model_shape(model), where=str(folder))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rotary = model_rotary(model)
    root = out / "checkpoints"
    run_config = {
        **config_dict(cfg),
        "adapter": str(Path(folder).resolve()),
        "seq_len": args.seq_len,
        "sequences": args.router_sequences,
        "heldout": args.heldout_sequences,
        "queries": args.queries_per_sequence,
    }
    fingerprint = model_fingerprint(model)
    start, reports = 0, []
    if latest_checkpoint(root) is not None:
        if not args.resume:
            raise ArmkvError(f"{root} holds checkpoints: pass --resume to go on, or another --out")
        ck = load_checkpoint(root, fingerprint=fingerprint, config=run_config)
        arm.load_state_dict({**arm.state_dict(), **{k: v.to(torch.float32) for k, v in ck.params.items()}})
        start, reports = ck.step, ck.extra["reports"]
        print(f"resuming after layer {start - 1}")
    train, heldout = _signal(model, tokenizer, args, cfg, out)
    layers = len(arm.layers)
    bar = tqdm(range(start, layers), desc="router", unit="layer", disable=args.no_progress)
    for layer in bar:
        router = arm.layers[layer].router
        before = evaluate(router, router, heldout, layer, rotary, cfg)
        log = train_layer(router, train, layer, rotary, cfg)
        with torch.no_grad():  # as the adapter stores it
            for p in (router.weight, router.bias, router.read_bias):
                p.copy_(p.to(torch.bfloat16).float())
        after = evaluate(router, router, heldout, layer, rotary, cfg)
        reports.append(
            {
                "layer": layer,
                "before": before,
                "after": after,
                "ce_first": log["ce"][:1],
                "ce_last": log["ce"][-1:],
                "balance_last": log["balance"][-1:],
                "read_cost_last": log["read_cost"][-1:],
            }
        )
        bar.set_postfix(missed=f"{before['missed']:.3f}->{after['missed']:.3f}")
        save_checkpoint(
            root,
            layer + 1,
            params=_router_params(arm),
            optimizer_state={"state": {}, "param_groups": []},
            scheduler_state={},
            data_state={},
            rng_states={0: capture_rng()},
            config=run_config,
            fingerprint=fingerprint,
            keep_last=2,
            extra={"reports": reports},
        )
    mean = lambda when, key: sum(r[when][key] for r in reports) / len(reports)  # noqa: E731
    summary = {
        "m": reports[0]["after"]["m"],
        "num_buckets": arm.layers[0].router.num_buckets,
        "heldout_queries_per_layer": args.heldout_sequences * args.queries_per_sequence,
        "missed_kmeans": mean("before", "missed"),
        "missed_trained": mean("after", "missed"),
        "oracle_kmeans": mean("before", "oracle"),
        "oracle_trained": mean("after", "oracle"),
        "read_share_kmeans": mean("before", "read_share"),
        "read_share_trained": mean("after", "read_share"),
        "pool": mean("after", "pool"),
    }
    arm.config = dataclasses.replace(arm.config, meta={**arm.config.meta, "router": "trained"})
    adapter = arm.save(
        out / "adapter",
        dtype=torch.bfloat16,
        extra={"router": {**run_config, "from": str(folder), **summary}},
    )
    write_json(out / "router_fit.json", {"summary": summary, "layers": reports, "config": run_config})
    if not args.no_plot:
        plot(reports, out / "router.png")
    print(f"ARM adapter: {adapter}")
    print(
        f"held-out attention missed by the tree read at M = {summary['m']} of {summary['num_buckets']} buckets "
        f"(mean over layers, before any merge): k-means {100 * summary['missed_kmeans']:.1f}%, "
        f"trained {100 * summary['missed_trained']:.1f}% (the M heaviest buckets: "
        f"{100 * summary['oracle_trained']:.1f}%; {100 * summary['pool']:.1f}% of the attention is on the pool)"
    )
    print(json.dumps(summary))
    return 0
