"""Run prompts through vLLM in a fresh process (every vLLM process loads the plugins anew):
``python engine_run.py JOB.json`` prints one JSON line: each prompt's greedy tokens, and, for
the plugin's model, each request's peak bytes per layer (``ARMKV_VLLM`` from the job).

A job ``{"jobs": [job, ...]}`` runs its jobs one engine after the other in this one process
(saving vLLM's import, most of a run's time on a tiny model) and prints their results as a
list. vLLM maps architectures to classes once a process, so its jobs are either all plain
vLLM (no ``arm``) or all through the plugin (``arm`` set, its method and budget free)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def arm_peaks(worker) -> dict:
    """{layer name: {state block: the peak bytes of that request's memory}} in this worker."""
    from armkv.vllm.backend import ARMAttention

    model = worker.model_runner.model
    return {
        name: {str(s): mem.layer.peak_bytes for s, mem in module.impl.memories.items()}
        for name, module in model.named_modules()
        if isinstance(module, ARMAttention)
    }


def arm_blocks(worker) -> dict:
    """{layer name: {state block: where that request's memory lies}}: the request's block, the
    layer's bytes of it (size and offset), the bytes its layer's state needs, the tensors it
    keeps (by path) and those outside its bytes of the block."""
    from armkv.memory.arena import within
    from armkv.vllm.backend import ARMAttention
    from armkv.vllm.feed import held_tensors

    out = {}
    for name, module in worker.model_runner.model.named_modules():
        if not isinstance(module, ARMAttention) or not module.arm_plan.placed:
            continue
        layer = {}
        for s, mem in module.impl.memories.items():
            block = module.impl.storage(module, module.kv_cache, s)  # (this layer's bytes of the request's block)
            held = held_tensors(mem)
            layer[str(s)] = {
                "request_block_bytes": module.impl.block(module.kv_cache, s).nbytes,
                "block_bytes": block.nbytes,
                "offset": module.arm_plan.offset,
                "storage_bytes": mem.layer.storage_bytes(),
                "held": len(held),
                "outside": [p for p, t in held.items() if not within(t, block)],
            }
        out[name] = layer
    return out


def preempted_run(llm, prompts, params, preempt_at: list[int], TokensPrompt) -> list[list[int]]:
    """The prompts stepped through the engine, every running request preempted (its state freed,
    recomputed from token 0 when it is scheduled again) after each step in ``preempt_at``."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt), params)
    done, steps, preempted = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps in preempt_at:
            preempted += engine.reset_prefix_cache(reset_running_requests=True)
    assert preempted == len(preempt_at), "the engine did not preempt"
    return [done[str(i)] for i in range(len(prompts))]


def run_job(job: dict) -> dict:
    """One engine for ``job``, its prompts' greedy tokens and ARM peaks; the engine is freed after."""
    import gc

    if job.get("arm") is None:
        os.environ.pop("ARMKV_VLLM", None)
    else:
        os.environ["ARMKV_VLLM"] = job["arm"]
    from vllm import LLM, SamplingParams, TokensPrompt

    args = dict(
        model=job["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=job.get("dtype", "float32"),
        max_model_len=4096,
        enable_prefix_caching=False,
        max_num_seqs=8,
        gpu_memory_utilization=0.1,  # (on the CPU build: the share of memory checked free at start)
        kv_cache_memory_bytes=1 << 28,
    )
    args.update(job.get("engine", {}))
    llm = LLM(**args)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    if job.get("preempt_at"):
        result = {"tokens": preempted_run(llm, job["prompts"], params, job["preempt_at"], TokensPrompt)}
    else:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
        result = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
    result["peaks"] = llm.collective_rpc(arm_peaks)[0] if job.get("arm") else {}
    result["blocks"] = llm.collective_rpc(arm_blocks)[0] if job.get("arm") else {}
    del llm
    gc.collect()
    return result


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    if "jobs" in job:
        if len({j.get("arm") is None for j in job["jobs"]}) > 1:
            raise SystemExit("engine_run.py: a process runs either plain vLLM or the plugin, not both")
        result = [run_job(j) for j in job["jobs"]]
    else:
        result = run_job(job)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
