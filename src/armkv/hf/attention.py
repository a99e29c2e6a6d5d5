"""The ``armkv`` attention implementation for transformers, and its mask function.

transformers' attention layers call the cache's ``update(key, value, layer_idx)`` and
then the attention function, without passing it the cache. :class:`ArmkvCache.update`
therefore marks itself active for that layer (a context variable) and hands the new key and
value back unchanged; :func:`armkv_attention` picks the layer up and lets it attend over its
own state. Causality and padding are enforced inside the cache layer, so the mask function
only passes on which of the current tokens are real: [B, T] bool instead of a 4D mask (and,
for a model called with another cache, what it needs to build the usual mask instead).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import torch

from armkv.errors import ArmkvError
from armkv.hf.compat import AttentionInterface, AttentionMaskInterface, sdpa_attention_forward, sdpa_mask

NAME = "armkv"

# (cache, layer_idx) of the last update not yet consumed by the attention function.
ACTIVE: ContextVar[tuple[object, int] | None] = ContextVar("armkv_active_layer", default=None)


class _Compiled:
    """The same inside a compiled forward (``ArmkvCache.forward``): torch.compile traces an
    attribute of a module-level object, not a context variable."""

    active: tuple[object, int] | None = None


COMPILED = _Compiled()


@dataclass
class CurrentTokens:
    """What the mask function hands the attention: the validity of the current tokens."""

    valid: torch.Tensor | None  # [B, T] bool; None = all valid
    mask_args: dict  # the mask function's arguments, to build an sdpa mask without an ArmkvCache

    def dense_mask(self) -> torch.Tensor | None:
        return sdpa_mask(**self.mask_args)


def current_validity(q_length: int, attention_mask: torch.Tensor | None = None, **kwargs) -> CurrentTokens:
    """The mask function: the validity of the current tokens (the last T columns of the 2D
    attention mask), None when every token is valid."""
    valid = None if attention_mask is None else attention_mask[:, -q_length:].to(torch.bool)
    return CurrentTokens(valid, dict(kwargs, q_length=q_length, attention_mask=attention_mask))


def armkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention through the active cache layer.

    Parameters
    ----------
    query : [B, Hq, T, d]; key, value : [B, Hkv, T, d] (post-RoPE, as returned by update)
    attention_mask : from :func:`current_validity` (the [B, T] validity), or None (all valid)
    kwargs : ``position_ids`` [B or 1, T] (the tokens' RoPE positions)

    Returns
    -------
    ([B, T, Hq, d], None)
    """
    b, _, t, d = query.shape
    if not isinstance(attention_mask, (CurrentTokens, type(None))):
        raise ArmkvError("the armkv attention expects the mask of its own mask function, not a prepared 4D mask")
    scaling = d**-0.5 if scaling is None else scaling
    if torch.compiler.is_compiling():
        active, COMPILED.active = COMPILED.active, None
    else:
        active = ACTIVE.get()
        ACTIVE.set(None)
    if active is None:
        # No ArmkvCache (another cache, or use_cache=False): transformers' sdpa attention with
        # the usual mask, so an attached model still runs as it did.
        mask = attention_mask.dense_mask() if attention_mask is not None else None
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    valid = attention_mask.valid if attention_mask is not None else None
    if valid is None:
        valid = torch.ones(b, t, dtype=torch.bool, device=query.device)
    cache, layer_idx = active
    layer = cache.layers[layer_idx]
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(layer.seen, layer.seen + t, device=query.device)[None]
    positions = positions.expand(b, t)
    return layer.attend(query, key, value, valid, positions, scaling), None


def register() -> None:
    """Register the attention and mask functions under ``"armkv"`` (idempotent; adds a name,
    changes no existing one)."""
    AttentionInterface.register(NAME, armkv_attention)
    AttentionMaskInterface.register(NAME, current_validity)
