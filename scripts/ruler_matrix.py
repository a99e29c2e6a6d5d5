"""One RULER table from the per-sample logs of several `armkv eval ruler` / `eval ablation`
output folders: per haystack, a row per method and a column per (task, length), each cell
the mean score, its sample count and the folder it came from. A later folder's cell replaces
an earlier one's (list the folders oldest first); a folder's `config.json` names its haystack
(ablation folders: `--haystack` says which), and `--label ROW=METHOD` maps an ablation row
(e.g. learned-M, the default ARM) to a method. Folders run with other settings than the
first one (budget, chunk, seed, generation cap, chat) are refused.

    python scripts/ruler_matrix.py docs/figures/s8-ruler-noise-2k docs/figures/s10-ruler/noise-8k \\
        --tasks niah_multikey_1,niah_multivalue,niah_multiquery --output docs/figures/s10-ruler/matrix

Prints the markdown tables and, last, one JSON line {haystack: {method: {task@length: {score, n, source}}}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

SAME = ("model", "budget", "chunk", "chat", "seed")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--tasks", default=None, help="comma-separated tasks to show (default: all found)")
    p.add_argument("--methods", default="full,arm,kivi,sink,swa", help="rows shown, in this order (default: %(default)s)")
    p.add_argument("--label", action="append", default=["learned-M=arm"], help="ROW=METHOD for ablation folders")
    p.add_argument("--haystack", default="essay", help="haystack of ablation folders, whose config does not say (default: essay)")
    p.add_argument("--output", type=Path, default=None, help="folder for matrix.md and matrix.json")
    a = p.parse_args()
    labels = dict(item.split("=", 1) for item in a.label)
    cells: dict = {}
    first = None
    for folder in a.folders:
        config = json.loads((folder / "config.json").read_text())
        settings = {k: config.get(k) for k in SAME}
        first = first or (folder, settings)
        if settings != first[1]:
            raise SystemExit(f"{folder}: settings {settings} differ from {first[0]}'s {first[1]}")
        haystack = config.get("haystack") or a.haystack
        for log in sorted(folder.glob("*.jsonl")):
            records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
            if not records:
                continue
            row = records[0].get("label") or records[0]["method"]
            row = labels.get(row, row)
            key = f"{records[0]['task']}@{records[0]['length']}"
            cells.setdefault(haystack, {}).setdefault(row, {})[key] = {
                "score": round(statistics.mean(r["score"] for r in records), 2),
                "n": len(records),
                "bytes": max(r["cache_bytes"] for r in records),
                "source": str(folder),
                "max_new_tokens": config.get("max_new_tokens"),
            }
    tasks = a.tasks.split(",") if a.tasks else None
    methods = a.methods.split(",")
    lines = []
    for haystack, rows in cells.items():
        keys = sorted({k for r in rows.values() for k in r}, key=lambda k: (int(k.split("@")[1]), k))
        if tasks:
            keys = [k for k in keys if k.split("@")[0] in tasks]
        lines += [f"### {haystack} haystack", "", "| method | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
        for m in [m for m in methods if m in rows]:
            lines.append(f"| {m} | " + " | ".join(
                f"{rows[m][k]['score']:g} ({rows[m][k]['n']})" if k in rows[m] else "-" for k in keys) + " |")
        lines += ["", "Sources (cell: folder):", ""]
        for m in [m for m in methods if m in rows]:
            for k in keys:
                if k in rows[m]:
                    cap = rows[m][k]["max_new_tokens"]
                    lines.append(f"- {m} {k}: {rows[m][k]['source']}" + (f" (at most {cap} new tokens)" if cap else " (RULER's answer budget)"))
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if a.output:
        a.output.mkdir(parents=True, exist_ok=True)
        (a.output / "matrix.md").write_text(text + "\n")
        (a.output / "matrix.json").write_text(json.dumps(cells, indent=1) + "\n")
    print(json.dumps(cells))


if __name__ == "__main__":
    main()
