"""``armkv eval policy``: the top-M the adapter's policy picks, and what it buys.

The histogram: the paper reports the distribution of M its policy learns (the shipped
adapter's policy picks M = N_b, every bucket, for every input; one fitted by ``armkv train
--method policy`` does not). Every input is a window of a text file; each window's first
chunk goes through an ARM cache (the inference path: the policy reads the mean of the first
``policy_tokens`` pre-RoPE keys of each layer) and the M each layer picked is recorded.
Output: ``policy.json`` (M per layer and input), ``table.md`` (per layer: mean, min, max,
share of inputs reading every bucket) and ``policy.png`` (the histogram of M over inputs
and layers, and M per layer).

    armkv eval policy --adapter runs/policy/adapter --input held_out.txt --inputs 64 --output policy

The curve (``--fixed``): quality against read cost. Each adapter given (its policy's M) and
each fixed M (the shipped adapter with ``top_m=fixed``) scores the same windows of the text
by perplexity under the budgeted chunked protocol (``armkv eval ppl``); its read cost is the
mean share of buckets its queries read (M / N_b over layers and windows). Each learned point
is set beside the fixed curve at the same cost (linear between the two nearest fixed M).
Output: ``curve.json`` (written after every point; a re-run with the same settings resumes),
``curve.md`` and ``curve.png``.

    armkv eval policy --fixed 8,16,32,48,64 --adapter runs/p90/adapter --adapter runs/p95/adapter \
        --input held_out.txt --inputs 3 --tokens 2048 --output curve
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from armkv.errors import ArmkvError, read_text

if TYPE_CHECKING:
    import torch


def add_arguments(parser) -> None:
    parser.add_argument(
        "--adapter",
        action="append",
        default=None,
        help="adapter folder, 'calibrated' or 'random' (default: the shipped calibrated one); "
        "with --fixed, repeatable: each is a learned point of the curve",
    )
    parser.add_argument(
        "--fixed",
        default=None,
        metavar="M,M,...",
        help="draw the curve of perplexity against read cost: these fixed M beside each --adapter's policy",
    )
    parser.add_argument("--chunk", type=int, default=256, help="with --fixed: P, the prefill chunk of the perplexity")
    parser.add_argument("--budget", type=int, default=512, help="token-equivalents per layer")
    parser.add_argument("--input", required=True, help="a UTF-8 text file; consecutive windows of it are the inputs")
    parser.add_argument("--inputs", type=int, default=64, help="how many windows")
    parser.add_argument(
        "--tokens", type=int, default=256, help="tokens per window (the policy reads the first policy_tokens)"
    )
    parser.add_argument("--model", default=None, help="model folder (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--output", default=None, help="folder for policy.json, table.md and policy.png")
    parser.add_argument(
        "--option",
        action="append",
        default=None,
        metavar="arm.KEY=VALUE",
        help="an arm option (repeatable) for every point and the histogram, e.g. arm.read_rank=tree; "
        "with --fixed not top_m or m_fixed, which the fixed points set",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def picked_m(
    model, windows: torch.Tensor, budget: int, adapter: str | None = None, options: dict | None = None
) -> tuple[torch.Tensor, int]:
    """M picked by each layer for each window: windows [N, T] ids -> ([layers, N] long, buckets per layer).
    ``options``: other arm options (``--option``)."""
    import torch

    from armkv.hf.attach import make_cache
    from armkv.hf.compat import cache_arg

    options = dict(options or {}) if adapter is None else {**(options or {}), "adapter": adapter}
    cache = make_cache(model, "arm", budget=budget, chunk=windows.shape[1], **options)
    with torch.inference_mode():
        model(input_ids=windows, **cache_arg(cache), use_cache=True)
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
            {
                "layer": i,
                "mean": float(row.mean()),
                "min": int(row.min()),
                "max": int(row.max()),
                "all_buckets": float((row == num_buckets).float().mean()),
            }
            for i, row in enumerate(mf)
        ],
        "histogram": {str(int(k)): int(v) for k, v in zip(*torch.unique(m, return_counts=True))},
    }


def markdown(summary: dict, caption: str) -> str:
    lines = [caption, "", "| layer | mean M | min | max | inputs reading all buckets |", "|---:|---:|---:|---:|---:|"]
    for row in summary["per_layer"]:
        lines.append(
            f"| {row['layer']} | {row['mean']:.1f} | {row['min']} | {row['max']} | {100 * row['all_buckets']:.0f}% |"
        )
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


def parse_fixed(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ArmkvError(f"--fixed {text!r}: give bucket counts of at least 1, comma-separated, e.g. 8,16,32,64")
    return sorted(set(values))


def fixed_at(points: list[dict], share: float) -> float | None:
    """Perplexity of the fixed-M curve at a read share: linear between the two nearest fixed
    points around it (None outside their range)."""
    pts = sorted((p["read_share"], p["ppl"]) for p in points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= share <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (share - x0) / (x1 - x0)
    return None


def read_share(cache) -> float:
    """Mean share of buckets the ARM layers' queries read (M / N_b over layers and batch rows)."""
    shares = [float(layer.m.float().mean()) / layer.memory.router.num_buckets for layer in cache.layers]
    return sum(shares) / len(shares)


def curve_point(model, windows: list, budget: int, chunk: int, options: dict) -> dict:
    """Perplexity (geometric mean over windows) and read share of one ARM setting."""
    import math

    from armkv.evals.ppl import perplexity

    ppls, shares, cache_bytes = [], [], 0
    for window in windows:
        result = perplexity(
            model, window, "arm", budget, chunk, on_cache=lambda c: shares.append(read_share(c)), **options
        )
        ppls.append(result["ppl"])
        cache_bytes = max(cache_bytes, result["cache_bytes"])
    return {
        "ppl": math.exp(sum(math.log(p) for p in ppls) / len(ppls)),
        "ppls": ppls,
        "read_share": sum(shares) / len(shares),
        "cache_bytes": cache_bytes,
    }


def curve_done(args, path: Path) -> tuple[dict, dict[str, dict]]:
    """The curve's settings, and the points an earlier run with the same settings left in
    ``--output`` (other settings there are a one-line error, before the model loads)."""
    from armkv.tools.results import compare_settings

    settings = {
        "budget": args.budget,
        "chunk": args.chunk,
        "input": str(path),
        "inputs": args.inputs,
        "tokens": args.tokens,
    }
    if args.option:  # (a curve made without options keeps its settings as they were)
        settings["options"] = arm_options(args)
    out = Path(args.output) if args.output else None
    if out is None or not (out / "curve.json").is_file():
        return settings, {}
    try:
        old = json.loads((out / "curve.json").read_text())
    except json.JSONDecodeError:
        raise ArmkvError(f"{out / 'curve.json'} is not JSON: pass another --output or delete it") from None
    compare_settings(old.get("settings", {}), settings, str(out / "curve.json"))
    return settings, {r["label"]: r for r in old.get("rows", [])}


def main_curve(args, model, windows: list, path: Path, settings: dict, done: dict[str, dict]) -> int:
    from tqdm.auto import tqdm

    from armkv.memory.module import _atomic_write
    from armkv.tools.report import curve_markdown, plot_curve

    fixed = parse_fixed(args.fixed)
    out = Path(args.output) if args.output else None
    extra = arm_options(args)
    points = [(f"M={m}", "fixed", {**extra, "top_m": "fixed", "m_fixed": m}) for m in fixed]
    points += [
        (Path(a).parent.name if Path(a).name == "adapter" else Path(a).name, "learned", {**extra, "adapter": a})
        for a in (args.adapter or [])
    ]
    rows = []
    for label, kind, options in tqdm(points, desc="curve", unit="point"):
        row = done.get(label)
        if row is None or row.get("options") != options:
            row = {
                "label": label,
                "kind": kind,
                "options": options,
                **curve_point(model, windows, args.budget, args.chunk, options),
            }
        rows.append(row)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            _atomic_write(
                out / "curve.json",
                lambda tmp: Path(tmp).write_text(json.dumps({"settings": settings, "rows": rows}, indent=1)),
            )
    fixed_rows = [r for r in rows if r["kind"] == "fixed"]
    for r in rows:
        if r["kind"] == "learned":
            r["fixed_at_same_share"] = fixed_at(fixed_rows, r["read_share"])
    caption = (
        f"Perplexity against buckets read, arm at budget {args.budget} ({rows[0]['cache_bytes']:,} cache bytes at "
        "most), "
        f"{len(windows)} windows of {args.tokens} tokens of {path.name}"
    )
    table = curve_markdown(rows, caption)
    summary = {"settings": settings, "rows": rows}
    if out is not None:
        _atomic_write(out / "curve.json", lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=1)))
        (out / "curve.md").write_text(table)
        plot_curve(rows, out / "curve.png", f"arm, budget {args.budget}: perplexity against read cost")
    if not args.json:
        print(table)
    print(json.dumps(summary))
    return 0


def arm_options(args) -> dict:
    """``--option arm.KEY=VALUE`` as arm's options (checked: another method's, an adapter, or
    with --fixed the top-M keys the fixed points set, are one-line errors)."""
    from armkv.options import options_for

    options = options_for("arm", args.option)
    if "adapter" in options:
        raise ArmkvError("--option arm.adapter=...: give the adapter with --adapter")
    if args.fixed is not None and {"top_m", "m_fixed"} & set(options):
        raise ArmkvError("--option arm.top_m / arm.m_fixed: with --fixed the fixed points set them; drop the option")
    return options


def main(args) -> int:
    from armkv.hf.model import load_model
    from armkv.tools.preflight import check_method, check_model_folder, check_output_folder

    if args.output:
        check_output_folder(args.output)
    check_model_folder(args.model)
    path = Path(args.input)
    text = read_text(path, "--input")
    options = arm_options(args)
    check_method("arm", args.budget, args.chunk, options, args.model)
    if args.inputs < 1 or args.tokens < 1:
        raise ArmkvError("--inputs and --tokens must be at least 1")
    if args.fixed is not None:
        parse_fixed(args.fixed)
        for a in args.adapter or []:
            if a not in ("calibrated", "random") and not Path(a).is_dir():
                raise ArmkvError(f"--adapter {a}: not a folder (an adapter folder, 'calibrated' or 'random')")
        curve = curve_done(args, path)
    elif args.adapter and len(args.adapter) > 1:
        raise ArmkvError("--adapter is given more than once: the histogram is of one adapter (several go with --fixed)")
    model, tokenizer = load_model(args.model)
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    need = args.inputs * args.tokens
    if ids.numel() < need:
        raise ArmkvError(
            f"--input {path} has {ids.numel()} tokens, fewer than --inputs x --tokens = {need}: lower either"
        )
    windows = ids[:need].view(args.inputs, args.tokens)
    if args.fixed is not None:
        return main_curve(args, model, [w.view(1, -1) for w in windows], path, *curve)
    adapter = args.adapter[0] if args.adapter else None
    m, num_buckets = picked_m(model, windows, args.budget, adapter, options)
    summary = summarise(m, num_buckets)
    summary.update(
        adapter=adapter or "default",
        budget=args.budget,
        inputs=args.inputs,
        tokens=args.tokens,
        input=str(path),
        **({"options": options} if options else {}),
    )
    caption = (
        f"Top-M picked by the policy of adapter {summary['adapter']}, {args.inputs} windows of "
        f"{args.tokens} tokens of {path.name}, {num_buckets} buckets per layer"
    )
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
