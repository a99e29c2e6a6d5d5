"""armkv eval ppl: the chunked protocol's perplexity equals a plain forward's for the full cache."""

import json
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


@pytest.mark.parametrize(
    "tool",
    [["eval", "ppl", "--method", "full"], ["eval", "policy"], ["generate", "--method", "full", "--output", "o.jsonl"]],
)
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


def test_windows_score_every_consecutive_window_with_a_fresh_cache(tmp_path, capsys, tiny_model_dir):
    """--windows: window k is tokens [kN, (k+1)N) of the file, scored as --max-tokens N scores
    a file holding just those tokens; the last line has every window and their geometric mean."""
    from armkv.hf.model import load_model

    model, tokenizer = load_model(str(tiny_model_dir))
    text = tmp_path / "t.txt"
    text.write_text("The grass is green. The sky is blue. The magic number is 1234567. " * 12)
    ids = tokenizer(text.read_text(), return_tensors="pt").input_ids
    n = 40
    assert ids.shape[1] // n >= 3
    args = [
        "eval",
        "ppl",
        "--method",
        "sink",
        "--budget",
        "16",
        "--chunk",
        "8",
        "--model",
        str(tiny_model_dir),
        "--input",
        str(text),
        "--max-tokens",
        str(n),
        "--json",
    ]
    assert main([*args, "--windows"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    *each, summary = lines
    assert [w["window"] for w in each] == list(range(ids.shape[1] // n))
    assert [w["first_token"] for w in each] == [k * n for k in range(len(each))]
    for k, w in enumerate(each):
        want = perplexity(model, ids[:, k * n : (k + 1) * n], "sink", 16, chunk=8)
        assert w["ppl"] == pytest.approx(want["ppl"], rel=1e-5) and w["tokens"] == n
    assert summary["ppl"] == [w["ppl"] for w in each]
    assert summary["geometric_mean"] == pytest.approx(math.exp(sum(math.log(w["ppl"]) for w in each) / len(each)))
    assert main(args) == 0  # without --windows: the first window only, as before
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ppl"] == pytest.approx(
        each[0]["ppl"], rel=1e-5
    )
    args[args.index("--max-tokens") + 1] = "100000"
    assert main([*args, "--windows"]) == 2
    assert "fewer than one window" in capsys.readouterr().err
