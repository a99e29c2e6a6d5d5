"""Attach armkv to a transformers model (reversibly) and build its caches."""

from __future__ import annotations

import contextlib
import weakref

import torch

from armkv.errors import ArmkvError
from armkv.hf.attention import NAME, register
from armkv.hf.cache import ArmkvCache
from armkv.memory.rope import Rotary
from armkv.methods.base import ModelInfo, get_method

# model -> the attention implementation it had before attach (restored by detach).
_ORIGINAL: "weakref.WeakKeyDictionary[torch.nn.Module, str | None]" = weakref.WeakKeyDictionary()


def _config(model: torch.nn.Module):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def attach(model: torch.nn.Module) -> torch.nn.Module:
    """Route the model's attention through armkv caches (idempotent). Returns the model.

    Called with another cache (or none), an attached model runs transformers' sdpa
    attention, so it gives the same logits as an sdpa model.
    """
    register()
    if model not in _ORIGINAL:
        _ORIGINAL[model] = model.config._attn_implementation
        model.config._attn_implementation = NAME
    return model


def detach(model: torch.nn.Module) -> torch.nn.Module:
    """Restore the attention implementation the model had before :func:`attach`."""
    if model in _ORIGINAL:
        model.config._attn_implementation = _ORIGINAL.pop(model)
    return model


def is_attached(model: torch.nn.Module) -> bool:
    return model in _ORIGINAL


@contextlib.contextmanager
def attached(model: torch.nn.Module):
    """``with attached(model): ...`` attaches for the block and detaches after (if it attached)."""
    was = is_attached(model)
    attach(model)
    try:
        yield model
    finally:
        if not was:
            detach(model)


def model_info(model: torch.nn.Module) -> ModelInfo:
    """What a cache needs to know about ``model`` (a Llama-family causal LM)."""
    config = _config(model)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelInfo(
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        max_positions=config.max_position_embeddings,
        dtype=model.dtype,
        device=model.device,
    )


def model_rotary(model: torch.nn.Module) -> Rotary:
    """The model's RoPE (``model.model.rotary_emb``)."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise ArmkvError(f"{type(model).__name__} has no model.rotary_emb.inv_freq: armkv supports Llama-family models")
    return Rotary(rotary.inv_freq, getattr(rotary, "attention_scaling", 1.0))


def make_cache(
    model: torch.nn.Module,
    method: str,
    budget: int | None = None,
    chunk: int = 256,
    horizon: int | None = None,
    compile: bool | dict = False,
    **options,
) -> ArmkvCache:
    """A fresh cache of ``method`` for ``model``, attaching the model if it is not yet.

    Device and dtype: the cache lives where the model does and in its dtype (float32,
    bfloat16 or float16; CPU or CUDA): each layer allocates its state on the device and in
    the dtype of the first keys it is given, and budgets count bytes of that dtype. ARM's
    parameters are copied to the model's device and stay float32; its memory computes in
    float32 (see :mod:`armkv.methods.arm`). Reads softmax in float32 where the model's
    dtype is narrower. The fused CPU kernels serve float32 on a CPU; elsewhere their PyTorch
    references run.

    Parameters
    ----------
    method : a registered method name (``armkv.methods.base.METHODS``)
    budget : token-equivalents of KV bytes per layer and sequence (None: unbounded methods only)
    chunk : P, the prefill chunk (the sync point of the budgeted chunked prefill)
    horizon : the tokens the cache will see (prompt + new tokens), where the caller knows
        them: passed to a method whose factory takes a ``horizon`` parameter (sink, swa and
        bounded kivi then allocate no more than it fills), ignored by the others
    compile : decode steps (one token) through a compiled forward of the whole model with
        this cache (``ArmkvCache.forward``; the layers keep their state in tensors
        allocated once, :meth:`~armkv.methods.base.CacheLayer.compile_decode`): True for
        the default settings (``mode="reduce-overhead"`` on CUDA, where the step is replayed
        as one CUDA graph; inductor's default mode on a CPU), or a dict of ``torch.compile``
        arguments (``backend``, ``mode``, ``options``). Bounded methods only (sink, swa,
        kivi with a budget, arm, fifo); prefill stays eager. Only steps made with
        ``cache.forward(model, ...)`` compile; ``model(...)`` and ``model.generate`` step it
        eagerly (with one warning)
    options : method options (e.g. ``bits=4`` for kivi, ``adapter=`` for arm)

    Raises
    ------
    ArmkvError for an unknown method, a budget too small for it, an option it does not take,
    or ``compile`` for a method whose decode step grows with the sequence.
    """
    if chunk < 1:
        raise ArmkvError(f"chunk={chunk} must be >= 1")
    if budget is not None and budget < 1:
        raise ArmkvError(f"budget={budget} must be >= 1 token-equivalent")
    spec = get_method(method)
    info = model_info(model)
    rotary = model_rotary(model)
    attach(model)

    if horizon is not None and spec.takes_horizon:
        options = {**options, "horizon": int(horizon)}

    compile_options = None
    if compile:
        compile_options = dict(compile) if isinstance(compile, dict) else {}
        if "options" not in compile_options:  # (torch.compile takes a mode or options, not both)
            compile_options.setdefault("mode", "reduce-overhead" if info.device.type == "cuda" else None)

    def make_layer(layer_idx: int):
        layer = spec.make_layer(layer_idx, info, rotary, budget, chunk, **options)
        if compile_options is not None:
            layer.compile_decode()
        return layer

    return ArmkvCache(make_layer, info.num_layers, method, budget, compile_options)
