"""Gather the ``armkv eval reads`` runs that compare the k-means tree's read, the trained
tree's read and ``partial`` into docs/results/router_reads.json and docs/router_reads.png.

Each run is one folder of ``armkv eval reads --ranks tree,partial --page-split 1`` (its
``summary.json`` and ``reads.jsonl``); the runs and the commands that made them are listed
in RUNS: the k-means trees (the shipped adapter), the trees of ``armkv train --method router
--out runs/router`` and those of ``armkv train --method router --read-cost 1 --out
runs/router-rc1``. ``python scripts/router_results.py`` rewrites both files from the folders
under ``runs/``; a run whose folder is absent keeps its entry as the file holds it.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = "armkv eval reads --tasks niah_single_1 --lengths 8k --samples 1 --ranks tree,partial --page-split 1"
PROSE = "--haystack essay --haystack-file heldout.txt"
TREES = {  # name: (folder prefix, adapter)
    "kmeans": ("km", None),
    "trained": ("tr", "runs/router/adapter"),
    "readcost": ("rc1", "runs/router-rc1/adapter"),
}
RUNS = {
    f"{tree} {budget} {haystack}": (
        f"runs/reads-{TREES[tree][0]}-{budget}-{haystack}",
        f"{COMMON} {'--haystack noise' if haystack == 'noise' else PROSE} --budget {budget}"
        + (f" --adapter {TREES[tree][1]}" if TREES[tree][1] else "")
        + f" --output reads-{TREES[tree][0]}-{budget}-{haystack}",
    )
    for tree in TREES
    for budget in (512, 1024)
    for haystack in ("noise", "prose")
}
BYTES = {512: 786_432, 1024: 1_572_864}
DECODE = (
    "armkv bench decode --methods arm --budget 4096 --lengths 4096 --gen-lengths 4 --repeats 16 --warmup 2 "
    "--threads 1 --clock process --prompt-file heldout.txt --option arm.slot_mixing=false --option arm.top_m=fixed "
    "--option arm.m_fixed=1/8"
)
DECODE_RUNS = {  # the decode read's cost: name -> (folder, command); the tree's run first, then partial's
    "trained tree (--read-cost 1), M = 8": (
        "runs/bench-tree",
        f"{DECODE} --option arm.read_rank=tree --adapter runs/router-rc1/adapter --output bench-tree",
    ),
    "partial, pages, M = 8": (
        "runs/bench-partial",
        f"{DECODE} --option arm.read_rank=partial --option arm.read_pages=true --output bench-partial",
    ),
}
FIELDS = ("read_ms_per_token", "paired_read_ms_per_token", "dense_read_ms_per_token", "read_share", "cache_bytes")


def decode() -> None:
    """docs/results/router_decode.json from the two bench decode runs (when both are there)."""
    runs = {}
    for name, (folder, command) in DECODE_RUNS.items():
        path = ROOT / folder / "results.json"
        if not path.is_file():
            return
        result = json.loads(path.read_text())
        runs[name] = {"command": command, **{f: result[f]["arm"]["4096"] for f in FIELDS}}
    tree, partial = runs.values()
    doc = {
        "setting": "whole-model decode, default model fp32, one thread, process clock, budget 4,096 (6,291,456 "
        "bytes a layer), a 4k prompt of held-out prose (python -m armkv.train.data heldout heldout.txt), unmixed "
        "slots, M = 8 of 64; the two runs one after the other on a 2-core CPU shared with four other jobs. "
        "read_ms_per_token: ARM's reads of its memory, summed over the 30 layers; paired / dense: the same steps' "
        "read and a dense read of every bucket timed beside it; read_share: occupied slots the reads touched.",
        "runs": runs,
        "ratio_read_ms_partial_over_tree": partial["read_ms_per_token"] / tree["read_ms_per_token"],
    }
    (ROOT / "docs/results/router_decode.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({"ratio_read_ms_partial_over_tree": doc["ratio_read_ms_partial_over_tree"]}))


def main() -> None:
    old = json.loads((ROOT / "docs/results/router_reads.json").read_text())
    out, commands = {}, {}
    for name, (folder, command) in RUNS.items():
        path = ROOT / folder / "summary.json"
        if not path.is_file():
            if name in old["summary"]:
                out[name], commands[name] = old["summary"][name], old["commands"][name]
            continue
        summary = json.loads(path.read_text())
        records = [json.loads(line) for line in (ROOT / folder / "reads.jsonl").read_text().splitlines()]
        tree, budget, haystack = name.split()
        out[name] = {
            "budget": int(budget),
            "budget_bytes_per_layer": BYTES[int(budget)],
            "haystack": haystack,
            "samples": len(records),
            "tokens": sum(r["tokens"] for r in records) / len(records),
            "slots_per_kv_head": sum(r["slots"] for r in records) / len(records),
            "m": records[0]["m"],
            "num_buckets": records[0]["num_buckets"],
            "settings": {
                setting: {k: row[k] for k in ("mean", "p90", "over_10pct", "read_share", "bytes_per_token", "error")}
                for setting, row in summary.items()
            },
        }
        commands[name] = command
    doc = {
        "setting": "armkv eval reads on RULER niah_single_1 at 8k (seed 42), default model fp32, arm reading every "
        "bucket on unmixed slots; at every decode step of the question and the teacher-forced answer, each query "
        "head's share of the full read's attention on the slots a read of M = N_b / 8 buckets would skip: the tree's "
        "read routing (the shipped k-means trees; runs/router/adapter from `armkv train --method router "
        "--out runs/router`; runs/router-rc1/adapter from `armkv train --method router --read-cost 1 --out "
        "runs/router-rc1`) and partial (pages of the mean bucket, a quarter of the key-code rows); bytes one layer "
        "reads for one decoded token (armkv.evals.read_cost).",
        "commands": commands,
        "summary": out,
    }
    (ROOT / "docs/results/router_reads.json").write_text(json.dumps(doc, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    cells = sorted({" ".join(n.split()[1:]) for n in out})
    width = 0.2
    bars = [
        ("k-means tree", "kmeans", "tree"),
        ("trained tree", "trained", "tree"),
        ("trained tree, --read-cost 1", "readcost", "tree"),
        ("partial (k-means adapter)", "kmeans", "partial, pages/1, rows 0.25"),
    ]
    for i, (label, tree, setting) in enumerate(bars):
        values = [100 * out.get(f"{tree} {c}", {}).get("settings", {}).get(setting, {}).get("mean", 0) for c in cells]
        ax.bar([j + i * width for j in range(len(cells))], values, width, label=label)
    ax.set_xticks([j + width * (len(bars) - 1) / 2 for j in range(len(cells))], [f"budget {c}" for c in cells])
    ax.set_ylabel("full read's attention missed (%)")
    ax.set_title("M = N_b / 8 at 8k, niah_single_1")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ROOT / "docs/router_reads.png", dpi=120)
    print(json.dumps({n: {s: round(v["mean"], 4) for s, v in r["settings"].items()} for n, r in out.items()}))
    decode()


if __name__ == "__main__":
    main()
