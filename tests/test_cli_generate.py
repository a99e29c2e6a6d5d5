"""``armkv generate`` end to end on a saved tiny model, its errors, and one real-model run."""

import json
import subprocess
import sys

import pytest

from armkv.cli import main

FIELDS = {
    "id",
    "method",
    "output",
    "prompt_tokens",
    "cache_bytes",
    "prefill_seconds",
    "decode_seconds_per_token",
    "settings",
    "hash",
}


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def run(tmp_path, model_dir, *extra, lines=None):
    src = write_lines(
        tmp_path / "in.jsonl",
        lines
        if lines is not None
        else [
            json.dumps(
                {
                    "id": "a",
                    "context": "The grass is green. The magic number is 1234567.",
                    "question": " What is the magic number?",
                    "answer_prefix": " It is",
                }
            ),
            "{not json",
            json.dumps({"id": "b", "prompt": "The sky is blue."}),
            json.dumps({"id": "c"}),
        ],
    )
    out = tmp_path / "out.jsonl"
    args = [
        "generate",
        "--model",
        str(model_dir),
        "--input",
        str(src),
        "--output",
        str(out),
        "--max-new-tokens",
        "5",
        "--chunk",
        "8",
        *extra,
    ]
    return main(args), out


def test_generate_writes_one_line_per_good_request(tmp_path, tiny_model_dir, capsys):
    code, out = run(tmp_path, tiny_model_dir, "--method", "sink", "--budget", "16")
    assert code == 1  # two lines skipped: counted at the end
    err = capsys.readouterr().err
    assert "in.jsonl:2: skipped, not JSON" in err
    assert "in.jsonl:4: skipped" in err and "'context' or 'prompt'" in err
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in results] == ["a", "b"]
    for r in results:
        assert set(r) == FIELDS and r["method"] == "sink" and r["cache_bytes"] > 0 and r["prompt_tokens"] > 0


def test_generate_chat_mode(tmp_path, tiny_model_dir):
    code, out = run(tmp_path, tiny_model_dir, "--method", "full", "--chat")
    assert code == 1  # two lines skipped
    assert len(out.read_text().splitlines()) == 2


@pytest.mark.parametrize(
    "extra,lines,message",
    [
        (["--method", "nope"], None, "unknown method 'nope'"),
        (["--method", "sink", "--budget", "3"], None, "too small"),
        (["--method", "full"], [], "holds no request"),
        (
            ["--method", "full", "--adapter", "random"],
            None,
            "--adapter applies to the arm and fifo methods, not 'full'",
        ),
    ],
)
def test_generate_errors_are_one_line(tmp_path, tiny_model_dir, capsys, extra, lines, message):
    code, _ = run(tmp_path, tiny_model_dir, *extra, lines=lines)
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert message in err[-1] and err[-1].startswith("armkv generate: error:")


def test_missing_model_folder(tmp_path, capsys):
    code, _ = run(tmp_path, tmp_path / "no-such-model", "--method", "full")
    assert code != 0
    assert "no-such-model: no such folder" in capsys.readouterr().err


def test_prompt_too_long_is_reported_and_others_go_on(tmp_path, tiny_model_dir, capsys):
    lines = [
        json.dumps({"id": "long", "prompt": "The grass is green. " * 400}),
        json.dumps({"id": "short", "prompt": "The sky is blue."}),
    ]
    code, out = run(tmp_path, tiny_model_dir, "--method", "full", lines=lines)
    assert code == 1
    assert "limit of 1024 positions" in capsys.readouterr().err
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["short"]


@pytest.mark.real_model
def test_generate_real_default_model(tmp_path):
    """The console script on the default model (SmolLM2-135M-Instruct), a short chat prompt."""
    src = write_lines(
        tmp_path / "in.jsonl",
        [
            json.dumps(
                {
                    "id": "q",
                    "context": "The magic number is 4321.",
                    "question": "What is the magic number?",
                    "answer_prefix": "The magic number is",
                }
            )
        ],
    )
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "armkv.cli",
            "generate",
            "--method",
            "sink",
            "--budget",
            "64",
            "--chat",
            "--max-new-tokens",
            "8",
            "--input",
            str(src),
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert set(result) == FIELDS
    assert "4321" in result["output"]


@pytest.mark.real_model
def test_real_model_cache_bytes_against_prompt_length():
    """On the default model: full grows with the prompt; bounded methods hold the same bytes
    for a short and a three times longer prompt (both beyond the budget)."""
    from armkv.hf.model import load_model
    from armkv.hf.runner import Runner

    model, tokenizer = load_model()
    noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    requests = [{"id": n, "prompt": noise * n} for n in (8, 24)]  # ~200 and ~600 tokens
    sizes = {}
    for method, budget in (("full", None), ("sink", 64), ("kivi", 64)):
        results = Runner(model, tokenizer, method, budget=budget, chunk=64).generate(requests, max_new_tokens=2)
        sizes[method] = [r["cache_bytes"] for r in results]
    token_bytes = 2 * 3 * 64 * 4 * 30  # K and V, 3 KV heads of 64, fp32, 30 layers
    assert sizes["full"][1] > 2.5 * sizes["full"][0]
    assert sizes["sink"][0] == sizes["sink"][1] == 64 * token_bytes
    assert sizes["kivi"][0] == sizes["kivi"][1] <= 64 * token_bytes


@pytest.mark.real_model
def test_real_model_arm_keeps_a_needle_that_sink_drops():
    """On the default model with the shipped adapter and packed slots: a needle in the middle of
    a 700-token prompt, budget 128, survives ARM's memory and not StreamingLLM's window."""
    from armkv.hf.model import load_model
    from armkv.hf.runner import Runner

    model, tokenizer = load_model()
    noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    request = {
        "id": "needle",
        "context": noise * 14 + "The special magic number is: 7305518. " + noise * 14,
        "question": " What is the special magic number mentioned in the text?",
        "answer_prefix": " The special magic number mentioned in the text is",
    }
    budget_bytes = 128 * 2 * 3 * 64 * 4 * 30  # K and V, 3 KV heads of 64, fp32, 30 layers
    outputs = {}
    for method in ("arm", "sink"):
        (result,) = Runner(model, tokenizer, method, budget=128, chunk=64).generate([request], max_new_tokens=10)
        assert result["cache_bytes"] <= budget_bytes
        outputs[method] = result["output"]
    assert "7305518" in outputs["arm"]
    assert "7305518" not in outputs["sink"]
