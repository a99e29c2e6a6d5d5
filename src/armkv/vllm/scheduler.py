"""vLLM's scheduler, with prompts scheduled in whole ARM chunks.

ARM commits a prompt in chunks of P tokens from position 0 (the budgeted chunked prefill);
a piece of a chunk cannot be committed alone. So that no piece waits between two steps
outside the request's block, the ARM model's scheduler ends every prefill piece on a
multiple of P or at the prompt's end, through the hook vLLM's scheduler already has for
states that must be cut at fixed positions (its Mamba "align" mode,
``_mamba_block_aligned_split``), with P in place of the Mamba block size. A request whose
next whole chunk does not fit in what is left of a step's token budget waits for the next
step, as vLLM's aligned Mamba prefills do; generated tokens, and a preempted request's
recompute past its prompt, are scheduled as vLLM would.

The plugin installs it through vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``),
which runs where the engine's config is made; :func:`check_scheduler` refuses an engine that
runs without it.
"""

from __future__ import annotations

from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from armkv.errors import ArmkvError


class _WholeChunks:
    """Ends each prefill piece on a multiple of ``arm_chunk`` (P) or at the prompt's end."""

    arm_chunk: int

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from armkv.vllm.settings import settings_from_env

        self.arm_chunk = settings_from_env().chunk
        self.need_mamba_block_aligned_split = True  # (the hook: _mamba_block_aligned_split below)
        self.mamba_partial_cache_hit = False

    def _mamba_block_aligned_split(
        self,
        request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        end = start + num_new_tokens
        if end >= request.num_prompt_tokens:  # (the prompt's last chunk, or generated tokens)
            return num_new_tokens
        return max(0, end // self.arm_chunk * self.arm_chunk - start)


class ARMScheduler(_WholeChunks, Scheduler):
    """vLLM's Scheduler with whole ARM chunks."""


class ARMAsyncScheduler(_WholeChunks, AsyncScheduler):
    """vLLM's AsyncScheduler with whole ARM chunks."""


def arm_scheduler(*args, **kwargs):
    """The engine's scheduler: vLLM's own (async or not, as the engine decided after the config
    hook ran) with whole ARM chunks."""
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    cls = ARMAsyncScheduler if vllm_config.scheduler_config.async_scheduling else ARMScheduler
    return cls(*args, **kwargs)


class ARMConfigHook(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook for the architectures the plugin serves."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        sched = vllm_config.scheduler_config
        if sched.scheduler_cls not in (None, arm_scheduler):
            raise ArmkvError(f"ARM layers need armkv's scheduler: drop --scheduler-cls ({sched.scheduler_cls})")
        sched.scheduler_cls = arm_scheduler


def check_scheduler(vllm_config, chunk: int) -> None:
    """A one-line error where the engine would split ARM's chunks: another scheduler, or a
    step's token budget smaller than one chunk."""
    sched = vllm_config.scheduler_config
    if sched.scheduler_cls is not arm_scheduler:
        raise ArmkvError(
            "the ARM model runs without armkv's scheduler (the plugin's config hook did not run): "
            "set ARMKV_VLLM in the environment of the process that starts vLLM"
        )
    if sched.enable_chunked_prefill and sched.max_num_batched_tokens < chunk:
        raise ArmkvError(
            f"ARM's prefill chunk ({chunk} tokens) is larger than a step's token budget "
            f"({sched.max_num_batched_tokens}): raise --max-num-batched-tokens to at least {chunk}, "
            'or lower "chunk" in ARMKV_VLLM'
        )


__all__ = ["ARMAsyncScheduler", "ARMConfigHook", "ARMScheduler", "arm_scheduler", "check_scheduler"]
