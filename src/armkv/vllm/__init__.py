"""ARM inside vLLM: a ``vllm.general_plugins`` plugin that gives vLLM's Llama-family models armkv's
fixed-size memory per request (``docs/serving.md``).

The one setting is the environment variable ``ARMKV_VLLM`` (:mod:`armkv.vllm.settings`), a
JSON object with the options ``armkv generate`` takes::

    ARMKV_VLLM='{"method": "arm", "budget": 1024}' vllm serve MODEL --no-enable-prefix-caching

Unset, the plugin changes nothing. Set, every process vLLM starts (the plugin runs in each)
maps the Llama-family architectures (:data:`ARCHITECTURES`: Llama 2/3, SmolLM2, Qwen2, Qwen3,
Mistral) to ARM variants whose
attention layers keep, per request, one fixed state of ``budget`` token-equivalents per layer
inside the block vLLM allocates for the request (``ARMStateSpec``, a ``MambaSpec``: one block
per request for its whole life, holding every layer's state) and attend through armkv's own
cache layers (:mod:`armkv.vllm.backend`), with prompts scheduled in whole ARM chunks
(:mod:`armkv.vllm.scheduler`).
"""

from __future__ import annotations

from armkv.errors import ArmkvError
from armkv.vllm.settings import ENV, Settings, settings_from_env

# The architectures the plugin serves, and the ARM variant registered for each.
ARCHITECTURES = {
    "LlamaForCausalLM": "armkv.vllm.model:ARMLlamaForCausalLM",
    "Qwen2ForCausalLM": "armkv.vllm.model:ARMQwen2ForCausalLM",
    "Qwen3ForCausalLM": "armkv.vllm.model:ARMQwen3ForCausalLM",
    "MistralForCausalLM": "armkv.vllm.model:ARMMistralForCausalLM",
}

_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it in every process it starts.
    Idempotent; does nothing unless ``ARMKV_VLLM`` is set (a bad value is a one-line error)."""
    global _registered
    if _registered:
        return
    settings = settings_from_env()
    if settings is None:
        return
    from vllm import ModelRegistry

    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)
    install_scheduler(ARCHITECTURES)
    _registered = True


def install_scheduler(architectures) -> None:
    """Give the served architectures armkv's scheduler (:mod:`armkv.vllm.scheduler`: prompts
    scheduled in whole ARM chunks) through vLLM's per-architecture config hook."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from armkv.vllm.scheduler import ARMConfigHook

    for arch in architectures:
        if MODELS_CONFIG_MAP.get(arch, ARMConfigHook) is not ARMConfigHook:
            raise ArmkvError(f"vLLM already has a config hook for {arch}; armkv's plugin cannot serve it")
        MODELS_CONFIG_MAP[arch] = ARMConfigHook


__all__ = ["ARCHITECTURES", "ENV", "Settings", "register", "settings_from_env"]
