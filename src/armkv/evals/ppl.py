"""``armkv eval ppl``: perplexity of a text file under the budgeted chunked protocol.

The text is fed in chunks of P tokens through one cache; every chunk's tokens are scored
while the cache holds only what the method kept of everything before (the same protocol as
generation), so a bounded method pays for what it forgot.

    armkv eval ppl --method arm --budget 512 --input held_out.txt --max-tokens 4096 --json

With ``--windows`` the whole file is cut into consecutive windows of ``--max-tokens`` tokens
(window k: tokens [k N, (k + 1) N) of the file), each scored through a fresh cache: one JSON
line per window, then one with every window's perplexity and their geometric mean. A
difference measured on a text's first N tokens holds or not on the rest of it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from armkv.errors import ArmkvError, read_text


def add_arguments(parser) -> None:
    parser.add_argument("--method", required=True, help="cache method (full, swa, sink, kivi, offload, arm, fifo)")
    parser.add_argument("--budget", type=int, default=512, help="token-equivalents per layer for bounded methods")
    parser.add_argument("--chunk", type=int, default=256, help="P: tokens per forward (the sync point)")
    parser.add_argument(
        "--adapter", default=None, help="arm: adapter folder, 'calibrated' (shipped, the default) or 'random'"
    )
    parser.add_argument("--input", required=True, help="a UTF-8 text file")
    parser.add_argument(
        "--max-tokens", type=int, default=4096, help="score the first N tokens of the file (with --windows: N a window)"
    )
    parser.add_argument(
        "--windows", action="store_true", help="score every consecutive window of N tokens, each with a fresh cache"
    )
    parser.add_argument("--model", default=None, help="model folder (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--json", action="store_true", help="print only the JSON line (with --windows: one a window, then the summary)"
    )
    parser.add_argument(
        "--option",
        action="append",
        default=None,
        metavar="METHOD.KEY=VALUE",
        help="a method option (repeatable), e.g. arm.slot_format=int8 or kivi.bits=2",
    )


def perplexity(model, ids: torch.Tensor, method: str, budget: int | None, chunk: int, on_cache=None, **options) -> dict:
    """Mean next-token NLL of ``ids`` [1, T] fed chunk by chunk through one cache of ``method``;
    ``on_cache(cache)``, if given, sees the cache at the end (e.g. to read what ARM's policy picked)."""
    from armkv.hf.attach import make_cache
    from armkv.hf.compat import cache_arg

    # the text's length is known: a method that plans by length (arm's budget shares) sees it
    cache = make_cache(model, method, budget=budget, chunk=chunk, horizon=ids.shape[1], **options)
    total, count = 0.0, 0
    previous = None  # the logits of the last token of the previous chunk predict this chunk's first
    with torch.inference_mode():
        for start in range(0, ids.shape[1], chunk):
            part = ids[:, start : start + chunk]
            positions = torch.arange(start, start + part.shape[1])[None]
            logits = model(input_ids=part, position_ids=positions, **cache_arg(cache), use_cache=True).logits.float()
            if previous is not None:
                logits = torch.cat([previous, logits], 1)
                targets = part
            else:
                targets = part[:, 1:]
            pred = logits[:, : targets.shape[1]]
            total += float(
                torch.nn.functional.cross_entropy(
                    pred.reshape(-1, pred.shape[-1]), targets.reshape(-1), reduction="sum"
                )
            )
            count += targets.numel()
            previous = logits[:, -1:]
    if on_cache is not None:
        on_cache(cache)
    return {
        "ppl": math.exp(total / max(count, 1)),
        "nll": total / max(count, 1),
        "tokens": count + 1,
        "cache_bytes": cache.peak_bytes(),
    }


def main(args) -> int:
    from armkv.hf.model import load_model
    from armkv.options import options_for
    from armkv.tools.preflight import check_method, check_model_folder, resolve_budget

    check_model_folder(args.model)
    path = Path(args.input)
    text = read_text(path, "--input")
    options = options_for(args.method, args.option, args.adapter)
    budget = resolve_budget(args.method, args.budget)
    check_method(args.method, budget, args.chunk, options, args.model)
    if args.max_tokens < 2:
        raise ArmkvError(f"--max-tokens {args.max_tokens}: score at least 2 tokens")
    model, tokenizer = load_model(args.model)
    ids = tokenizer(text, return_tensors="pt").input_ids
    windows = [(0, ids[:, : args.max_tokens])]
    if args.windows:
        n = args.max_tokens
        windows = [(k * n, ids[:, k * n : (k + 1) * n]) for k in range(ids.shape[1] // n)]
        if not windows:
            raise ArmkvError(f"--input {path}: {ids.shape[1]} tokens, fewer than one window of --max-tokens {n}")
    if windows[0][1].shape[1] < 2:
        raise ArmkvError(f"--input {path}: fewer than 2 tokens to score")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and windows[0][1].shape[1] > limit:
        raise ArmkvError(f"--max-tokens {windows[0][1].shape[1]} is beyond the model's {limit} positions")
    results = []
    for k, (start, window) in enumerate(windows):
        result = perplexity(model, window, args.method, budget, args.chunk, **options)
        result.update(method=args.method, budget=budget, adapter=args.adapter, options=options, input=str(path))
        if args.windows:
            result.update(window=k, first_token=start)
        results.append(result)
        if not args.json:
            where = f" (window {k}, tokens {start}-{start + window.shape[1] - 1})" if args.windows else ""
            print(
                f"{args.method} (budget {budget}): ppl {result['ppl']:.3f} over {result['tokens']} tokens{where}, "
                f"cache {result['cache_bytes'] / 2**20:.1f} MiB"
            )
        if args.windows:
            print(json.dumps(result), flush=True)
    if args.windows:
        ppls = [r["ppl"] for r in results]
        summary = {
            "ppl": ppls,
            "geometric_mean": math.exp(sum(math.log(p) for p in ppls) / len(ppls)),
            "tokens": args.max_tokens,
            "cache_bytes": max(r["cache_bytes"] for r in results),
            "method": args.method,
            "budget": budget,
            "adapter": args.adapter,
            "options": options,
            "input": str(path),
        }
        print(json.dumps(summary))
    else:
        print(json.dumps(results[0]))
    return 0
