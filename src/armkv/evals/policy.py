"""``armkv eval policy``: the top-M the adapter's policy picks, per layer and input.

The paper reports the distribution of M its policy learns (the shipped adapter's policy
picks M = N_b, every bucket, for every input; a trained one may not). Here every input is a window of
a text file; each window's first chunk goes through an ARM cache (the inference path: the
policy reads the mean of the first ``policy_tokens`` pre-RoPE keys of each layer) and the M
each layer picked is recorded. Output: ``policy.json`` (M per layer and input),
``table.md`` (per layer: mean, min, max, share of inputs reading every bucket) and
``policy.png`` (the histogram of M over inputs and layers, and M per layer).

    armkv eval policy --adapter runs/arm/adapter --input held_out.txt --inputs 64 --output policy
"""

from __future__ import annotations

import json
from pathlib import Path

from armkv.errors import ArmkvError, read_text


def add_arguments(parser) -> None:
    parser.add_argument("--adapter", default=None, help="adapter folder, 'calibrated' or 'random' (default: the shipped calibrated one)")
    parser.add_argument("--budget", type=int, default=512, help="token-equivalents per layer")
    parser.add_argument("--input", required=True, help="a UTF-8 text file; consecutive windows of it are the inputs")
    parser.add_argument("--inputs", type=int, default=64, help="how many windows")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per window (the policy reads the first policy_tokens)")
    parser.add_argument("--model", default=None, help="model folder (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--output", default=None, help="folder for policy.json, table.md and policy.png")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def picked_m(model, windows: torch.Tensor, budget: int, adapter: str | None = None) -> tuple[torch.Tensor, int]:
    """M picked by each layer for each window: windows [N, T] ids -> ([layers, N] long, buckets per layer)."""
    import torch

    from armkv.hf.attach import make_cache

    options = {} if adapter is None else {"adapter": adapter}
    cache = make_cache(model, "arm", budget=budget, chunk=windows.shape[1], **options)
    with torch.inference_mode():
        model(input_ids=windows, past_key_values=cache, use_cache=True)
    return torch.stack([layer.m.cpu() for layer in cache.layers]), cache.layers[0].memory.router.num_buckets


def summarise(m: torch.Tensor, num_buckets: int) -> dict:
    """Per-layer and overall statistics of M [layers, N]."""
    import torch

    mf = m.float()
    return {
        "num_buckets": num_buckets,
        "mean": float(mf.mean()),
        "read_share": float(mf.mean() / num_buckets),
        "per_layer": [
            {"layer": i, "mean": float(row.mean()), "min": int(row.min()), "max": int(row.max()),
             "all_buckets": float((row == num_buckets).float().mean())}
            for i, row in enumerate(mf)
        ],
        "histogram": {str(int(k)): int(v) for k, v in zip(*torch.unique(m, return_counts=True))},
    }


def markdown(summary: dict, caption: str) -> str:
    lines = [caption, "", "| layer | mean M | min | max | inputs reading all buckets |", "|---:|---:|---:|---:|---:|"]
    for row in summary["per_layer"]:
        lines.append(f"| {row['layer']} | {row['mean']:.1f} | {row['min']} | {row['max']} | {100 * row['all_buckets']:.0f}% |")
    lines.append(f"| all | {summary['mean']:.1f} | | | |")
    return "\n".join(lines) + "\n"


def plot(m: torch.Tensor, num_buckets: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.hist(m.flatten().numpy(), bins=range(1, num_buckets + 2), align="left", color="tab:blue")
    ax1.set_xlabel(f"M (buckets read, of {num_buckets})")
    ax1.set_ylabel("layer x input")
    ax1.set_title("distribution of M")
    mf = m.float()
    layers = range(m.shape[0])
    ax2.plot(layers, mf.mean(1).numpy(), marker="o", label="mean")
    ax2.fill_between(layers, mf.min(1).values.numpy(), mf.max(1).values.numpy(), alpha=0.3, label="min-max over inputs")
    ax2.set_xlabel("layer")
    ax2.set_ylabel("M")
    ax2.set_ylim(0, num_buckets + 1)
    ax2.set_title("M per layer")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    from armkv.hf.model import load_model

    path = Path(args.input)
    text = read_text(path, "--input")
    if args.inputs < 1 or args.tokens < 1:
        raise ArmkvError("--inputs and --tokens must be at least 1")
    model, tokenizer = load_model(args.model)
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    need = args.inputs * args.tokens
    if ids.numel() < need:
        raise ArmkvError(
            f"--input {path} has {ids.numel()} tokens, fewer than --inputs x --tokens = {need}: lower either"
        )
    windows = ids[:need].view(args.inputs, args.tokens)
    m, num_buckets = picked_m(model, windows, args.budget, args.adapter)
    summary = summarise(m, num_buckets)
    summary.update(adapter=args.adapter or "default", budget=args.budget, inputs=args.inputs, tokens=args.tokens,
                   input=str(path))
    caption = (f"Top-M picked by the policy of adapter {summary['adapter']}, {args.inputs} windows of "
               f"{args.tokens} tokens of {path.name}, {num_buckets} buckets per layer")
    table = markdown(summary, caption)
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "policy.json").write_text(json.dumps({**summary, "m": m.tolist()}, indent=1))
        (out / "table.md").write_text(table)
        plot(m, num_buckets, out / "policy.png", caption if len(caption) < 90 else f"adapter {summary['adapter']}")
    if not args.json:
        print(table)
    print(json.dumps(summary))
    return 0
