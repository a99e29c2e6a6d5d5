"""``armkv eval`` end to end on a tiny random Llama saved as a model folder, through the real Runner."""

from __future__ import annotations

import json

import pytest

from armkv.cli import main as armkv_main
from test_evals_fixtures import DATA, tiny_model, tiny_tokenizer

pytest.importorskip("armkv.hf.runner", reason="the generation engine (armkv.hf.runner) is not in this build")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = tiny_tokenizer()
    tiny_model(tok, max_positions=2048).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run(*argv):
    return armkv_main(["eval", *map(str, argv)])


def test_ruler_runs_every_method_and_writes_the_folder(model_dir, tmp_path, capsys):
    out = tmp_path / "ruler"
    common = [
        "--model",
        model_dir,
        "--lengths",
        "512",
        "--samples",
        "1",
        "--budget",
        "64",
        "--chunk",
        "64",
        "--max-new-tokens",
        "3",
    ]
    assert run("ruler", "--output", out, "--tasks", "niah_single_1", "--methods", "full,swa,arm", *common) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"full", "swa", "arm"}
    assert all(
        set(tasks) == {"niah_single_1"} and all(set(v) == {"512"} for v in tasks.values()) for tasks in summary.values()
    )
    record = json.loads((out / "arm__niah_single_1__512.jsonl").read_text())
    assert record["prompt_tokens"] > 300 and record["cache_bytes"] > 0
    # a bounded method holds less than the full cache at this length
    full = json.loads((out / "full__niah_single_1__512.jsonl").read_text())
    assert record["cache_bytes"] < full["cache_bytes"]
    # the memory method reports on the needle's value tokens; the others do not
    memory = record["memory"]
    assert memory["watched_tokens"] >= 1 and 0 <= memory["exact_share"] <= 1
    assert len(memory["exact_share_by_layer"]) == 2 and 0 < memory["slots_used"] <= memory["slots"]
    assert "memory" not in full
    printed = capsys.readouterr().out
    assert "needle-value tokens still held exactly" in printed
    assert "| Method | 512 | Avg. |" in printed and "Budget: 64 token-equivalents per layer" in printed
    assert (out / "ruler.png").is_file() and (out / "table.md").is_file()
    # resume: nothing left to do, same summary
    assert run("ruler", "--output", out, "--tasks", "niah_single_1", "--methods", "full,swa,arm", *common) == 0
    assert json.loads((out / "summary.json").read_text()) == summary


def test_ablation_and_longbench_run_end_to_end(model_dir, tmp_path):
    common = ["--model", model_dir, "--samples", "1", "--budget", "64", "--chunk", "64"]
    out = tmp_path / "ablation"
    rows = "fixed-M-1/4"
    assert (
        run(
            "ablation",
            "--output",
            out,
            "--rows",
            rows,
            "--tasks",
            "niah_single_1",
            "--lengths",
            "512",
            "--max-new-tokens",
            "3",
            *common,
        )
        == 0
    )
    assert set(json.loads((out / "summary.json").read_text())) == set(rows.split(","))
    assert "| fixed-M-1/4 | arm | top_m=fixed, m_fixed=" in (out / "table.md").read_text()
    out = tmp_path / "longbench"
    assert (
        run(
            "longbench",
            "--output",
            out,
            "--data-dir",
            DATA / "longbench",
            "--tasks",
            "hotpotqa,lcc",
            "--methods",
            "swa",
            "--max-new-tokens",
            "3",
            *common,
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["swa"]) == {"hotpotqa", "lcc"}


def test_bad_input_is_one_line(model_dir, tmp_path, capsys):
    assert (
        run("ruler", "--output", tmp_path, "--model", model_dir, "--lengths", "4096", "--tasks", "niah_single_1") == 2
    )
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "armkv eval: error: --lengths 4096 is beyond the model's limit of 2048 positions (max_position_embeddings)"
    )
    assert run("ruler", "--output", tmp_path, "--tasks", "qa_1") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--qa-file" in err
    assert run("ruler", "--output", tmp_path, "--methods", "full,nope") == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
