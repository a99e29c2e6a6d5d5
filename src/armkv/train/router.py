"""``armkv train --method router``: train each layer's tree so that a query's top-M read
reaches the buckets that hold its attention.

The signal (:mod:`armkv.evals.router_signal`) is the model's own: every layer's pre-RoPE
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
tree). docs/training.md has the measurements that chose this.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from armkv.errors import ArmkvError
from armkv.evals.router_signal import QKSample, bucket_mass, grouped, missed_mass
from armkv.memory.rope import Rotary
from armkv.memory.route import Router


@dataclass(frozen=True)
class RouterTrainConfig:
    """What a router run does to each layer (every field is in the checkpoints' config)."""

    steps: int = 200  # Adam steps per layer
    lr: float = 0.02  # Adam step size, relative to the layer's mean key norm (cosine to 1/10 of it)
    batch_queries: int = 2048  # queries per KV head and step (each with its R query heads)
    batch_keys: int = 4096  # keys per KV head and step in the balance loss
    alpha: float = 0.01  # weight of the balance loss
    refile_every: int = 50  # steps between re-filings of the keys under the tree being trained
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


def read_loss(router: Router, x: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the group read distribution against the group's bucket mass.

    x : [1, H, R, N, d] pre-RoPE queries; mass : [H, R, N, N_b] -> scalar (per unit of mass)"""
    _, H, R, N, d = x.shape
    logp = router.leaf_scores(x.reshape(1, H, R * N, d), read=True).view(H, R, N, -1)
    group = torch.logsumexp(logp, 1) - math.log(R)  # [H, N, N_b]
    target = mass.sum(1)  # [H, N, N_b]
    return -(target * group).sum() / target.sum().clamp_min(1e-12)


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
    return {
        "missed": float(got["tree"].mean()),
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
    x = mass = None
    log = {"ce": [], "balance": []}
    for step in range(cfg.steps):
        if step % cfg.refile_every == 0:
            x, mass = layer_masses(router, samples, layer, rotary, cfg)
        lr = base[1] + 0.5 * (base[0] - base[1]) * (1 + math.cos(math.pi * step / max(1, cfg.steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        N = x.shape[3]
        pick = torch.randperm(N, generator=g)[: cfg.batch_queries]
        ce = read_loss(router, x[:, :, :, pick], mass[:, :, pick])
        loss = ce
        if cfg.alpha:
            kpick = torch.randperm(keys.shape[1], generator=g)[: cfg.batch_keys]
            balance = router.balance_loss(keys[None, :, kpick])
            loss = loss + cfg.alpha * balance
            log["balance"].append(float(balance))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        log["ce"].append(float(ce))
    for p in params:
        p.requires_grad_(False)
    return log


def train_query_map(
    router: Router, samples: list[QKSample], layer: int, rotary: Rotary, cfg: RouterTrainConfig
) -> Router:
    """The alternative the shipped tree was measured against (docs/decisions.md): keys stay
    filed by ``router`` (untouched) and queries are routed by a copy whose node weights are
    ``W_p A_h``, a per-KV-head d x d query map ``A_h`` (from the identity) trained with the read
    biases on the same loss. Returns the read router."""
    g = torch.Generator().manual_seed(cfg.seed * 1009 + layer)
    read = copy.deepcopy(router)
    x, mass = layer_masses(router, samples, layer, rotary, cfg)
    H, d = read.weight.shape[0], read.head_dim
    A = torch.eye(d).repeat(H, 1, 1).requires_grad_(True)
    read.weight.requires_grad_(False)
    read.read_bias.requires_grad_(True)
    optimizer = torch.optim.Adam([A, read.read_bias], lr=cfg.lr)
    for step in range(cfg.steps):
        lr = cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * step / max(1, cfg.steps))))
        for group in optimizer.param_groups:
            group["lr"] = lr
        pick = torch.randperm(x.shape[3], generator=g)[: cfg.batch_queries]
        xb = torch.einsum("hij,bhrnj->bhrni", A, x[:, :, :, pick])
        loss = read_loss(read, xb, mass[:, :, pick])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        read.weight.copy_(torch.einsum("hkcd,hde->hkce", read.weight, A.detach()))
    read.read_bias.requires_grad_(False)
    return read


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
    if cfg.fraction < 1 or cfg.lr <= 0 or cfg.alpha < 0:
        raise ArmkvError("--fraction must be >= 1, --lr > 0 and --alpha >= 0")
