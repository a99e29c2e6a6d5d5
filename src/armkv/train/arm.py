"""The ARM side of ``armkv train`` and ``armkv calibrate``.

Training runs the very forward used at inference: every batch gets a fresh ARM cache
(budgeted chunked prefill: each chunk reads the memory as it was at the chunk's start,
then is written into it), so train and inference cannot diverge.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from armkv.config import ARMConfig
from armkv.errors import ArmkvError
from armkv.memory.kmeans import init_router_from_keys
from armkv.memory.module import ARMModel


class ARMTrainModel(nn.Module):
    """A frozen causal LM plus the ARM parameters being trained.

    ``forward(input_ids)`` runs the model with a fresh ARM cache; the aux losses of that
    forward (``aux_losses``: the router balance loss and the policy's read cost E[M] / N_b,
    each averaged over layers) and the trainer's schedule (``set_schedule``: Gumbel
    temperature ``tau`` and exploration ``epsilon``) follow armkv.train.losses' hooks.
    """

    def __init__(self, model: nn.Module, arm: ARMModel, budget: int, chunk: int, overrides: dict | None = None):
        super().__init__()
        self.model, self.arm = model, arm
        self.budget, self.chunk = budget, chunk
        self.overrides = dict(overrides or {})
        self._cache = None

    @property
    def config(self):
        return self.model.config

    def set_schedule(self, values: dict) -> None:
        for name in ("tau", "epsilon"):
            if name in values:
                self.overrides[name] = float(values[name])

    def forward(self, input_ids: torch.Tensor, **kwargs):
        from armkv.hf.attach import make_cache
        from armkv.hf.compat import cache_arg

        cache = make_cache(
            self.model, "arm", budget=self.budget, chunk=self.chunk, arm=self.arm, arm_overrides=self.overrides
        )
        self._cache = cache
        return self.model(input_ids=input_ids, **cache_arg(cache), use_cache=True, **kwargs)

    def aux_losses(self) -> dict[str, torch.Tensor]:
        if self._cache is None:
            return {}
        totals: dict[str, list[torch.Tensor]] = {}
        for layer in self._cache.layers:
            for name, value in layer.aux_losses().items():
                totals.setdefault(name, []).append(torch.as_tensor(value))
        self._cache = None
        return {name: torch.stack(v).mean() for name, v in totals.items()}


def model_shape(model: nn.Module) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of a transformers causal LM."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers, c.num_key_value_heads, head_dim


def new_arm(model: nn.Module, budget: int, adapter: str | None = None, **config_overrides) -> ARMModel:
    """ARM parameters to train: from an adapter folder, or freshly initialised for ``budget``."""
    layers, kv_heads, head_dim = model_shape(model)
    if adapter:
        arm = ARMModel.load(adapter)
        arm.check_fits(layers, kv_heads, head_dim, where=str(adapter))
        return arm
    config = ARMConfig.for_budget(budget, head_dim, **config_overrides)
    return ARMModel(config, layers, kv_heads, head_dim, getattr(model.config, "_name_or_path", ""))


def prepare_arm_training(model: nn.Module, budget: int, chunk: int, adapter: str | None = None, seed: int = 0):
    """(ARMTrainModel with only the ARM parameters trainable beside what the caller unfroze,
    teacher input_ids -> logits with the full cache). A fresh initialisation depends on
    ``seed`` only, so two runs with the same seed start from the same parameters."""
    from armkv.hf.attach import make_cache
    from armkv.hf.compat import cache_arg

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        arm = new_arm(model, budget, adapter).train()
    arm.requires_grad_(True)
    wrapped = ARMTrainModel(model, arm, budget, chunk)

    @torch.no_grad()
    def teacher(input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids, **cache_arg(make_cache(model, "full", chunk=chunk)), use_cache=True).logits

    return wrapped, teacher


def calibrate_arm(
    model: nn.Module, keys: list[torch.Tensor], budget: int, seed: int = 0, **config_overrides
) -> ARMModel:
    """The training-free adapter: each layer's tree from hierarchical k-means of its keys.

    keys : per layer, [Hkv, N, d] pre-RoPE keys of calibration text
    """
    arm = new_arm(model, budget, None, **config_overrides)
    if len(keys) != len(arm.layers):
        raise ArmkvError(f"got keys for {len(keys)} layers, the model has {len(arm.layers)}")
    for layer, k in zip(arm.layers, keys):
        init_router_from_keys(layer.router, k, seed=seed)
    arm.config = dataclasses.replace(arm.config, meta={**arm.config.meta, "init": "kmeans"})
    return arm.eval()


def save_adapter(arm: ARMModel, out: str | Path, extra: dict | None = None, dtype: torch.dtype | None = None) -> Path:
    return arm.save(out, dtype=dtype, extra=extra)
