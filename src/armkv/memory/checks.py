"""Argument checks for the public memory functions: a wrong shape or dtype gets a
message naming the argument, not an einsum error from deep inside."""

from __future__ import annotations

import torch

from armkv.errors import ArmkvError


def check_tensor(
    name: str,
    x: object,
    ndim: int | None = None,
    last: int | None = None,
    floating: bool = True,
    dtype: torch.dtype | None = None,
) -> None:
    if not isinstance(x, torch.Tensor):
        raise ArmkvError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ArmkvError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if last is not None and x.shape[-1] != last:
        raise ArmkvError(f"{name} must have last dimension {last} (head_dim), got shape {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise ArmkvError(f"{name} must have dtype {dtype}, got {x.dtype}")
    if floating and dtype is None and not x.is_floating_point():
        raise ArmkvError(f"{name} must be a floating-point tensor, got {x.dtype}")
