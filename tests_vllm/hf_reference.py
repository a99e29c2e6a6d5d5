"""armkv's HF path on the tiny model (run by the main environment's Python, whose transformers
armkv supports): ``python hf_reference.py JOB.json`` prints each prompt's greedy tokens with
the job's method and budget: the prompt in one call (chunks of P inside), then one token a call.
A job ``{"jobs": [job, ...]}`` runs each in turn and prints their results as a list."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def run_job(job: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from armkv.hf import make_cache

    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, local_files_only=True).eval()
    out = []
    for prompt in job["prompts"]:
        cache = make_cache(model, job["method"], job.get("budget"), chunk=job.get("chunk", 256), **job["options"])
        ids = torch.tensor([prompt])
        new = []
        with torch.no_grad():
            for _ in range(job["max_tokens"]):
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
                token = int(logits.argmax())
                new.append(token)
                ids = torch.tensor([[token]])
        out.append(new)
    return {"tokens": out}


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    result = [run_job(j) for j in job["jobs"]] if "jobs" in job else run_job(job)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
