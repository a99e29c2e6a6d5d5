"""Shared fixtures: tiny seeded models from configs, and the NaN-filled torch.empty of fla."""

import pytest
import torch


@pytest.fixture
def nan_empty(monkeypatch):
    """Fill every freshly allocated torch.empty / empty_like with NaN, so that a read of
    state that was never written shows up as NaN in the outputs."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan_fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan_fill(empty_like(*a, **k)))
    yield


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)


def tiny_model(arch: str, seed: int = 0):
    """A tiny random causal LM of the given architecture (llama, qwen2, qwen3, mistral), eval mode."""
    import transformers

    torch.manual_seed(seed)
    if arch == "llama":
        config = transformers.LlamaConfig(**TINY)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**TINY)
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**TINY, head_dim=16)
    elif arch == "mistral":
        config = transformers.MistralConfig(**TINY, sliding_window=None)
    else:
        raise ValueError(arch)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.eval()


ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(params=ARCHS)
def any_model(request):
    return tiny_model(request.param)


@pytest.fixture
def llama():
    return tiny_model("llama")


def tiny_tokenizer():
    """A byte-level BPE tokenizer built offline, with a minimal chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"])
    tok.train_from_iterator(["The grass is green. The sky is blue. The magic number is 1234567."] * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny Llama (vocab 320, 1024 positions) with its tokenizer: a local model folder."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**dict(TINY, vocab_size=320, max_position_embeddings=1024))
    model = transformers.AutoModelForCausalLM.from_config(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
