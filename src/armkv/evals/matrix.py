"""``armkv eval matrix``: one RULER table from the per-sample logs of several ``armkv eval
ruler`` / ``eval ablation`` output folders.

Per haystack, a row per method and a column per (task, length); each cell is the mean score,
its sample count and the folder it came from. A later folder's cell replaces an earlier one's
(list the folders oldest first). A folder's ``config.json`` names its haystack (ablation
folders: ``--haystack`` says which), and ``--label ROW=METHOD`` maps an ablation row (e.g.
``policy-M``, the default ARM) to a method. Folders run with other settings than the first
(model, budget, chunk, seed, chat) are refused.

    armkv eval matrix runs/ruler-noise runs/ruler-prose --bar arm --output runs/matrix

With ``--bar ROW``, each table is followed by that row checked in every cell: within
``--within`` points of the full cache and above every other bounded row shown (bold where it
meets it); ``--current PREFIX`` marks with ``*`` the ROW cells whose folder does not start
with PREFIX (not re-run on the setting being checked). Writes ``matrix.md`` and
``matrix.json`` ({haystack: {method: {task@length: {score, n, bytes, source, max_new_tokens}}}})
to ``--output``; the last stdout line is that JSON. ``armkv report`` renders the committed one.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from armkv.errors import ArmkvError
from armkv.tools.report import column_keys, meets_bar, short_name

SAME = ("model", "budget", "chunk", "chat", "seed")


def add_arguments(parser) -> None:
    parser.add_argument(
        "folders", nargs="+", type=Path, help="output folders of eval ruler / eval ablation, oldest first"
    )
    parser.add_argument("--tasks", default=None, help="comma-separated tasks to show (default: all found)")
    parser.add_argument(
        "--methods", default="full,arm,kivi,sink,swa", help="rows shown, in this order (default: %(default)s)"
    )
    parser.add_argument("--label", action="append", default=["policy-M=arm"], help="ROW=METHOD for ablation folders")
    parser.add_argument(
        "--haystack", default="essay", help="haystack of ablation folders, whose config does not say (default: essay)"
    )
    parser.add_argument("--output", type=Path, default=None, help="folder for matrix.md and matrix.json")
    parser.add_argument(
        "--bar", default=None, help="row to check against the full cache and the other bounded rows (e.g. arm)"
    )
    parser.add_argument(
        "--within",
        type=float,
        default=10.0,
        help="points under the full cache the --bar row may be (default: %(default)s)",
    )
    parser.add_argument(
        "--current", default=None, help="folder prefix of the --bar row's current runs; its other cells get a *"
    )


def collect(folders: list[Path], labels: dict[str, str] | None = None, haystack: str = "essay") -> dict:
    """{haystack: {row: {task@length: cell}}} from the folders' per-sample logs, later folders
    replacing earlier ones' cells."""
    labels = labels or {}
    cells: dict = {}
    first = None
    for folder in folders:
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ArmkvError(f"{folder}: no config.json; give output folders of `armkv eval ruler` or `eval ablation`")
        config = json.loads(config_path.read_text())
        settings = {k: config.get(k) for k in SAME}
        first = first or (folder, settings)
        if settings != first[1]:
            raise ArmkvError(
                f"{folder}: settings {settings} differ from {first[0]}'s {first[1]}; give folders of one setting"
            )
        hay = config.get("haystack") or haystack
        for log in sorted(folder.glob("*.jsonl")):
            records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
            if not records:
                continue
            row = records[0].get("label") or records[0]["method"]
            row = labels.get(row, row)
            key = f"{records[0]['task']}@{records[0]['length']}"
            cells.setdefault(hay, {}).setdefault(row, {})[key] = {
                "score": round(statistics.mean(r["score"] for r in records), 2),
                "n": len(records),
                "bytes": max(r["cache_bytes"] for r in records),
                "source": str(folder),
                "max_new_tokens": config.get("max_new_tokens"),
            }
    return cells


def bar_table(
    haystack: str, rows: dict, keys: list, bar: str, methods: list, within: float, current: str | None
) -> list[str]:
    """The compact table of one haystack with the ``bar`` row checked in every cell it has."""
    keys = [k for k in keys if k in rows[bar] and k in rows["full"]]
    bounded = [m for m in methods if m != "full"]
    lines = [
        f"{haystack}, {bar} against the bar (**bold**: within {within:g} of full and above every other bounded row"
        + (f"; *: not from {current}" if current else "")
        + "):",
        "",
        "| method | " + " | ".join(short_name(k) for k in keys) + " |",
        "|---|" + "---:|" * len(keys),
    ]
    met, stale = [], []
    for m in methods:
        out = []
        for k in keys:
            if k not in rows[m]:
                out.append("-")
                continue
            cell = rows[m][k]
            text = f"{cell['score']:.1f}".rstrip("0").rstrip(".") + ("" if cell["n"] == 10 else f" ({cell['n']})")
            if m == bar:
                if current and not cell["source"].startswith(current):
                    stale.append(k)
                    text += "*"
                if meets_bar(rows, k, bar, bounded, within):
                    met.append(k)
                    text = f"**{text}**"
            out.append(text)
        lines.append(f"| {m} | " + " | ".join(out) + " |")
    lines += [
        "",
        f"{bar} meets the bar in {len(met)} of {len(keys)} cells"
        + (f"; not from {current}: {', '.join(stale) or 'none'}" if current else "")
        + ".",
        "",
    ]
    return lines


def render(
    cells: dict,
    methods: list[str],
    tasks: list[str] | None = None,
    bar: str | None = None,
    within: float = 10.0,
    current: str | None = None,
) -> str:
    lines = []
    for haystack, rows in cells.items():
        keys = column_keys(rows, tasks)
        shown = [m for m in methods if m in rows]
        lines += [
            f"### {haystack} haystack",
            "",
            "| method | " + " | ".join(keys) + " |",
            "|---|" + "---:|" * len(keys),
        ]
        for m in shown:
            lines.append(
                f"| {m} | "
                + " | ".join(f"{rows[m][k]['score']:g} ({rows[m][k]['n']})" if k in rows[m] else "-" for k in keys)
                + " |"
            )
        lines += ["", "Sources (cell: folder):", ""]
        for m in shown:
            for k in keys:
                if k in rows[m]:
                    cap = rows[m][k]["max_new_tokens"]
                    lines.append(
                        f"- {m} {k}: {rows[m][k]['source']}"
                        + (f" (at most {cap} new tokens)" if cap else " (RULER's answer budget)")
                    )
        lines.append("")
        if bar and bar in rows and "full" in rows:
            lines += bar_table(haystack, rows, keys, bar, shown, within, current)
    return "\n".join(lines)


def main(args) -> int:
    labels = {}
    for item in args.label:
        row, sep, method = item.partition("=")
        if not sep:
            raise ArmkvError(f"--label {item!r}: expected ROW=METHOD, e.g. policy-M=arm")
        labels[row] = method
    cells = collect(args.folders, labels, args.haystack)
    tasks = args.tasks.split(",") if args.tasks else None
    text = render(cells, args.methods.split(","), tasks, args.bar, args.within, args.current)
    print(text)
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        _write(args.output / "matrix.md", text + "\n")
        _write(args.output / "matrix.json", json.dumps(cells, indent=1) + "\n")
    print(json.dumps(cells))
    return 0


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
