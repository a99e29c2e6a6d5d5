"""``armkv generate --engine vllm``: the same requests and results, answered by vLLM with
armkv's plugin (``armkv.vllm``; docs/serving.md) instead of the HF path.

All requests go to one vLLM engine at once (continuous batching). What differs from the HF
path: a request's context and question are one prompt (the HF path feeds them as two
prefills, so the question starts a chunk of its own there); ``cache_bytes`` is the largest
peak any request of the run reached, summed over the layers (vLLM does not tell the
attention layers which request a memory serves); the timings are the run's, per request.
"""

from __future__ import annotations

import os
import sys
import time

from armkv.errors import ArmkvError

# The one command that builds vLLM's environment (vLLM pins its own transformers, so it gets a
# venv of its own); docs/serving.md.
VLLM_ENV_COMMAND = (
    "python -m venv ~/.venvs/armkv-vllm && ~/.venvs/armkv-vllm/bin/pip install 'armkv[vllm]' && "
    "~/.venvs/armkv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec"
)


def require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ArmkvError(
            f"--engine vllm needs vLLM, which lives in an environment of its own; build it with: {VLLM_ENV_COMMAND} "
            "and run ~/.venvs/armkv-vllm/bin/armkv generate --engine vllm ..."
        ) from None


def encode(tokenizer, request: dict, chat: bool) -> list[int]:
    """A request's prompt ids: the HF path's stages (``Runner.encode``) as one prompt."""
    if "prompt" in request:
        if chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": request["prompt"]}], add_generation_prompt=True, tokenize=False
            )
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer(request["prompt"])["input_ids"]
    context, question, prefix = request["context"], request.get("question", ""), request.get("answer_prefix", "")
    if chat:
        content = context + ("\n\n" + question if question else "")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        cut = text.index(context) + len(context)
        first, rest = text[:cut], text[cut:] + prefix
        ids = tokenizer(first, add_special_tokens=False)["input_ids"]
    else:
        rest = question + prefix
        ids = tokenizer(context)["input_ids"]
    return ids + (tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else [])


def _arm_peaks(worker) -> list[dict]:
    from armkv.vllm.backend import ARMAttention

    return [
        {s: mem.layer.peak_bytes for s, mem in module.impl.memories.items()}
        for module in worker.model_runner.model.modules()
        if isinstance(module, ARMAttention)
    ]


def run(args, requests: list[dict], output, budget, options: dict, sampling: dict | None) -> tuple[int, bool]:
    """Answer the requests not yet in ``output`` through vLLM: ``(requests failed, whether the run
    went through them all)``, the contract of ``generate.run``."""
    require_vllm()
    from armkv.vllm.settings import METHODS, Settings

    if args.method not in METHODS:
        raise ArmkvError(f"--engine vllm serves the methods {', '.join(METHODS)}, not {args.method!r}")
    if args.compile:
        raise ArmkvError("--compile is the HF path's; drop it with --engine vllm")
    from armkv.tools.generate import id_key

    todo = [r for r in requests if id_key(r["id"]) not in output.done]
    if not todo:
        return 0, True
    os.environ["ARMKV_VLLM"] = Settings(args.method, budget, args.chunk, options).to_env()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    from armkv.hf.model import DEFAULT_NAME, cache_dir

    model = args.model or str(cache_dir() / "models" / DEFAULT_NAME)
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ArmkvError(f"{model} holds no model: run `armkv generate` once in armkv's main environment to convert it")
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    prompts = [encode(tokenizer, r, args.chat) for r in todo]
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=longest,
        enable_prefix_caching=False,
        enforce_eager=True,  # (a run of requests: vLLM's torch.compile of the model costs more than it saves here)
        gpu_memory_utilization=float(os.environ.get("ARMKV_VLLM_MEMORY", "0.3")),
    )
    if sampling is None:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    else:
        params = SamplingParams(
            temperature=sampling["temperature"] or 1.0,
            top_p=sampling["top_p"] or 1.0,
            top_k=sampling["top_k"] or 0,
            seed=sampling["seed"],
            max_tokens=args.max_new_tokens,
        )
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    seconds = time.perf_counter() - start
    layers = llm.collective_rpc(_arm_peaks)[0]
    peak = sum(max(layer.values(), default=0) for layer in layers)
    for request, prompt, out in zip(todo, prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        output.write(
            {
                "id": request["id"],
                "method": args.method,
                "output": tokenizer.decode(tokens, skip_special_tokens=True),
                "prompt_tokens": len(prompt),
                "cache_bytes": peak,
                "prefill_seconds": None,
                "decode_seconds_per_token": seconds / max(1, sum(len(o.outputs[0].token_ids) for o in outs)),
            },
            request,
        )
    print(f"armkv generate: {len(todo)} requests through vLLM in {seconds:.1f} s", file=sys.stderr)
    return 0, True


__all__ = ["VLLM_ENV_COMMAND", "encode", "require_vllm", "run"]
