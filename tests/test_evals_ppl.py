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


@pytest.mark.parametrize("tool", [["eval", "ppl", "--method", "full"], ["eval", "policy"], ["generate", "--method", "full", "--output", "o.jsonl"]])
def test_text_that_is_not_utf8_is_a_one_line_error(tmp_path, capsys, monkeypatch, tool):
    """A file in another encoding (here UTF-16, as some editors save) is named with the byte
    that failed, before any model loads, in every tool that reads a user's text."""
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "t.txt"
    text.write_bytes("hello world\n".encode("utf-16"))
    assert main([*tool, "--input", str(text)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not UTF-8 text (byte 0xff at offset 0)" in err[0], err


def test_read_text_names_each_problem(tmp_path):
    from armkv.errors import ArmkvError, read_text

    (tmp_path / "ok.txt").write_text("caf\u00e9\r\n", encoding="utf-8")
    assert read_text(tmp_path / "ok.txt", "--input") == "caf\u00e9\n"  # newlines as Path.read_text reads them
    with pytest.raises(ArmkvError, match="--input .*: no such file"):
        read_text(tmp_path / "nope.txt", "--input")
    with pytest.raises(ArmkvError, match="--haystack-file .*: not a file"):
        read_text(tmp_path, "--haystack-file")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(ArmkvError, match=r"not UTF-8 text \(byte 0xe9 at offset 3\); save it as UTF-8"):
        read_text(tmp_path / "latin1.txt", "--input")


def test_bad_option_is_a_one_line_error(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 20)
    assert main(["eval", "ppl", "--method", "full", "--input", str(text), "--option", "oops"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected METHOD.KEY=VALUE" in err[0]
