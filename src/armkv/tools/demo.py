"""``armkv demo``: needle in a haystack, every cache method at one budget.

A few RULER-style samples (noise haystack, one 7-digit magic number) at ~1k, 2k and 4k
tokens; each registered method answers them with the same budget under the budgeted
chunked prefill (the context is compressed before the question is read). Prints a
markdown table (accuracy, cache MB per length) and every method's answer to one 4k sample;
saves ``table.md``, ``results.json`` and ``demo.png`` to --output.

The table has no latency column: a few answers' tokens, timed beside whatever else the
machine runs, measure the machine more than the method. ``armkv bench decode`` measures
decode latency (medians of timed steps after warm-up, one thread, the clock named).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from armkv.errors import ArmkvError

# Where the demo's reader gets latency (the demo does not time its answers: see the module's docstring).
LATENCY = (
    "Decode latency is not measured here: `armkv bench decode --methods {methods} --budget {budget} "
    "--threads 1` times it (medians of timed steps after warm-up, the clock named)."
)

# Shown in this order when registered; any other registered method follows.
PREFERRED = ["full", "swa", "sink", "kivi", "offload", "arm", "fifo"]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "One of the special magic numbers for {key} is: {value}. "
# RULER's niah template, cut where its context goes.
BEFORE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
QUESTION = "\nWhat are all the special magic numbers for {key} mentioned in the provided text?"
ANSWER_PREFIX = " The special magic numbers for {key} mentioned in the provided text are"
KEYS = [
    "tense-lobster",
    "quiet-harbor",
    "amber-falcon",
    "rusty-violin",
    "silver-meadow",
    "brave-comet",
    "lucky-orchid",
    "hollow-summit",
    "gentle-walrus",
    "crimson-maple",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", type=int, default=512, help="token-equivalents per layer, for every bounded method")
    parser.add_argument("--methods", default=None, help="comma-separated methods (default: every registered one)")
    parser.add_argument("--lengths", default="1024,2048,4096", help="context lengths in tokens")
    parser.add_argument(
        "--samples", type=int, default=1, help="samples per length (more: a finer accuracy, a longer run)"
    )
    parser.add_argument(
        "--model", default=None, help="local transformers model folder (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--adapter", default=None, help="ARM parameters for arm-family methods (folder, 'calibrated', 'random')"
    )
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk P")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="most tokens generated per answer")
    parser.add_argument("--seed", type=int, default=0, help="seed of the needles and their depths")
    parser.add_argument("--output", default="armkv-demo", help="folder for table.md, results.json, demo.png")


def make_samples(tokenizer, lengths: list[int], per_length: int, seed: int) -> list[dict]:
    """Needle samples whose context is ``length`` tokens (to a noise repeat), needle at a random depth."""
    rng = random.Random(seed)
    unit = len(tokenizer(NOISE, add_special_tokens=False)["input_ids"])
    samples = []
    for length in lengths:
        for i in range(per_length):
            key, value = rng.choice(KEYS), str(rng.randint(1_000_000, 9_999_999))
            repeats = max(1, (length - 40) // unit)
            depth = rng.randint(0, repeats)
            context = BEFORE + NOISE * depth + NEEDLE.format(key=key, value=value) + NOISE * (repeats - depth)
            samples.append(
                {
                    "id": f"{length}-{i}",
                    "length": length,
                    "context": context,
                    "question": QUESTION.format(key=key),
                    "answer_prefix": ANSWER_PREFIX.format(key=key),
                    "answer": value,
                    "depth": round(depth / repeats, 2),
                }
            )
    return samples


def pick_methods(requested: str | None) -> tuple[list[str], list[str]]:
    """(methods to run, notes about those skipped)."""
    from armkv.methods.base import METHODS, _load_builtin_methods

    _load_builtin_methods()
    registered = [m for m in PREFERRED if m in METHODS] + sorted(set(METHODS) - set(PREFERRED))
    if requested is None:
        notes = [f"{m}: not registered in this build, skipped" for m in PREFERRED if m not in METHODS]
        return registered, notes
    wanted = [m.strip() for m in requested.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in METHODS]
    if unknown:
        raise ArmkvError(f"unknown method(s) {', '.join(unknown)}; choose from: {', '.join(registered)}")
    return wanted, []


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from armkv.hf.model import load_model
    from armkv.hf.runner import Runner
    from armkv.methods.base import METHODS

    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if not lengths or min(lengths) < 64 or args.samples < 1:
        raise ArmkvError("--lengths needs lengths of at least 64 tokens and --samples at least 1")
    methods, notes = pick_methods(args.methods)
    from armkv.tools.preflight import check_budget, check_model_folder, check_output_folder

    check_output_folder(args.output)
    check_model_folder(args.model)
    check_budget(args.budget, args.model)
    model, tokenizer = load_model(args.model)
    samples = make_samples(tokenizer, lengths, args.samples, args.seed)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)

    rows, answers = [], {}
    started = time.perf_counter()
    bar = tqdm(total=len(methods) * len(samples), desc="demo", unit="sample")
    for method in methods:
        bounded = METHODS[method].bounded
        options = {"adapter": args.adapter} if args.adapter is not None and method in ("arm", "fifo") else {}
        try:
            runner = Runner(
                model,
                tokenizer,
                method,
                budget=args.budget if bounded else None,
                chunk=args.chunk,
                chat=True,
                **options,
            )
        except ArmkvError as e:
            notes.append(f"{method}: skipped ({e})")
            bar.update(len(samples))
            continue
        results = []
        for sample in samples:
            bar.set_postfix_str(f"{method} {sample['id']}")
            (result,) = runner.generate([sample], max_new_tokens=args.max_new_tokens)
            result.update(
                length=sample["length"], answer=sample["answer"], correct=sample["answer"] in result["output"]
            )
            results.append(result)
            bar.update(1)
        rows.append(summarise(method, bounded, results, lengths))
        longest = [r for r in results if r["length"] == max(lengths)][0]
        answers[method] = longest
    bar.close()
    elapsed = time.perf_counter() - started

    table = format_table(rows, lengths, args.budget)
    example = [s for s in samples if s["length"] == max(lengths)][0]
    lines = [
        table,
        "",
        f"Answers to sample {example['id']} (needle {example['answer']} at depth {example['depth']}):",
        "",
    ]
    lines += [f"- **{m}**: {json.dumps(r['output'].strip())}" for m, r in answers.items()]
    lines += [""] + [f"- note: {n}" for n in notes]
    lines += ["", f"{len(methods)} methods x {len(samples)} samples in {elapsed:.0f} s on {model.device}."]
    lines += [LATENCY.format(methods=",".join(r["method"] for r in rows), budget=args.budget)]
    report = "\n".join(lines)
    print(report)
    (out_dir / "table.md").write_text(report + "\n", encoding="utf-8")
    (out_dir / "results.json").write_text(
        json.dumps(
            {"budget": args.budget, "lengths": lengths, "rows": rows, "answers": answers, "notes": notes}, indent=2
        )
        + "\n",
        encoding="utf-8",
    )
    plot(rows, lengths, args.budget, out_dir / "demo.png")
    print(f"saved {out_dir / 'table.md'}, {out_dir / 'results.json'}, {out_dir / 'demo.png'}", file=sys.stderr)
    return 0


def summarise(method: str, bounded: bool, results: list[dict], lengths: list[int]) -> dict:
    return {
        "method": method,
        "bounded": bounded,
        "accuracy": 100.0 * sum(r["correct"] for r in results) / len(results),
        "accuracy_by_length": {
            n: 100.0 * sum(r["correct"] for r in results if r["length"] == n) / sum(r["length"] == n for r in results)
            for n in lengths
        },
        "cache_mb_by_length": {n: max(r["cache_bytes"] for r in results if r["length"] == n) / 2**20 for n in lengths},
    }


def format_table(rows: list[dict], lengths: list[int], budget: int) -> str:
    head = ["method", "budget", "accuracy %"] + [f"cache MB @{n}" for n in lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["method"], str(budget) if r["bounded"] else "-", f"{r['accuracy']:.0f}"]
        cells += [f"{r['cache_mb_by_length'][n]:.1f}" for n in lengths]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], lengths: list[int], budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["method"] for r in rows]
    left.bar(names, [r["accuracy"] for r in rows], color="tab:blue")
    left.set_ylabel("needle accuracy (%)")
    left.set_ylim(0, 105)
    left.set_title(f"needle in a haystack, budget {budget}")
    for r in rows:
        right.plot(lengths, [r["cache_mb_by_length"][n] for n in lengths], marker="o", label=r["method"])
    right.set_xlabel("context tokens")
    right.set_ylabel("peak cache (MB)")
    right.set_title("cache size against context length")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
