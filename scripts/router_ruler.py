"""Gather the RULER runs at merging budgets that compare reading every bucket with the tree
read of the k-means trees and of the trained trees (M = N_b / 8) into
docs/results/router_ruler.json and docs/router_ruler.png.

Each run is one folder of ``armkv eval ruler --methods arm`` at 8k (runs/ruler/READING-BUDGET-
HAYSTACK, made by the commands in COMMANDS); a cell is scored on the sample ids every reading
of it holds, so the readings are compared on the same samples. Beside each score: the
occupied slots a KV head after the prefill (mean over layers) against the prompt's tokens.

    python scripts/router_ruler.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BYTES = {512: 786_432, 1024: 1_572_864}
TREE = "--option arm.top_m=fixed --option arm.m_fixed=1/8 --option arm.read_rank=tree"
READINGS = {  # folder prefix: (label, options)
    "all": ("every bucket", ""),
    "kmtree": ("k-means tree, M = 8", TREE),
    "trtree": ("trained tree (--read-cost 1), M = 8", f"{TREE} --adapter runs/router-rc1/adapter"),
}
HAYSTACKS = {"noise": "--haystack noise", "prose": "--haystack essay --haystack-file runs/heldout.txt"}
TASKS, SAMPLES = "niah_single_1", 1  # what the runs covered in the time they had
COMMAND = (
    f"armkv eval ruler --methods arm --tasks {TASKS} --lengths 8k {{haystack}} --budget {{budget}} --samples {SAMPLES} "
    "--max-new-tokens 64 {options} --output runs/ruler/{reading}-{budget}-{hay}"
)


def main() -> None:
    cells, commands = {}, {}
    for budget in BYTES:
        for hay, hay_args in HAYSTACKS.items():
            logs = {}
            for reading, (_, options) in READINGS.items():
                folder = ROOT / "runs" / "ruler" / f"{reading}-{budget}-{hay}"
                for path in sorted(folder.glob("arm__*__8192.jsonl")):
                    for line in path.read_text().splitlines():
                        r = json.loads(line)
                        logs.setdefault(r["task"], {}).setdefault(reading, {})[r["id"]] = r
                if folder.is_dir():
                    commands[f"{reading} {budget} {hay}"] = " ".join(
                        COMMAND.format(
                            haystack=hay_args, budget=budget, options=options, reading=reading, hay=hay
                        ).split()
                    )
            for task, by_reading in logs.items():
                if set(by_reading) != set(READINGS):
                    continue
                ids = sorted(set.intersection(*(set(v) for v in by_reading.values())))
                if not ids:
                    continue
                row = {"budget": budget, "budget_bytes_per_layer": BYTES[budget], "haystack": hay, "samples": len(ids)}
                for reading, (label, _) in READINGS.items():
                    got = [by_reading[reading][i] for i in ids]
                    row[label] = {
                        "score": sum(r["score"] for r in got) / len(got),
                        "scores": [r["score"] for r in got],
                        "slots_a_kv_head": sum(r["memory"]["slots_used"] for r in got) / len(got),
                        "prompt_tokens": sum(r["prompt_tokens"] for r in got) / len(got),
                    }
                row["ids"] = ids
                cells[f"{task} 8k {budget} {hay}"] = row
    doc = {
        "setting": "RULER at 8k, default model fp32, arm (chunks of 256, --max-new-tokens 64, seed 42), the default "
        "mixed slots; reading every bucket, or M = 8 of 64 buckets ranked by the tree's read routing "
        "(read_rank=tree): the shipped k-means trees, or runs/router-rc1/adapter from `armkv train --method router "
        "--read-cost 1 --out runs/router-rc1`; each cell on the sample ids all three readings hold (the same "
        "samples); slots_a_kv_head: occupied slots a KV head after the prefill, mean over layers, against "
        "prompt_tokens. Runs on a 2-core CPU shared with four other jobs: about 6-11 minutes a sample.",
        "commands": commands,
        "cells": cells,
    }
    (ROOT / "docs/results/router_ruler.json").write_text(json.dumps(doc, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(cells)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.25
    for i, (label, _) in enumerate(READINGS.values()):
        ax.bar(
            [j + i * width for j in range(len(names))], [cells[n][label]["score"] for n in names], width, label=label
        )
    ax.set_xticks(
        [j + width for j in range(len(names))], [f"{n}\n({cells[n]['samples']} samples)" for n in names], fontsize=7
    )
    ax.set_ylabel("RULER score")
    ax.set_title("RULER at 8k where the pool merges, M = N_b / 8")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ROOT / "docs/router_ruler.png", dpi=120)
    print(json.dumps({n: {label: c[label]["score"] for label, _ in READINGS.values()} for n, c in cells.items()}))


if __name__ == "__main__":
    main()
