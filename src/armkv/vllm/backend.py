"""The ARM attention layer, its per-request state spec and its attention backend for vLLM.

State. vLLM keeps one block per request for an ``ARMStateSpec`` layer (a ``MambaSpec``: the
state of a request is fixed in size, allocated when it is scheduled and freed when it ends or
is preempted), and the request's memory lies inside it. The memory is an armkv cache layer
(:class:`armkv.methods.arm.ARMLayer`: sinks, window, the tokens waiting for the write, the
slot pool with its codes, scales and metadata) made per request and per layer by the same
factory as the Hugging Face path (``armkv.methods``) and placed in the request's block
(``ARMLayer.place``: its tensors are views of the block, ``ARMLayer.storage_layout``), found
by the block id in vLLM's metadata. The block is the budget's bytes of the layer's share plus
the positions and validity of its exact tokens; after every step the layer keeps nothing
outside it (``ARMLayer.settle``), so vLLM's accounting is the memory's, and a finished or
preempted request's memory is gone with its block. (``full``, the exact mode, grows with every
token: it keeps its own tensors and its block reserves every position.)

Attention. Each step's batch mixes prefill pieces and decode tokens of different requests;
:class:`RequestMemory` gives every request's tokens to its layer as the Hugging Face path
does: the prompt in chunks of P tokens from position 0 (a piece of a chunk that vLLM's
scheduler split is read with ``peek_chunk`` and the chunk committed once whole; the prompt's
last chunk is committed as it is), then one token at a time. So the memory, and the outputs,
do not depend on how vLLM chunks a prompt, and a preempted request recomputed from token 0
rebuilds the same memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionImpl, AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.kv_cache_interface import MambaSpec

from armkv.errors import ArmkvError
from armkv.vllm.feed import RequestMemory


@dataclass(frozen=True, kw_only=True)
class ARMStateSpec(MambaSpec):
    """One fixed block per request holding every layer's state (``shapes = ((bytes,),)``, uint8;
    declared by the first ARM layer, shared by the others: ``LayerPlan``)."""

    method: str = "arm"


class ARMAttention(Attention):
    """vLLM's ``Attention`` whose KV cache is an :class:`ARMStateSpec` and whose backend is
    :class:`ARMBackend`. ``plan`` makes this layer's armkv cache layer for one request, placed
    in the request's block (``plan(block)`` -> CacheLayer), and knows the block's bytes
    (``plan.state_bytes``) and this layer's share of them (``plan.offset``, ``plan.own_bytes``).
    Every ARM layer after the first shares the first one's cache (vLLM's cross-layer KV
    sharing): one block a request holds them all."""

    def __init__(self, *args, plan, prefix: str, **kwargs):
        if plan.placed and plan.layer_idx > 0:  # (the request's block is the first layer's: see LayerPlan)
            parts = prefix.split(".")
            parts[parts.index(str(plan.layer_idx))] = "0"
            kwargs["kv_sharing_target_layer_name"] = ".".join(parts)
        super().__init__(*args, attn_backend=ARMBackend, prefix=prefix, **kwargs)
        self.arm_plan = plan

    def get_kv_cache_spec(self, vllm_config):
        from armkv.vllm.scheduler import check_scheduler

        check_scheduler(vllm_config, self.arm_plan.chunk)
        cache = vllm_config.cache_config
        if cache.enable_prefix_caching:
            raise ArmkvError(
                "ARM layers keep one merged memory per request, which cannot be shared between prompts: "
                "pass --no-enable-prefix-caching (enable_prefix_caching=False)"
            )
        if vllm_config.speculative_config is not None:
            raise ArmkvError(
                "ARM layers commit every token they read, so drafted tokens cannot be rolled back: "
                "run without speculative decoding"
            )
        return ARMStateSpec(
            shapes=((self.arm_plan.state_bytes,),),
            dtypes=(torch.uint8,),
            block_size=vllm_config.model_config.max_model_len,
            mamba_cache_mode="none",
            method=self.arm_plan.method,
        )


@dataclass
class ARMMetadata:
    """Per step: each request's tokens [query_start[i], query_start[i + 1]), the position of
    its first one, its prompt length and its state block."""

    num_actual_tokens: int
    query_start: list[int]
    starts: list[int]
    prompt_lens: list[int]
    state_ids: list[int]


class ARMMetadataBuilder(AttentionMetadataBuilder[ARMMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        m = common_attn_metadata
        n = m.num_reqs
        query_start = m.query_start_loc_cpu[: n + 1].tolist()
        seq_lens = m.seq_lens[:n].cpu().tolist()
        if m.rswa_prefix_lens is None:
            raise ArmkvError(
                "vLLM passed no prompt lengths to the ARM layers (the model's rswa_window is unset): "
                "load the model through armkv's plugin"
            )
        prompt_lens = m.rswa_prefix_lens[:n].cpu().tolist()
        starts = [s - (query_start[i + 1] - query_start[i]) for i, s in enumerate(seq_lens)]
        state_ids = m.block_table_tensor[:n, 0].cpu().tolist()
        return ARMMetadata(m.num_actual_tokens, query_start, starts, prompt_lens, state_ids)


class ARMAttentionImpl(AttentionImpl[ARMMetadata]):
    """Runs each request's tokens through its :class:`RequestMemory` (one per state block)."""

    def __init__(
        self,
        num_heads,
        head_size,
        scale,
        num_kv_heads,
        alibi_slopes,
        sliding_window,
        kv_cache_dtype,
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
        **kwargs,
    ):
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise ArmkvError("ARM layers serve RoPE attention without ALiBi, sliding window or soft cap")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.memories: dict[int, RequestMemory] = {}  # state block -> the request's memory

    @staticmethod
    def block(kv_cache, state: int) -> torch.Tensor:
        """Block ``state`` of the cache as flat uint8 bytes (a view: the block itself): a
        request's memory in every layer. vLLM binds a MambaSpec layer's cache as a list of its
        states' tensors, [num_blocks, ...] each."""
        if isinstance(kv_cache, (list, tuple)):
            kv_cache = kv_cache[0]
        block = kv_cache[state]
        if not block.is_contiguous():
            raise ArmkvError(f"vLLM's block for an ARM layer is not contiguous ({tuple(kv_cache.shape)})")
        return block.reshape(-1).view(torch.uint8)

    def storage(self, layer, kv_cache, state: int) -> torch.Tensor:
        """The bytes of block ``state`` that hold this layer's memory of the request."""
        plan = layer.arm_plan
        return self.block(kv_cache, state)[plan.offset : plan.offset + plan.own_bytes]

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output=None,
        output_scale=None,
        output_block_scale=None,
        output_block_scale_layout=None,
    ):
        if output is None:
            output = torch.empty_like(query)
        if attn_metadata is None:  # (vLLM's profiling run)
            return output.zero_()
        plan = layer.arm_plan
        m: ARMMetadata = attn_metadata
        for i, state in enumerate(m.state_ids):
            lo, hi = m.query_start[i], m.query_start[i + 1]
            if hi == lo:
                continue
            memory = self.memories.get(state)
            if memory is None or m.starts[i] == 0:  # a new request, or one recomputed from token 0
                memory = self.memories[state] = RequestMemory(
                    plan(self.block(kv_cache, state) if plan.placed else None), plan.chunk
                )
            out = memory.step(query[lo:hi], key[lo:hi], value[lo:hi], m.starts[i], m.prompt_lens[i], self.scale)
            output[lo:hi].copy_(out)
            if plan.placed:
                if memory.open is not None:
                    raise ArmkvError(
                        "vLLM split an ARM prefill chunk across steps (armkv's scheduler was not used): "
                        "serve through the plugin with ARMKV_VLLM set in every process"
                    )
                memory.layer.settle()
        return output

    def state_bytes(self) -> dict[int, int]:
        """Bytes each request's memory holds now in this layer: {state block: bytes}."""
        return {s: mem.layer.state_bytes() for s, mem in self.memories.items()}


class ARMBackend(CPUAttentionBackend):
    """The CPU backend's name and checks, with armkv's layers doing the attention."""

    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_impl_cls():
        return ARMAttentionImpl

    @staticmethod
    def get_builder_cls():
        return ARMMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any
