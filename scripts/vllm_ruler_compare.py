"""RULER through vLLM beside RULER through armkv's HF path, sample by sample (run in armkv's main
environment, after ``armkv eval ruler`` wrote both folders; docs/serving.md):

    python scripts/vllm_ruler_compare.py --pair noise runs/hf-noise runs/vllm-noise \\
        --pair prose runs/hf-prose runs/vllm-prose --haystack-file heldout.txt --output docs/results/vllm_ruler.json

For every sample both folders scored: whether the two outputs are equal, and both scores. The
engines feed a sample differently in one respect: the HF path prefills the context, then the
question as a second prefill (a chunk of its own); vLLM gets them as one prompt, so its last
chunk holds the context's tail and the question together. Each sample whose outputs differ is
run once more on the HF path with vLLM's layout (the same token ids as one prefill): where
that reproduces vLLM's output word for word, the difference is the chunk layout, not the engine.
With ``--rounding``, each difference left is run once more on the HF path, as the eval runs it,
by the model with every weight moved by one float32 rounding step: where the HF path's own
answer moves, the sample's answer rests on rounding, which the two engines' kernels do differently.
Prints a table and a final JSON line; writes the JSON (with the commands) to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def logs(folder: Path) -> dict:
    """{(label, task, length, id): record} of every scored sample in an eval folder."""
    from armkv.evals.common import SampleLog

    out = {}
    for path in sorted(folder.glob("*__*__*.jsonl")):
        for r in SampleLog(path).records:
            out[(r["label"], r["task"], str(r["length"]), r["id"])] = r
    return out


def settings(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def one_prefill_outputs(keys: list[tuple], config: dict, haystack_file: str | None, rounding: bool = False) -> dict:
    """{key: output} of the HF path with each sample fed as one prefill (vLLM's layout); with
    ``rounding``, fed as the eval feeds it (two prefills) by the model with every weight moved by
    at most one float32 rounding step (x (1 + k 2^-23), k in {-1, 0, 1}, seeded): how far the
    sample's answer depends on rounding, which two engines' kernels do differently."""
    if not keys:
        return {}
    import torch

    from armkv.evals import ruler
    from armkv.hf.model import load_model
    from armkv.hf.runner import Runner
    from armkv.methods.base import get_method
    from armkv.tools.vllm_engine import encode

    model, tokenizer = load_model(None if config["model"] == "default" else config["model"])
    if rounding:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 2.0**-23 * torch.randint(-1, 2, p.shape, generator=g).to(p.dtype))
    words = ruler.load_essay(haystack_file) if haystack_file else None
    override = None if config["haystack"] == "task" else config["haystack"]
    generator = ruler.RulerGenerator(tokenizer, config["seed"], words, None, haystack=override)
    out = {}
    for key in keys:
        label, task, length, sample_id = key
        index = int(sample_id.rsplit("-", 1)[1])
        sample = generator.samples(task, int(length), index + 1, config.get("depths"))[index]
        options = dict(config["options"].get(label, {}))
        budget = config["budget"] if get_method(label).bounded else None
        runner = Runner(model, tokenizer, label, budget=budget, chunk=config["chunk"], **options)
        limit = min(ruler.tokens_to_generate(task), config.get("max_new_tokens") or 10**9)
        if rounding:
            out[key] = runner.generate([sample], max_new_tokens=limit)[0]["output"]
            continue
        ids = encode(tokenizer, sample, config["chat"])
        tokens, _, _ = runner.generate_ids([ids], limit)
        out[key] = tokenizer.decode(tokens, skip_special_tokens=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", nargs=3, action="append", required=True, metavar=("NAME", "HF_DIR", "VLLM_DIR"))
    p.add_argument("--haystack-file", default=None, help="the prose haystack the essay folders were made with")
    p.add_argument(
        "--rounding",
        action="store_true",
        help="re-run each difference the chunk layout does not explain on the HF path with weights moved by one "
        "float32 rounding step, to see whether the sample's answer rests on rounding",
    )
    p.add_argument(
        "--no-rerun", dest="rerun", action="store_false", help="compare only: re-run no difference on the HF path"
    )
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--command", action="append", default=[], help="a command that made the folders (kept in the JSON)")
    args = p.parse_args()

    cells, rows = {}, []
    for name, hf_dir, vllm_dir in args.pair:
        hf_dir, vllm_dir = Path(hf_dir), Path(vllm_dir)
        a, b = settings(hf_dir), settings(vllm_dir)
        if b.get("engine") != "vllm" or a.get("engine", "hf") != "hf":
            sys.exit(f"{name}: {hf_dir} must be an HF-path folder and {vllm_dir} a --engine vllm one")
        if {k: v for k, v in a.items() if k != "engine"} != {k: v for k, v in b.items() if k != "engine"}:
            sys.exit(f"{name}: the folders were made under other settings: {a} vs {b}")
        hf, vl = logs(hf_dir), logs(vllm_dir)
        both = sorted(set(hf) & set(vl))
        differ = [k for k in both if hf[k]["output"] != vl[k]["output"]]
        words = args.haystack_file if a["haystack"] == "essay" else None
        rerun = one_prefill_outputs(differ, a, words) if args.rerun else {}
        left = [k for k in differ if k in rerun and rerun[k] != vl[k]["output"]]
        rounded = one_prefill_outputs(left, a, words, rounding=True) if args.rounding else {}
        for key in both:
            label, task, length, sample_id = key
            row = {
                "haystack": name,
                "method": label,
                "task": task,
                "length": int(length),
                "id": sample_id,
                "equal": hf[key]["output"] == vl[key]["output"],
                "score_hf": hf[key]["score"],
                "score_vllm": vl[key]["score"],
                "output_hf": hf[key]["output"],
                "output_vllm": vl[key]["output"],
                "cache_bytes_hf": hf[key].get("cache_bytes"),
                "cache_bytes_vllm": vl[key].get("cache_bytes"),
            }
            if key in rerun:
                row["output_hf_one_prefill"] = rerun[key]
                row["explained_by_chunk_layout"] = rerun[key] == vl[key]["output"]
            if key in rounded:
                row["output_hf_rounding_moved"] = rounded[key]
                row["hf_answer_moves_with_rounding"] = rounded[key] != hf[key]["output"]
            rows.append(row)
            cell = cells.setdefault(f"{name} {label} {length}", {"samples": 0, "equal": 0, "explained": 0})
            cell["samples"] += 1
            cell["equal"] += row["equal"]
            cell["explained"] += bool(row.get("explained_by_chunk_layout"))
            cell["moves_with_rounding"] = cell.get("moves_with_rounding", 0) + bool(
                row.get("hf_answer_moves_with_rounding")
            )
            cell.setdefault("score_hf", []).append(row["score_hf"])
            cell.setdefault("score_vllm", []).append(row["score_vllm"])
        settings_of = a
    print(
        "| haystack / method / length | samples | equal outputs | differing, explained by the chunk layout "
        "| score HF | score vLLM |"
    )
    print("|---|---|---|---|---|---|")
    for name, c in cells.items():
        c["score_hf"] = round(sum(c["score_hf"]) / c["samples"], 2)
        c["score_vllm"] = round(sum(c["score_vllm"]) / c["samples"], 2)
        print(f"| {name} | {c['samples']} | {c['equal']} | {c['explained']} | {c['score_hf']} | {c['score_vllm']} |")
    total = {
        "samples": len(rows),
        "equal": sum(r["equal"] for r in rows),
        "explained": sum(bool(r.get("explained_by_chunk_layout")) for r in rows),
        "hf_answer_moves_with_rounding": sum(bool(r.get("hf_answer_moves_with_rounding")) for r in rows),
        "unexplained": sum(not r["equal"] and not r.get("explained_by_chunk_layout") for r in rows),
    }
    result = {
        "what": "RULER needle samples through vLLM with armkv's plugin vs armkv's HF path, same samples, same budget",
        "settings": settings_of,
        "commands": args.command + [" ".join(["python", "scripts/vllm_ruler_compare.py", *sys.argv[1:]])],
        "cells": cells,
        "total": total,
        "samples": rows,
    }
    if args.output is not None:
        tmp = args.output.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(args.output)
    print(json.dumps({"total": total, "cells": cells}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
