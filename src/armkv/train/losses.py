"""Losses for ``armkv train``: next-token cross-entropy, distillation, and the ARM hooks.

The ARM parameters plug into the generic loss through two duck-typed module methods,
so this file needs no import of the ARM layers:

- ``set_schedule(values: dict[str, float])``: called on every module that defines it
  before each forward, with the trainer's current scalars (e.g. ``tau`` for the
  Gumbel-Softmax, ``epsilon`` for the policy's exploration, and ``step``).
- ``aux_losses() -> dict[str, Tensor]``: called on every module that defines it after
  the forward; each returns its auxiliary losses of that forward as scalars (e.g.
  ``{"balance": L_bal, "budget": E[M] / N_b}``). Same-named losses are averaged over
  modules (layers) and added to the loss with the weight ``aux_weights[name]`` (the
  paper's alpha for ``balance``, lambda for ``budget``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from armkv.errors import ArmkvError


def next_token_ce(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from positions <= t.

    Parameters
    ----------
    logits : [B, T, V]
    input_ids : [B, T]
    loss_mask : [B, T] bool, optional
        Which target tokens count (position t masks the prediction of token t).
    """
    # logits[:, t] predicts input_ids[:, t + 1]; computed in fp32 for a stable log-softmax under bf16.
    pred = logits[:, :-1].float().reshape(-1, logits.shape[-1])  # [B*(T-1), V]
    target = input_ids[:, 1:].reshape(-1)  # [B*(T-1)]
    if loss_mask is None:
        return F.cross_entropy(pred, target)
    keep = loss_mask[:, 1:].reshape(-1).to(pred.dtype)
    per_token = F.cross_entropy(pred, target, reduction="none")
    return (per_token * keep).sum() / keep.sum().clamp_min(1.0)


def distill_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float = 1.0,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL(teacher || student) per token at ``temperature``, averaged over tokens.

    Scaled by ``temperature ** 2`` so its gradient keeps the same size when the
    temperature changes (Hinton et al.). Both logits are [B, T, V]; the teacher's get
    no gradient. ``loss_mask`` [B, T] selects the positions that count.
    """
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)  # [B, T, V]
    t = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)  # [B, T, V]
    per_token = (t.exp() * (t - s)).sum(-1)  # [B, T]
    if loss_mask is not None:
        keep = loss_mask.to(per_token.dtype)
        return (per_token * keep).sum() / keep.sum().clamp_min(1.0) * temperature**2
    return per_token.mean() * temperature**2


def logits_of(output) -> torch.Tensor:
    """Logits from a model output: a transformers ``ModelOutput`` or a plain tensor."""
    return output if isinstance(output, torch.Tensor) else output.logits


def broadcast_schedule(model: torch.nn.Module, schedule: dict) -> None:
    """Give the current schedule values to every module that has ``set_schedule``."""
    for module in model.modules():
        if hasattr(module, "set_schedule"):
            module.set_schedule(schedule)


def collect_aux_losses(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Average each named auxiliary loss over the modules that report it."""
    totals: dict[str, list[torch.Tensor]] = {}
    for module in model.modules():
        if hasattr(module, "aux_losses"):
            for name, value in module.aux_losses().items():
                totals.setdefault(name, []).append(value)
    return {name: torch.stack(values).mean() for name, values in totals.items()}


def make_arm_loss(
    *,
    ce_weight: float = 1.0,
    kl_weight: float = 0.0,
    temperature: float = 1.0,
    teacher: Callable[[torch.Tensor], torch.Tensor] | None = None,
    aux_weights: dict[str, float] | None = None,
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> Callable[[torch.nn.Module, dict, dict], tuple[torch.Tensor, dict]]:
    """The training loss ``loss_fn(model, batch, schedule) -> (loss, metrics)``.

    loss = ce_weight * CE + kl_weight * KL(teacher || student) + sum_n aux_weights[n] * aux_n

    Parameters
    ----------
    ce_weight, kl_weight : float
        Weights of next-token cross-entropy and of distillation.
    temperature : float
        Distillation temperature.
    teacher : callable input_ids [B, T] -> logits [B, T, V], optional
        Needed when ``kl_weight > 0``: for ARM, the same frozen model with the full cache
        (the caller detaches ARM around the call). Run under ``torch.no_grad``.
    aux_weights : dict, optional
        Weight of each auxiliary loss the model's modules report through
        ``aux_losses()`` (see the module docstring); a reported loss without a weight is
        an error, so a new ARM loss is never silently left out.
    forward : callable (model, input_ids) -> logits, optional
        Default: ``model(input_ids=input_ids)`` and its ``.logits``.
    """
    if kl_weight > 0 and teacher is None:
        raise ArmkvError("distillation (kl_weight > 0) needs a teacher")
    if temperature <= 0:
        raise ArmkvError(f"temperature={temperature}: must be positive")
    aux_weights = dict(aux_weights or {})
    forward = forward or (lambda model, ids: logits_of(model(input_ids=ids)))

    def loss_fn(model: torch.nn.Module, batch: dict, schedule: dict) -> tuple[torch.Tensor, dict]:
        input_ids = batch["input_ids"]  # [B, T]
        mask = batch.get("loss_mask")  # [B, T] or None
        broadcast_schedule(model, schedule)
        logits = forward(model, input_ids)  # [B, T, V]
        metrics: dict[str, torch.Tensor] = {}
        loss = logits.new_zeros((), dtype=torch.float32)
        if ce_weight:
            ce = next_token_ce(logits, input_ids, mask)
            loss = loss + ce_weight * ce
            metrics["ce"] = ce.detach()
        if kl_weight:
            with torch.no_grad():
                teacher_logits = teacher(input_ids)  # [B, T, V]
            kl = distill_kl(logits, teacher_logits, temperature, mask)
            loss = loss + kl_weight * kl
            metrics["kl"] = kl.detach()
        for name, value in collect_aux_losses(model).items():
            if name not in aux_weights:
                raise ArmkvError(
                    f"the model reports an auxiliary loss {name!r} without a weight; pass aux_weights[{name!r}]"
                )
            loss = loss + aux_weights[name] * value
            metrics[name] = value.detach()
        return loss, metrics

    return loss_fn
