"""A tiny random-weight Llama saved as a transformers folder (safetensors), and helpers that
run it through vLLM with and without armkv's plugin."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def build_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (head size 32: the CPU backend's smallest; 4 query, 2 KV heads), random
    weights of scale 0.2 (so that attention is not uniform), saved with safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def run_vllm(model: Path, token_prompts, max_tokens: int, arm: str | None, logprobs: bool = False, **engine):
    """Greedy tokens (and the chosen tokens' logprobs) for each prompt through vLLM; ``arm``:
    the ARMKV_VLLM setting (None: plain vLLM)."""
    if arm is None:
        os.environ.pop("ARMKV_VLLM", None)
    else:
        os.environ["ARMKV_VLLM"] = arm
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its layers inspectable
    from vllm import LLM, SamplingParams, TokensPrompt

    args = dict(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=4096,
        enable_prefix_caching=False,
        max_num_seqs=8,
        gpu_memory_utilization=0.1,  # (on the CPU build: the share of memory checked free at start)
        kv_cache_memory_bytes=1 << 28,
    )
    args.update(engine)
    llm = LLM(**args)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0 if logprobs else None)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in token_prompts], params, use_tqdm=False)
    result = [list(o.outputs[0].token_ids) for o in outs]
    return result, llm
