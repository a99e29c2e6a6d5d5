"""The plugin on the Llama family beyond Llama: tiny random-weight Qwen2 (q/k/v biases), Qwen3
(per-head q/k norms before RoPE, head size other than hidden / heads) and Mistral, built here.

For each: the exact mode (``full`` through the plugin) gives plain vLLM's tokens, and ARM
through vLLM gives armkv's HF path's tokens at the same budget, so the ARM layer is given the
queries and keys vLLM's own attention is (biases and norms applied as vLLM applies them).
Three processes in all (plain vLLM; the plugin; the HF path), each running its engines one
after the other, to keep the added time small.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_plugin import run
from tiny import FAMILIES, build_tiny, prompts

BUDGET = 64
LENGTHS = [5, 333, 900]  # the longest overflows the budget many times over
NEW = 10
ARM = {"method": "arm", "budget": BUDGET, "adapter": "random"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: build_tiny(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory) -> dict:
    """{family: {"plain", "full", "arm": engine result}}: plain vLLM in one process, the plugin's
    exact mode and ARM in another."""
    tmp = tmp_path_factory.mktemp("family-jobs")
    base = {"prompts": prompts(LENGTHS), "max_tokens": NEW, "engine": {"max_num_batched_tokens": 256}}
    plain = run("engine_run.py", {"jobs": [dict(base, model=str(m), arm=None) for m in models.values()]}, tmp)
    plugin_jobs = [
        dict(base, model=str(m), arm=json.dumps(arm)) for m in models.values() for arm in ({"method": "full"}, ARM)
    ]
    plugin = run("engine_run.py", {"jobs": plugin_jobs}, tmp)
    return {
        family: {"plain": plain[i], "full": plugin[2 * i], "arm": plugin[2 * i + 1]} for i, family in enumerate(models)
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_mode_equals_plain_vllm(runs, family):
    plain, full, arm = runs[family]["plain"], runs[family]["full"], runs[family]["arm"]
    assert full["peaks"] and arm["peaks"], "the plugin's model did not load"
    assert full["tokens"] == plain["tokens"]
    # ARM is in effect: the longest prompt overflows its budget, and its answer changes
    assert arm["tokens"][-1] != plain["tokens"][-1]


@pytest.mark.skipif(not os.environ.get("ARMKV_HF_PYTHON"), reason="ARMKV_HF_PYTHON (the main environment) unset")
def test_arm_equals_hf_path(models, runs, tmp_path):
    jobs = [
        {
            "model": str(m),
            "prompts": prompts(LENGTHS),
            "max_tokens": NEW,
            "method": "arm",
            "budget": BUDGET,
            "options": {"adapter": "random"},
        }
        for m in models.values()
    ]
    hf = run("hf_reference.py", {"jobs": jobs}, tmp_path, python=os.environ["ARMKV_HF_PYTHON"])
    for family, result in zip(models, hf):
        assert runs[family]["arm"]["tokens"] == result["tokens"], family
