"""armkv's vLLM plugin end to end on a tiny random-weight Llama (built and run by conftest.py's
``engines``: plain vLLM, the plugin and armkv's HF path, each in a process of its own).

- the plugin loads, and its exact mode (``full``: every token, through the plugin's
  state, backend and feeding) gives plain vLLM's tokens
- ARM through vLLM gives armkv's HF path's tokens at the same budget (the HF path runs in the
  main environment's Python, ``ARMKV_HF_PYTHON``; skipped without it)
- 8 concurrent requests of mixed lengths: each request's memory stays within its budget and
  lies in the block vLLM allocated for it
- vLLM's chunking (64 and 4,096 tokens a step) and forced preemption change nothing
"""

from __future__ import annotations

import os

import pytest

from conftest import BUDGET, LENGTHS

BUDGET_BYTES = BUDGET * 2 * 2 * 32 * 4  # tokens x (K, V) x KV heads x head size x float32


def test_exact_mode_equals_plain_vllm(engines):
    plain, exact = engines["llama plain"], engines["llama full"]
    assert exact["peaks"], "the plugin's model did not load"
    assert exact["tokens"] == plain["tokens"]


def test_arm_stays_within_budget(engines):
    arm = engines["llama arm"]
    assert len(arm["peaks"]) == 2
    for layer, peaks in arm["peaks"].items():
        assert len(peaks) == len(LENGTHS), layer  # every request its own memory
        assert 0 < max(peaks.values()) <= BUDGET_BYTES, (layer, peaks)
    # a long prompt fills its memory: ARM differs from the full cache there, not on the shortest
    plain = engines["llama plain"]
    assert arm["tokens"][5] == plain["tokens"][5]
    assert arm["tokens"][4] != plain["tokens"][4]


def test_state_lives_in_its_block(engines):
    """Each request's memory lies in the one block vLLM allocated for it: every layer's state in
    its own bytes of that block (every tensor it keeps between steps a view of them), and the
    block is the layers' states: the budget's bytes plus the exact tokens' positions and validity."""
    layers = list(engines["llama arm"]["blocks"].values())
    assert len(layers) == 2
    for layer in layers:
        assert len(layer) == len(LENGTHS)
        for state, where in layer.items():
            assert where["held"] >= 13 and where["outside"] == [], (state, where)
            assert where["block_bytes"] == where["storage_bytes"]
            assert BUDGET_BYTES < where["block_bytes"] <= BUDGET_BYTES + 1024, where
    for state in layers[0]:  # the layers' bytes tile the request's block
        assert [layer[state]["offset"] for layer in layers] == [0, layers[0][state]["block_bytes"]]
        assert layers[0][state]["request_block_bytes"] == sum(layer[state]["block_bytes"] for layer in layers)


def test_chunking_changes_nothing(engines):
    assert engines["llama arm small steps"]["tokens"] == engines["llama arm"]["tokens"]


def test_forced_preemption_changes_nothing(engines):
    """Every running request preempted twice (64 tokens a step: mid-prompt for the long ones,
    while decoding for the short ones): recomputed from token 0, the memories give the same tokens."""
    assert engines["llama arm preempted"]["tokens"] == engines["llama arm"]["tokens"]


@pytest.mark.skipif(not os.environ.get("ARMKV_HF_PYTHON"), reason="ARMKV_HF_PYTHON (the main environment) unset")
def test_arm_equals_hf_path(engines):
    assert engines["llama arm"]["tokens"] == engines["llama hf"]["tokens"]


def test_bad_setting_is_one_line(engines):
    code, stderr = engines["refused"]
    assert code != 0 and "method 'kivi' does not serve in vLLM" in stderr


def test_scheduler_cuts_prompts_in_whole_chunks():
    """A prefill piece ends on a multiple of P or at the prompt's end (else it waits a step);
    generated tokens and a recompute past the prompt are scheduled as vLLM would."""
    from types import SimpleNamespace

    from armkv.vllm.scheduler import ARMConfigHook, _WholeChunks, arm_scheduler, check_scheduler

    split = _WholeChunks.__new__(_WholeChunks)
    split.arm_chunk = 32
    for computed, new, prompt, expected in [
        (0, 64, 300, 64),
        (0, 50, 300, 32),
        (32, 20, 300, 0),
        (288, 64, 300, 64),
        (0, 10, 5, 10),
        (300, 1, 300, 1),
        (0, 305, 300, 305),  # (a preempted request's recompute: prompt and generated tokens)
    ]:
        request = SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=prompt)
        assert split._mamba_block_aligned_split(request, new) == expected, (computed, new, prompt)
    sched = SimpleNamespace(scheduler_cls=None, enable_chunked_prefill=True, max_num_batched_tokens=16)
    config = SimpleNamespace(scheduler_config=sched)
    ARMConfigHook.verify_and_update_config(config)
    assert sched.scheduler_cls is arm_scheduler
    with pytest.raises(Exception, match="max-num-batched-tokens to at least 32"):
        check_scheduler(config, 32)
    sched.scheduler_cls = "my.Scheduler"
    with pytest.raises(Exception, match="drop --scheduler-cls"):
        ARMConfigHook.verify_and_update_config(config)
