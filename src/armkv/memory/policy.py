"""Adaptive top-M (paper 3.4): an LSTM that decides, per layer and input, how many buckets
each query reads."""

from __future__ import annotations

import torch
from torch import nn


class TopMPolicy(nn.Module):
    """s0 (pooled first tokens) -> h0; at step m a step embedding goes in, and
    g_m = sigmoid(w h_m + b) is the probability of reading one bucket more.

    Parameters
    ----------
    in_dim : size of the pooled state (here: the KV heads' pre-RoPE keys, concatenated)
    hidden : LSTM width; m_max : the largest M
    """

    def __init__(self, in_dim: int, hidden: int, m_max: int, m_min: int = 1):
        super().__init__()
        self.m_max, self.m_min = m_max, m_min
        self.inp = nn.Linear(in_dim, hidden)
        self.steps = nn.Embedding(max(1, m_max - m_min), hidden)
        self.cell = nn.LSTMCell(hidden, hidden)
        self.out = nn.Linear(hidden, 1)
        with torch.no_grad():
            # start by reading all m_max buckets (g = 0.88 at every step, whatever the input);
            # only training (the budget penalty of `armkv train`) can move M below m_max, and
            # the shipped adapter's policy still reads every bucket (docs/design.md)
            self.out.weight.zero_()
            self.out.bias.fill_(2.0)

    def continue_probs(self, s0: torch.Tensor) -> torch.Tensor:
        """s0 [B, in_dim] -> g [B, m_max - m_min], g[:, i] for the step from M = m_min + i."""
        h = torch.tanh(self.inp(s0))
        c = torch.zeros_like(h)
        gs = []
        for step in range(self.m_max - self.m_min):
            h, c = self.cell(self.steps.weight[step].expand_as(h), (h, c))
            gs.append(torch.sigmoid(self.out(h)).squeeze(-1))
        if not gs:
            return s0.new_zeros(s0.shape[0], 0)
        return torch.stack(gs, -1)

    def decide(
        self, s0: torch.Tensor, training: bool = False, epsilon: float = 0.0, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Roll the policy.

        Returns (m [B] long, g_final [B], expected_m [B]): M grows from m_min while
        g >= 0.5 (in training each decision is random with probability epsilon);
        g_final is the score of the decision that stopped it (the soft cascade weight
        of Top(M + 1)); expected_m = m_min + sum_m prod_{k<=m} g_k is differentiable
        (the budget penalty).
        """
        g = self.continue_probs(s0)
        B, K = g.shape
        go = g >= 0.5
        if training and epsilon > 0 and K > 0:
            explore = torch.rand(g.shape, generator=generator, device=g.device) < epsilon
            coin = torch.rand(g.shape, generator=generator, device=g.device) < 0.5
            go = torch.where(explore, coin, go)
        steps = go.long().cumprod(-1).sum(-1)  # consecutive "continue" decisions
        m = self.m_min + steps
        stop_at = steps.clamp_max(max(K - 1, 0))
        g_final = g.gather(1, stop_at.unsqueeze(1)).squeeze(1) if K > 0 else g.new_zeros(B)
        expected = self.m_min + g.cumprod(-1).sum(-1)
        return m, g_final, expected
