"""The one attention kernel of the cache methods: a joint softmax over a state and a new chunk.

A new chunk of T tokens attends over the layer's state (L keys, each valid or not) and over
itself causally, in one softmax. Grouped-query attention is handled by viewing the Hq query
heads as Hkv groups of G = Hq / Hkv, so the keys are never repeated in memory.

Every tensor is in the model's dtype and on its device. A chunk's read is SDPA (which
accumulates a bfloat16 or float16 read in float32 itself); a decode step's read takes
its logits from the products in the model's dtype and softmaxes them in float32. The
split CPU path (two flash attentions merged by their log-sum-exps) serves float32 only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from armkv.memory.quant import at_least_float32


def safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where -inf marks excluded keys; a row with none left gives zeros.

    Padding queries may have no key at all; a plain softmax would give NaN there, and the
    NaN would reach valid rows through the value products of later layers' padding tokens.

    Without gradients this is torch's fused softmax with such rows' NaNs zeroed: one pass,
    and 2-15x faster on CPU than the written-out form, whose exp slows down on logits far
    under the peak (float32 underflow; a decode step's read over thousands of slots has
    many). With gradients the written-out form serves, whose empty rows stay finite in the
    backward pass too. ``tests/test_methods.py`` checks that the two agree.
    """
    if not (scores.requires_grad and torch.is_grad_enabled()):
        return torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    return safe_softmax_reference(scores)


def safe_softmax_reference(scores: torch.Tensor) -> torch.Tensor:
    """:func:`safe_softmax` written out (max, exp, sum), differentiable everywhere."""
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(scores - peak)
    return weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).tiny)


def zero_invalid(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """values [B, H, L, d], valid broadcastable to [B, H, L]: invalid rows set to 0.

    A zero attention weight times a NaN value is NaN, and unwritten state may hold anything.
    """
    return torch.where(valid[..., None], values, torch.zeros((), dtype=values.dtype, device=values.device))


def _per_head(mask: torch.Tensor) -> torch.Tensor:
    """[B, L] or [B, Hkv, L] -> broadcastable to [B, Hkv, rows, L]."""
    return mask[:, None, None, :] if mask.dim() == 2 else mask[:, :, None, :]


def joint_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    state_key: torch.Tensor | None = None,
    state_value: torch.Tensor | None = None,
    state_valid: torch.Tensor | None = None,
    state_bias: torch.Tensor | None = None,
    state_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`joint_attention` written out (matmul, masked softmax, matmul): the oracle the
    fused kernel is tested against. Same arguments (all but ``state_clean``) and result."""
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    # [B, Hkv, G*T, d]: the G query heads of a KV head share its keys.
    q = query.reshape(b, hkv, g * t, d)
    causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril().repeat(g, 1)  # [G*T, T]
    chunk_ok = causal[None, None] & valid[:, None, None, :]  # [B, 1, G*T, T]
    chunk_scores = torch.matmul(q, key.transpose(-1, -2)) * scaling
    chunk_scores = chunk_scores.masked_fill(~chunk_ok, float("-inf"))
    chunk_value = zero_invalid(value, valid[:, None, :])

    if state_key is None or state_key.shape[2] == 0:
        weights = safe_softmax(chunk_scores)
        out = torch.matmul(weights, chunk_value)
    else:
        n = state_key.shape[2]
        if state_valid is not None:
            # unwritten entries may hold anything: a masked score's zero gradient times a NaN
            # key would still give the queries a NaN gradient
            valid_kv = state_valid if state_valid.dim() == 3 else state_valid[:, None]
            state_key = zero_invalid(state_key, valid_kv)
            state_value = zero_invalid(state_value, valid_kv)
        state_scores = torch.matmul(q, state_key.transpose(-1, -2)) * scaling  # [B, Hkv, G*T, L]
        if state_bias is not None:
            state_scores = state_scores + state_bias[:, :, None, :].to(state_scores.dtype)
        state_ok = None
        if state_valid is not None:
            state_ok = _per_head(state_valid)
        if state_mask is not None:
            per_query = state_mask.reshape(b, hkv, g * t, n)
            state_ok = per_query if state_ok is None else state_ok & per_query
        if state_ok is not None:
            state_scores = state_scores.masked_fill(~state_ok, float("-inf"))
        weights = safe_softmax(torch.cat([state_scores, chunk_scores], dim=-1))
        out = torch.matmul(weights[..., :n], state_value) + torch.matmul(weights[..., n:], chunk_value)
    return out.reshape(b, hq, t, d).transpose(1, 2)


def _readable(state_key, state_value, state_valid, state_mask, state_clean: bool, rows: int):
    """The state as a query may read it: (keys, values, which keys each of the ``rows``
    query rows per KV head may read, broadcastable to [B, Hkv, rows, L], or None for all).
    Unwritten entries may hold anything (NaN included; -inf + NaN is NaN): they are zeroed
    unless the caller keeps them zero (``state_clean``)."""
    ok = None
    if state_valid is not None:
        if not state_clean:
            valid_kv = state_valid if state_valid.dim() == 3 else state_valid[:, None]
            state_key = zero_invalid(state_key, valid_kv)
            state_value = zero_invalid(state_value, valid_kv)
        ok = _per_head(state_valid)
    if state_mask is not None:
        b, hkv, n = state_key.shape[0], state_key.shape[1], state_key.shape[2]
        per_query = state_mask.reshape(b, hkv, rows, n)
        ok = per_query if ok is None else ok & per_query
    return state_key, state_value, ok


def _additive(ok: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (and a bias where it holds) as the float mask SDPA adds to the logits."""
    blocked = torch.full((), float("-inf"), dtype=dtype, device=ok.device)
    kept = torch.zeros((), dtype=dtype, device=ok.device) if bias is None else bias.to(dtype)
    return torch.where(ok, kept, blocked)


def _flash_with_lse():
    """CPU flash attention that also returns each query's log-sum-exp (an ATen op, not a
    public API: absent in a torch without it, and the one-softmax path serves)."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _split_serves(q: torch.Tensor) -> bool:
    """Whether :func:`_split_attention` serves: a CPU float32 read with no gradient wanted."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and not (torch.is_grad_enabled() and q.requires_grad)
        and _flash_with_lse() is not None
        and SPLIT_ATTENTION
    )


SPLIT_ATTENTION = True  # tests switch it off to compare with the one-softmax path


def _split_attention(q, state_key, state_value, state_mask, key, value, chunk_mask, scaling) -> torch.Tensor:
    """The joint softmax over [state | chunk] as two flash attentions, one over the state
    with its mask as a single broadcast row (bias where readable, -inf elsewhere), one over
    the chunk with the causal mask, merged by their log-sum-exps. The one-call path builds a
    float mask of [queries, state + chunk] per KV head (78 MB a layer for 8,192 slots and a
    chunk of 256) and concatenates the state with the chunk; this one copies neither.
    q [B, Hkv, R, d]; state_mask [B, 1 or Hkv, 1, L]; chunk_mask [B, 1, R, T]. Rows with no
    key at all give zeros, as in :func:`joint_attention_reference`."""
    flash = _flash_with_lse()
    out_s, lse_s = flash(q, state_key, state_value, 0.0, False, attn_mask=state_mask, scale=scaling)
    out_c, lse_c = flash(q, key, value, 0.0, False, attn_mask=chunk_mask, scale=scaling)
    # a row with no key to read comes back as zeros with a log-sum-exp of 0: make it -inf
    gone = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
    lse_s = torch.where(torch.isfinite(state_mask).any(-1), lse_s, gone)
    lse_c = torch.where(torch.isfinite(chunk_mask).any(-1), lse_c, gone)
    peak = torch.maximum(lse_s, lse_c)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    w_s, w_c = torch.exp(lse_s - peak).unsqueeze(-1), torch.exp(lse_c - peak).unsqueeze(-1)
    total = (w_s + w_c).clamp_min(torch.finfo(q.dtype).tiny)
    return (out_s.nan_to_num(0.0) * w_s + out_c.nan_to_num(0.0) * w_c) / total


def joint_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    state_key: torch.Tensor | None = None,
    state_value: torch.Tensor | None = None,
    state_valid: torch.Tensor | None = None,
    state_bias: torch.Tensor | None = None,
    state_mask: torch.Tensor | None = None,
    state_clean: bool = False,
) -> torch.Tensor:
    """Attend a chunk's queries over the state (all of it) and the chunk (causally), jointly.

    One call of torch's fused ``scaled_dot_product_attention`` over [state | chunk] with an
    additive mask (the state's bias where a key may be read, -inf elsewhere); for one new
    token (decoding), two matmuls over the state and the token's own logit, so that the
    state is not copied every step. A query with no key at all (padding) gets zeros, as in
    :func:`joint_attention_reference`, which both paths must equal (tests/test_methods.py).

    Parameters
    ----------
    query : [B, Hq, T, d] post-RoPE queries
    key, value : [B, Hkv, T, d] the chunk's keys and values
    valid : [B, T] bool, False for padding (never attended)
    scaling : softmax scale
    state_key, state_value : [B, Hkv, L, d] or None (no state)
    state_valid : [B, L] or [B, Hkv, L] bool; None = all valid
    state_bias : [B, Hkv, L] additive logit bias of the state keys (e.g. log of a slot's count)
    state_mask : [B, Hq, T, L] bool, per query: False excludes that state key for that query
    state_clean : the caller guarantees the invalid state entries hold zeros (a method that
        keeps them so saves two passes over the state per call)

    Returns
    -------
    [B, T, Hq, d]
    """
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    dtype = query.dtype
    if t == 1 and state_key is not None and state_key.shape[2] > 0:
        return _decode_attention(
            query, key, value, valid, scaling, state_key, state_value, state_valid, state_bias, state_mask, state_clean
        )
    # [B, Hkv, G*T, d]: the G query heads of a KV head share its keys (rows ordered (g, t)).
    q = query.reshape(b, hkv, g * t, d)
    causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril().repeat(g, 1)  # [G*T, T]
    chunk_mask = _additive(causal[None, None] & valid[:, None, None, :], None, dtype)  # [B, 1, G*T, T]
    chunk_value = zero_invalid(value, valid[:, None, :])
    if state_key is None or state_key.shape[2] == 0:
        keys, values, mask = key, chunk_value, chunk_mask
    else:
        n = state_key.shape[2]
        state_key, state_value, ok = _readable(state_key, state_value, state_valid, state_mask, state_clean, g * t)
        if ok is None:
            ok = torch.ones(1, 1, 1, n, dtype=torch.bool, device=query.device)
        bias = None if state_bias is None else state_bias[:, :, None, :]
        state_part = _additive(ok, bias, dtype)
        if state_mask is None and _split_serves(q):
            # every query reads the same state keys: the state's mask is one row, broadcast
            out = _split_attention(q, state_key, state_value, state_part, key, chunk_value, chunk_mask, scaling)
            return out.reshape(b, hq, t, d).transpose(1, 2)
        heads = max(state_part.shape[1], 1)
        mask = torch.cat([state_part.expand(b, heads, g * t, n), chunk_mask.expand(b, heads, g * t, t)], dim=-1)
        keys, values = torch.cat([state_key, key], dim=2), torch.cat([state_value, chunk_value], dim=2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, t, d).transpose(1, 2)


def decode_scores(
    q: torch.Tensor,
    key: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    state_key: torch.Tensor,
    state_ok: torch.Tensor | None = None,
    state_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token's logits over a state and itself, -inf where excluded.

    q [B, Hkv, G, d] (the G query heads of each KV head), key [B, Hkv, 1, d], valid [B, 1],
    state_key [B, Hkv, L, d], state_ok broadcastable to [B, Hkv, G, L] (None: all readable),
    state_bias [B, Hkv, L]. Returns [B, Hkv, G, L + 1] (the token's own logit last)."""
    scores = torch.matmul(q, state_key.transpose(-1, -2)) * scaling
    if state_bias is not None:
        scores = scores + state_bias[:, :, None, :].to(scores.dtype)
    if state_ok is not None:
        scores = scores.masked_fill(~state_ok, float("-inf"))
    own = ((q * key).sum(-1, keepdim=True) * scaling).masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.cat([scores, own], -1)


def decode_values(
    weights: torch.Tensor, state_value: torch.Tensor, value: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """The weighted sum of :func:`decode_scores`' softmax: weights [B, Hkv, G, L + 1],
    state_value [B, Hkv, L, d] (invalid entries zero), value [B, Hkv, 1, d] -> [B, Hkv, G, d]."""
    n = state_value.shape[2]
    own = zero_invalid(value, valid[:, None, :])
    return torch.matmul(weights[..., :n], state_value) + weights[..., n:] * own


def _decode_attention(
    query, key, value, valid, scaling, state_key, state_value, state_valid, state_bias, state_mask, state_clean
):
    """:func:`joint_attention` for one new token: the state's and the token's logits in one
    softmax, with no copy of the state (SDPA would need [state | token] concatenated and a
    float mask the size of the state, every decode step)."""
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    q = query.reshape(b, hkv, g, d)
    state_key, state_value, ok = _readable(state_key, state_value, state_valid, state_mask, state_clean, g)
    # softmax in float32 (the logits of a bfloat16 or float16 model as its products round
    # them, as transformers' eager attention takes them; no-ops for float32)
    weights = safe_softmax(at_least_float32(decode_scores(q, key, valid, scaling, state_key, ok, state_bias))).to(
        query.dtype
    )
    out = decode_values(weights, state_value, value, valid)
    return out.reshape(b, hq, 1, d).transpose(1, 2)
