"""The plugin on the Llama family beyond Llama: tiny random-weight Qwen2 (q/k/v biases), Qwen3
(per-head q/k norms before RoPE, head size other than hidden / heads) and Mistral, built and run
by conftest.py's ``engines``.

For each: the exact mode (``full`` through the plugin) gives plain vLLM's tokens, and ARM
through vLLM gives armkv's HF path's tokens at the same budget, so the ARM layer is given the
queries and keys vLLM's own attention is (biases and norms applied as vLLM applies them).
"""

from __future__ import annotations

import os

import pytest
from tiny import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_mode_equals_plain_vllm(engines, family):
    plain, full, arm = (engines[f"{family} {run}"] for run in ("plain", "full", "arm"))
    assert full["peaks"] and arm["peaks"], "the plugin's model did not load"
    assert full["tokens"] == plain["tokens"]
    # ARM is in effect: the longest prompt overflows its budget, and its answer changes
    assert arm["tokens"][-1] != plain["tokens"][-1]


@pytest.mark.skipif(not os.environ.get("ARMKV_HF_PYTHON"), reason="ARMKV_HF_PYTHON (the main environment) unset")
@pytest.mark.parametrize("family", FAMILIES)
def test_arm_equals_hf_path(engines, family):
    assert engines[f"{family} arm"]["tokens"] == engines[f"{family} hf"]["tokens"]
