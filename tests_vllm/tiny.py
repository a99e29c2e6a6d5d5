"""Tiny random-weight Llama-family models saved as transformers folders (safetensors), and prompts."""

from __future__ import annotations

from pathlib import Path

import torch

# The tiny models' shape: 2 layers, 4 query and 2 KV heads of size 32 (the CPU backend's smallest).
SHAPE = dict(
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


def build_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (head size 32: the CPU backend's smallest; 4 query, 2 KV heads), random
    weights of scale 0.2 (so that attention is not uniform), saved with safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPE)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


# The families beside Llama, each with what sets its attention apart from Llama's.
FAMILIES = ("qwen2", "qwen3", "mistral")


def build_tiny(family: str, folder: Path, seed: int = 0) -> Path:
    """A 2-layer model of ``family`` (4 query, 2 KV heads), random weights of scale 0.2, saved
    with safetensors. Qwen2: q/k/v biases, drawn like the weights; Qwen3: per-head q/k norms
    with weights 1 + N(0, 0.2), and a head size (64) other than hidden / heads (32); Mistral:
    Llama's attention under Mistral's class (no sliding window)."""
    import transformers

    if family == "qwen2":
        config = transformers.Qwen2Config(**SHAPE)
    elif family == "qwen3":
        config = transformers.Qwen3Config(**SHAPE, head_dim=64)
    elif family == "mistral":
        config = transformers.MistralConfig(**SHAPE, sliding_window=None)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 or name.endswith(".bias"):
                p.normal_(0, 0.2)
            elif "q_norm" in name or "k_norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def save_tiny_tokenizer(folder: Path, vocab_size: int = 512) -> Path:
    """A byte-level BPE of ``vocab_size`` tokens trained on RULER's own text (its templates, noise
    haystack and words), saved beside a tiny model so that the evals can run on it."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from armkv.evals import ruler, words

    corpus = [
        ruler.NOISE,
        *(t["template"] + t["answer_prefix"] for t in ruler.TEMPLATES.values()),
        " ".join(words.ADJECTIVES),
        " ".join(words.NOUNS),
        " ".join(str(i) for i in range(1000)),
        string.ascii_letters,
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.save_pretrained(folder)
    return folder


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
