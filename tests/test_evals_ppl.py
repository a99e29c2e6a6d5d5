"""armkv eval ppl: the chunked protocol's perplexity equals a plain forward's for the full cache."""

import math

import pytest
import torch

from armkv.cli import main
from armkv.evals.ppl import perplexity
from conftest import tiny_model


def test_full_cache_ppl_equals_plain_forward():
    model = tiny_model("llama").eval()
    ids = torch.randint(0, 100, (1, 77))
    with torch.no_grad():
        logits = model(ids).logits
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    got = perplexity(model, ids, "full", None, chunk=16)
    assert got["tokens"] == 77
    assert abs(got["ppl"] - math.exp(float(nll))) < 1e-3 * math.exp(float(nll))
    bounded = perplexity(model, ids, "swa", 8, chunk=16)
    assert bounded["cache_bytes"] < got["cache_bytes"]


def test_missing_input_is_a_one_line_error(tmp_path, capsys):
    assert main(["eval", "ppl", "--method", "full", "--input", str(tmp_path / "nope.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file" in err[0]


def test_bad_option_is_a_one_line_error(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 20)
    assert main(["eval", "ppl", "--method", "full", "--input", str(text), "--option", "oops"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected KEY=VALUE" in err[0]
