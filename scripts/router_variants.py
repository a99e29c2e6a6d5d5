"""The two ways of training a tree for its read that ``armkv train --method router`` chose
between, on the signal a router run wrote (OUT/signal.safetensors), layer by layer:

- one tree for keys and queries (what the run trains, ``armkv.train.router.train_layer``):
  the node centroids, write and read biases trained, the keys re-filed under the tree as it
  trains;
- key and query maps of one tree: the k-means tree files the keys as before, and queries
  are routed through a per-KV-head d x d query map A (from the identity, ``W_p A`` at each
  node) trained with the read biases on the same loss;
- and, with ``--read-costs`` / ``--alphas``, the one tree trained with the read-cost term
  (``--read-cost`` of the run: the read's expected share of the pool in the loss) or the
  balance loss at each weight given.

Both start from ``--adapter`` (the shipped k-means adapter by default) and are scored on
the run's held-out sequences: the share of the dense read's attention a tree read at
M = N_b / 8 misses, that of the M heaviest buckets, and the share of the pool's keys the
tree read takes (before any merging).

    python scripts/router_variants.py --signal runs/router/signal.safetensors --layers 5,18,23

Prints one JSON line a layer, then a JSON line of the means.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math

import torch

from armkv.train.router import RouterTrainConfig, evaluate, layer_masses, read_loss, train_layer
from armkv.train.router_signal import QKSample


def train_query_map(router, samples, layer, rotary, cfg):
    """Keys stay filed by ``router``; a copy routes queries with node weights ``W_p A_h``,
    ``A_h`` a per-KV-head query map trained with the read biases. Returns the read router."""
    g = torch.Generator().manual_seed(cfg.seed * 1009 + layer)
    read = copy.deepcopy(router)
    x, mass = layer_masses(router, samples, layer, rotary, cfg)
    H, d = read.weight.shape[0], read.head_dim
    A = torch.eye(d).repeat(H, 1, 1).requires_grad_(True)
    read.weight.requires_grad_(False)
    read.read_bias.requires_grad_(True)
    optimizer = torch.optim.Adam([A, read.read_bias], lr=cfg.lr)
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * step / max(1, cfg.steps))))
        pick = torch.randperm(x.shape[3], generator=g)[: cfg.batch_queries]
        loss = read_loss(read, torch.einsum("hij,bhrnj->bhrni", A, x[:, :, :, pick]), mass[:, :, pick])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        read.weight.copy_(torch.einsum("hkcd,hde->hkce", read.weight, A.detach()))
    read.read_bias.requires_grad_(False)
    return read


def main() -> None:
    from safetensors.torch import load_file

    from armkv.hf.attach import model_rotary
    from armkv.hf.model import load_model
    from armkv.memory.module import ARMModel
    from armkv.train.policy import _adapter_folder

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--signal", required=True, help="OUT/signal.safetensors of an armkv train --method router run")
    p.add_argument("--layers", default="5,18,23", help="layers to compare (default: %(default)s)")
    p.add_argument("--adapter", default=None, help="the tree to start from (default: the shipped adapter)")
    p.add_argument("--steps", type=int, default=RouterTrainConfig.steps)
    p.add_argument(
        "--read-costs", default="", help="weights of the read-cost term to train the one tree at, e.g. 0.3,1"
    )
    p.add_argument("--alphas", default="", help="weights of the balance loss to train the one tree at, e.g. 0.1,1")
    p.add_argument("--no-query-map", action="store_true", help="leave out the key and query maps")
    args = p.parse_args()
    t = load_file(args.signal)

    def split(name):
        n = len([k for k in t if k.startswith(f"{name}.") and k.endswith(".q")])
        return [QKSample(q=t[f"{name}.{i}.q"], qpos=t[f"{name}.{i}.qpos"], k=t[f"{name}.{i}.k"]) for i in range(n)]

    train, held = split("train"), split("heldout")
    model, _ = load_model()
    rotary = model_rotary(model)
    arm = ARMModel.load(_adapter_folder(model, args.adapter))
    cfg = RouterTrainConfig(steps=args.steps)
    costs = [float(x) for x in args.read_costs.split(",") if x]
    alphas = [float(x) for x in args.alphas.split(",") if x]
    variants = {"one_tree": cfg}
    variants.update({f"one_tree read_cost {w:g}": dataclasses.replace(cfg, read_cost=w) for w in costs})
    variants.update({f"one_tree alpha {a:g}": dataclasses.replace(cfg, alpha=a) for a in alphas})
    rows = []
    for layer in (int(x) for x in args.layers.split(",")):
        router = arm.layers[layer].router
        row = {"layer": layer, "kmeans": evaluate(router, router, held, layer, rotary, cfg)}
        if not args.no_query_map:
            read = train_query_map(router, train, layer, rotary, cfg)
            row["query_map"] = evaluate(router, read, held, layer, rotary, cfg)
        for name, variant in variants.items():
            shared = copy.deepcopy(router)
            train_layer(shared, train, layer, rotary, variant)
            row[name] = evaluate(shared, shared, held, layer, rotary, cfg)
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    means = {
        f"{k} {field}": sum(r[k][field] for r in rows) / len(rows)
        for k in rows[0]
        if k != "layer"
        for field in ("missed", "oracle", "read_share")
    }
    print(json.dumps({"layers": [r["layer"] for r in rows], "steps": cfg.steps, **means}))


if __name__ == "__main__":
    main()
