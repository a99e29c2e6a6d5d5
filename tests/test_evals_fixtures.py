"""Offline stand-ins the eval tests share: a small BPE tokenizer, a tiny random Llama, a fake runner.

Nothing here downloads: the tokenizer is trained in memory on text like the evals'
prompts, so token counts behave like a real byte-level BPE's.
"""

from __future__ import annotations

import functools
import string
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    """A byte-level BPE (vocabulary 600) trained on RULER-like text, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from armkv.evals import ruler, words

    corpus = [
        ruler.NOISE,
        *(t["template"] + t["answer_prefix"] for t in ruler.TEMPLATES.values()),
        " ".join(words.ADJECTIVES),
        " ".join(words.NOUNS),
        " ".join(words.VERBS),
        (DATA / "essay.txt").read_text(),
        " ".join(str(i) for i in range(1000)),
        string.ascii_letters,
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 3, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=8192,
    )


def tiny_model(tokenizer, max_positions: int = 4096):
    """A 2-layer random Llama (GQA: 4 query heads, 2 KV heads, head_dim 16) for the tokenizer's vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


class FakeRunner:
    """The Runner contract without a model: answers with the sample's needle when it can see it.

    ``answer(request) -> str`` decides the output; every call is recorded in ``calls``.
    """

    def __init__(self, method: str, options: dict, answer, calls: list):
        self.method, self.options, self.answer, self.calls = method, options, answer, calls

    def generate(self, requests, max_new_tokens=32, do_sample=False):
        out = []
        for request in requests:
            self.calls.append((self.method, request["id"], max_new_tokens))
            out.append(
                {
                    "id": request["id"],
                    "method": self.method,
                    "output": self.answer(self.method, request),
                    "prompt_tokens": len(request.get("context", request.get("prompt", "")).split()),
                    "cache_bytes": 1000 if self.method == "full" else 100,
                    "prefill_seconds": 0.0,
                    "decode_seconds_per_token": 0.0,
                }
            )
        return out


def fake_factory(answer, calls: list | None = None):
    """A ``runner_factory`` making :class:`FakeRunner` objects that share one ``calls`` list."""
    calls = [] if calls is None else calls
    return lambda method, options: FakeRunner(method, options, answer, calls)


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()


def test_tiny_tokenizer_round_trips_and_is_bpe():
    tok = tiny_tokenizer()
    text = "One of the special magic numbers for abrasive-cat is: 1234567."
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert 5 < len(ids) < len(text)  # merges happened, but not one token per word
