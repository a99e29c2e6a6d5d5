"""The ``armkv`` attention implementation for transformers, and its mask function.

transformers' attention layers call ``past_key_values.update(key, value, layer_idx)`` and
then the attention function, without passing it the cache. :class:`ArmkvCache.update`
therefore marks itself active for that layer (a context variable) and hands the new key and
value back unchanged; :func:`armkv_attention` picks the layer up and lets it attend over its
own state. Causality and padding are enforced inside the cache layer, so the mask function
only passes on which of the current tokens are real: [B, T] bool instead of a 4D mask.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch

from armkv.errors import ArmkvError
from armkv.hf.compat import AttentionInterface, AttentionMaskInterface
from armkv.methods.attention import joint_attention

NAME = "armkv"

# (cache, layer_idx) of the last update not yet consumed by the attention function.
ACTIVE: ContextVar[tuple[object, int] | None] = ContextVar("armkv_active_layer", default=None)


def current_validity(
    batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
    mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs,
) -> torch.Tensor | None:
    """The mask function: [B, T] bool validity of the current tokens (the last T columns of
    the 2D attention mask), or None when every token is valid."""
    if attention_mask is None:
        return None
    return attention_mask[:, -q_length:].to(torch.bool)


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
    attention_mask : [B, T] bool from :func:`current_validity`, or None (all valid)
    kwargs : ``position_ids`` [B or 1, T] (the tokens' RoPE positions)

    Returns
    -------
    ([B, T, Hq, d], None)
    """
    b, _, t, d = query.shape
    valid = attention_mask if attention_mask is not None else torch.ones(b, t, dtype=torch.bool, device=query.device)
    if valid.dim() != 2:
        raise ArmkvError("the armkv attention expects the [B, T] validity from its own mask function, not a 4D mask")
    scaling = d**-0.5 if scaling is None else scaling
    active = ACTIVE.get()
    ACTIVE.set(None)
    if active is None:
        # No ArmkvCache (use_cache=False): plain causal attention over the given tokens.
        if key.shape[2] != t:
            raise ArmkvError(
                "a model attached to armkv needs an ArmkvCache (armkv.hf.make_cache) or use_cache=False, "
                f"got {key.shape[2] - t} cached tokens from another cache"
            )
        return joint_attention(query, key, value, valid, scaling), None
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
