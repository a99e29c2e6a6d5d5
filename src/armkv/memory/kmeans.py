"""Training-free start: build each tree from keys by hierarchical k-means.

At every router node the children's centroids c_j become the router: W_p = [c_j],
b_p = -|c_j|^2 / 2, so the write argmax picks the nearest centroid. For reads,
W_p q = q . c_j is the attention a query pays a child's centroid: the same tree serves
both (docs/design.md, "Routing").
"""

from __future__ import annotations

import torch

from armkv.memory.checks import check_tensor
from armkv.memory.route import Router


def kmeans(x: torch.Tensor, k: int, iters: int = 15, generator: torch.Generator | None = None) -> torch.Tensor:
    """Plain Lloyd k-means with k-means++ seeding. x [N, d] -> centroids [k, d].

    With fewer than k distinct points, centroids repeat points plus a little noise.
    """
    n = x.shape[0]
    if n == 0:
        return torch.randn(k, x.shape[1], generator=generator, dtype=x.dtype)
    first = int(torch.randint(n, (1,), generator=generator))
    cents = [x[first]]
    d2 = ((x - cents[0]) ** 2).sum(-1)
    for _ in range(1, k):
        total = float(d2.sum())
        if total <= 0:
            idx = int(torch.randint(n, (1,), generator=generator))
        else:
            idx = int(torch.multinomial(d2 / total, 1, generator=generator))
        cents.append(x[idx])
        d2 = torch.minimum(d2, ((x - x[idx]) ** 2).sum(-1))
    c = torch.stack(cents)
    for _ in range(iters):
        assign = torch.cdist(x, c).argmin(-1)
        sums = torch.zeros_like(c).index_add(0, assign, x)
        counts = torch.bincount(assign, minlength=k).to(x.dtype).unsqueeze(-1)
        c = torch.where(counts > 0, sums / counts.clamp_min(1), c)
    scale = x.std() if n > 1 else x.new_tensor(1.0)
    dup = torch.cdist(c, c).fill_diagonal_(float("inf")).min(-1).values < 1e-6
    if bool(dup.any()):
        c = c + dup.unsqueeze(-1) * 1e-3 * scale * torch.randn(c.shape, generator=generator, dtype=c.dtype)
    return c


@torch.no_grad()
def init_router_from_keys(router: Router, keys: torch.Tensor, iters: int = 15, seed: int = 0) -> None:
    """Set every router node from hierarchical k-means of one layer's pre-RoPE keys.

    keys : [H, N, d] keys of each KV head (a sample of calibration text), any dtype and
        device: the k-means runs in float32 on the CPU (its seeded draws take a CPU
        generator, and a calibration sample is small), and
        the centroids are written into the router in its own dtype and device
    """
    check_tensor("keys", keys, ndim=3, last=router.head_dim)
    H = keys.shape[0]
    if H != router.weight.shape[0]:
        raise ValueError(f"keys has {H} KV heads, the router {router.weight.shape[0]}")
    g = torch.Generator().manual_seed(seed)
    C = router.branching
    for h in range(H):
        x = keys[h].float().cpu()
        members = {0: torch.arange(x.shape[0])}  # node -> indices of the keys routed through it
        for level in range(router.depth):
            first = (C**level - 1) // (C - 1)
            for node in range(first, first + C**level):
                idx = members.pop(node)
                c = kmeans(x[idx], C, iters, g)
                router.weight[h, node] = c.to(router.weight)
                router.bias[h, node] = (-0.5 * (c**2).sum(-1)).to(router.bias)
                router.read_bias[h, node] = 0.0
                if level + 1 < router.depth:
                    assign = torch.cdist(x[idx], c).argmin(-1) if idx.numel() else idx
                    for j in range(C):
                        members[node * C + 1 + j] = idx[assign == j]
