"""Rotary position embedding as an orthogonal rotation that can be undone.

transformers hands the attention post-RoPE queries and keys. ARM routes and merges on
pre-RoPE keys (a rotation by position would make equal keys at different positions look
different), so it recovers them: R(theta)^-1 = R(-theta), and with an attention scaling s
(YaRN, LongRoPE) the inverse is R(-theta) / s.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary:
    """RoPE of one model: ``inv_freq`` [d/2] and the attention scaling (1 for plain RoPE).

    Positions may be fractional (a merged slot sits at its count-weighted mean position).
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        self.inv_freq = inv_freq.detach().float()
        self.scaling = float(attention_scaling)

    def half_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., d/2]: one per frequency (unscaled)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., d] (unscaled)."""
        cos, sin = self.half_cos_sin(positions, dtype)  # each frequency once, then both halves
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply RoPE. x [..., T, d], positions broadcastable to [..., T]."""
        cos, sin = self.cos_sin(positions, x.dtype)
        return (x * cos + rotate_half(x) * sin) * self.scaling

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Undo RoPE: ``unrotate(rotate(x, p), p) == x``."""
        cos, sin = self.cos_sin(positions, x.dtype)
        return (x * cos - rotate_half(x) * sin) / self.scaling
