"""Shared fixtures: tiny seeded models from configs, and the NaN-filled torch.empty of fla."""

import json
import os

# Triton reads TRITON_INTERPRET when it is first imported (torch and transformers import it while
# the test modules are collected), so the Triton kernels' tests can only run in its interpreter on
# a machine without CUDA if it is set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "0" if os.path.exists("/dev/nvidia0") else "1")
# Under pytest-xdist (pyproject.toml's addopts) the workers share the cores: each takes its part
# of them for torch's threads, here and in the processes its tests start.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))

import pytest  # noqa: E402
import torch  # noqa: E402


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


TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


# The dtypes and devices a cache runs in. CUDA cases run wherever a GPU is visible and are
# skipped elsewhere, so the one suite checks a GPU where there is one.
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HAS_CUDA = torch.cuda.is_available()
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device"))
DEVICES = ["cpu", CUDA]

# How far a cache's logits may be from a no-cache forward of the same model in the same
# dtype (torch.testing.assert_close's atol and rtol): the two sum in different orders, so
# they differ by a few roundings of the dtype (eps: float32 1.2e-7, bfloat16 7.8e-3,
# float16 9.8e-4), amplified through the layers. Measured on the tiny models here (logits
# up to 0.7): at most 6e-3 in bfloat16 and 7e-4 in float16, as far as the same no-cache
# forward in that dtype is from the float32 one; a wrong mask or a lost token moves them
# by the logits' own size.
TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A tiny random causal LM of the given architecture (llama, qwen2, qwen3, mistral), eval
    mode, in ``dtype`` on ``device`` (the same weights as the float32 one, rounded)."""
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
    return model.to(device=device, dtype=dtype).eval()


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
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"],
    )
    tok.train_from_iterator(["The grass is green. The sky is blue. The magic number is 1234567."] * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
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


@pytest.fixture(scope="module")
def one_thread():
    """Benchmark tests in one torch thread: on a busy 2-core machine an oversubscribed tiny
    model runs several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Vectorised:
    """The fused kernel module with ``vectorised`` fixed on every call (False: the portable
    loops), for tests that compare them with the vector loops through the library's callers."""

    def __init__(self, module, vectorised: bool):
        self.module, self.vectorised = module, vectorised

    def __getattr__(self, name):
        fn = getattr(self.module, name)
        return lambda *args, **kwargs: fn(*args, **kwargs, vectorised=self.vectorised)


# ``armkv generate`` on a tiny model: the shared pieces of the CLI's safety tests.


def write_requests(path, requests, raw=()):
    """A request JSONL: ``requests`` as JSON lines, then the ``raw`` lines as they are."""
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in requests) + "".join(line + "\n" for line in raw), encoding="utf-8"
    )
    return path


def requests(n, prompt="The sky is blue. {i}"):
    return [{"id": f"r{i}", "prompt": prompt.format(i=i)} for i in range(n)]


def generate(model_dir, src, out, *extra):
    """``armkv generate`` of ``src`` into ``out``: 3 new tokens, prefill chunk 8, then ``extra``."""
    from armkv.cli import main

    argv = ["generate", "--model", str(model_dir), "--input", str(src), "--output", str(out)]
    return main([*argv, "--max-new-tokens", "3", "--chunk", "8", *extra])


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: the checks under test must come before it."""
    import armkv.hf.model

    def refuse(*a, **k):
        raise AssertionError("the model loaded before the check")

    monkeypatch.setattr(armkv.hf.model, "load_model", refuse)


@pytest.fixture
def calls(monkeypatch):
    """Counts Runner.generate calls. ``calls.hook`` (if set) runs before each; with
    ``calls.stop_after = n`` call n + 1 raises KeyboardInterrupt (a user's Ctrl-C)."""
    from armkv.hf.runner import Runner

    class Calls:
        n = 0
        hook = None
        stop_after = None

    real = Runner.generate

    def counted(self, reqs, *a, **k):
        if Calls.stop_after is not None and Calls.n >= Calls.stop_after:
            raise KeyboardInterrupt
        if Calls.hook is not None:
            Calls.hook(Calls.n)
        Calls.n += 1
        return real(self, reqs, *a, **k)

    monkeypatch.setattr(Runner, "generate", counted)
    return Calls


def modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.split())
