"""A tiny random-weight Llama saved as a transformers folder (safetensors), and its prompts."""

from __future__ import annotations

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
