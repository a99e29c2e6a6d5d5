"""One RULER table from the per-sample logs of several `armkv eval ruler` / `eval ablation`
output folders: per haystack, a row per method and a column per (task, length), each cell
the mean score, its sample count and the folder it came from. A later folder's cell replaces
an earlier one's (list the folders oldest first); a folder's `config.json` names its haystack
(ablation folders: `--haystack` says which), and `--label ROW=METHOD` maps an ablation row
(e.g. learned-M, the default ARM) to a method. Folders run with other settings than the
first one (budget, chunk, seed, generation cap, chat) are refused.

    python scripts/ruler_matrix.py docs/figures/s8-ruler-noise-2k docs/figures/s10-ruler/noise-8k \\
        --tasks niah_multikey_1,niah_multivalue,niah_multiquery --output docs/figures/s10-ruler/matrix

With `--bar ROW`, each table is followed by that row checked against issue 7's bar in every
cell: within `--within` points of the full cache and above every other bounded row shown
(bold where it meets it); `--current PREFIX` marks with `*` the ROW cells whose folder does
not start with PREFIX (not re-run on the setting being checked).

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
    p.add_argument("--bar", default=None, help="row to check against the full cache and the other bounded rows (e.g. arm)")
    p.add_argument("--within", type=float, default=10.0, help="points under the full cache the --bar row may be (default: %(default)s)")
    p.add_argument("--current", default=None, help="folder prefix of the --bar row's current runs; its other cells get a *")
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
        if a.bar and a.bar in rows and "full" in rows:
            lines += bar_table(haystack, rows, keys, a.bar, [m for m in methods if m in rows], a.within, a.current)
    text = "\n".join(lines)
    print(text)
    if a.output:
        a.output.mkdir(parents=True, exist_ok=True)
        (a.output / "matrix.md").write_text(text + "\n")
        (a.output / "matrix.json").write_text(json.dumps(cells, indent=1) + "\n")
    print(json.dumps(cells))


def bar_table(haystack: str, rows: dict, keys: list, bar: str, methods: list, within: float, current: str | None) -> list:
    """The compact table of one haystack with the `bar` row checked in every cell it has."""
    short = {"niah_single_1": "single", "niah_multikey_1": "mk1", "niah_multivalue": "mv", "niah_multiquery": "mq"}
    keys = [k for k in keys if k in rows[bar] and k in rows["full"]]
    head = [f"{short.get(k.split('@')[0], k.split('@')[0])} {int(k.split('@')[1]) // 1024}k" for k in keys]
    lines = [f"{haystack}, {bar} against the bar (**bold**: within {within:g} of full and above every other bounded row"
             + (f"; *: not from {current}" if current else "") + "):", "",
             "| method | " + " | ".join(head) + " |", "|---|" + "---:|" * len(keys)]
    met, stale = [], []
    for m in methods:
        cells = []
        for k in keys:
            if k not in rows[m]:
                cells.append("-")
                continue
            cell = rows[m][k]
            text = f"{cell['score']:.1f}".rstrip("0").rstrip(".") + ("" if cell["n"] == 10 else f" ({cell['n']})")
            if m == bar:
                others = [rows[o][k]["score"] for o in methods if o not in (bar, "full") and k in rows[o]]
                ok = cell["score"] >= rows["full"][k]["score"] - within - 1e-9 and all(cell["score"] > o for o in others)
                if current and not cell["source"].startswith(current):
                    stale.append(k)
                    text += "*"
                if ok:
                    met.append(k)
                    text = f"**{text}**"
            cells.append(text)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", f"{bar} meets the bar in {len(met)} of {len(keys)} cells"
              + (f"; not from {current}: {', '.join(stale) or 'none'}" if current else "") + ".", ""]
    return lines


if __name__ == "__main__":
    main()
