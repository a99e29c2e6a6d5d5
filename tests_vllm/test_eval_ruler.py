"""``armkv eval ruler --engine vllm`` on the tiny Llama (with a tokenizer trained on RULER's
text): the same samples, scores and outputs as the HF path's ``armkv eval ruler`` (run in the
main environment's Python, ``ARMKV_HF_PYTHON``).

The HF path feeds a sample's context and question as two prefills, vLLM as one prompt; with
``--chunk 1`` every token is a chunk of its own in both, so ARM's memory, and its answers,
must be the same too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from processes import ENV
from tiny import build_tiny_llama, save_tiny_tokenizer

BUDGET = 64


def eval_ruler(python: str, model: Path, out: Path, engine: str) -> subprocess.Popen:
    """``armkv eval ruler`` started in ``python``'s environment; its stderr goes to ``out``.err."""
    command = [python, "-m", "armkv.cli", "eval", "ruler", "--engine", engine, "--model", str(model)]
    command += ["--methods", "full,arm", "--budget", str(BUDGET), "--adapter", "random", "--chunk", "1"]
    command += ["--tasks", "niah_single_1", "--lengths", "512", "--samples", "2", "--max-new-tokens", "6"]
    env = dict(os.environ, **ENV, ARMKV_VLLM_MEMORY="0.05")
    with open(f"{out}.err", "w") as err:
        return subprocess.Popen(command + ["--output", str(out)], stdout=subprocess.DEVNULL, stderr=err, env=env)


def finish(run: subprocess.Popen, out: Path) -> None:
    assert run.wait() == 0, Path(f"{out}.err").read_text()[-4000:]


def records(folder: Path) -> dict:
    return {
        p.name: [json.loads(line) for line in p.read_text().splitlines()] for p in sorted(folder.glob("*__*.jsonl"))
    }


@pytest.mark.skipif(not os.environ.get("ARMKV_HF_PYTHON"), reason="ARMKV_HF_PYTHON (the main environment) unset")
def test_eval_ruler_engine_vllm_equals_hf_path(tmp_path):
    model = save_tiny_tokenizer(build_tiny_llama(tmp_path / "tiny"))
    vllm = eval_ruler(sys.executable, model, tmp_path / "vllm", "vllm")  # (the two side by side)
    hf = eval_ruler(os.environ["ARMKV_HF_PYTHON"], model, tmp_path / "hf", "hf")
    finish(vllm, tmp_path / "vllm")
    finish(hf, tmp_path / "hf")
    ours, theirs = records(tmp_path / "vllm"), records(tmp_path / "hf")
    assert set(ours) == set(theirs) == {"arm__niah_single_1__512.jsonl", "full__niah_single_1__512.jsonl"}
    keys = ("id", "answers", "prompt_tokens", "output", "score")
    for name in ours:
        assert [{k: r[k] for k in keys} for r in ours[name]] == [{k: r[k] for k in keys} for r in theirs[name]], name
    arm = ours["arm__niah_single_1__512.jsonl"]
    assert all(0 < r["cache_bytes"] <= BUDGET * 2 * 2 * 2 * 32 * 4 for r in arm)  # (layers x K,V x heads x d x fp32)
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["engine"] == "vllm"
    for name in ("summary.json", "table.md", "ruler.png"):
        assert (tmp_path / "vllm" / name).is_file()
    # a second run finds every sample done
    finish(eval_ruler(sys.executable, model, tmp_path / "vllm", "vllm"), tmp_path / "vllm")
    assert records(tmp_path / "vllm") == ours
