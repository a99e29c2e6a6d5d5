"""ARM through vLLM beside vLLM's own full cache, on the same concurrent requests (run in vLLM's
environment, docs/serving.md):

    python scripts/bench_vllm.py --requests 16 --min-tokens 2048 --max-tokens 8192 --new 16 --budget 512 \
        [--output docs/results/vllm_concurrency.json]

Each engine runs in a process of its own (vLLM loads its plugins once a process), on the same
prompts (random token ids, lengths spread evenly over [min, max]), all submitted at once, and
with a KV pool sized for its own requests (``--kv-slack`` over what they need: the full cache
every token of every request, ARM one block per request and layer), so peak memory compares
what each engine needs. Prints each engine's tokens/s (prompt and generated tokens over the
wall time of the batch), the worker's peak resident memory and the KV bytes the requests
hold; for ARM each request's state at its peak over every step (summed over the layers)
beside its budget's bytes and its vLLM blocks, and whether any request keeps a tensor outside
its blocks; the ratios; and a final JSON line (also written to ``--output`` with the command).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def worker_stats(worker) -> dict:
    """Peak RSS and, per ARM request (by its state block): the peak of its memory summed over the
    layers, its blocks' bytes, and the tensors it keeps outside its blocks."""
    import resource

    from armkv.memory.arena import within
    from armkv.vllm.backend import ARMAttention
    from armkv.vllm.feed import held_tensors

    layers = [m for m in worker.model_runner.model.modules() if isinstance(m, ARMAttention)]
    peaks: dict[int, int] = {}
    blocks: dict[int, int] = {}
    outside: list[str] = []
    for layer in layers:
        for state, memory in layer.impl.memories.items():
            peaks[state] = peaks.get(state, 0) + memory.layer.peak_bytes
            if layer.arm_plan.placed:  # (one block a request, every layer's state in its own bytes of it)
                blocks[state] = layer.impl.block(layer.kv_cache, state).nbytes
                own = layer.impl.storage(layer, layer.kv_cache, state)
                outside += [
                    f"{layer.layer_name}:{state}:{p}" for p, t in held_tensors(memory).items() if not within(t, own)
                ]
    return {
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "arm_request_peaks": peaks,
        "arm_request_block_bytes": blocks,
        "arm_tensors_outside_blocks": outside[:20],
    }


def forget_warmup(worker) -> None:
    """Drop the warm-up request's memories (their peaks would count as a request of the run)."""
    from armkv.vllm.backend import ARMAttention

    for m in worker.model_runner.model.modules():
        if isinstance(m, ARMAttention):
            m.impl.memories.clear()


def prompts_for(args) -> list[list[int]]:
    import torch

    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(args.min_tokens, args.max_tokens, args.requests).long().tolist()
    return [torch.randint(min(100, vocab // 4), min(40000, vocab), (n,), generator=g).tolist() for n in lengths]


def one_engine(args) -> None:
    if args.arm:
        os.environ["ARMKV_VLLM"] = args.arm
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams, TokensPrompt

    prompts = prompts_for(args)
    lengths = [len(p) for p in prompts]
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=args.max_tokens + args.new,
        max_num_seqs=args.requests,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=args.kv_bytes,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    # warm-up, untimed: one short request (loads, or builds once a machine, armkv's fused kernels)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:300])], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.collective_rpc(forget_warmup)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=True)
    seconds = time.perf_counter() - start
    stats = llm.collective_rpc(worker_stats)[0]
    new = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "seconds": seconds,
        "tokens_per_s": (sum(lengths) + new) / seconds,
        "generated_per_s": new / seconds,
        "prompt_tokens": lengths,
        "generated_tokens": new,
        "kv_pool_bytes": args.kv_bytes,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        **stats,
    }
    print("RESULT " + json.dumps(result), flush=True)


def plot(summary: dict, path: str) -> None:
    """The run's figures as bars, ARM beside vLLM's full cache: tokens/s, peak RSS, KV bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, labels = ("vllm_full", "arm"), ("vLLM, full cache", f"vLLM + ARM, budget {summary['budget']}")
    panels = [
        ("tokens/s (prompt + generated)", [summary["tokens_per_s"][n] for n in names]),
        ("worker peak RSS (GiB)", [summary["peak_rss_bytes"][n] / 2**30 for n in names]),
        ("KV memory of the requests (GiB)", [summary["kv_bytes"][n] / 2**30 for n in names]),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for ax, (title, values) in zip(axes, panels):
        ax.bar(labels, values, color=["tab:gray", "tab:blue"])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8)
    lengths = summary["prompt_tokens"]
    fig.suptitle(
        f"{summary['requests']} concurrent requests of {min(lengths):,}-{max(lengths):,} tokens, "
        f"{summary['new_tokens']} generated each ({summary['model']}, float32, CPU)",
        fontsize=10,
    )
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.expanduser("~/.cache/armkv/models/smollm2-135m-instruct"))
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--min-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--kv-slack", type=float, default=1.1, help="each engine's KV pool over what its requests need")
    p.add_argument(
        "--output", default=None, help="also write the result JSON here (with the command), and its plot beside it"
    )
    p.add_argument(
        "--plot", default=None, metavar="JSON", help="only draw the plot of a result JSON (needs matplotlib)"
    )
    p.add_argument("--figure", default=None, metavar="PNG", help="where the plot goes (default: beside the JSON)")
    p.add_argument("--kv-bytes", type=int, default=0, help=argparse.SUPPRESS)  # (the child's pool)
    p.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # (the child process's setting)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return one_engine(args)
    if args.plot:
        out = args.figure or os.path.splitext(args.plot)[0] + ".png"
        plot(json.load(open(args.plot)), out)
        return print(f"bench_vllm: wrote {out}")
    config = json.load(open(os.path.join(args.model, "config.json")))
    longest = config.get("max_position_embeddings")
    if longest and args.max_tokens + args.new > longest:
        sys.exit(
            f"bench_vllm: --max-tokens + --new ({args.max_tokens + args.new}) exceeds the model's {longest} positions"
        )
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    layers = config["num_hidden_layers"]
    token_bytes = 2 * config.get("num_key_value_heads", heads) * head_dim * 4  # one token, one layer, float32
    lengths = [len(x) for x in prompts_for(args)]
    full_kv = sum(n + args.new for n in lengths) * token_bytes * layers  # every token of every request
    budget_bytes = args.budget * token_bytes * layers  # one request's budget, all layers
    arm_setting = json.dumps({"method": "arm", "budget": args.budget})
    # ARM's pool: one block per request and layer; a block is at most the budget's bytes of the
    # largest layer share plus its bookkeeping, bounded here by twice the budget (the run reports the blocks)
    arm_pool = args.requests * 2 * budget_bytes
    results = {}
    base = [sys.executable, __file__, "--child", "--model", args.model, "--requests", str(args.requests)]
    base += ["--min-tokens", str(args.min_tokens), "--max-tokens", str(args.max_tokens), "--new", str(args.new)]
    runs = (
        ("arm", ["--kv-bytes", str(int(arm_pool * args.kv_slack)), "--arm", arm_setting]),
        ("vllm_full", ["--kv-bytes", str(int(full_kv * args.kv_slack))]),
    )
    for name, extra in runs:
        print(f"bench_vllm: {name} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(base + extra, stdout=subprocess.PIPE, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"bench_vllm: the {name} engine failed (its log is above)")
        results[name] = json.loads(lines[-1][7:])
        r = results[name]
        print(
            f"{name:10s} {r['seconds']:8.1f} s  {r['tokens_per_s']:8.1f} tok/s  "
            f"peak RSS {r['max_rss_bytes'] / 2**30:.2f} GiB  KV pool {r['kv_pool_bytes'] / 2**30:.2f} GiB",
            flush=True,
        )
    arm = results["arm"]
    arm_peak = max(arm["arm_request_peaks"].values())
    arm_blocks = max(arm["arm_request_block_bytes"].values())
    same = sum(a == b for a, b in zip(arm["tokens"], results["vllm_full"]["tokens"]))
    summary = {
        "command": "python scripts/bench_vllm.py " + " ".join(sys.argv[1:]),
        "model": os.path.basename(args.model.rstrip("/")),
        "requests": args.requests,
        "prompt_tokens": lengths,
        "new_tokens": args.new,
        "budget": args.budget,
        "tokens_per_s": {k: r["tokens_per_s"] for k, r in results.items()},
        "seconds": {k: r["seconds"] for k, r in results.items()},
        "peak_rss_bytes": {k: r["max_rss_bytes"] for k, r in results.items()},
        "kv_bytes": {"vllm_full": full_kv, "arm": arm_blocks * args.requests},
        "throughput_ratio_arm_over_full": arm["tokens_per_s"] / results["vllm_full"]["tokens_per_s"],
        "peak_rss_ratio_arm_over_full": arm["max_rss_bytes"] / results["vllm_full"]["max_rss_bytes"],
        "kv_bytes_ratio_arm_over_full": arm_blocks * args.requests / full_kv,
        "arm_request_peak_bytes": arm_peak,
        "arm_request_block_bytes": arm_blocks,
        "arm_budget_bytes": budget_bytes,
        "arm_requests_within_budget": sum(v <= budget_bytes for v in arm["arm_request_peaks"].values()),
        "arm_tensors_outside_blocks": arm["arm_tensors_outside_blocks"],
        "requests_with_full_cache_tokens": same,
    }
    print(
        f"ARM request state at most {arm_peak:,} B over every step (budget {budget_bytes:,} B, its vLLM blocks "
        f"{arm_blocks:,} B); {summary['arm_requests_within_budget']}/{len(arm['arm_request_peaks'])} requests within "
        f"budget; tensors outside blocks: {len(arm['arm_tensors_outside_blocks'])}"
    )
    print(
        f"ARM / full: {summary['throughput_ratio_arm_over_full']:.2f}x tokens/s, "
        f"{summary['peak_rss_ratio_arm_over_full']:.2f}x peak RSS, "
        f"{summary['kv_bytes_ratio_arm_over_full']:.3f}x KV bytes"
    )
    line = json.dumps(summary)
    if args.output:
        tmp = args.output + ".tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps({**summary, "results": results}, indent=1) + "\n")
        os.replace(tmp, args.output)
        try:
            plot(summary, args.figure or os.path.splitext(args.output)[0] + ".png")
        except ImportError:  # (vLLM's environment has no matplotlib)
            print(f"bench_vllm: plot it in armkv's main environment: python scripts/bench_vllm.py --plot {args.output}")
    print(line)


if __name__ == "__main__":
    main()
