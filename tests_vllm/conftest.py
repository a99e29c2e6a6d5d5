"""The plugin's tests run in vLLM's environment (``.ci/run`` builds it; docs/serving.md):
elsewhere they are skipped.

Every engine the tests compare runs in one of three processes started together (vLLM's import is
most of a run's time on a tiny model, and the processes share the cores): plain vLLM, the plugin
(vLLM maps architectures to classes once a process), and armkv's HF path in the main environment's
Python (``ARMKV_HF_PYTHON``; its tests are skipped without it)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (docs/serving.md builds its environment)")

sys.path.insert(0, str(Path(__file__).parent))
from processes import Job  # noqa: E402
from tiny import FAMILIES, build_tiny, build_tiny_llama, prompts  # noqa: E402

BUDGET = 64
# The Llama runs: 8 requests of mixed lengths; ARM's prefill chunk P is at most a step's tokens
# (64 in the small-step runs).
LENGTHS = [37, 300, 700, 90, 1200, 5, 450, 260]
NEW = 12
CHUNK = 32
ARM = {"method": "arm", "budget": BUDGET, "adapter": "random", "chunk": CHUNK}
# The other families: three requests, the longest overflowing the budget many times over.
FAMILY_LENGTHS = [5, 333, 900]
FAMILY_NEW = 10
FAMILY_ARM = {"method": "arm", "budget": BUDGET, "adapter": "random"}


def _jobs(llama: Path, families: dict[str, Path]) -> dict[str, list[tuple[str, dict]]]:
    """{process: [(run name, job)]}: every engine run the tests compare."""
    base = {"model": str(llama), "prompts": prompts(LENGTHS), "max_tokens": NEW, "engine": {}}
    big, small = {"max_num_batched_tokens": 4096}, {"max_num_batched_tokens": 64}
    plain = [("llama plain", dict(base, arm=None))]
    plugin = [
        ("llama full", dict(base, arm=json.dumps({"method": "full"}))),
        ("llama arm", dict(base, arm=json.dumps(ARM), engine=big)),
        ("llama arm small steps", dict(base, arm=json.dumps(ARM), engine=small)),
        ("llama arm preempted", dict(base, arm=json.dumps(ARM), engine=small, preempt_at=[4, 30])),
    ]
    hf_base = {"prompts": prompts(LENGTHS), "max_tokens": NEW, "method": "arm", "budget": BUDGET}
    hf = [("llama hf", dict(hf_base, model=str(llama), chunk=CHUNK, options={"adapter": "random"}))]
    fam = {"prompts": prompts(FAMILY_LENGTHS), "max_tokens": FAMILY_NEW, "engine": {"max_num_batched_tokens": 256}}
    for family, model in families.items():
        plain.append((f"{family} plain", dict(fam, model=str(model), arm=None)))
        plugin.append((f"{family} full", dict(fam, model=str(model), arm=json.dumps({"method": "full"}))))
        plugin.append((f"{family} arm", dict(fam, model=str(model), arm=json.dumps(FAMILY_ARM))))
        hf.append(
            (
                f"{family} hf",
                dict(
                    hf_base,
                    model=str(model),
                    prompts=fam["prompts"],
                    max_tokens=FAMILY_NEW,
                    options={"adapter": "random"},
                ),
            )
        )
    return {"plain": plain, "plugin": plugin, "hf": hf}


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """The tiny random-weight models, saved with safetensors: "llama" and each of FAMILIES."""
    root = tmp_path_factory.mktemp("models")
    return {"llama": build_tiny_llama(root / "llama")} | {f: build_tiny(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def engines(models, tmp_path_factory) -> dict:
    """{run name: its result (tokens; for the plugin, each request's peak bytes and block layout)};
    the HF path's runs are None without ``ARMKV_HF_PYTHON``; "refused": (exit status, stderr) of an
    engine given a method the plugin does not serve."""
    tmp = tmp_path_factory.mktemp("engines")
    jobs = _jobs(models["llama"], {f: models[f] for f in FAMILIES})
    hf_python = os.environ.get("ARMKV_HF_PYTHON")
    started = {
        "plain": Job("engine_run.py", {"jobs": [j for _, j in jobs["plain"]]}, tmp),
        "plugin": Job("engine_run.py", {"jobs": [j for _, j in jobs["plugin"]]}, tmp),
    }
    # a setting the plugin refuses: the engine must stop with its one-line error
    bad = {"model": str(models["llama"]), "prompts": [[5, 6]], "max_tokens": 1, "arm": '{"method": "kivi"}'}
    refused = Job("engine_run.py", bad, tmp)
    if hf_python:
        started["hf"] = Job("hf_reference.py", {"jobs": [j for _, j in jobs["hf"]]}, tmp, python=hf_python)
    out = {name: None for name, _ in jobs["hf"]}
    for process, job in started.items():
        out.update(zip([name for name, _ in jobs[process]], job.result()))
    out["refused"] = refused.finish()
    return out
