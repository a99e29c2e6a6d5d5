"""The routing tree: hard top-down writes, top-M reads, and the balance loss (paper 3.1).

Nodes are numbered in heap order: the root is 0 and the children of node p are
``p * C + 1 ... p * C + C``. The last level's children are the leaf buckets; bucket
``j`` is node ``num_nodes + j``. Every KV head has its own tree.

A router is ``logits = W_p x + b_p`` over the C children of node p. Writes route a
(pre-RoPE) key by argmax at each level. Reads score a leaf by the sum of log-softmax
router outputs along its path, with a read-side bias ``r_p`` (queries and keys live in
different spaces: ``W_p q`` is the attention a query pays a child's centroid, while the
write bias ``b_p`` holds -|c|^2 / 2 for nearest-centroid routing of keys).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from armkv.memory.checks import check_tensor

# Trees with at most this many router outputs (nodes x C: 84 for the default D = 3, C = 4)
# route writes with one product over all of them (Router.route_writes)
ALL_NODES_AT_ONCE = 512


class Router(nn.Module):
    """Routers of one layer, one tree per KV head.

    Parameters
    ----------
    num_kv_heads, head_dim, depth, branching : tree shape
    """

    def __init__(self, num_kv_heads: int, head_dim: int, depth: int, branching: int):
        super().__init__()
        self.depth, self.branching = depth, branching
        self.num_nodes = (branching**depth - 1) // (branching - 1)
        self.num_buckets = branching**depth
        self.head_dim = head_dim
        # weight: [H, nodes, C, d]; bias, read_bias: [H, nodes, C]
        self.weight = nn.Parameter(torch.randn(num_kv_heads, self.num_nodes, branching, head_dim) / head_dim**0.5)
        self.bias = nn.Parameter(torch.zeros(num_kv_heads, self.num_nodes, branching))
        self.read_bias = nn.Parameter(torch.zeros(num_kv_heads, self.num_nodes, branching))
        self.read_scale = head_dim**-0.5

    # ------------------------------------------------------------------ helpers
    def _level_nodes(self, level: int) -> range:
        first = (self.branching**level - 1) // (self.branching - 1)
        return range(first, first + self.branching**level)

    def _logits_at(self, x: torch.Tensor, nodes: torch.Tensor, read: bool) -> torch.Tensor:
        """Router logits of the given nodes.

        x : [B, H, N, d]; nodes : [B, H, N, K] node ids -> [B, H, N, K, C]
        """
        H = x.shape[1]
        h = torch.arange(H, device=x.device).view(1, H, 1, 1).expand_as(nodes)
        w = self.weight[h, nodes]  # [B, H, N, K, C, d]
        logits = torch.einsum("bhnd,bhnkcd->bhnkc", x, w)
        if read:
            return logits * self.read_scale + self.read_bias[h, nodes]
        return logits + self.bias[h, nodes]

    def level_logits(self, x: torch.Tensor, level: int, read: bool) -> torch.Tensor:
        """Logits of every node of one level. x [B, H, N, d] -> [B, H, N, C**level, C]."""
        nodes = self._level_nodes(level)
        w = self.weight[:, nodes.start : nodes.stop]  # [H, K, C, d]
        logits = torch.einsum("bhnd,hkcd->bhnkc", x, w)
        if read:
            return logits * self.read_scale + self.read_bias[:, nodes.start : nodes.stop].unsqueeze(1)
        return logits + self.bias[:, nodes.start : nodes.stop].unsqueeze(1)

    # ------------------------------------------------------------------ writes
    def route_writes(self, x: torch.Tensor) -> torch.Tensor:
        """Hard top-down routing of keys to buckets.

        x : [B, H, N, d] pre-RoPE keys -> [B, H, N] bucket ids in [0, N_b)
        """
        check_tensor("x", x, ndim=4, last=self.head_dim)
        node = torch.zeros(x.shape[:3], dtype=torch.long, device=x.device)
        if self.num_nodes * self.branching <= ALL_NODES_AT_ONCE:
            # every router's logits in one [N, d] x [d, nodes * C] product per head, then the
            # walk down gathers C of them per level: cheaper, for a small tree, than gathering
            # each token's D router weights (a [N, D, C, d] copy) for D * C dot products
            every = torch.einsum("bhnd,hkcd->bhnkc", x, self.weight) + self.bias.unsqueeze(1)  # [B, H, N, nodes, C]
            C = self.branching
            for _ in range(self.depth):
                logits = every.gather(3, node[..., None, None].expand(*node.shape, 1, C)).squeeze(3)  # [B, H, N, C]
                node = node * C + 1 + logits.argmax(-1)
            return node - self.num_nodes
        for _ in range(self.depth):
            logits = self._logits_at(x, node.unsqueeze(-1), read=False).squeeze(-2)  # [B, H, N, C]
            node = node * self.branching + 1 + logits.argmax(-1)
        return node - self.num_nodes

    # ------------------------------------------------------------------ reads
    def leaf_scores(self, x: torch.Tensor, read: bool = True) -> torch.Tensor:
        """Exhaustive path scores of every bucket (sum of log-softmax along the path).

        x : [B, H, N, d] -> [B, H, N, N_b]. Costs ~N_b * C / (C - 1) dot products per query.
        """
        score = torch.zeros(*x.shape[:3], 1, dtype=x.dtype, device=x.device)
        for level in range(self.depth):
            logp = torch.log_softmax(self.level_logits(x, level, read), dim=-1)  # [B, H, N, K, C]
            score = (score.unsqueeze(-1) + logp).flatten(-2)
        return score

    def _all_leaf_scores(self, x: torch.Tensor, read: bool = True) -> torch.Tensor:
        """:meth:`leaf_scores` for a small tree in one product: every router's logits at once
        ([N, d] x [d, nodes * C] per head), one log-softmax, then each leaf sums the D entries
        on its path (fewer, larger ops: a decode step routes a handful of queries).

        x : [B, H, N, d] -> [B, H, N, N_b]"""
        H, K, C, d = self.weight.shape
        w = self.weight.reshape(H, K * C, d).transpose(1, 2)  # [H, d, K * C]
        logits = torch.matmul(x, w.to(x.dtype))
        if read:
            logits = logits * self.read_scale + self.read_bias.reshape(H, 1, K * C).to(x.dtype)
        else:
            logits = logits + self.bias.reshape(H, 1, K * C).to(x.dtype)
        logp = torch.log_softmax(logits.unflatten(-1, (K, C)), dim=-1).flatten(-2)
        return logp[..., self._leaf_paths(x.device)].sum(-2)

    def _leaf_paths(self, device) -> torch.Tensor:
        """[D, N_b]: for each leaf, the flat (node * C + child) index of its path's step at each level."""
        cached = getattr(self, "_paths", None)
        if cached is None or cached.device != torch.device(device):
            C = self.branching
            node = torch.arange(self.num_buckets, device=device) + self.num_nodes
            steps = []
            for _ in range(self.depth):
                parent = (node - 1) // C
                steps.append(parent * C + (node - 1) % C)
                node = parent
            cached = self._paths = torch.stack(steps[::-1])
        return cached

    def exhaustive(self, m: int) -> bool:
        """Whether the top-m search scores every leaf (small trees: it costs no more than the
        beam's D * m * C dot products per query, and is exact) rather than the beam."""
        return self.num_nodes * self.branching <= self.depth * min(m, self.num_buckets) * self.branching

    def fused_group_topm(
        self, kernel, query: torch.Tensor, positions: torch.Tensor, rotary, m: int
    ) -> torch.Tensor | None:
        """:meth:`group_topm_buckets` of one decoded token in one call of the fused CPU kernel
        (``armkv.memory.kernels``), un-rotating the query inside; None where it does not
        serve (the beam search, or routers not in float32).

        query : [B, Hq, 1, d] post-RoPE float32; positions : [B, 1] -> buckets [B * H, m']
        """
        if not self.exhaustive(m) or self.weight.dtype != torch.float32:
            return None
        H, K, C, d = self.weight.shape
        B, Hq = query.shape[:2]
        return kernel.group_leaf_topm(
            query.reshape(B * H, Hq // H, d),
            positions[:, 0],
            rotary.inv_freq,
            rotary.scaling,
            self.weight.detach().reshape(H, K * C, d),
            self.read_bias.detach().reshape(H, K * C),
            self.read_scale,
            self._leaf_paths(query.device),
            C,
            min(m, self.num_buckets),
        )[0]

    def beam_topm(self, x: torch.Tensor, m: int, read: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Beam search of width m down the tree: D * m * C dot products per query, whatever N_b.

        x : [B, H, N, d] -> (buckets [B, H, N, m], scores [B, H, N, m]), best first.
        Exact when m >= N_b / C; otherwise a leaf whose ancestor fell out of the beam is missed.
        """
        B, H, N, _ = x.shape
        node = torch.zeros(B, H, N, 1, dtype=torch.long, device=x.device)
        score = torch.zeros(B, H, N, 1, dtype=x.dtype, device=x.device)
        for _ in range(self.depth):
            logp = torch.log_softmax(self._logits_at(x, node, read), dim=-1)  # [B, H, N, K, C]
            cand = (score.unsqueeze(-1) + logp).flatten(-2)
            child = (node.unsqueeze(-1) * self.branching + 1 + torch.arange(self.branching, device=x.device)).flatten(
                -2
            )
            k = min(m, cand.shape[-1])
            score, idx = cand.topk(k, dim=-1)
            node = child.gather(-1, idx)
        return node - self.num_nodes, score

    def topm_buckets(self, x: torch.Tensor, m: int, read: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The m best buckets per query, best first: exhaustive scoring when it is cheaper
        than the beam (small trees, exact), beam search otherwise (cost flat in N_b).

        x : [B, H, N, d] -> (buckets [B, H, N, m'], scores [B, H, N, m']), m' = min(m, N_b)
        """
        check_tensor("x", x, ndim=4, last=self.head_dim)
        m = min(m, self.num_buckets)
        if self.exhaustive(m):
            scores, buckets = self.leaf_scores(x, read).topk(m, dim=-1)
            return buckets, scores
        return self.beam_topm(x, m, read)

    def group_topm_buckets(self, x: torch.Tensor, m: int, read: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The m best buckets of each group of R queries that share a KV head's keys: a
        bucket's group score is log of the mean over the R queries of their path
        probabilities (a bucket one query head wants strongly ranks high, as it would for
        that head alone). Exhaustive or beam search as :meth:`topm_buckets`; the beam keeps
        the m best partial paths by the same group score.

        Why one choice per group: the R query heads of a KV head read the same slots, so a
        sparse read gathers each of its slots once and scores it against all R heads in one
        product (the dense read's reuse of a key); per-head choices would gather up to R
        times as many slots for the same M.

        x : [B, H, R, N, d] -> (buckets [B, H, N, m'], scores [B, H, N, m']), m' = min(m, N_b)
        """
        B, H, R, N, d = x.shape
        m = min(m, self.num_buckets)
        flat = x.reshape(B, H, R * N, d)
        check_tensor("x", flat, ndim=4, last=self.head_dim)
        if self.exhaustive(m):
            group = torch.logsumexp(self._all_leaf_scores(flat, read).view(B, H, R, N, -1), 2) - math.log(R)
            scores, buckets = group.topk(m, dim=-1)
            return buckets, scores
        C = self.branching
        node = torch.zeros(B, H, N, 1, dtype=torch.long, device=x.device)
        score = torch.zeros(B, H, R, N, 1, dtype=x.dtype, device=x.device)  # each query's path log-prob
        for _ in range(self.depth):
            K = node.shape[-1]
            nodes = node.unsqueeze(2).expand(B, H, R, N, K).reshape(B, H, R * N, K)
            logp = torch.log_softmax(self._logits_at(flat, nodes, read), dim=-1).view(B, H, R, N, K, C)
            cand = (score.unsqueeze(-1) + logp).flatten(-2)  # [B, H, R, N, K * C]
            child = (node.unsqueeze(-1) * C + 1 + torch.arange(C, device=x.device)).flatten(-2)
            _, idx = torch.logsumexp(cand, 2).topk(min(m, K * C), dim=-1)
            node = child.gather(-1, idx)
            score = cand.gather(-1, idx.unsqueeze(2).expand(B, H, R, N, idx.shape[-1]))
        return node - self.num_nodes, torch.logsumexp(score, 2) - math.log(R)

    # ------------------------------------------------------------------ training signal
    def balance_loss(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """L_bal = sum over levels of (L1 + L2), paper section 3.1, on write routing.

        L1 = mean over tokens of the entropy of the token's child distribution at the node
        it is (hard-)routed through; L2 = sum over nodes p of sum_j pbar_pj log pbar_pj,
        pbar_p the mean child distribution of the tokens routed through p. Averaged over
        the batch and KV heads.

        x : [B, H, N, d]; valid : [B, N] bool or None -> scalar
        """
        B, H, N, _ = x.shape
        w = torch.ones(B, 1, N, dtype=x.dtype, device=x.device) if valid is None else valid[:, None].to(x.dtype)
        w = w.expand(B, H, N)
        node = torch.zeros(B, H, N, dtype=torch.long, device=x.device)
        total = x.new_zeros(())
        for _ in range(self.depth):
            logits = self._logits_at(x, node.unsqueeze(-1), read=False).squeeze(-2)  # [B, H, N, C]
            p = torch.softmax(logits, dim=-1)
            entropy = -(p * torch.log(p.clamp_min(1e-12))).sum(-1)
            l1 = (entropy * w).sum((1, 2)) / w.sum((1, 2)).clamp_min(1)  # [B]
            # pbar per (b, h, node): scatter the child distributions by node
            flat = (torch.arange(B * H, device=x.device).view(B, H, 1) * self.num_nodes + node).flatten()
            sums = torch.zeros(B * H * self.num_nodes, self.branching, dtype=x.dtype, device=x.device)
            sums = sums.index_add(0, flat, (p * w.unsqueeze(-1)).reshape(-1, self.branching))
            counts = torch.zeros(B * H * self.num_nodes, dtype=x.dtype, device=x.device).index_add(0, flat, w.flatten())
            pbar = sums / counts.clamp_min(1e-12).unsqueeze(-1)
            neg_entropy = (pbar * torch.log(pbar.clamp_min(1e-12))).sum(-1) * (counts > 0)
            l2 = neg_entropy.view(B, H, self.num_nodes).sum(-1).mean(1)  # [B]
            total = total + (l1 + l2).mean()
            node = node * self.branching + 1 + logits.argmax(-1)
        return total
