"""armkv's vLLM plugin end to end on a tiny random-weight Llama (built here, saved with
safetensors): every engine runs in its own process (``engine_run.py``), as vLLM loads its
plugins once a process.

- the plugin loads, and its exact mode (``full``: every token, through the plugin's
  state, backend and feeding) gives plain vLLM's tokens
- ARM through vLLM gives armkv's HF path's tokens at the same budget (the HF path runs in the
  main environment's Python, ``ARMKV_HF_PYTHON``; skipped without it)
- 8 concurrent requests of mixed lengths: each request's memory stays within its budget and
  lies in the block vLLM allocated for it
- vLLM's chunking (64 and 4,096 tokens a step) and forced preemption change nothing
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from tiny import build_tiny_llama, prompts  # noqa: E402

BUDGET = 64
LENGTHS = [37, 300, 700, 90, 1200, 5, 450, 260]  # 8 requests, mixed lengths
NEW = 12
CHUNK = 32  # ARM's prefill chunk P: at most a step's tokens (64 in the small-step runs)
ARM = json.dumps({"method": "arm", "budget": BUDGET, "adapter": "random", "chunk": CHUNK})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def run(script: str, job: dict, tmp: Path, python: str = sys.executable) -> dict:
    path = tmp / f"job-{abs(hash(json.dumps(job, sort_keys=True)))}.json"
    path.write_text(json.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([python, str(HERE / script), str(path)], capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{script} failed:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


_runs: dict = {}


def engine(tiny: Path, tmp: Path, arm: str | None, preempt_at: list[int] | None = None, **engine_args) -> dict:
    key = (arm, json.dumps(engine_args, sort_keys=True), str(preempt_at))
    if key not in _runs:
        job = {"model": str(tiny), "prompts": prompts(LENGTHS), "max_tokens": NEW, "arm": arm, "engine": engine_args}
        job["preempt_at"] = preempt_at
        _runs[key] = run("engine_run.py", job, tmp)
    return _runs[key]


def test_exact_mode_equals_plain_vllm(tiny, tmp_path):
    plain = engine(tiny, tmp_path, None)
    exact = engine(tiny, tmp_path, json.dumps({"method": "full"}))
    assert exact["peaks"], "the plugin's model did not load"
    assert exact["tokens"] == plain["tokens"]


def test_arm_stays_within_budget(tiny, tmp_path):
    arm = engine(tiny, tmp_path, ARM, max_num_batched_tokens=4096)
    budget_bytes = BUDGET * 2 * 2 * 32 * 4  # tokens x (K, V) x KV heads x head size x float32
    assert len(arm["peaks"]) == 2
    for layer, peaks in arm["peaks"].items():
        assert len(peaks) == len(LENGTHS), layer  # every request its own memory
        assert 0 < max(peaks.values()) <= budget_bytes, (layer, peaks)
    # a long prompt fills its memory: ARM differs from the full cache there, not on the shortest
    plain = engine(tiny, tmp_path, None)
    assert arm["tokens"][5] == plain["tokens"][5]
    assert arm["tokens"][4] != plain["tokens"][4]


def test_state_lives_in_its_block(tiny, tmp_path):
    """Each request's memory lies in the one block vLLM allocated for it: every layer's state in
    its own bytes of that block (every tensor it keeps between steps a view of them), and the
    block is the layers' states: the budget's bytes plus the exact tokens' positions and validity."""
    arm = engine(tiny, tmp_path, ARM, max_num_batched_tokens=4096)
    budget_bytes = BUDGET * 2 * 2 * 32 * 4
    layers = list(arm["blocks"].values())
    assert len(layers) == 2
    for layer in layers:
        assert len(layer) == len(LENGTHS)
        for state, where in layer.items():
            assert where["held"] >= 13 and where["outside"] == [], (state, where)
            assert where["block_bytes"] == where["storage_bytes"]
            assert budget_bytes < where["block_bytes"] <= budget_bytes + 1024, where
    for state in layers[0]:  # the layers' bytes tile the request's block
        assert [layer[state]["offset"] for layer in layers] == [0, layers[0][state]["block_bytes"]]
        assert layers[0][state]["request_block_bytes"] == sum(layer[state]["block_bytes"] for layer in layers)


def test_chunking_changes_nothing(tiny, tmp_path):
    big = engine(tiny, tmp_path, ARM, max_num_batched_tokens=4096)
    small = engine(tiny, tmp_path, ARM, max_num_batched_tokens=64)
    assert small["tokens"] == big["tokens"]


def test_forced_preemption_changes_nothing(tiny, tmp_path):
    """Every running request preempted twice (64 tokens a step: mid-prompt for the long ones,
    while decoding for the short ones): recomputed from token 0, the memories give the same tokens."""
    steady = engine(tiny, tmp_path, ARM, max_num_batched_tokens=4096)
    preempted = engine(tiny, tmp_path, ARM, max_num_batched_tokens=64, preempt_at=[4, 30])
    assert preempted["tokens"] == steady["tokens"]


@pytest.mark.skipif(not os.environ.get("ARMKV_HF_PYTHON"), reason="ARMKV_HF_PYTHON (the main environment) unset")
def test_arm_equals_hf_path(tiny, tmp_path):
    arm = engine(tiny, tmp_path, ARM, max_num_batched_tokens=4096)
    job = {
        "model": str(tiny),
        "prompts": prompts(LENGTHS),
        "max_tokens": NEW,
        "method": "arm",
        "budget": BUDGET,
        "chunk": CHUNK,
        "options": {"adapter": "random"},
    }
    hf = run("hf_reference.py", job, tmp_path, python=os.environ["ARMKV_HF_PYTHON"])
    assert arm["tokens"] == hf["tokens"]


def test_bad_setting_is_one_line(tiny, tmp_path):
    job = {"model": str(tiny), "prompts": [[5, 6]], "max_tokens": 1, "arm": '{"method": "kivi"}', "engine": {}}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, str(HERE / "engine_run.py"), str(path)], capture_output=True, text=True)
    assert proc.returncode != 0 and "method 'kivi' does not serve in vLLM" in proc.stderr


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
