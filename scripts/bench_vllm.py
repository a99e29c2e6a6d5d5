"""ARM through vLLM beside vLLM's own full cache, on the same concurrent requests (run in vLLM's
environment, docs/serving.md):

    python scripts/bench_vllm.py --requests 16 --min-tokens 2048 --max-tokens 8192 --new 16 [--budget 512]

Each engine runs in a process of its own (vLLM loads its plugins once a process). Prints each
engine's tokens/s (prompt and generated tokens over the wall time of the batch) and the worker's
peak resident memory, ARM's largest per-request state (summed over layers) beside the full
cache's bytes for the longest request, the ratios, and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def worker_stats(worker) -> dict:
    import resource

    from armkv.vllm.backend import ARMAttention

    layers = [m for m in worker.model_runner.model.modules() if isinstance(m, ARMAttention)]
    peaks: dict[int, int] = {}
    for layer in layers:
        for state, memory in layer.impl.memories.items():
            peaks[state] = peaks.get(state, 0) + memory.layer.peak_bytes
    return {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "arm_request_peaks": peaks}


def one_engine(args) -> None:
    if args.arm:
        os.environ["ARMKV_VLLM"] = args.arm
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams, TokensPrompt

    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(args.min_tokens, args.max_tokens, args.requests).long().tolist()
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]
    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=args.max_tokens + args.new,
        max_num_seqs=args.requests,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=args.kv_bytes,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.collective_rpc(worker_stats)[0]
    new = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        "RESULT "
        + json.dumps(
            {
                "seconds": seconds,
                "tokens_per_s": (sum(lengths) + new) / seconds,
                "generated_per_s": new / seconds,
                "prompt_tokens": lengths,
                **stats,
            }
        ),
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.expanduser("~/.cache/armkv/models/smollm2-135m-instruct"))
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--min-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--kv-bytes", type=int, default=4 << 30, help="vLLM's KV cache pool, both engines")
    p.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # (the child process's setting)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return one_engine(args)
    results = {}
    base = [sys.executable, __file__, "--child", "--model", args.model, "--requests", str(args.requests)]
    base += ["--min-tokens", str(args.min_tokens), "--max-tokens", str(args.max_tokens), "--new", str(args.new)]
    base += ["--kv-bytes", str(args.kv_bytes)]
    arm = json.dumps({"method": "arm", "budget": args.budget})
    for name, extra in (("vllm_full", []), ("arm", ["--arm", arm])):
        proc = subprocess.run(base + extra, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"bench_vllm: the {name} engine failed:\n{proc.stderr[-3000:]}")
        results[name] = json.loads(lines[-1][7:])
        r = results[name]
        print(
            f"{name:10s} {r['seconds']:8.1f} s  {r['tokens_per_s']:8.1f} tok/s  "
            f"peak RSS {r['max_rss_bytes'] / 2**30:.2f} GiB"
        )
    config = json.load(open(os.path.join(args.model, "config.json")))
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    token_bytes = 2 * config.get("num_key_value_heads", heads) * head_dim * 4 * config["num_hidden_layers"]
    full_longest = (args.max_tokens + args.new) * token_bytes
    arm_peak = max(results["arm"]["arm_request_peaks"].values())
    budget_bytes = args.budget * token_bytes
    summary = {
        "requests": args.requests,
        "prompt_tokens": [args.min_tokens, args.max_tokens],
        "budget": args.budget,
        "throughput_ratio_arm_over_full": results["arm"]["tokens_per_s"] / results["vllm_full"]["tokens_per_s"],
        "peak_rss_ratio_arm_over_full": results["arm"]["max_rss_bytes"] / results["vllm_full"]["max_rss_bytes"],
        "arm_request_peak_bytes": arm_peak,
        "arm_budget_bytes": budget_bytes,
        "full_cache_bytes_longest_request": full_longest,
        "results": results,
    }
    print(
        f"ARM request state at most {arm_peak} B (budget {budget_bytes} B); full cache of the longest {full_longest} B"
    )
    print(
        f"ARM / full: {summary['throughput_ratio_arm_over_full']:.2f}x tokens/s, "
        f"{summary['peak_rss_ratio_arm_over_full']:.2f}x peak RSS"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
